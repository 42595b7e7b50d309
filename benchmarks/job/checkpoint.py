"""Durable checkpoints: what they cost a training job, and how fast a job resumes from one.

For a synthetic model of about 1, 10 and 100 MB of state (float32 parameters plus SGD momentum
of the same size), one ``hvd-edl-run -np 1 --checkpoint-dir`` job trains (an optimizer step over
the whole state, a fixed 256x256 matmul load, a commit every 10 steps) in alternating windows of
``--window`` seconds: without a checkpoint, then with one (forced at the window's first commit,
the path ``hvd-edl-ctl checkpoint`` takes), ``--pairs`` times.  Side by side windows see the
same load from anything else on the machine, so the difference is the checkpoint's:

* throughput (steps/s) in windows without and with a checkpoint (medians);
* the training time one checkpoint costs, ``window * (1 - on / off)`` (median over the pairs),
  and the overhead at the default interval, that cost / 60 s;
* time to write per MB (serialise, SHA-256, fsync, rename; the writer thread's own figure);
* time from a resumed job's launch (``hvd-edl-run`` on the directory) to the end of its first
  step, against the same for a fresh job without checkpoints.

    .venv/bin/python benchmarks/job/checkpoint.py  # writes benchmarks/results/checkpoint.json

``--worker`` is the training script the jobs run (one JSON line ``BENCH {...}`` at its end).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
LAUNCHER = str(Path(sys.executable).parent / "hvd-edl-run")
DEFAULT_INTERVAL_S = 60.0


def worker(args) -> None:
    import torch
    import hvd_edl.torch as hvd
    from hvd_edl import checkpoint
    hvd.init()
    torch.set_num_threads(1)
    rows = max(1, int(args.megabytes / 2 * 2 ** 20 / 4 / 1024))  # half parameters, half momentum
    layers = [torch.nn.Linear(1024, 1024, bias=False) for _ in range(rows // 1024)]
    if rows % 1024:
        layers.append(torch.nn.Linear(1024, rows % 1024, bias=False))
    model = torch.nn.Sequential(*layers)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9),
                                   named_parameters=model.named_parameters())
    grads = [torch.full_like(p, 1e-3) for p in model.parameters()]
    a = torch.randn(256, 256)
    state = hvd.elastic.TorchState(model, opt, epoch=0)
    out = {"first_step_wall": None, "writes": []}

    @hvd.elastic.run
    def train(state):
        from hvd_edl import runtime
        rt = runtime.get()
        out["start_step"] = rt.steps
        windows = []  # [checkpoint forced in it, steps, seconds]
        seen = None
        on, steps, started, ends, warming = False, 0, 0.0, 0.0, True
        while True:
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            opt.step()
            for _ in range(4):
                a @ a
            now = time.monotonic()
            if out["first_step_wall"] is None:
                out["first_step_wall"] = time.time()
                if args.first_step_only:
                    return
                started, ends = now, now + args.warmup
            steps += 1
            if rt.steps % 10 == 0:
                state.commit()
                w = checkpoint.writer()
                if w is not None and w.written is not None and w.written != seen:
                    seen = w.written
                    out["writes"].append((os.path.getsize(w.written), w.last_write_s))
            if now >= ends:
                if not warming:
                    windows.append([on, steps, now - started])
                warming = False
                if len(windows) == 2 * args.pairs:
                    break
                on = len(windows) % 2 == 1  # off, on, off, on, ...
                if on:
                    rt.checkpoint_request += 1  # what hvd-edl-ctl checkpoint does
                steps, started, ends = 0, now, now + args.window
        out["windows"] = windows

    train(state)
    w = checkpoint.writer()
    if w is not None:
        w.wait(60)
    print("BENCH " + json.dumps(out), flush=True)


def run_job(megabytes: float, ck_dir, args, first_step_only: bool = False) -> dict:
    cmd = [LAUNCHER, "-np", "1"]
    if ck_dir is not None:  # written only when forced (the windows' own schedule)
        cmd += ["--checkpoint-dir", str(ck_dir), "--checkpoint-every", "1e9"]
    cmd += [sys.executable, __file__, "--worker", "--megabytes", str(megabytes), "--window",
            str(args.window), "--pairs", str(args.pairs), "--warmup", str(args.warmup)]
    if first_step_only:
        cmd.append("--first-step-only")
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    line = next((ln for ln in r.stdout.splitlines() if "BENCH " in ln), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"job failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    out = json.loads(line.split("BENCH ", 1)[1])
    out["launch_to_first_step_s"] = round(out["first_step_wall"] - t0, 3)
    out["resumed"] = "resumed from checkpoint" in r.stdout
    return out


def _median(xs):
    return statistics.median(xs) if xs else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--first-step-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--megabytes", type=float, nargs="+", default=[1.0, 10.0, 100.0])
    p.add_argument("--window", type=float, default=1.5, help="seconds per window")
    p.add_argument("--pairs", type=int, default=10, help="pairs of windows (off, on)")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--out", default=str(RESULTS / "checkpoint.json"))
    a = p.parse_args(argv)
    if a.worker:
        a.megabytes = a.megabytes[0]
        worker(a)
        return 0
    rows = []
    for mb in a.megabytes:
        ck = Path(tempfile.mkdtemp(prefix="hvd-edl-ckbench-"))
        try:
            job = run_job(mb, ck, a)
            resumed = run_job(mb, ck, a, first_step_only=True)
            fresh = run_job(mb, None, a, first_step_only=True)
        finally:
            shutil.rmtree(ck, ignore_errors=True)
        w = job["windows"]
        pairs = [(w[i][1] / w[i][2], w[i + 1][1] / w[i + 1][2]) for i in range(0, len(w), 2)]
        cost_s = _median([a.window * (1 - on / off) for off, on in pairs])
        writes = job["writes"]
        total_mb = sum(b for b, _ in writes) / 2 ** 20
        row = {
            "state_mb": round(writes[0][0] / 2 ** 20, 2) if writes else mb,
            "steps_per_s_off": round(_median([off for off, _ in pairs]), 2),
            "steps_per_s_on": round(_median([on for _, on in pairs]), 2),
            "checkpoints_written": len(writes),
            "training_s_per_checkpoint": round(cost_s, 4),
            "overhead_at_default_interval": round(cost_s / DEFAULT_INTERVAL_S, 4),
            "write_s_per_mb": round(sum(s for _, s in writes) / total_mb, 4) if writes else None,
            "write_s_max": round(max(s for _, s in writes), 3) if writes else None,
            "fresh_launch_to_first_step_s": fresh["launch_to_first_step_s"],
            "resumed_launch_to_first_step_s": resumed["launch_to_first_step_s"],
            "resumed_from_step": resumed["start_step"], "resumed": resumed["resumed"],
            "pairs_steps_per_s": [[round(x, 1) for x in p] for p in pairs],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"{'state MB':>8} {'steps/s off':>11} {'on':>7} {'s/ckpt':>8} "
          f"{'at 60 s':>8} {'s/MB':>7} {'resume s':>8} {'fresh s':>8}")
    for r in rows:
        print(f"{r['state_mb']:>8} {r['steps_per_s_off']:>11} {r['steps_per_s_on']:>7} "
              f"{r['training_s_per_checkpoint']:>8.3f} {r['overhead_at_default_interval']:>8.2%} "
              f"{r['write_s_per_mb'] or 0:>7.4f} {r['resumed_launch_to_first_step_s']:>8} "
              f"{r['fresh_launch_to_first_step_s']:>8}")
    result = {"benchmark": "checkpoint", "window_s": a.window, "pairs": a.pairs,
              "host": platform.node(), "cpus": os.cpu_count(), "rows": rows,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
