"""The gradient noise estimator's cost per step (hvd_edl.torch.gradient_noise), inside a real
2-worker job: the digits CNN (examples/train_digits.py, small and large), global batch 32.

    .venv/bin/python benchmarks/job/gradient_noise_cost.py [--slices 12] [--steps 40]
        [--every 1,4] [--out benchmarks/results/gradient_noise_cost.json]

Two figures per model, both from one job (``--worker`` is what each rank runs):
* direct: the seconds the measurement itself takes on the training thread (its hooks' norms,
  the local sum, launching the scalar allreduce, the averaged gradient's norm, polling),
  timed by ``GradientNoiseMeter.cost_s``, per step, over the mean step; for every step measured
  and for every 4th (``--every 1,4``: ``HVD_EDL_GRADIENT_NOISE_EVERY``);
* side by side: slices of ``--steps`` steps with the meter on and off, interleaved (on, off,
  off, on, ...), steps/s of each slice: the median ratio off/on (1.0 = no visible cost) and its
  spread, which on the shared 2 cores is mostly other processes' noise.
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


def worker(model_name: str, slices: int, steps: int, out: str) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    import torch.nn.functional as F
    import hvd_edl.torch as hvd
    from train_digits import DigitsCNN, load_data
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train, _ = load_data(0, repeat=8)
    model = DigitsCNN() if model_name == "small" else DigitsCNN(4, 256)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
                                   named_parameters=model.named_parameters())
    meter = opt.gradient_noise
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
        order = [(k % 4) in (0, 3) for k in range(2 * slices)]  # on, off, off, on, ...
        rows = []
        for _ in range(steps):  # warm-up
            i, (x, y) = batch()
            opt.zero_grad()
            (F.cross_entropy(model(x), y) * sampler.loss_weight(i)).backward()
            opt.step()
            sampler.record_batch(i, len(x))
        for on in order:
            meter.enabled = on
            c0, n0 = meter.cost_s, meter.cost_steps
            t0 = time.perf_counter()
            for _ in range(steps):
                i, (x, y) = batch()
                opt.zero_grad()
                (F.cross_entropy(model(x), y) * sampler.loss_weight(i)).backward()
                opt.step()
                sampler.record_batch(i, len(x))
            dt = time.perf_counter() - t0
            rows.append({"on": on, "steps_per_s": steps / dt,
                         "cost_s_per_step": (meter.cost_s - c0) / steps if on else 0.0,
                         "measured_steps": meter.cost_steps - n0})
        if hvd.rank() == 0:
            Path(out).write_text(json.dumps(rows))

    train_fn(state)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slices", type=int, default=12, help="slices per setting")
    p.add_argument("--steps", type=int, default=40, help="steps per slice")
    p.add_argument("--models", default="small,large")
    p.add_argument("--every", default="1,4", help="HVD_EDL_GRADIENT_NOISE_EVERY values to run")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                        "gradient_noise_cost.json"))
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker[0], a.slices, a.steps, a.worker[1])
        return 0
    result = {"what": "gradient noise estimator cost per step, 2-worker digits job, batch 32",
              "machine": "2 shared CPU cores, loaded (other sessions' jobs running)",
              "command": "benchmarks/job/gradient_noise_cost.py " + " ".join(argv or sys.argv[1:]),
              "models": {}}
    for model, every in [(m, e) for e in a.every.split(",") for m in a.models.split(",")]:
        out = Path(a.out).with_name(f".cost-{model}.json")
        cmd = [str(Path(sys.executable).parent / "hvd-edl-run"), "-np", "2", sys.executable,
               __file__, "--worker", model, str(out), "--slices", str(a.slices), "--steps",
               str(a.steps)]
        r = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT),
                                         HVD_EDL_GRADIENT_NOISE_EVERY=every),
                           capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            print(r.stdout[-3000:], r.stderr[-3000:])
            return 1
        rows = json.loads(out.read_text())
        out.unlink()
        on = [x for x in rows if x["on"]]
        off = [x for x in rows if not x["on"]]
        ratios = [b["steps_per_s"] / a_["steps_per_s"] for a_, b in zip(on, off)]
        step_s = statistics.median(1 / x["steps_per_s"] for x in on)
        cost = statistics.median(x["cost_s_per_step"] for x in on)
        m = {"step_s_median_on": step_s,
             "step_s_median_off": statistics.median(1 / x["steps_per_s"] for x in off),
             "direct_cost_s_per_step": cost, "direct_fraction": cost / step_s,
             "ratio_off_over_on_median": statistics.median(ratios),
             "ratio_range": [min(ratios), max(ratios)], "slices": rows}
        result["models"][f"{model}, every {every}"] = m
        print(f"{model}, every {every}: step {1e3 * step_s:.1f} ms; estimator {1e6 * cost:.0f} us per step = "
              f"{100 * cost / step_s:.2f} % (direct); steps/s off/on median "
              f"{m['ratio_off_over_on_median']:.3f} (range {min(ratios):.2f}-{max(ratios):.2f})",
              flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
