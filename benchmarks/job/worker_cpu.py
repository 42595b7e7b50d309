"""CPU seconds of each process a small job runs: the launcher, its zygote, the stubs, and each
worker forked from the zygote (issue 38: a worker's own CPU after the fork, its exit included).

A 2-worker job of Horovod's elastic test script (``tests/horovod_style/elastic_main.py``, 3
epochs of 10 steps, ``OMP_NUM_THREADS=1`` as make test sets it) runs under BSD process
accounting (``accton``, package ``acct``; root), which records every process's user and system
CPU when it ends, exit included, wherever its parent is.  ``--trees A B``: the same job from
each source tree in turn (``PYTHONPATH`` and the script from that tree), alternating for
``--runs`` rounds, so two versions are compared side by side on a loaded machine.

Process accounting is one file for the whole machine: do not run this while anything else
uses ``accton``.

Usage::

    sudo PYTHONPATH=$PWD .venv/bin/python benchmarks/job/worker_cpu.py [--trees /work/main $PWD] [--runs 3]

Prints one line per run and the mean per worker per tree; writes
``benchmarks/results/worker_cpu.json``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "worker_cpu.json"
LAUNCHER = ROOT / ".venv" / "bin" / "hvd-edl-run"
PYTHON = ROOT / ".venv" / "bin" / "python"


def _records(pacct: Path) -> list:
    """``dump-acct`` rows: comm, user and system CPU seconds, pid, ppid."""
    out = subprocess.run(["dump-acct", str(pacct)], capture_output=True, text=True,
                         check=True).stdout
    rows = []
    for line in out.splitlines():
        f = [x.strip() for x in line.split("|")]
        rows.append({"comm": f[0], "user_s": float(f[2]) / 100, "sys_s": float(f[3]) / 100,
                     "pid": int(f[9]), "ppid": int(f[10])})
    return rows


def _roles(rows: list, launcher_pid: int) -> dict:
    """CPU seconds by role in the job's process tree: launcher, zygote, stubs, workers."""
    children = collections.defaultdict(list)
    for r in rows:
        children[r["ppid"]].append(r)
    out = {"launcher": [], "zygote": [], "stub": [], "worker": [], "other": []}
    for r in rows:
        if r["pid"] == launcher_pid:
            out["launcher"].append(r)
    for r in children[launcher_pid]:
        kids = children[r["pid"]]
        if r["comm"].startswith("python") and kids and all(k["comm"].startswith("python")
                                                          for k in kids):
            out["zygote"].append(r)
            out["worker"].extend(kids)
        elif r["comm"].startswith("python"):
            out["stub"].append(r)
        else:
            out["other"].append(r)
    return {role: [round(r["user_s"] + r["sys_s"], 2) for r in rs] for role, rs in out.items()}


def run_once(tree: Path, workdir: Path) -> dict:
    pacct = workdir / "job.pacct"
    pacct.write_bytes(b"")
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    env.pop("HVD_EDL_ZYGOTE_KEEP", None)
    subprocess.run(["accton", str(pacct)], check=True, capture_output=True)
    try:
        t0 = time.monotonic()
        p = subprocess.Popen([str(LAUNCHER), "-np", "2", str(PYTHON),
                              str(tree / "tests" / "horovod_style" / "elastic_main.py"),
                              "--logfile", str(workdir / "epochs.log"), "--epochs", "3"],
                             cwd=str(tree), env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        rc = p.wait(timeout=600)
        wall_s = time.monotonic() - t0
    finally:
        subprocess.run(["accton", "off"], check=True, capture_output=True)
    return {"tree": str(tree), "rc": rc, "wall_s": round(wall_s, 1),
            **_roles(_records(pacct), p.pid)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", nargs="+", type=Path, default=[ROOT],
                   help="source trees to compare (default: this one)")
    p.add_argument("--runs", type=int, default=3, help="rounds (each tree once per round)")
    args = p.parse_args()
    if os.geteuid() != 0 or shutil.which("accton") is None or shutil.which("dump-acct") is None:
        sys.exit("worker_cpu.py: needs root and BSD process accounting (accton, dump-acct)")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.runs):
            for tree in args.trees:
                r = run_once(tree.resolve(), Path(tmp))
                runs.append(r)
                print(json.dumps(r), flush=True)
    summary = {}
    for tree in args.trees:
        rs = [r for r in runs if r["tree"] == str(tree.resolve())]
        workers = [c for r in rs for c in r["worker"]]
        summary[str(tree)] = {
            "worker_cpu_s_mean": round(sum(workers) / max(1, len(workers)), 3),
            "worker_cpu_s_range": [min(workers, default=0), max(workers, default=0)],
            "launcher_cpu_s_mean": round(sum(c for r in rs for c in r["launcher"]) / len(rs), 3),
            "stub_cpu_s_mean": round(sum(c for r in rs for c in r["stub"])
                                     / max(1, sum(len(r["stub"]) for r in rs)), 3)}
        print(tree, json.dumps(summary[str(tree)]))
    RESULTS.write_text(json.dumps({
        "what": "CPU seconds per process of a 2-worker elastic_main.py job (3 epochs), BSD "
                "process accounting, trees alternating",
        "command": "sudo PYTHONPATH=$PWD .venv/bin/python benchmarks/job/worker_cpu.py --trees "
                   + " ".join(str(t) for t in args.trees) + f" --runs {args.runs}",
        "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
        "runs": runs, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
