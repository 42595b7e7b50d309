"""How fast the cluster service takes lent slots back (issue 28's "lending idle slots" goal), and
where the time goes, against the leaving job's commit period.

    .venv/bin/python benchmarks/cluster/reclaim.py [--slots 3] [--rounds 5] [--commit-every 1,5,10]
    .venv/bin/python benchmarks/cluster/reclaim.py --cluster-hosts 2      # as root: h1, h2 over ssh

One ``hvd-edl-cluster serve --policy edl --hold 2`` on a pool of ``--slots`` slots (with
``--cluster-hosts K``: ``localhost`` keeps ``--slots`` minus K, and K hosts of the namespace test
cluster, tests/cluster.py, give one slot each, reached over ssh).  A long job A
(examples/train_synthetic.py, 1 MB, 0.08 s of sleeping compute a step, ``--commit-every C``,
``--min-np 1 --max-np SLOTS``) is lent the whole pool; then ``--rounds`` times: a one-slot job B
is submitted, edl takes a slot back from A by stop-free scale-in, B runs a few steps and ends,
and A is lent the slot again.  Per round, from the service's and A's own event logs
(``cluster_service.reclaim_parts``): the reclaim (B's submission to A's leaver out of the ring,
the slot free for B) = ``decide`` (submission to A's allocation file rewritten) +
``to_switch`` (that to A's scale-in generation: A's discovery poll, 0.2 s, the wait for A's
script's next ``state.commit()``, at most its commit period, and the agreement there) +
``after`` (the generation to the service counting the slot free: its 0.05 s telemetry poll).
Under Horovod's contract a worker leaves at a commit (``HostsUpdatedInterrupt`` is raised in
``state.commit()`` / ``check_host_updates()``), so the commit period bounds the reclaim from
below; the script prints the commit period measured beside each figure.

Written to benchmarks/results/reclaim.json (``reclaim_cluster.json`` with namespace hosts).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common import cluster_service  # noqa: E402  (Serve, reclaim_parts, argv_of)
from benchmarks.common.cluster_service import wait_for  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
COMPUTE_S = 0.08


def synthetic(samples: int, epochs: int, commit_every: int, stop_file: Path = None):
    cmd = [sys.executable, str(ROOT / "examples" / "train_synthetic.py"), "--params-mb", "1",
           "--samples", str(samples), "--epochs", str(epochs), "--batch-size", "8",
           "--compute-s", str(COMPUTE_S), "--commit-every", str(commit_every)]
    return cmd + (["--stop-file", str(stop_file)] if stop_file else [])


def job(svc, job_id):
    return next(j for j in svc.call("status")["jobs"] if j["id"] == job_id)


def commit_period_s(tmp: Path, job_id: str, commit_every: int) -> float:
    """A's commit period (seconds): ``commit_every`` x its step time at its full size, from the
    speed points the service's telemetry recorded (``cluster_service.speed_points``)."""
    steps = cluster_service.speed_points(tmp).get(job_id, {})
    if not steps:
        return float("nan")
    return commit_every * steps[max(steps)]


def run_one(commit_every: int, rounds: int, pool: dict, tmp: Path, env: dict = None,
            during_grow: bool = False) -> dict:
    """A's ``commit_every`` (and ``env`` in A's environment, e.g. the agreement's
    ``HVD_EDL_SYNC_AGREE_S``); ``rounds`` reclaims; returns the parts per round."""
    slots = sum(pool["hosts"].values())
    svc = cluster_service.Serve(tmp, "edl", pool)
    svc.extra = ["--hold", "2"]
    svc.start()
    stop = tmp / "stop-A"
    try:
        a = svc.call("submit", argv=synthetic(512, 1000, commit_every, stop),
                     cwd=str(ROOT),
                     env=dict(env or {}),
                     name=f"A-commit{commit_every}", np=1, min_np=1,
                     max_np=slots, priority=0, checkpoint_dir=None)["id"]
        bs = []
        for r in range(rounds):
            if during_grow and r > 0:  # B arrives while A's joiner is still starting
                wait_for(f"A lent all {slots} slots",
                         lambda: job(svc, a)["world_size"] == slots, 120, poll_s=0.05)
            else:
                wait_for(f"A lent all {slots} slots",
                         lambda: job(svc, a)["world_size"] == slots
                         and a_steady(svc, tmp, a, slots), 120)
            b = svc.call("submit", argv=synthetic(64, 1, 1), cwd=str(ROOT), env={},
                         name=f"B{r}", np=1, min_np=1, max_np=1, priority=0,
                         checkpoint_dir=None)["id"]
            bs.append(b)
            wait_for(f"B{r} done", lambda: job(svc, b)["state"] in ("done", "failed"), 120)
        stop.write_text("")
        wait_for("A done", lambda: job(svc, a)["state"] in ("done", "failed"), 120)
        events = svc.call("events", since=0)["events"]
    finally:
        stop.write_text("")
        for j in svc.call("status")["jobs"]:  # nothing outlives the benchmark
            if j["state"] in ("queued", "running", "suspended"):
                svc.call("cancel", job=j["id"])
        svc.stop()
    parts = [p for p in cluster_service.reclaim_parts(tmp, events) if p["job"] in bs]
    states = {j["id"]: j["state"] for j in svc_status_safe(events)}
    return {"commit_every": commit_every, "env": dict(env or {}),
            "commit_period_s": round(commit_period_s(tmp, a, commit_every), 3),
            "parts": parts, "states": states}


def svc_status_safe(events):
    """The jobs' last recorded states from the event history (the service is stopped)."""
    last = {}
    for e in events:
        if e["kind"] in ("end", "fail", "cancel"):
            last[e["job"]] = e["kind"]
    return [{"id": j, "state": k} for j, k in last.items()]


def a_steady(svc, tmp: Path, job_id: str, slots: int) -> bool:
    """A's latest generation has every slot in its ring (the joiners built and joined, so the
    next reclaim takes a member out, not a worker still starting)."""
    gens = []
    for log in (tmp / "state" / "jobs" / job_id).glob("run*.events.jsonl"):
        gens += [json.loads(x) for x in log.read_text().splitlines() if '"generation"' in x]
    return bool(gens) and max(gens, key=lambda g: g["time"])["world_size"] == slots


def summary(parts, key):
    xs = [p[key] for p in parts if p.get(key) is not None]
    return {"median": round(statistics.median(xs), 3), "max": round(max(xs), 3)} if xs else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--commit-every", default="1,5,10",
                   help="A's steps between commits, one run each (comma-separated)")
    p.add_argument("--variant", action="append", default=None, metavar="NAME=V[,NAME=V]",
                   help="an environment for A to compare (repeatable; '' = the library's "
                        "defaults), one run each per commit interval, e.g. "
                        "--variant '' --variant HVD_EDL_SYNC_AGREE_S=0.5,"
                        "HVD_EDL_SYNC_AGREE_WINDOW=1 (the agreement before this benchmark)")
    p.add_argument("--during-grow", action="store_true",
                   help="submit each B (after the first) as soon as A is lent the slot again, "
                        "while A's joiner is still starting, instead of after it joined")
    p.add_argument("--cluster-hosts", type=int, default=0, metavar="K")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--pool-json", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.cluster_hosts and not a.pool_json:
        return cluster_service.in_cluster(a.cluster_hosts, a.slots, __file__)
    pool = json.loads(a.pool_json) if a.pool_json else {"hosts": {"localhost": a.slots}}
    base = Path(tempfile.mkdtemp(prefix="reclaim-"))
    out = []
    variants = [dict(kv.split("=", 1) for kv in v.split(",") if kv) for v in a.variant or [""]]
    for c in (int(x) for x in a.commit_every.split(",")):
        for i, env in enumerate(variants):
            tmp = base / f"commit{c}-variant{i}"
            tmp.mkdir()
            r = run_one(c, a.rounds, pool, tmp, env, a.during_grow)
            out.append(r)
            print(f"commit every {c:3d} steps (period {r['commit_period_s']:.2f} s), "
                  f"{env or 'defaults'}: reclaim {summary(r['parts'], 'total_s')}, decide "
                  f"{summary(r['parts'], 'decide_s')}, to switch "
                  f"{summary(r['parts'], 'to_switch_s')}, after "
                  f"{summary(r['parts'], 'after_s')}; rounds {len(r['parts'])}", flush=True)
            for part in r["parts"]:
                print(f"    {part}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "reclaim" + ("_cluster" if a.pool_json else "")
    (RESULTS / f"{stem}.json").write_text(json.dumps(
        {"command": " ".join(["benchmarks/cluster/reclaim.py"] + cluster_service.argv_of(sys.argv[1:])),
         "pool": pool["hosts"], "runs": out,
         "summary": {f"commit_every={r['commit_every']} {r['env'] or 'defaults'}": {
                         "commit_period_s": r["commit_period_s"],
                                         **{k: summary(r["parts"], k) for k in
                                            ("total_s", "decide_s", "to_switch_s", "after_s")}}
                     for r in out}}, indent=1))
    if a.keep:
        print(f"state kept in {base}")
    else:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
