"""Sampler reset cost: ``set_epoch`` (a reset) plus the first batch, hvd_edl's ElasticSampler
against Horovod 0.28.1's ``horovod.torch.elastic.ElasticSampler``, at N = 10^4, 10^6, 10^8.

Ours keeps three integers and maps positions through a Feistel permutation on the fly, so the
cost should not grow with N; Horovod's builds and shuffles a Python list of all N indices at
every reset and copies it again when iteration starts.

    .venv/bin/python benchmarks/job/sampler.py        # writes benchmarks/results/sampler.json

Each case runs in a fresh process (so one case's memory does not slow the next) up to ``--reps``
times (median reported with min and max); a case whose runs pass ``--budget-s`` seconds in total
stops early and says how many runs it got (Horovod at 10^8 takes minutes per run here).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
BATCH = 32

_CASE = r"""
import json, sys, time, resource
impl, n, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import torch.utils.data
if impl == "hvd_edl":
    from hvd_edl.torch.elastic import ElasticSampler
    s = ElasticSampler(range(n), shuffle=True, seed=0, batch_size=batch)
else:
    import horovod.torch as hvd
    hvd.init()
    from horovod.torch.elastic import ElasticSampler
    s = ElasticSampler(range(n), shuffle=True, seed=0)
t0 = time.perf_counter()
s.set_epoch(1)                      # a reset, as after every generation change
first = next(iter(torch.utils.data.BatchSampler(s, batch, drop_last=False)))
dt = time.perf_counter() - t0
assert len(first) == min(batch, n)
print(json.dumps({"seconds": dt,
                  "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run_case(impl: str, n: int) -> dict:
    """One fresh process: seconds for reset + first batch, and its peak RSS in MB."""
    out = subprocess.run([sys.executable, "-c", _CASE, impl, str(n), str(BATCH)],
                         capture_output=True, text=True, check=True, cwd=str(ROOT))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1e4,1e6,1e8", help="comma-separated N (default %(default)s)")
    p.add_argument("--reps", type=int, default=5, help="runs per case (default 5)")
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="stop repeating a case once its runs took this many seconds (default 240)")
    p.add_argument("--out", default=str(RESULTS / "sampler.json"))
    a = p.parse_args()
    if a.reps < 1:
        p.error("--reps must be >= 1")
    sizes = [int(float(x)) for x in a.sizes.split(",")]
    results = []
    for n in sizes:
        for impl in ("hvd_edl", "horovod"):
            runs, spent = [], 0.0
            while len(runs) < a.reps and spent < a.budget_s:
                t = time.perf_counter()
                runs.append(run_case(impl, n))
                spent += time.perf_counter() - t
            secs = sorted(r["seconds"] for r in runs)
            row = {"impl": impl, "n": n, "runs": len(runs),
                   "median_s": statistics.median(secs), "min_s": secs[0], "max_s": secs[-1],
                   "max_rss_mb": max(r["max_rss_mb"] for r in runs)}
            results.append(row)
            print(f"{impl:8s} N={n:>11,d}: reset + first batch {row['median_s'] * 1e3:10.2f} ms "
                  f"median (min {row['min_s'] * 1e3:.2f}, max {row['max_s'] * 1e3:.2f}, "
                  f"{row['runs']} runs), peak RSS {row['max_rss_mb']:.0f} MB", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "sampler reset + first batch", "batch": BATCH, "results": results,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "python": platform.python_version()}}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
