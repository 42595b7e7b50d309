"""Measures a joiner's time to ready with workers forked from a zygote (``--zygote``, the
default) and exec'd (``--no-zygote``), side by side in one run: an elastic job of 1 worker on
this host (the benchmark workload), one slot added; the time from the hosts file's change to the
generation that includes the joiner (discovery, spawn, the joiner's imports and build, its
ready, the switch), and the job's start (launch to generation 1).  Rounds alternate the two
ways, so both see the same load; the machine's load is recorded beside the figures.

    .venv/bin/python benchmarks/job/zygote_join.py [--rounds 3]

Writes benchmarks/results/zygote_join.json; docs/zygote.md shows the figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common.jobs import RESULTS, Job, machine_info  # noqa: E402

WAYS = {"zygote": ("--zygote",), "exec": ("--no-zygote",)}


def one_round(way: str, timeout_s: float) -> dict:
    """Start a 1-worker job the given way, add a slot, return the start and join times (s)."""
    with tempfile.TemporaryDirectory(prefix=f"zygote-join-{way}-") as tmp:
        job = Job("hvd_edl", Path(tmp), 1, step_delay=0.01, max_np=2,
                  launcher_args=WAYS[way])
        try:
            started = job.started
            first = _generation(job, 1, timeout_s)
            if not job.wait_settled(1, 5, first["time"], timeout_s):
                raise RuntimeError(f"{way}: no steps at size 1: {job.output_tail()}")
            changed = job.change(2)
            second = _generation(job, 2, timeout_s)
            return {"way": way, "start_s": round(first["time"] - started, 3),
                    "join_s": round(second["time"] - changed, 3),
                    "world_size": second["world_size"]}
        finally:
            job.finish()


def _generation(job: Job, number: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [e for e in job.events() if e.get("generation") == number]
        if found:
            return found[0]
        if job.proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"no generation {number}: {job.output_tail()}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds per way (default 3)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per wait")
    p.add_argument("--out", default=str(RESULTS / "zygote_join.json"))
    a = p.parse_args(argv)
    runs = []
    for i in range(a.rounds):
        for way in (("zygote", "exec") if i % 2 == 0 else ("exec", "zygote")):
            r = one_round(way, a.timeout)
            runs.append(r)
            print(f"round {i + 1} {way:6s} start {r['start_s']:6.2f} s  "
                  f"joiner ready (hosts change -> ring of 2) {r['join_s']:6.2f} s", flush=True)
    table = {}
    for way in WAYS:
        mine = [r for r in runs if r["way"] == way]
        table[way] = {k: round(statistics.median(r[k] for r in mine), 3)
                      for k in ("start_s", "join_s")}
    print(f"{'':8s}{'start (median)':>16s}{'join (median)':>16s}")
    for way, t in table.items():
        print(f"{way:8s}{t['start_s']:14.2f} s{t['join_s']:14.2f} s")
    out = {"what": "joiner time to ready, zygote vs exec (benchmarks/job/zygote_join.py)",
           "command": "python benchmarks/job/zygote_join.py --rounds %d" % a.rounds,
           "median": table, "runs": runs, "machine": machine_info()}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"written {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
