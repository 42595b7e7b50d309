"""How well make test's two pytest-xdist workers are packed, and what another order would give
(issue 38): replays xdist's ``--dist loadgroup`` scheduling over the per-test seconds of a real
run and prints the makespan for the collection order and for the files costliest first.

    make test PYTEST_ARGS=--durations=0 2>&1 | tee /tmp/run.log
    PYTHONPATH=$PWD .venv/bin/python benchmarks/suite/packing.py /tmp/run.log [more logs...]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/suite/packing.py benchmarks/results/packing_issue38/*.json

The replay is xdist 3.8's ``LoadScopeScheduling`` as ``LoadGroupScheduling`` uses it: one work
unit per ``xdist_group`` (tests/conftest.py's namespace-cluster group; the cluster-faults and
cluster-gpus file marks) and per other test; units handed out largest first (``loadscopereorder``),
ties in collection order; one unit per worker, then one more each time a worker has two tests
or fewer left.  A test costs its set-up + call + tear-down from ``--durations=0`` (the ones under
5 ms that pytest hides cost 5 ms).  Fidelity: the replayed makespan of the collection order
against the run's own wall (which also holds collection and start-up, ~10-20 s).
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from typing import Dict, List, Optional, Tuple

NAMESPACE_CLUSTER_FILES = {"test_cluster.py", "test_ray.py", "test_cluster_users.py"}
FILE_GROUPS = {"test_cluster_faults.py": "cluster-faults", "test_cluster_gpus.py": "cluster-gpus"}
HIDDEN_S = 0.005  # what --durations=0 leaves out costs at most this


def durations(path: str) -> Tuple[Dict[str, float], Optional[float]]:
    """({test node id: set-up + call + tear-down seconds}, the run's wall seconds or None), from
    a log, or from a ``.json`` that :func:`main`'s ``--save`` wrote (``{"wall_s", "tests"}``)."""
    if path.endswith(".json"):
        with open(path) as f:
            record = json.load(f)
        return record["tests"], record["wall_s"]
    cost: Dict[str, float] = collections.defaultdict(float)
    wall = None
    with open(path) as f:
        for line in f:
            m = re.match(r"^([0-9.]+)s (call|setup|teardown)\s+(tests/\S+)", line)
            if m:
                cost[m.group(3)] += float(m.group(1))
            m = re.search(r"(?:passed|failed).* in ([0-9.]+)s", line)
            if m:
                wall = float(m.group(1))
    return dict(cost), wall


def group(nodeid: str) -> Optional[str]:
    """The test's xdist group as make test marks it (None: a unit of its own)."""
    name = nodeid.split("::")[0].split("/")[-1]
    if name in NAMESPACE_CLUSTER_FILES or "vanished_pool_host" in nodeid:
        return "namespace-cluster"
    return FILE_GROUPS.get(name)


def makespan(order: List[str], cost: Dict[str, float], workers: int = 2) -> List[float]:
    """Each worker's busy seconds when ``order`` (test ids, as collected) is handed out by
    loadgroup over ``workers`` workers; the run's wall is their maximum."""
    units: Dict[str, List[str]] = collections.OrderedDict()
    for t in order:
        units.setdefault(group(t) or t, []).append(t)
    queue = collections.OrderedDict(sorted(units.items(), key=lambda kv: -len(kv[1])))
    pending: Dict[int, List[str]] = {w: [] for w in range(workers)}

    def assign(w: int) -> None:
        if queue:
            pending[w].extend(queue.popitem(last=False)[1])
    for w in range(workers):
        assign(w)
    for w in range(workers):
        if len(pending[w]) <= 2:
            assign(w)
    busy = [0.0] * workers
    while any(pending.values()):
        w = min((w for w in pending if pending[w]), key=lambda w: busy[w])
        busy[w] += cost.get(pending[w].pop(0), HIDDEN_S)
        if len(pending[w]) <= 2:
            assign(w)
    return busy


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("logs", nargs="+", help="make test output with --durations=0")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--save", metavar="FOLDER", help="also write each log's per-test "
                        "seconds and wall as FOLDER/<log name>.json (read back like a log)")
    args = parser.parse_args(argv)
    for path in args.logs:
        cost, wall = durations(path)
        if not cost:
            print(f"{path}: no --durations=0 table", file=sys.stderr)
            return 2
        if args.save:
            name = path.rsplit("/", 1)[-1].rsplit(".", 1)[0] + ".json"
            with open(f"{args.save}/{name}", "w") as f:
                json.dump({"wall_s": wall, "tests": cost}, f, indent=0, sort_keys=True)
        files: Dict[str, List[str]] = collections.OrderedDict()
        for t in sorted(cost):
            files.setdefault(t.split("::")[0], []).append(t)
        per_file = {f: sum(cost[t] for t in ts) for f, ts in files.items()}
        collected = [t for ts in files.values() for t in ts]
        costliest = [t for f in sorted(files, key=lambda f: -per_file[f]) for t in files[f]]
        total = sum(cost.values())
        print(f"{path}: {len(cost)} tests timed, {total:.0f} s in all (bound with "
              f"{args.workers} workers: {total / args.workers:.0f} s); the run's wall "
              f"{wall if wall is not None else '?'} s")
        for name, order in (("collection order", collected), ("costliest files first", costliest)):
            busy = makespan(order, cost, args.workers)
            print(f"    {name:22} makespan {max(busy):6.1f} s (workers {', '.join(f'{b:.0f}' for b in busy)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
