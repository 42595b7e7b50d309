"""Request-to-switch delay: how long after a requested change (here a scale-in asked for with
``hvd-edl-ctl scale``) the ring agrees on a step boundary and the coordinator forms the next
generation, for three rhythms of commits.

    .venv/bin/python benchmarks/job/timeliness.py [--requests 4] [--out FILE]

Patterns (Horovod's integration script, ``tests/horovod_style/elastic_main.py``, 2 workers):

* ``steady``: a commit after each batch, one batch about every 50 ms;
* ``bursty``: Horovod's integration pattern, 10 quick batches each committed, then a pause
  (``--pause`` s, standing for an evaluation pass) and the epoch's commit;
* ``slow``: a commit every 4 batches of 0.5 s (one commit every 2 s).

Each request is sent at a random moment (seeded); the delay is the generation's formation time
(the event log's wall-clock ``time``) minus the moment the control API's ``scale`` request (what
``hvd-edl-ctl scale`` sends) was sent.  The
job is scaled back to 2 between requests.  Prints one line per pattern: median, max, and how many
commits rank 0 began after the request, the one the ring switched at included (1: the first
commit after the request).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common.jobs import stop_launcher  # noqa: E402
from launcher.observe.events import read as read_events  # noqa: E402
from launcher.serve.control import ControlClient  # noqa: E402
BIN = Path(sys.executable).parent
SCRIPT = ROOT / "tests" / "horovod_style" / "elastic_main.py"

PATTERNS = {
    "steady": ["--batches-per-commit", "1", "--step-delay", "0.05", "--batches-per-epoch", "40"],
    "bursty": ["--batches-per-commit", "1", "--step-delay", "0.01", "--batches-per-epoch", "10"],
    "slow": ["--batches-per-commit", "4", "--step-delay", "0.5", "--batches-per-epoch", "8"],
}


def _events(path: Path):
    return read_events(path)[0]  # not EventLog.note lines


def _wait(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")


def run_pattern(name: str, requests: int, pause_s: float, rng: random.Random) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"hvd_edl_timely_{name}_"))
    events, job_file, stop = tmp / "events.jsonl", tmp / "job.json", tmp / "stop"
    extra = list(PATTERNS[name])
    if name == "bursty":
        extra += ["--epoch-wait", str(pause_s)]
    cmd = [str(BIN / "hvd-edl-run"), "-np", "2", "--min-np", "1", "--max-np", "2",
           "-H", "localhost:2", "--event-log", str(events), "--job-file", str(job_file),
           str(BIN / "python"), str(SCRIPT), "--logfile", str(tmp / "log"), "--epochs", "0",
           "--stop-file", str(stop), "--commit-log", str(tmp / "commits")] + extra
    out = open(tmp / "launcher.out", "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT))
    delays, commits = [], []
    try:
        _wait(lambda: any(e["generation"] == 1 for e in _events(events)), 120, "generation 1")
        gen = 1
        for _ in range(requests):
            time.sleep(rng.uniform(1.0, 1.0 + (pause_s + 1.0 if name == "bursty" else 2.5)))
            client = ControlClient(job_file)
            t0 = time.time()
            client.call("scale", np=1)
            gen += 1
            ev = _wait(lambda: next((e for e in _events(events) if e["generation"] == gen), None),
                       120, f"generation {gen}")
            delays.append(ev["time"] - t0)
            times = [float(x) for x in (tmp / "commits").read_text().split()]
            # commits rank 0 began after the request, up to the one the ring switched at
            commits.append(sum(1 for t in times if t0 < t <= ev["time"]))
            client.call("scale", np=2)
            gen += 1
            _wait(lambda: next((e for e in _events(events) if e["generation"] == gen), None),
                  180, f"generation {gen}")
    finally:
        stop_launcher(proc, stop, out)
    return {"pattern": name, "delays_s": [round(d, 3) for d in delays], "commits": commits,
            "median_s": round(statistics.median(delays), 3), "max_s": round(max(delays), 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=4, help="scale-in requests per pattern")
    p.add_argument("--pause", type=float, default=6.0, help="bursty pattern's pause (s)")
    p.add_argument("--patterns", default="steady,bursty,slow")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    a = p.parse_args()
    rng = random.Random(a.seed)
    results = []
    for name in a.patterns.split(","):
        r = run_pattern(name, a.requests, a.pause, rng)
        results.append(r)
        print(f"{name:7s} request -> switch: median {r['median_s']:.3f} s, max {r['max_s']:.3f} s"
              f"  ({', '.join(f'{d:.2f}' for d in r['delays_s'])}); switched at commit "
              f"{', '.join(str(c) for c in r['commits'])} after the request", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
