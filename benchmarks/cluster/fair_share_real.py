"""What fair share between users changes in a real stream (issue 40's "must show"): two Unix
users made for the run share ``localhost:2`` under a root ``hvd-edl-cluster serve --policy
tiresias``; user A submits 4 jobs at once, user B one job STAGGER_S seconds later.  Run twice,
fair share on (the default) and ``serve --no-fair-share``: per-user average JCT, B's job's wait
(submission to first start) and JCT, preemptions, every job's exactly-once audit.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/cluster/fair_share_real.py   # as root; ~3-5 min

Jobs: tests/horovod_style/ledger_main.py (Horovod's API, the audit ledger), ``--np 1``, 768
samples, 1 epoch, 0.15 s of sleeping compute a step (2 cores measure scheduling, not CPU
contention), submitted by each user from their own shell through a team install every user can
run (tests/unix_users.py; users removed at the end).  No namespaces: the pool is this host's
loopback only.  Tiresias's queue threshold compressed with the time (42 GPU-s,
benchmarks/common/cluster_service.py), so every job stays in the first queue and only the order
within it differs: by submission without fair share (B's job behind A's four), by slots ahead
per user with it (B's job before A's second: A's second is preempted to its checkpoint).

Written to benchmarks/results/fair_share_real.json (``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from benchmarks.common.cluster_service import QUEUE_THRESHOLD_GPU_S, Serve, wait_for  # noqa: E402
from unix_users import TeamUsers, team_install  # noqa: E402

from hvd_edl import audit  # noqa: E402

LEDGER = ROOT / "tests" / "horovod_style" / "ledger_main.py"
SAMPLES = 768
STEP_DELAY_S = 0.15
A_JOBS = 4
STAGGER_S = 8.0
ENDED = ("done", "failed", "cancelled")


def run_stream(fair_share: bool, users, bin_dir: Path, tmp: Path, timeout_s: float) -> dict:
    """One stream under a root service on ``localhost:2`` (``fair_share`` or
    ``--no-fair-share``); returns its figures (seconds)."""
    tmp.mkdir(mode=0o755)
    svc = Serve(tmp, "tiresias", {"hosts": {"localhost": 2}})
    svc.cli = [str(bin_dir / "python"), "-m", "launcher.cluster.cli"]
    svc.cwd = "/"
    svc.extra = ["--queue-thresholds", f"{QUEUE_THRESHOLD_GPU_S:g}"] \
        + ([] if fair_share else ["--no-fair-share"])
    svc.start()
    jobs = {}
    try:
        def submit(u, name: str) -> None:
            work = tmp / u.name
            work.mkdir(mode=0o755, exist_ok=True)
            os.chown(work, u.uid, u.gid)
            ledger = work / f"audit-{name}"
            ledger.mkdir(mode=0o755)
            os.chown(ledger, u.uid, u.gid)
            argv = u.argv([str(bin_dir / "hvd-edl-cluster"), "--cluster", str(svc.cluster),
                           "submit", "--name", name, "--np", "1", "--", str(bin_dir / "python"),
                           str(LEDGER), "--dataset-size", str(SAMPLES), "--batch-size", "8",
                           "--epochs", "1", "--step-delay", str(STEP_DELAY_S),
                           "--done-log", str(work / f"{name}.done")])
            r = subprocess.run(argv, env=u.env([str(bin_dir)], HVD_EDL_AUDIT_DIR=str(ledger)),
                               cwd=str(work), capture_output=True, text=True, timeout=60)
            if r.returncode != 0:
                raise RuntimeError(f"submit {name} as {u.name}: {r.stderr.strip()}")
            jobs[r.stdout.strip().splitlines()[-1]] = {"name": name, "user": u.name,
                                                      "ledger": ledger}

        t0 = time.monotonic()
        for i in range(A_JOBS):
            submit(users[0], f"a{i + 1}")
        while time.monotonic() < t0 + STAGGER_S:  # the stream's arrival time, not a sync
            time.sleep(0.05)
        submit(users[1], "b1")
        def ended():
            s = svc.call("status")
            return s if all(j["state"] in ENDED for j in s["jobs"]) else None
        st = wait_for("the stream's end", ended, timeout_s, poll_s=0.5)
        events = svc.call("events", since=0)["events"]
    finally:
        svc.stop()
    rows = {j["id"]: j for j in st["jobs"]}
    out = {}
    for jid, d in jobs.items():
        r = rows[jid]
        rep = audit.check(d["ledger"], SAMPLES)
        out[jid] = {"name": d["name"], "user": d["user"], "state": r["state"],
                    "runs": r["runs"],
                    "wait_s": round(r["started_at"] - r["submitted_at"], 1)
                    if r["started_at"] else None,
                    "jct_s": round(r["finished_at"] - r["submitted_at"], 1)
                    if r["finished_at"] else None,
                    "preempted": sum(1 for e in events if e["job"] == jid
                                     and e["kind"] == "preempt"),
                    "ends": sum(1 for e in events if e["job"] == jid and e["kind"] == "end"),
                    "audit": {"repeated": rep.repeated, "missing": rep.missing, "ok": rep.ok}}
    per_user = {}
    for u in users:
        mine = [j["jct_s"] for j in out.values() if j["user"] == u.name and j["jct_s"]]
        per_user[u.name] = round(statistics.mean(mine), 1) if mine else None
    b = next(j for j in out.values() if j["name"] == "b1")
    first = min(r["submitted_at"] for r in rows.values())
    last = max(r["finished_at"] or first for r in rows.values())
    return {"fair_share": fair_share, "jobs": out,
            "avg_jct_s": round(statistics.mean(j["jct_s"] for j in out.values()), 1),
            "avg_jct_per_user_s": per_user, "b_wait_s": b["wait_s"], "b_jct_s": b["jct_s"],
            "makespan_s": round(last - first, 1),
            "preemptions": sum(j["preempted"] for j in out.values()),
            "all_done_once": all(j["state"] == "done" and j["ends"] == 1 for j in out.values()),
            "exactly_once": all(j["audit"]["ok"] for j in out.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                          "fair_share_real.json"))
    ap.add_argument("--timeout", type=float, default=300.0, help="each stream's bound, s")
    a = ap.parse_args()
    t_start = time.monotonic()
    shared = Path(tempfile.mkdtemp(prefix="hvdedl-fair-"))
    os.chmod(shared, 0o755)
    team = TeamUsers(2)
    users = team.users
    runs = []
    try:
        bin_dir = team_install(shared / "prefix")
        for fair in (True, False):
            runs.append(run_stream(fair, users, bin_dir, shared / ("fair" if fair else "unfair"),
                                   a.timeout))
            r = runs[-1]
            print(f"fair share {'on ' if fair else 'off'}: avg JCT {r['avg_jct_s']} s, per "
                  f"user {r['avg_jct_per_user_s']}, B waited {r['b_wait_s']} s", flush=True)
    finally:
        team.close()
        shutil.rmtree(shared, ignore_errors=True)
    a_name, b_name = users[0].name, users[1].name
    out = {"command": "benchmarks/cluster/fair_share_real.py"
                      + "".join(f" {x}" for x in sys.argv[1:]),
           "pool": "localhost:2", "policy": "tiresias", "users": {"A": a_name, "B": b_name},
           "stream": f"A: {A_JOBS} jobs at 0 s, B: 1 job at {STAGGER_S:g} s; each --np 1, "
                     f"{SAMPLES} samples, {STEP_DELAY_S} s a step",
           "runs": runs, "wall_s": round(time.monotonic() - t_start, 1)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"\n{'FAIR SHARE':<11}{'AVG JCT':>8}{'A AVG JCT':>10}{'B AVG JCT':>10}{'B WAIT':>8}"
          f"{'PREEMPT':>8}{'MAKESPAN':>9}  EXACTLY-ONCE")
    for r in runs:
        print(f"{'on' if r['fair_share'] else 'off':<11}{r['avg_jct_s']:>8}"
              f"{r['avg_jct_per_user_s'][a_name]:>10}{r['avg_jct_per_user_s'][b_name]:>10}"
              f"{r['b_wait_s']:>8}{r['preemptions']:>8}{r['makespan_s']:>9}  "
              f"{r['exactly_once'] and r['all_done_once']}")
    print(f"written to {a.out} ({out['wall_s']:.0f} s)")
    return 0 if all(r["exactly_once"] and r["all_done_once"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
