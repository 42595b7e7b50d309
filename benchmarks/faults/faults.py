"""The membership's edges under repetition (issue 26): how jobs end, and a job whose hosts flap.

``end``: ``--runs`` jobs of 3 workers (``tests/horovod_style/ledger_main.py``, a Horovod-style
script with the exactly-once ledger) that train 2 epochs and end, the workers finishing in every
order (after training, each rank works 0, 0.5 or 1 s longer, by the 6 permutations) and, every
fourth run, one worker frozen (SIGSTOP) for 3 s once its training function returned, as a
loaded machine's interpreter teardown can be.  Per run: the exit status, the generations (a
failure generation at the end of a job is the bug), how many times the script's code after
training ran per worker (must be once), the audit.

``flapping``: one job (``-np 2 --min-np 1 --max-np 4``) for ``--seconds`` while its discovery
output changes every 0.2-0.5 s (``localhost:N``, N in 1..4) and ``hvd-edl-ctl scale --np N``
asks for a random size every 2-4 s; then the job is asked to stop at an epoch's end.  Reports
the longest window without a training step anywhere in the job (from the script's step log),
the generations by kind, the audit.

    .venv/bin/python benchmarks/faults/faults.py end --runs 20
    .venv/bin/python benchmarks/faults/faults.py flapping --seconds 60
    # results: benchmarks/results/faults.json (one key per mode)
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from hvd_edl import audit  # noqa: E402
from launcher.observe.events import read as read_events  # noqa: E402

BIN = Path(sys.executable).parent
SCRIPT = str(ROOT / "tests" / "horovod_style" / "ledger_main.py")
RESULTS = ROOT / "benchmarks" / "results" / "faults.json"
JOB_TIMEOUT_S = 240.0


def _events(path: Path) -> list:
    return read_events(path)[0]


def _audit(ledger: Path, n: int) -> dict:
    report = audit.check(ledger, n)
    return {"epochs": len(report.epochs), "complete": all(e.complete for e in report.epochs),
            "repeated": report.repeated, "missing": report.missing}


def _launch(tmp: Path, args: list, script_args: list, hosts: str) -> subprocess.Popen:
    (tmp / "hosts.txt").write_text(hosts + "\n")
    env = dict(os.environ, HVD_EDL_AUDIT_DIR=str(tmp / "ledger"))
    cmd = [str(BIN / "hvd-edl-run"), "--event-log", str(tmp / "events.jsonl"),
           "--job-file", str(tmp / "job.json"),
           "--host-discovery-script", f"cat {tmp / 'hosts.txt'}", *args,
           sys.executable, SCRIPT, "--done-log", str(tmp / "done.jsonl"), *script_args]
    return subprocess.Popen(cmd, stdout=open(tmp / "launcher.out", "w"),
                            stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))


def end_runs(runs: int) -> dict:
    orders = list(itertools.permutations(("0", "0.5", "1")))
    rows = []
    for i in range(runs):
        tmp = Path(tempfile.mkdtemp(prefix=f"hvd-edl-end{i}-"))
        order = orders[i % len(orders)]
        post = ",".join(f"{r}:{s}" for r, s in enumerate(order))
        freeze = f"w{1 + (i // 4) % 3}:3" if i % 4 == 3 else ""
        t0 = time.monotonic()
        proc = _launch(tmp, ["-np", "3", "--min-np", "1", "--max-np", "3"],
                       ["--dataset-size", "384", "--epochs", "2", "--post-s", post,
                        "--freeze-after", freeze], "localhost:3")
        try:
            rc = proc.wait(JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        kinds = [e["kind"] for e in _events(tmp / "events.jsonl")]
        done = Counter(json.loads(x)["worker"] for x in
                       (tmp / "done.jsonl").read_text().splitlines()) \
            if (tmp / "done.jsonl").exists() else Counter()
        row = {"run": i, "post_s_by_rank": post, "frozen_after_training": freeze, "rc": rc,
               "generations": kinds, "failure_generations": kinds.count("failure"),
               "after_training_runs": dict(done), "seconds": round(time.monotonic() - t0, 1),
               "audit": _audit(tmp / "ledger", 384)}
        row["ok"] = (rc == 0 and kinds == ["start"] and sorted(done.values()) == [1, 1, 1]
                     and row["audit"]["complete"] and row["audit"]["repeated"] == 0
                     and row["audit"]["missing"] == 0)
        rows.append(row)
        print(f"end run {i:2d}: post {post:17s} frozen {freeze or '-':5s} rc {rc} generations "
              f"{kinds} after-training {dict(done)} audit {row['audit']} "
              f"{'OK' if row['ok'] else 'BAD'}", flush=True)
    return {"runs": rows, "ok": sum(r["ok"] for r in rows),
            "failure_generations": sum(r["failure_generations"] for r in rows)}


def flapping(seconds: float, seed: int) -> dict:
    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="hvd-edl-flap-"))
    stop, steps = tmp / "stop", tmp / "steps.log"
    proc = _launch(tmp, ["-np", "2", "--min-np", "1", "--max-np", "4",
                         "--discovery-interval", "0.1"],
                   ["--dataset-size", "2048", "--epochs", "100000", "--step-delay", "0.01",
                    "--stop-file", str(stop), "--step-log", str(steps)], "localhost:2")
    t_end = time.monotonic() + seconds
    next_scale = time.monotonic() + rng.uniform(2, 4)
    changes = scales = 0
    while time.monotonic() < t_end and proc.poll() is None:
        hosts = tmp / "hosts.txt"
        (tmp / "hosts.new").write_text(f"localhost:{rng.randint(1, 4)}\n")
        os.replace(tmp / "hosts.new", hosts)
        changes += 1
        if time.monotonic() >= next_scale and (tmp / "job.json").exists():
            subprocess.run([str(BIN / "hvd-edl-ctl"), "--job", str(tmp / "job.json"), "scale",
                            "--np", str(rng.randint(1, 4))], capture_output=True, timeout=30)
            scales += 1
            next_scale = time.monotonic() + rng.uniform(2, 4)
        time.sleep(rng.uniform(0.2, 0.5))
    (tmp / "hosts.txt").write_text("localhost:2\n")
    stop.touch()
    try:
        rc = proc.wait(JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    times = sorted(float(x) for x in steps.read_text().split()) if steps.exists() else []
    gaps = [b - a for a, b in zip(times, times[1:])]
    kinds = Counter(e["kind"] for e in _events(tmp / "events.jsonl"))
    out = {"seconds": seconds, "seed": seed, "host_changes": changes, "scale_requests": scales,
           "rc": rc, "generations": dict(kinds), "steps": len(times),
           "longest_window_without_a_step_s": round(max(gaps, default=0.0), 2),
           "windows_over_5_s": sum(1 for g in gaps if g > 5.0),
           "audit": _audit(tmp / "ledger", 2048), "dir": str(tmp)}
    print(f"flapping {seconds:g} s: {changes} host changes, {scales} scale requests, rc {rc}, "
          f"generations {dict(kinds)}, {len(times)} steps, longest window without a step "
          f"{out['longest_window_without_a_step_s']} s, audit {out['audit']}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    e = sub.add_parser("end", help="jobs that end, workers finishing in every order")
    e.add_argument("--runs", type=int, default=20)
    f = sub.add_parser("flapping", help="one job whose hosts flap and whose size is requested")
    f.add_argument("--seconds", type=float, default=60.0)
    f.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    result = end_runs(a.runs) if a.mode == "end" else flapping(a.seconds, a.seed)
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    old[a.mode] = result
    RESULTS.write_text(json.dumps(old, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
