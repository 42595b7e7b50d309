"""State sync cost: Horovod 0.28.1's ``broadcast_object`` against hvd_edl's, for a model state of
about 1, 10 and 100 MB, among 3 workers on this machine (the before/after of the switch's sync
phase: hvd_edl used Horovod's until this change).

    python benchmarks/sync.py            # writes benchmarks/results/sync.json

Runs ``hvd-edl-run -np 3`` on this file with ``--worker``; rank 0 prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RESULTS = ROOT / "benchmarks" / "results"


def worker(sizes, reps: int) -> None:
    import horovod.torch as horovod
    import torch
    import hvd_edl.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    rows = []
    for mb in sizes:
        state = {"w": torch.randn(int(mb * 2 ** 20 / 4))}
        for impl, fn in (("horovod", horovod.broadcast_object), ("hvd_edl", hvd.broadcast_object)):
            times = []
            for i in range(reps):
                hvd.allreduce(torch.zeros(1), name=f"barrier.{impl}.{mb}.{i}")
                t = time.perf_counter()
                out = fn(state, root_rank=0, name=f"sync.{impl}.{mb}.{i}")
                times.append(time.perf_counter() - t)
                assert torch.equal(out["w"], state["w"]) or hvd.rank() != 0
            rows.append({"impl": impl, "state_mb": mb, "median_s": statistics.median(times),
                         "min_s": min(times), "max_s": max(times), "runs": reps})
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,10,100", help="state MB (default %(default)s)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(RESULTS / "sync.json"))
    a = p.parse_args()
    sizes = [float(x) for x in a.sizes.split(",")]
    if a.worker:
        worker(sizes, a.reps)
        return 0
    out = subprocess.run([str(BIN / "hvd-edl-run"), "-np", "3", sys.executable, __file__,
                          "--worker", "--sizes", a.sizes, "--reps", str(a.reps)],
                         capture_output=True, text=True, cwd=str(ROOT), timeout=1800)
    line = next((x for x in out.stdout.splitlines() if "RESULT " in x), None)
    if out.returncode != 0 or line is None:
        print(out.stdout[-3000:], out.stderr[-3000:])
        return 1
    rows = json.loads(line.split("RESULT ", 1)[1])
    for r in rows:
        print(f"{r['impl']:8s} {r['state_mb']:6.0f} MB: broadcast_object {r['median_s']:8.3f} s "
              f"median (min {r['min_s']:.3f}, max {r['max_s']:.3f}, {r['runs']} runs, 3 workers)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"benchmark": "broadcast_object among 3 workers",
                                       "results": rows}, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
