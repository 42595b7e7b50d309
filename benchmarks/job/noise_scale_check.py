"""The online gradient noise scale (hvd_edl.torch.gradient_noise, measured inside
hvd.DistributedOptimizer of a real 2-worker job) against a direct offline estimate from
per-sample gradients of the same model on the same data, at a few checkpoints; and the
estimator's cost per step on the training thread.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/job/noise_scale_check.py [--epochs 10]
        [--models small,large] [--probe-every 1] [--out benchmarks/results/noise_scale_check.json]

The job is examples/train_digits.py under hvd-edl-run (-np 2, global batch 32 split over the
ranks, SGD lr 0.02 momentum 0.9), saving its parameters and the online estimate at each epoch's
end (``--save-epochs``).  At each checkpoint (``--checkpoints``) the same 2-worker job is run
again from those parameters with lr 0 (``--init-params``; 24 epochs, 1,032 steps, with the
estimator's memory at 500 steps, ``--probe-smoothing 0.998``: at 2 ranks x 16 samples one step's
|G|^2 estimate is a difference of two norms each larger than |G|^2 late in training, so 100 steps
of memory, the default, leave it noisy): the online estimate then measures
the checkpoint's own noise (during training it is an exponential average over about the last
100 steps of a moving target, while the snapshot's |G|^2 swings from one step to the next under
momentum: both are in the JSON and the plot, but only the fixed-parameter figure is the check:
like with like, an average over steps at which the parameters do not move).  The lr-0 jobs
measure every step (``--probe-every 1``; 0: the default period chosen from the cost, which
thins the samples k-fold: the accuracy it costs is the figure's noise, not a bias).  Each check
also gives the estimate without the finite-population term (``sqr - var / N``, exact for the
same average), which is what the estimator gave before it had one.
Offline, at the same parameters: every training sample's gradient of the cross-entropy
(torch.func.vmap over torch.func.grad), |G|^2 of their mean and tr(Sigma) their mean squared
deviation (one sample's covariance): B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018).
Writes the JSON and a PNG beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))


def run_job(model: str, epochs: int, folder: Path, *extra: str, smoothing=None,
            every=None) -> dict:
    """One 2-worker digits job logging every epoch; returns its accuracy log's lines."""
    log = folder / "accuracy.jsonl"
    cmd = [str(Path(sys.executable).parent / "hvd-edl-run"), "-np", "2",
           sys.executable, str(ROOT / "examples" / "train_digits.py"), "--epochs", str(epochs),
           "--global-batch-size", "32", "--model", model, "--accuracy-log", str(log), *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if smoothing is not None:
        env["HVD_EDL_NOISE_SMOOTHING"] = str(smoothing)
    env.pop("HVD_EDL_GRADIENT_NOISE_EVERY", None)
    if every:
        env["HVD_EDL_GRADIENT_NOISE_EVERY"] = str(every)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        raise RuntimeError(f"job failed ({r.returncode}): {r.stdout[-2000:]}{r.stderr[-2000:]}")
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    return {"lines": lines}


def offline(model_name: str, path: Path, train_ds) -> dict:
    """Per-sample |G|^2, tr(Sigma) and B_simple at the parameters saved in ``path``."""
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad, vmap
    from train_digits import DigitsCNN
    saved = torch.load(path, weights_only=True)
    model = DigitsCNN() if model_name == "small" else DigitsCNN(4, 256)
    model.load_state_dict(saved["params"])
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x, y):
        return F.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    xs, ys = train_ds.tensors
    sums, sq = None, 0.0
    for i in range(0, len(xs), 256):
        g = vmap(grad(loss), in_dims=(None, 0, 0))(params, xs[i:i + 256], ys[i:i + 256])
        flat = torch.cat([v.flatten(1) for v in g.values()], 1).double()
        sums = flat.sum(0) if sums is None else sums + flat.sum(0)
        sq += float((flat ** 2).sum())
    n = len(xs)
    mean = sums / n
    g2 = float(mean @ mean)
    trace = (sq / n - g2) * n / (n - 1)
    return {"sqr": g2, "var": trace, "noise_scale_samples": trace / g2,
            "line": saved["line"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--checkpoints", default="2,5,10", help="epochs whose parameters are "
                   "measured again at fixed parameters (lr 0)")
    p.add_argument("--probe-epochs", type=int, default=24, help="epochs of each lr-0 job")
    p.add_argument("--probe-smoothing", type=float, default=0.998,
                   help="the estimator's theta in the lr-0 jobs (HVD_EDL_NOISE_SMOOTHING; "
                        "training uses the default 0.99)")
    p.add_argument("--probe-every", type=int, default=1,
                   help="the lr-0 jobs measure every k-th step (HVD_EDL_GRADIENT_NOISE_EVERY); "
                        "0: the default, k chosen from the cost (fewer samples per probe)")
    p.add_argument("--models", default="small,large")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                        "noise_scale_check.json"))
    a = p.parse_args(argv)
    import torch
    from train_digits import load_data
    torch.set_num_threads(1)
    train_ds, _ = load_data(0)
    out = {"what": "online noise scale (2-worker job, EMA) vs per-sample offline estimate at "
                   "checkpoints (lr-0 jobs from their parameters)",
           "command": "benchmarks/job/noise_scale_check.py " + " ".join(argv or sys.argv[1:]),
           "probe_smoothing": a.probe_smoothing, "probe_epochs": a.probe_epochs,
           "probe_every": a.probe_every or "default (chosen from the cost)",
           "train_size": len(train_ds), "machine": "2 shared CPU cores, loaded", "models": {}}
    for model in a.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.time()
            job = run_job(model, a.epochs, Path(tmp), "--save-epochs", str(Path(tmp) / "ckpt"))
            rows = []
            checks = []
            for k in [int(e) for e in a.checkpoints.split(",")]:
                ck = Path(tmp) / "ckpt" / f"epoch-{k}.pt"
                off = offline(model, ck, train_ds)
                probe = Path(tmp) / f"probe-{k}"
                probe.mkdir()
                lines = run_job(model, a.probe_epochs, probe, "--init-params", str(ck),
                                "--lr", "0", smoothing=a.probe_smoothing,
                                every=a.probe_every)["lines"]
                on = lines[-1]["noise"] or {}
                ns_on = on.get("noise_scale_samples")
                # the same average without the finite-population term (sqr - var / N: both
                # averages have the same weights): what the estimator gave before it
                raw_sqr = on["sqr"] - on["var"] / len(train_ds) if on else None
                checks.append({"epoch": k, "accuracy": off["line"]["accuracy"],
                               "probe_steps": lines[-1]["step"],
                               "online": {x: on.get(x) for x in ("sqr", "var",
                                                                 "noise_scale_samples")},
                               "offline": {x: off[x] for x in ("sqr", "var",
                                                               "noise_scale_samples")},
                               "ratio": ns_on / off["noise_scale_samples"] if ns_on else None,
                               "without_population_term": {
                                   "sqr": raw_sqr,
                                   "ratio": on["var"] / raw_sqr / off["noise_scale_samples"]
                                   if raw_sqr and raw_sqr > 0 else None}})
                print(f"{model} checkpoint epoch {k}: online B_simple at fixed parameters "
                      f"({lines[-1]['step']} steps) {ns_on or float('nan'):.1f}, offline "
                      f"{off['noise_scale_samples']:.1f}: ratio "
                      f"{checks[-1]['ratio'] or float('nan'):.2f}  (sqr "
                      f"{on.get('sqr', float('nan')):.4g} vs {off['sqr']:.4g}, var "
                      f"{on.get('var', float('nan')):.4g} vs {off['var']:.4g}; without the "
                      f"population term: sqr {raw_sqr or float('nan'):.4g}, ratio "
                      f"{checks[-1]['without_population_term']['ratio'] or float('nan'):.2f})",
                      flush=True)
            for line in job["lines"]:
                ck = Path(tmp) / "ckpt" / f"epoch-{line['epoch']}.pt"
                off = offline(model, ck, train_ds)
                on = line["noise"] or {}
                ns_on = on.get("noise_scale_samples")
                rows.append({"epoch": line["epoch"], "step": line["step"],
                             "accuracy": line["accuracy"],
                             "online": {k: on.get(k) for k in ("sqr", "var",
                                                               "noise_scale_samples")},
                             "offline": {k: off[k] for k in ("sqr", "var",
                                                             "noise_scale_samples")},
                             "ratio": ns_on / off["noise_scale_samples"] if ns_on else None,
                             "noise_cost_s": line.get("noise_cost_s"),
                             "step_s": line.get("step_s")})
                print(f"{model} epoch {line['epoch']:2d} step {line['step']:4d} acc "
                      f"{line['accuracy']:.3f}: online B_simple {ns_on or float('nan'):8.1f}  "
                      f"offline {off['noise_scale_samples']:8.1f}  ratio "
                      f"{rows[-1]['ratio'] or float('nan'):.2f}", flush=True)
            last = rows[-1]
            cost = {"noise_cost_s_per_step": last["noise_cost_s"],
                    "step_s": last["step_s"],
                    "fraction": (last["noise_cost_s"] / last["step_s"]
                                 if last["noise_cost_s"] and last["step_s"] else None)}
            print(f"{model}: estimator {1e6 * (cost['noise_cost_s_per_step'] or 0):.0f} us per "
                  f"step of {1e3 * (cost['step_s'] or 0):.1f} ms "
                  f"({100 * (cost['fraction'] or 0):.2f} %) on rank 0", flush=True)
            within = [r for r in checks if r["ratio"] and abs(r["ratio"] - 1) <= 0.25]
            out["models"][model] = {"checks": checks, "training": rows, "cost": cost,
                                    "wall_s": time.time() - t0,
                                    "checks_within_25pct": f"{len(within)}/{len(checks)}"}
            print(f"{model}: {len(within)}/{len(checks)} checkpoints within 25 %", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    _plot(out, Path(a.out).with_suffix(".png"))
    print(f"wrote {a.out}")
    return 0


def _plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(out["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for ax, m in zip(axes[0], models):
        rows = out["models"][m]["training"]
        ep = [r["epoch"] for r in rows]
        ax.plot(ep, [r["offline"]["noise_scale_samples"] for r in rows], "o:", color="grey",
                label="offline, snapshot at each epoch end")
        ax.plot(ep, [r["online"]["noise_scale_samples"] for r in rows], "s:", color="tab:blue",
                alpha=0.5, label="online while training (EMA)")
        checks = out["models"][m]["checks"]
        ce = [c["epoch"] for c in checks]
        off = [c["offline"]["noise_scale_samples"] for c in checks]
        ax.errorbar(ce, off, yerr=[[0.25 * v for v in off], [0.25 * v for v in off]], fmt="o",
                    color="black", capsize=4, label="offline at checkpoint +-25 %")
        ax.plot(ce, [c["online"]["noise_scale_samples"] for c in checks], "D", color="tab:red",
                label="online at checkpoint (lr 0)")
        ax.set_title(f"digits, {m} model, 2 workers, batch 32")
        ax.set_xlabel("epoch")
        ax.set_ylabel("noise scale B_simple (samples)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
