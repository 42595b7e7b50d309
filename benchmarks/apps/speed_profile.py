"""Profiles of two jobs at 1-4 workers through ``hvd-edl-ctl profile`` (EDL's profiling through
elasticity) and the speed model's leave-one-size-out error per held-out size (CM-DARE).

Jobs, each started at 2 workers (``-np 2 --min-np 1 --max-np 4 --target-np 2``, discovery
``localhost:4``) and walked through 1, 2, 3, 4 workers stop-free and back:

* digits: ``examples/train_digits.py`` (the small CNN, batch 16 per worker) with
  ``--step-delay`` seconds of sleeping compute per step (default 0.05): on this 2-core machine
  four workers of real compute would measure CPU contention, not data-parallel scaling;
* synthetic: ``examples/train_synthetic.py``, an MLP of ``--params-mb`` MB (default 16) whose
  gradients are allreduced every step, with ``--compute-s`` seconds of sleeping compute (0.15).

Writes benchmarks/results/profile_digits.{json,png}, profile_synthetic.{json,png} and
profile_mape.json (the table it prints), with the load average before and after.

    .venv/bin/python benchmarks/apps/speed_profile.py [--seconds 8] [--only digits|synthetic]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common.jobs import stop_launcher  # noqa: E402
from launcher.observe.events import read as read_events  # noqa: E402

BIN = Path(sys.executable).parent
RESULTS = ROOT / "benchmarks" / "results"
SIZES = "1,2,3,4"


def job_command(name: str, a, stop: Path):
    if name == "digits":
        return [sys.executable, str(ROOT / "examples" / "train_digits.py"), "--epochs", "100000",
                "--step-delay", str(a.step_delay), "--stop-file", str(stop)]
    return [sys.executable, str(ROOT / "examples" / "train_synthetic.py"), "--params-mb",
            str(a.params_mb), "--compute-s", str(a.compute_s), "--samples", "1024",
            "--stop-file", str(stop)]


def profile_job(name: str, a) -> dict:
    """Start the job, profile it, stop it; returns profile.json's contents plus the load."""
    tmp = Path(tempfile.mkdtemp(prefix=f"profile-{name}-"))
    (tmp / "hosts").write_text("localhost:4\n")
    job_file, events = tmp / "job.json", tmp / "events.jsonl"
    out = open(tmp / "launcher.out", "w")
    launcher = subprocess.Popen(
        [str(BIN / "hvd-edl-run"), "-np", "2", "--min-np", "1", "--max-np", "4", "--target-np",
         "2", "--discovery-interval", "0.5", "--host-discovery-script", f"cat {tmp / 'hosts'}",
         "--job-file", str(job_file), "--event-log", str(events),
         *job_command(name, a, tmp / "stop")], stdout=out, stderr=subprocess.STDOUT,
        cwd=str(ROOT))
    try:
        deadline = time.monotonic() + 120
        while not (job_file.exists() and events.exists() and '"generation": 1' in
                   events.read_text()):
            if time.monotonic() > deadline or launcher.poll() is not None:
                raise RuntimeError(f"{name}: the job did not start; see {tmp / 'launcher.out'}")
            time.sleep(0.2)
        load_before = os.getloadavg()
        t0 = time.monotonic()
        r = subprocess.run([str(BIN / "hvd-edl-ctl"), "--job", str(job_file), "profile",
                            "--sizes", SIZES, "--seconds", str(a.seconds), "--out", str(tmp)],
                           capture_output=True, text=True, timeout=900)
        print(r.stdout, r.stderr, sep="", flush=True)
        doc = json.loads((tmp / "profile.json").read_text())
        doc["load_before"], doc["load_after"] = load_before, os.getloadavg()
        doc["profile_wall_s"] = round(time.monotonic() - t0, 1)
        doc["generations"] = read_events(events)[0]
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"profile_{name}.json").write_text(json.dumps(doc, indent=2))
        if (tmp / "profile.png").exists():
            shutil.copy(tmp / "profile.png", RESULTS / f"profile_{name}.png")
        return doc
    finally:
        stop_launcher(launcher, tmp / "stop", out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=8.0, help="measurement per size (s)")
    p.add_argument("--step-delay", type=float, default=0.05, help="digits: sleep per step (s)")
    p.add_argument("--params-mb", type=float, default=16.0, help="synthetic: model MB")
    p.add_argument("--compute-s", type=float, default=0.15, help="synthetic: sleep per step (s)")
    p.add_argument("--only", choices=("digits", "synthetic"))
    a = p.parse_args()
    table_path = RESULTS / "profile_mape.json"
    table = json.loads(table_path.read_text()) if table_path.exists() else {}
    for name in ("digits", "synthetic"):
        if a.only and name != a.only:
            continue
        doc = profile_job(name, a)
        model = doc.get("model") or {}
        table[name] = {
            "loso_mape_percent": model.get("loso_mape_percent"),
            "samples_per_s": {str(pt["world_size"]): round(pt["samples_per_s"], 2)
                              for pt in doc["points"]},
            "efficiency": {str(pt["world_size"]): round(pt["efficiency"], 3)
                           for pt in doc["points"]},
            "rolled_back_steps": [g["rolled_back_steps"] for g in doc["generations"]],
            "aborted": doc.get("aborted"), "seconds": a.seconds,
            "load_before": doc["load_before"], "load_after": doc["load_after"],
            "command": doc.get("command"),
        }
    table_path.write_text(json.dumps(table, indent=2))
    print(f"{'job':<10} {'held-out size: LOSO error %':<40} samples/s")
    for name, row in table.items():
        print(f"{name:<10} {json.dumps(row['loso_mape_percent']):<40} "
              f"{json.dumps(row['samples_per_s'])}  (load {row['load_before'][0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
