"""The job's goodput model against measurement: a real adaptive digits job (examples/train_digits.py
--adaptive-batch under hvd-edl-run) is stepped through global batches at each world size
(``hvd-edl-ctl batch``'s path, ``/ctl/batch``; the size by ``/ctl/scale``), and at each the
measured optimizer-step seconds (telemetry's compute + wait per step, the 5 s window after the
generation settled) are compared with what launcher/apps/batch_goodput.py's fitted model
predicts (fitted from the points a job would have: first from the first batch alone, with the
one-batch prior, then from all), and the goodput measured (base batch x AdaScale gain at the noise
scale then / measured step seconds) with the predicted.

    .venv/bin/python benchmarks/job/goodput_fit_check.py [--model large] [--sizes 1,2]
        [--batches 32,64,128,256,512] [--out benchmarks/results/goodput_fit_check.json]

On the 2 shared CPU cores here: figures move with the other sessions' load; the points of one
size are measured within a minute of each other.
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

from benchmarks.common.cluster_service import wait_for  # noqa: E402 - after the path

WINDOW_S = 7.0    # after a point's generation settled (telemetry's window is 5 s)
SETTLE_S = 6.0


def measure(model: str, sizes, batches, max_local: int, folder: Path) -> list:
    """The measured points: one dict per (world size, batch)."""
    from launcher.serve.control import ControlClient, ControlError
    hosts = folder / "hosts"
    hosts.write_text(f"localhost:{max(sizes)}\n")
    job_file, stop = folder / "job.json", folder / "stop"
    cmd = [str(Path(sys.executable).parent / "hvd-edl-run"), "--job-file", str(job_file),
           "-np", str(sizes[0]), "--min-np", "1", "--max-np", str(max(sizes)),
           "--host-discovery-script", f"cat {hosts}", "--discovery-interval", "0.5",
           sys.executable, str(ROOT / "examples" / "train_digits.py"), "--model", model,
           "--epochs", "500", "--adaptive-batch", "--global-batch-size", str(batches[0]),
           "--max-batch", str(max(batches)), "--max-local-batch", str(max_local),
           "--commit-every", "4", "--stop-file", str(stop)]
    out = open(folder / "out.txt", "w")
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=out,
                            stderr=subprocess.STDOUT)
    points = []
    try:
        client = wait_for("the job file", lambda: job_file.exists() and ControlClient(
            job_file, timeout_s=20), 120, poll_s=0.3)

        def tel():
            try:
                return client.call("telemetry")
            except ControlError:
                return None
        for size in sizes:
            for b in batches:
                if b < size:
                    continue
                client.call("scale", np=size)
                client.call("batch", batch=b)

                def settled():
                    t = tel()
                    plan = (t or {}).get("adaptive_batch") or {}
                    return t if (plan.get("batch") and int(plan["world_size"]) == size
                                 and t["job"].get("world_size") == size
                                 and abs(plan["batch"] - b) <= size) else None
                t = wait_for(f"batch {b} at {size}", settled, 180, poll_s=0.3)
                gen = t["job"]["generation"]
                t0 = time.monotonic()
                time.sleep(SETTLE_S + WINDOW_S)  # a measurement window, not a synchronisation
                t = tel()
                if t is None or t["job"]["generation"] != gen:
                    print(f"  size {size} batch {b}: generation moved, skipped", flush=True)
                    continue
                plan, job, noise = t["adaptive_batch"], t["job"], t.get("gradient_noise") or {}
                p = {"world_size": size, "batch": int(plan["batch"]),
                     "local_batch": int(plan["local_batch"]),
                     "accumulation": int(plan["accumulation"]),
                     "compute_s": job["compute_s"], "wait_s": job.get("wait_s") or 0.0,
                     "step_s": job["compute_s"] + (job.get("wait_s") or 0.0),
                     "sqr": noise.get("sqr"), "var": noise.get("var"),
                     "noise_scale_samples": noise.get("noise_scale_samples"),
                     "base_batch": int(plan["base_batch"]),
                     "at_s": round(time.monotonic() - t0, 1)}
                points.append(p)
                print(f"  size {size} batch {p['batch']}: step {p['step_s'] * 1e3:.1f} ms "
                      f"(compute {p['compute_s'] * 1e3:.1f}, wait {p['wait_s'] * 1e3:.1f}), "
                      f"{p['batch'] / p['step_s']:.0f} samples/s, noise scale "
                      f"{p['noise_scale_samples']}", flush=True)
    finally:
        stop.touch()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.terminate()
            proc.wait(30)
        out.close()
    return points


def compare(points: list) -> dict:
    """Predicted against measured step seconds and goodput at each point, for two fits: from
    the first point of the point's own size alone (what a job knows before it tried another
    batch there: :func:`launcher.apps.batch_goodput.one_batch_prior`), and from every point
    (all sizes and batches, as the adapter's fit ends up)."""
    from launcher.apps.batch_goodput import GoodputModel, StepPoint, fit, one_batch_prior
    from hvd_edl.gradient_noise import gain   # clamped to [1, B/B0] (|G|^2 <= 0: unknown)
    sp = [StepPoint(p["world_size"], 1, p["local_batch"], p["accumulation"], p["compute_s"],
                    p["wait_s"]) for p in points]
    first = {}
    for s in sp:
        first.setdefault(s.world_size, s)
    by_size = {n: fit([s]) for n, s in first.items()}
    every = fit(sp)
    rows = []
    for p, s in zip(points, sp):
        b0 = p["base_batch"]
        r = gain(p["sqr"] or 0.0, p["var"] or 0.0, p["batch"], b0)
        row = {"world_size": p["world_size"], "batch": p["batch"],
               "measured_step_s": round(p["step_s"], 4),
               "measured_samples_per_s": round(p["batch"] / p["step_s"], 1),
               "gain": round(r, 3), "efficiency": round(r * b0 / p["batch"], 3),
               "measured_goodput": round(b0 * r / p["step_s"], 1),
               "noise_scale_samples": round(p["noise_scale_samples"] or -1, 1)}
        for name, perf in (("first_batch_only", by_size[s.world_size]), ("all_points", every)):
            t = perf.step_seconds(s.world_size, 1, s.local_batch, s.accumulation)
            row[f"{name}_step_s"] = round(t, 4)
            row[f"{name}_goodput"] = round(b0 * r / t, 1)
        rows.append(row)
    best = {}
    last = points[-1]
    top = max(p["batch"] for p in points)
    max_local = max(p["local_batch"] for p in points)
    for n in sorted(first):
        for name, perf in (("first_batch_only", by_size[n]), ("all_points", every)):
            m = GoodputModel(perf, last["sqr"] or 0.0, last["var"] or 0.0, last["base_batch"],
                             last["base_batch"], top, max_local)
            best.setdefault(name, {})[str(n)] = m.best(n)
        measured = [r for r in rows if r["world_size"] == n]
        best.setdefault("measured", {})[str(n)] = max(
            ((r["batch"], r["measured_goodput"]) for r in measured), key=lambda x: x[1])
    return {"fits": {"first_batch_only": {str(n): vars(v) for n, v in by_size.items()},
                     "all_points": vars(every)}, "rows": rows, "best": best,
            "one_batch_prior": one_batch_prior.__doc__.split("\n\n")[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="large", choices=("small", "large"))
    p.add_argument("--sizes", default="1,2")
    p.add_argument("--batches", default="32,64,128,256,512")
    p.add_argument("--max-local-batch", type=int, default=256)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                        "goodput_fit_check.json"))
    a = p.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        points = measure(a.model, sizes, batches, a.max_local_batch, Path(tmp))
    result = {"what": f"goodput model vs measured, digits {a.model} CNN",
              "machine": "2 shared CPU cores, loaded",
              "command": "benchmarks/job/goodput_fit_check.py " + " ".join(argv or sys.argv[1:]),
              "points": points, **compare(points)}
    for r in result["rows"]:
        print(f"W={r['world_size']} B={r['batch']:4d}: step measured {r['measured_step_s']*1e3:7.1f}"
              f" ms, fit(first) {r['first_batch_only_step_s']*1e3:7.1f}, fit(all) "
              f"{r['all_points_step_s']*1e3:7.1f}; goodput measured {r['measured_goodput']:6.0f}"
              f", fit(first) {r['first_batch_only_goodput']:6.0f}, fit(all) "
              f"{r['all_points_goodput']:6.0f}  (noise scale {r['noise_scale_samples']})")
    print("best batch per size:", result["best"])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
