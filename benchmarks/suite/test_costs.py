"""Where make test's time goes: wall and CPU seconds per test and per file (issue 38).

Runs each named test file alone (``pytest -q FILE``, no xdist, so a file's figures are not
mixed with another's) with HVD_EDL_TEST_COSTS set (tests/conftest.py records one JSON line per
test: wall seconds, and CPU seconds of the test process and the children it waited for), then
prints a table per file and the slowest tests.  CPU seconds move less with a loaded machine
than wall seconds, so compare those between runs on a shared machine.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/suite/test_costs.py tests/test_elastic.py ...
    PYTHONPATH=$PWD .venv/bin/python benchmarks/suite/test_costs.py --read costs.jsonl

``--out FILE`` also writes the table as JSON (benchmarks/results/test_costs.json by convention).
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
from typing import Dict, List


def run_files(files: List[str], costs_path: Path, pytest_args: List[str]) -> Dict[str, dict]:
    """Run each of ``files`` in its own ``pytest -q`` (from the current directory), appending
    per-test costs to ``costs_path``; returns {file: {"rc", "wall_s"}} (the whole pytest
    process's wall seconds, collection and start-up included)."""
    runs = {}
    for name in files:
        env = dict(os.environ, HVD_EDL_TEST_COSTS=str(costs_path))
        start = time.monotonic()
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              *pytest_args, name], env=env)
        runs[name] = {"rc": rc, "wall_s": round(time.monotonic() - start, 1)}
    return runs


def per_file(costs_path: Path) -> Dict[str, dict]:
    """{file: {"tests", "wall_s", "cpu_s", "slowest": [[test, wall_s, cpu_s], ...]}} summed
    from the JSON lines in ``costs_path``."""
    files: Dict[str, dict] = defaultdict(lambda: {"tests": 0, "wall_s": 0.0, "cpu_s": 0.0,
                                                  "slowest": []})
    for line in costs_path.read_text().splitlines():
        row = json.loads(line)
        entry = files[row["test"].split("::")[0]]
        entry["tests"] += 1
        entry["wall_s"] += row["wall_s"]
        entry["cpu_s"] += row["cpu_s"]
        entry["slowest"].append([row["test"], row["wall_s"], row["cpu_s"]])
    for entry in files.values():
        entry["slowest"].sort(key=lambda t: -t[1])
        entry["wall_s"], entry["cpu_s"] = round(entry["wall_s"], 1), round(entry["cpu_s"], 1)
    return dict(files)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", help="test files to run one by one")
    parser.add_argument("--read", type=Path, help="summarise this costs file instead of running")
    parser.add_argument("--out", type=Path, help="also write the per-file table as JSON here")
    parser.add_argument("--top", type=int, default=5, help="slowest tests shown per file")
    args, pytest_args = parser.parse_known_args(argv)
    if bool(args.files) == bool(args.read):
        parser.error("give test files to run, or --read COSTS_FILE")
    runs = {}
    if args.read:
        costs = args.read
    else:
        costs = Path(tempfile.mkstemp(prefix="test_costs.", suffix=".jsonl")[1])
        runs = run_files(args.files, costs, pytest_args)
    table = per_file(costs)
    print(f"{'file':40} {'tests':>5} {'wall_s':>8} {'cpu_s':>8}")
    for name, entry in sorted(table.items(), key=lambda kv: -kv[1]["wall_s"]):
        print(f"{name:40} {entry['tests']:5d} {entry['wall_s']:8.1f} {entry['cpu_s']:8.1f}"
              + (f"   (pytest rc {runs[name]['rc']}, {runs[name]['wall_s']} s)" if name in runs else ""))
        for test, wall_s, cpu_s in entry["slowest"][:args.top]:
            print(f"    {wall_s:7.1f} {cpu_s:7.1f}  {test.split('::', 1)[1]}")
    if args.out:
        args.out.write_text(json.dumps({"files": table, "runs": runs}, indent=1) + "\n")
    print(f"costs per test: {costs}")
    return 0 if all(r["rc"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
