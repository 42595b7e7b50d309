"""Where make test's time goes: wall and CPU seconds per test and per file (issue 38).

Runs each named test file alone (``pytest -q FILE``, no xdist, so a file's figures are not
mixed with another's) with HVD_EDL_TEST_COSTS set (tests/conftest.py records one JSON line per
test: wall seconds, and CPU seconds of the test process and the children it waited for), then
prints a table per file and the slowest tests.  As root on cgroup v1, each file's pytest runs in
a cpuacct cgroup of its own, so ``tree_cpu_s`` also counts what no test process waits for (the
cluster service's jobs, sshd's sessions in the namespace hosts, orphans): the figure to compare.
CPU seconds move less with a loaded machine than wall seconds (though contention still inflates
them), so compare those between runs on a shared machine, side by side.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/suite/test_costs.py tests/test_elastic.py ...
    PYTHONPATH=$PWD .venv/bin/python benchmarks/suite/test_costs.py --read costs.jsonl

``--out FILE`` also writes the table as JSON (benchmarks/results/test_costs.json by convention).

``--suite`` runs the whole suite instead, as ``make test`` does (``pytest -n 2 --dist
loadgroup tests``), with HVD_EDL_TEST_COSTS_CGROUPS set: each xdist worker sits in a cpuacct
cgroup of its own (tests/conftest.py), so every test's ``tree_cpu_s`` is what it started under
make test's own schedule, and the run's total CPU is the parent cgroup's:

    sudo PYTHONPATH=$PWD .venv/bin/python benchmarks/suite/test_costs.py --suite --out F.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional


CPUACCT = Path("/sys/fs/cgroup/cpuacct")


def _make_cgroup() -> Optional[Path]:
    """A fresh cpuacct cgroup (cgroup v1, root only), or None where there is none."""
    folder = CPUACCT / f"hvd-edl-test-costs-{os.getpid()}-{time.monotonic_ns()}"
    try:
        folder.mkdir()
    except OSError:
        return None
    return folder


def _remove_cgroup(folder: Path) -> None:
    """Move what is left in ``folder`` (leftovers of a test) to the root cgroup, then remove it."""
    for _ in range(50):
        for pid in (folder / "cgroup.procs").read_text().split():
            try:
                (CPUACCT / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # gone meanwhile
        try:
            folder.rmdir()
            return
        except OSError:
            time.sleep(0.1)  # a process forked while we moved the others


def run_files(files: List[str], costs_path: Path, pytest_args: List[str]) -> Dict[str, dict]:
    """Run each of ``files`` in its own ``pytest -q`` (from the current directory), appending
    per-test costs to ``costs_path``; returns {file: {"rc", "wall_s", "tree_cpu_s"}} (the whole
    pytest run's wall seconds, collection and start-up included; its cgroup's CPU seconds, or
    None without a cgroup)."""
    runs = {}
    for name in files:
        env = dict(os.environ, HVD_EDL_TEST_COSTS=str(costs_path))
        cgroup = _make_cgroup()
        if cgroup is not None:
            env["HVD_EDL_TEST_COSTS_CGROUP"] = str(cgroup)
        procs = str(cgroup / "cgroup.procs") if cgroup is not None else None

        def enter_cgroup():  # in the child, before exec: pytest and all it starts are inside
            if procs:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))
        start = time.monotonic()
        try:
            rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p",
                                  "no:cacheprovider", *pytest_args, name], env=env,
                                 preexec_fn=enter_cgroup)
            tree = int((cgroup / "cpuacct.usage").read_text()) / 1e9 if cgroup else None
        finally:
            if cgroup is not None:
                _remove_cgroup(cgroup)
        runs[name] = {"rc": rc, "wall_s": round(time.monotonic() - start, 1),
                      "tree_cpu_s": round(tree, 1) if tree is not None else None}
    return runs


def run_suite(costs_path: Path, pytest_args: List[str], jobs: int = 2) -> Dict[str, dict]:
    """The whole suite as ``make test`` runs it (``jobs`` xdist workers, ``--dist loadgroup``),
    each worker in a cpuacct cgroup of its own under one made here; returns {"suite": {"rc",
    "wall_s", "tree_cpu_s"}} (the parent cgroup's CPU seconds: every process of the run)."""
    cgroup = _make_cgroup()
    env = dict(os.environ, HVD_EDL_TEST_COSTS=str(costs_path))
    if cgroup is not None:
        env["HVD_EDL_TEST_COSTS_CGROUPS"] = str(cgroup)
    start = time.monotonic()
    try:
        rc = subprocess.call([sys.executable, "-m", "pytest", "-n", str(jobs), "--dist",
                              "loadgroup", "-q", "-p", "no:cacheprovider", *pytest_args, "tests"],
                             env=env)
        tree = int((cgroup / "cpuacct.usage").read_text()) / 1e9 if cgroup else None
    finally:
        if cgroup is not None:
            for sub in cgroup.iterdir():
                if sub.is_dir():
                    _remove_cgroup(sub)
            _remove_cgroup(cgroup)
    return {"suite": {"rc": rc, "wall_s": round(time.monotonic() - start, 1),
                      "tree_cpu_s": round(tree, 1) if tree is not None else None}}


def per_file(costs_path: Path) -> Dict[str, dict]:
    """{file: {"tests", "wall_s", "cpu_s", "slowest": [[test, wall_s, cpu_s], ...]}} summed
    from the JSON lines in ``costs_path``."""
    files: Dict[str, dict] = defaultdict(lambda: {"tests": 0, "wall_s": 0.0, "cpu_s": 0.0,
                                                  "tree_cpu_s": 0.0, "slowest": []})
    for line in costs_path.read_text().splitlines():
        row = json.loads(line)
        entry = files[row["test"].split("::")[0]]
        entry["tests"] += 1
        entry["wall_s"] += row["wall_s"]
        entry["cpu_s"] += row["cpu_s"]
        entry["tree_cpu_s"] += row.get("tree_cpu_s", 0.0)
        entry["slowest"].append([row["test"], row["wall_s"], row["cpu_s"],
                                 row.get("tree_cpu_s")])
    for entry in files.values():
        entry["slowest"].sort(key=lambda t: -t[1])
        for key in ("wall_s", "cpu_s", "tree_cpu_s"):
            entry[key] = round(entry[key], 1)
    return dict(files)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", help="test files to run one by one")
    parser.add_argument("--read", type=Path, help="summarise this costs file instead of running")
    parser.add_argument("--out", type=Path, help="also write the per-file table as JSON here")
    parser.add_argument("--top", type=int, default=5, help="slowest tests shown per file")
    parser.add_argument("--suite", action="store_true",
                        help="run the whole suite as make test does (two xdist workers)")
    args, pytest_args = parser.parse_known_args(argv)
    if sum((bool(args.files), bool(args.read), args.suite)) != 1:
        parser.error("give test files to run, --suite, or --read COSTS_FILE")
    runs = {}
    if args.read:
        costs = args.read
    else:
        costs = Path(tempfile.mkstemp(prefix="test_costs.", suffix=".jsonl")[1])
        runs = run_suite(costs, pytest_args) if args.suite else \
            run_files(args.files, costs, pytest_args)
    table = per_file(costs)
    print(f"{'file':40} {'tests':>5} {'wall_s':>8} {'cpu_s':>8} {'tree_cpu_s':>10}")
    for name, entry in sorted(table.items(), key=lambda kv: -kv[1]["wall_s"]):
        run = runs.get(name)
        print(f"{name:40} {entry['tests']:5d} {entry['wall_s']:8.1f} {entry['cpu_s']:8.1f} "
              f"{entry['tree_cpu_s']:10.1f}"
              + (f"   (pytest rc {run['rc']}, {run['wall_s']} s, cgroup {run['tree_cpu_s']} "
                 "CPU s)" if run else ""))
        for test, wall_s, cpu_s, tree_cpu_s in entry["slowest"][:args.top]:
            print(f"    {wall_s:7.1f} {cpu_s:7.1f} {tree_cpu_s if tree_cpu_s is not None else '-':>7}"
                  f"  {test.split('::', 1)[1]}")
    if args.out:
        args.out.write_text(json.dumps({"files": table, "runs": runs}, indent=1) + "\n")
    if "suite" in runs:
        print(f"suite: pytest rc {runs['suite']['rc']}, {runs['suite']['wall_s']} s, "
              f"{runs['suite']['tree_cpu_s']} CPU s in all")
    print(f"costs per test: {costs}")
    return 0 if all(r["rc"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
