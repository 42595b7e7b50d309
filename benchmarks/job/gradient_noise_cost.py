"""The gradient noise estimator's cost per step (hvd_edl.torch.gradient_noise), inside a real
2-worker job: the digits CNN (examples/train_digits.py, small and large), global batch 32.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/job/gradient_noise_cost.py [--slices 12]
        [--steps 40] [--models small,large] [--out benchmarks/results/gradient_noise_cost.json]

Three settings side by side in one job per model (``--worker`` is what each rank runs): the
meter off, the meter measuring every step (``HVD_EDL_GRADIENT_NOISE_EVERY=1``, what AdaptDL does)
and the default (every k-th step, k chosen from the meter's measured cost,
hvd_edl.measuring_period), in slices of ``--steps`` steps whose order rotates (off/every/auto,
auto/off/every, ...).  Per setting:
* direct: the seconds the meter itself takes on the training thread (its hooks' norms, sending
  the buffer, the averaged gradient's norm, reading results), ``GradientNoiseMeter.cost_s``, per
  step, over the median step;
* side by side: each slice's steps/s; the median over slices of (off / setting) (1.0 = no
  visible cost), which on the shared 2 cores is mostly other processes' noise;
* the k the default chose (its decisions).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


MODES = ("off", "every", "auto")


def worker(model_name: str, slices: int, steps: int, out: str) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    import torch.nn.functional as F
    import hvd_edl.torch as hvd
    from hvd_edl.measuring_period import MeasuringPeriod
    from train_digits import DigitsCNN, load_data
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train, _ = load_data(0, repeat=8)
    model = DigitsCNN() if model_name == "small" else DigitsCNN(4, 256)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
                                   named_parameters=model.named_parameters())
    meter = opt.gradient_noise
    auto, every = meter.period, MeasuringPeriod(fixed=1)
    sampler = hvd.elastic.ElasticBatchSampler(train, 32)
    loader = torch.utils.data.DataLoader(train, batch_sampler=sampler)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler)

    @hvd.elastic.run
    def train_fn(state):
        epoch = [0, iter(enumerate(loader))]

        def batch():
            try:
                return next(epoch[1])
            except StopIteration:  # a new epoch
                epoch[0] += 1
                sampler.set_epoch(epoch[0])
                epoch[1] = iter(enumerate(loader))
                return next(epoch[1])

        def run(n):
            t0 = time.perf_counter()
            for _ in range(n):
                i, (x, y) = batch()
                opt.zero_grad()
                (F.cross_entropy(model(x), y) * sampler.loss_weight(i)).backward()
                opt.step()
                sampler.record_batch(i, len(x))
            return time.perf_counter() - t0

        def use(mode):  # the same on every rank, at the same step
            meter.drain()
            meter.enabled = mode != "off"
            meter.period = every if mode == "every" else auto

        use("auto")
        run(3 * steps)  # warm-up; the default's first decisions
        rows = []
        for k in range(slices):
            order = MODES[k % 3:] + MODES[:k % 3]
            order = order if k % 2 == 0 else order[::-1]
            for mode in order:
                use(mode)
                c0 = meter.cost_s
                dt = run(steps)
                rows.append({"mode": mode, "slice": k, "steps_per_s": steps / dt,
                             "cost_s_per_step": (meter.cost_s - c0) / steps,
                             "k": meter.every if mode != "off" else None})
        if hvd.rank() == 0:
            Path(out).write_text(json.dumps({"rows": rows, "decisions": auto.decisions}))

    train_fn(state)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slices", type=int, default=12, help="slices per setting")
    p.add_argument("--steps", type=int, default=40, help="steps per slice")
    p.add_argument("--models", default="small,large")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                        "gradient_noise_cost.json"))
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker[0], a.slices, a.steps, a.worker[1])
        return 0
    result = {"what": "gradient noise estimator cost per step, 2-worker digits job, batch 32: off, "
                    "every step, default (k chosen from the measured cost), side by side",
              "machine": "2 shared CPU cores, loaded (other sessions' jobs running)",
              "command": "benchmarks/job/gradient_noise_cost.py " + " ".join(argv or sys.argv[1:]),
              "models": {}}
    for model in a.models.split(","):
        out = Path(a.out).with_name(f".cost-{model}.json")
        cmd = [str(Path(sys.executable).parent / "hvd-edl-run"), "-np", "2", sys.executable,
               __file__, "--worker", model, str(out), "--slices", str(a.slices), "--steps",
               str(a.steps)]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.pop("HVD_EDL_GRADIENT_NOISE_EVERY", None)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            print(r.stdout[-3000:], r.stderr[-3000:])
            return 1
        got = json.loads(out.read_text())
        out.unlink()
        rows = got["rows"]
        by = {m: [x for x in rows if x["mode"] == m] for m in MODES}
        step_s = {m: statistics.median(1 / x["steps_per_s"] for x in by[m]) for m in MODES}
        m_out = {"decisions_step_k": got["decisions"], "slices": rows}
        line = [f"{model}: step {1e3 * step_s['off']:.1f} ms off"]
        for mode in ("every", "auto"):
            cost = statistics.median(x["cost_s_per_step"] for x in by[mode])
            ratios = [o["steps_per_s"] / x["steps_per_s"]
                      for o, x in zip(by["off"], by[mode])]  # the same slice k
            ks = sorted({x["k"] for x in by[mode]})
            m_out[mode] = {"step_s_median": step_s[mode], "direct_cost_s_per_step": cost,
                           "direct_fraction": cost / step_s[mode],
                           "ratio_off_over_setting_median": statistics.median(ratios),
                           "ratio_range": [min(ratios), max(ratios)], "k": ks}
            line.append(f"{mode} (k {','.join(map(str, ks))}): {1e6 * cost:.0f} us per step = "
                        f"{100 * cost / step_s[mode]:.2f} % direct, steps/s off/{mode} median "
                        f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})")
        m_out["step_s_median_off"] = step_s["off"]
        result["models"][model] = m_out
        print("; ".join(line), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
