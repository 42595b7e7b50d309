"""Fair share between users, simulated on Pollux's published workloads: each user's average JCT.

    .venv/bin/python benchmarks/cluster/scheduler_sim.py --users 4 [--shares 50,25,15,10]
        [--user-quota 48] [--workloads 1-8] [--loads 1.0]

(``scheduler_sim.py --users N`` runs :func:`main` here.)  Needs ``../shared/traces/pollux-osdi21``
(or ``$HVD_EDL_POLLUX_TRACES``).  Every workload's jobs are split among N users with skewed
shares of the jobs (default 50/25/15/10 %, a seeded shuffle: :func:`launcher.cluster.workload.
assign_users`), on the published 16 x 4 pool, and each of ``fifo``, ``tiresias`` (30 s per
change) and ``edl`` (stop-free, the repository's measured switch costs) runs three ways: without
fair share (users ignored: today's policies), with fair share (``launcher/cluster/fair_share.py``),
and with fair share and a per-user quota (``--user-quota`` slots, default 48: the largest trace
job's size, so every job can still run).  Prints, per load, the average JCT over all jobs and per
user (mean over the workloads), the most slots each user held at once (the quota must hold), and
the one-user check: ``tiresias`` with fair share on and every job of one user against the
published Tiresias (goal: within 1 %, as without users).  Writes
``benchmarks/results/scheduler_sim_users.json``; ``scheduler_sim.json`` is not touched.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launcher.cluster.policies import make_policy                      # noqa: E402
from launcher.cluster.simulator import pool_of, simulate               # noqa: E402
from launcher.cluster.workload import (assign_users, load_workload,    # noqa: E402
                                       published, sim_jobs)

RESULTS = ROOT / "benchmarks" / "results"
GOAL_ONE_USER_FIDELITY = 0.01
VARIANTS = ("no_fair_share", "fair_share", "fair_share_quota")


def run_users(policy: str, load: str, workloads: Sequence[int], elastic: bool, shares,
              fair_share: bool, user_quota: Optional[int], one_user: bool = False,
              seed: int = 0, **costs) -> Dict:
    """Simulate ``policy`` on each workload with its jobs split among users by ``shares``
    (``one_user``: every job the default user); the mean over workloads of the average JCT, of
    each user's average JCT (seconds), and the most slots each user held at once."""
    runs = []
    for i in workloads:
        jobs = sim_jobs(load_workload(load, i), elastic=elastic)
        if not one_user:
            jobs = assign_users(jobs, shares, seed=seed + i)
        user_of = {j.id: j.user for j in jobs}
        r = simulate(jobs, pool_of(16, 4), make_policy(policy, fair_share=fair_share,
                                                       user_quota=user_quota),
                     timeline=True, **costs)
        per_user: Dict[str, List[float]] = {}
        for job_id, res in r.jobs.items():
            per_user.setdefault(user_of[job_id], []).append(res.jct_s)
        peak: Dict[str, int] = {}
        for _, slots, _ in r.timeline:
            held: Dict[str, int] = {}
            for job_id, n in slots.items():
                held[user_of[job_id]] = held.get(user_of[job_id], 0) + n
            for u, n in held.items():
                peak[u] = max(peak.get(u, 0), n)
        runs.append({"workload": i, "avg_jct_s": r.avg_jct_s, "makespan_s": r.makespan_s,
                     "utilisation": r.utilisation,
                     "changes": sum(j.changes for j in r.jobs.values()),
                     "preemptions": sum(j.preemptions for j in r.jobs.values()),
                     "user_avg_jct_s": {u: statistics.mean(v) for u, v in sorted(per_user.items())},
                     "user_jobs": {u: len(v) for u, v in sorted(per_user.items())},
                     "user_peak_slots": dict(sorted(peak.items()))})
    users = sorted({u for x in runs for u in x["user_avg_jct_s"]})
    return {"runs": runs,
            "mean_avg_jct_s": statistics.mean(x["avg_jct_s"] for x in runs),
            "mean_makespan_s": statistics.mean(x["makespan_s"] for x in runs),
            "mean_utilisation": statistics.mean(x["utilisation"] for x in runs),
            "mean_preemptions": statistics.mean(x["preemptions"] for x in runs),
            "user_mean_avg_jct_s": {u: statistics.mean(x["user_avg_jct_s"][u] for x in runs
                                                       if u in x["user_avg_jct_s"])
                                    for u in users},
            "user_peak_slots": {u: max(x["user_peak_slots"].get(u, 0) for x in runs)
                                for u in users}}


def main(wl: Sequence[int], loads: Sequence[str], shares: Sequence[float], user_quota: int,
         ckpt: Dict, stopfree: Dict, out: Path) -> int:
    """The users benchmark (the module's docstring); ``ckpt`` / ``stopfree``: the simulator's
    cost arguments of the checkpoint-restart and stop-free settings (scheduler_sim.py's)."""
    t0 = time.process_time()
    n = len(shares)
    print(f"{n} users with {'/'.join(f'{100 * s:g}' for s in shares)} % of each workload's jobs "
          f"(seeded), 16 x 4 GPUs, workloads {wl[0]}-{wl[-1]}, quota {user_quota} slots")
    table: Dict = {}
    for load in loads:
        row: Dict = {}
        for pol, el, costs in (("fifo", False, ckpt), ("tiresias", False, ckpt),
                               ("edl", True, stopfree)):
            for var in VARIANTS:
                row[f"{pol}/{var}"] = run_users(
                    pol, load, wl, el, shares, fair_share=var != "no_fair_share",
                    user_quota=user_quota if var == "fair_share_quota" else None, **costs)
        one = run_users("tiresias", load, wl, False, shares, fair_share=True, user_quota=None,
                        one_user=True, **ckpt)
        pub = statistics.mean(published("tiresias", load)["avgs"][f"workload-{i}"] for i in wl)
        row["one_user_tiresias"] = {"ours_s": one["mean_avg_jct_s"], "published_s": pub,
                                    "diff": one["mean_avg_jct_s"] / pub - 1,
                                    "same_as_no_fair_share":
                                        one["mean_avg_jct_s"]
                                        == row["tiresias/no_fair_share"]["mean_avg_jct_s"]}
        table[load] = row
        print(f"  load {load} done ({time.process_time() - t0:.0f} s CPU)", flush=True)

    users = [f"user{k + 1}" for k in range(n)]
    for load in loads:
        row = table[load]
        print(f"\nLoad {load}: average JCT (s), mean over workloads; per user "
              f"({', '.join(f'{u} {100 * s:g} %' for u, s in zip(users, shares))})")
        print(f"{'policy':>9} {'variant':>17} {'all jobs':>9} " + " ".join(f"{u:>8}" for u in users)
              + f" {'max/min':>8} {'preempt':>7}  peak slots per user")
        for pol in ("fifo", "tiresias", "edl"):
            for var in VARIANTS:
                r = row[f"{pol}/{var}"]
                per = [r["user_mean_avg_jct_s"][u] for u in users]
                print(f"{pol:>9} {var:>17} {r['mean_avg_jct_s']:>9.0f} "
                      + " ".join(f"{x:>8.0f}" for x in per) + f" {max(per) / min(per):>8.2f} "
                      + f"{r['mean_preemptions']:>7.1f}  "
                      + "/".join(str(r["user_peak_slots"][u]) for u in users))
        o = row["one_user_tiresias"]
        print(f"one user, fair share on: tiresias {o['ours_s']:.0f} s vs published "
              f"{o['published_s']:.0f} s ({100 * o['diff']:+.1f} %; identical to fair share off: "
              f"{o['same_as_no_fair_share']})")
    goals = {
        "one_user_within_1pct_of_published_tiresias": all(
            abs(table[ld]["one_user_tiresias"]["diff"]) <= GOAL_ONE_USER_FIDELITY for ld in loads),
        "quota_held": all(max(table[ld][f"{p}/fair_share_quota"]["user_peak_slots"].values())
                          <= user_quota for ld in loads for p in ("fifo", "tiresias", "edl")),
    }
    print("\nGoals: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in goals.items()))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "setting": {"pool": "16 nodes x 4 GPUs", "round_s": 60, "workloads": list(wl),
                    "loads": list(loads), "users": users, "shares_of_jobs": list(shares),
                    "split": "seeded shuffle per workload (assign_users, seed = workload index)",
                    "user_quota": user_quota, "checkpoint_costs": ckpt,
                    "stop_free_costs": stopfree,
                    "variants": {"no_fair_share": "users ignored (today's policies)",
                                 "fair_share": "launcher/cluster/fair_share.py",
                                 "fair_share_quota": f"fair share and at most {user_quota} "
                                                     f"slots per user"}},
        "table": table, "goals": goals, "cpu_s": time.process_time() - t0}, indent=1))
    print(f"\nwrote {out} ({time.process_time() - t0:.0f} s CPU)")
    return 0
