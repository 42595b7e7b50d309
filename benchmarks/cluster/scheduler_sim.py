"""Simulated scheduling on Pollux's published workloads: fidelity, JCT per policy, round time.

    .venv/bin/python benchmarks/cluster/scheduler_sim.py [--workloads 1-8] [--loads 0.5,1.0,1.5,2.0]
    .venv/bin/python benchmarks/cluster/scheduler_sim.py --users 4   (fair share between users:
        benchmarks/cluster/scheduler_sim_users.py, writes scheduler_sim_users.json instead)

Needs ``../shared/traces/pollux-osdi21`` (or ``$HVD_EDL_POLLUX_TRACES``).  Prints three tables and
writes ``benchmarks/results/scheduler_sim.json`` and ``scheduler_sim.png``:

* fidelity: our ``tiresias`` (trace GPU counts and batches, 30 s per change) against the published
  Tiresias mean average JCT per load (goal: within 1 % at every load);
* JCT: ``fifo``, ``tiresias`` (30 s per change), ``edl`` with 30 s per change (checkpoint
  rescaling) and with our stop-free switch (its stall and a joiner's start-up time read from this
  repository's own measured figures, printed), beside Pollux's and Optimus's published figures,
  with makespan and GPU utilisation (goals: edl below Pollux's 2,751 s at 1.0x and at most 0.6x
  our tiresias at every load);
* goodput (issue 41): the ``goodput`` policy with jobs that adapt their batch (Pollux's progress
  model, ``launcher/cluster/progress.py``), with our stop-free switch (``edl_goodput``) and with 30 s
  per change (``edl_goodput_30s``: what stop-free buys; ``edl_stopfree`` is the same scheduler
  with the trace's batch: what goodput buys); goal: ``edl_goodput`` below Pollux's published
  average JCT at every load; finish-time fairness (Themis: JCT over JCT alone on 1/N of the
  cluster, worst and median per workload, averaged) for every policy;
* bound: the average JCT if every job ran alone on the pool at its fastest GPU count (compact
  placement, trace batch, its start cost and its wait for the first round included): no scheduler
  that keeps the trace's batch can do better, printed beside the 0.6x-tiresias target;
* scale: the 1.0x workload replicated 16x onto 1,024 GPUs, CPU seconds of one scheduling round
  (``time.process_time``) per policy, goodput's batch search included, the profiles' candidate
  step times tabulated first (the simulator's stand-in for each job's own throughput model, not
  the policy's work) (goal: at most 1 s).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Optional
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launcher.cluster.fairness import finish_time_fairness             # noqa: E402
from launcher.cluster.policies import make_policy                      # noqa: E402
from launcher.cluster.policy import Policy                             # noqa: E402
from launcher.cluster.progress import adaptive_sim_jobs, warm_profiles  # noqa: E402
from launcher.cluster.simulator import SimJob, pool_of, simulate       # noqa: E402
from launcher.cluster.workload import (LOADS, load_workload, published,  # noqa: E402
                                       sim_jobs, traces_dir)

RESULTS = ROOT / "benchmarks" / "results"
PUBLISHED_RESTART_S = 30.0
GOAL_FIDELITY = 0.01
GOAL_POLLUX_1X_S = 2751.0
GOAL_RATIO = 0.6
GOAL_ROUND_CPU_S = 1.0


def measured_switch_costs() -> dict:
    """The stop-free switch's costs from this repository's measured figures (seconds)."""
    latest = json.loads((RESULTS / "latest.json").read_text())["hvd_edl"]
    per_size = {}
    for size, rows in latest.get("switch_breakdown", {}).items():
        vals = [r["stall_s"]["median"] if isinstance(r["stall_s"], dict) else r["stall_s"]
                for r in rows]
        per_size[size] = statistics.median(vals)
    ckpt = json.loads((RESULTS / "checkpoint.json").read_text())
    starts = []

    def walk(o):
        if isinstance(o, dict):
            for k, v in o.items():
                if k == "fresh_launch_to_first_step_s" and isinstance(v, (int, float)):
                    starts.append(float(v))
                else:
                    walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)
    walk(ckpt)
    stall = max([latest["scale_out_stall_delay0_s"]["median"], latest["scale_in_stall_s"]["median"],
                 *per_size.values()])
    return {
        "change_cost_s": round(stall, 4),
        "join_s": round(max(starts), 3),
        "restart_cost_s": PUBLISHED_RESTART_S,
        "sources": {
            "benchmarks/results/latest.json": {
                "hvd_edl.scale_out_stall_delay0_s.median": latest["scale_out_stall_delay0_s"]["median"],
                "hvd_edl.scale_in_stall_s.median": latest["scale_in_stall_s"]["median"],
                "hvd_edl.switch_breakdown median stall_s per state size": per_size},
            "benchmarks/results/checkpoint.json": {"fresh_launch_to_first_step_s": starts},
        },
        "rule": "change = the largest measured median switch stall (the 100 MB state's, a "
                "conservative figure for the profiled models); a joiner adds throughput after "
                "the slowest measured fresh launch to first step; start/resume = the published "
                "30 s restart",
    }


def alone_bound(load: str, workloads, restart_cost_s: float, round_s: float = 60.0) -> dict:
    """Mean over ``workloads`` of the average JCT with every job alone on the 16 x 4 pool at its
    fastest GPU count (compact placement, the trace's global batch), plus the wait for the first
    round at or after its submission and ``restart_cost_s`` for its start (seconds): a lower bound
    for any scheduler that keeps the trace's batch, whatever it knows."""
    import math
    from launcher.cluster.policies.edl import compact_placement
    avgs = []
    for i in workloads:
        jct = []
        for j in sim_jobs(load_workload(load, i), elastic=True):
            best = min(j.step_time(compact_placement(n, 4)) for n in range(1, j.max_np + 1))
            wait = math.ceil(j.submitted_at / round_s) * round_s - j.submitted_at
            jct.append(wait + restart_cost_s + best * j.total_steps)
        avgs.append(statistics.mean(jct))
    return {"per_workload_s": avgs, "mean_avg_jct_s": statistics.mean(avgs)}


def workload_jobs(load: str, i: int, jobs: str):
    """The simulated jobs of a workload: ``static`` (trace GPUs and batch), ``elastic`` (trace
    batch), ``goodput`` (adapting their batch, Pollux's progress model)."""
    trace = load_workload(load, i)
    if jobs == "goodput":
        return adaptive_sim_jobs(trace)
    return sim_jobs(trace, elastic=(jobs == "elastic"))


def run_one(policy: str, load: str, i: int, jobs: str, costs: dict,
            cache: Optional[str] = None) -> dict:
    """One workload under one policy: average JCT, makespan, utilisation, changes, fairness;
    read from / written to ``cache`` (a folder) when given."""
    path = None
    if cache:
        tag = "-".join(f"{k}={v}" for k, v in sorted(costs.items()))
        path = Path(cache) / f"{policy}-{jobs}-{load}-{i}-{tag}.json"
        if path.exists():
            return json.loads(path.read_text())
    out = _run_one(policy, load, i, jobs, costs)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out))
    return out


def _run_one(policy: str, load: str, i: int, jobs: str, costs: dict) -> dict:
    r = simulate(workload_jobs(load, i, jobs), pool_of(16, 4), make_policy(policy),
                 timeline=True, **costs)
    fair = finish_time_fairness(r, sim_jobs(load_workload(load, i), elastic=True), 64, 4,
                                costs.get("restart_cost_s", PUBLISHED_RESTART_S))
    return {"workload": i, "avg_jct_s": r.avg_jct_s, "makespan_s": r.makespan_s,
            "utilisation": r.utilisation,
            "changes": sum(j.changes for j in r.jobs.values()),
            "batch_changes": sum(j.batch_changes for j in r.jobs.values()),
            "ftf_worst": fair["worst"], "ftf_median": fair["median"]}


def run_set(policy: str, load: str, workloads, jobs: str, pool=None, cache=None, **costs):
    """:func:`run_one` over ``workloads`` (in ``pool``'s processes when given), with means."""
    args = [(policy, load, i, jobs, costs, cache) for i in workloads]
    out = list(pool.map(run_one, *zip(*args))) if pool is not None else \
        [run_one(*a) for a in args]
    return {"runs": out,
            "mean_avg_jct_s": statistics.mean(x["avg_jct_s"] for x in out),
            "mean_makespan_s": statistics.mean(x["makespan_s"] for x in out),
            "mean_utilisation": statistics.mean(x["utilisation"] for x in out),
            "mean_ftf_worst": statistics.mean(x["ftf_worst"] for x in out),
            "mean_ftf_median": statistics.mean(x["ftf_median"] for x in out)}


class TimedPolicy(Policy):
    """Wraps a policy; records the CPU seconds of every round."""

    def __init__(self, inner: Policy):
        self.inner = inner
        self.name = inner.name
        self.cpu_s = []
        self.jobs = []

    def allocate(self, snap):
        t = time.process_time()
        a = self.inner.allocate(snap)
        self._t = time.process_time() - t
        self.jobs.append(len(snap.jobs))
        return a

    def batch_sizes(self, snap, alloc):
        """The inner policy's batches; the round's CPU time counts the batch search."""
        t = time.process_time()
        b = self.inner.batch_sizes(snap, alloc)
        self.cpu_s.append(self._t + time.process_time() - t)
        return b


def scale_round(policy: str, costs: dict, factor: int = 16, hours: float = 6.0) -> dict:
    kind = {"edl": "elastic", "goodput": "goodput"}.get(policy, "static")
    jobs = []
    for j in workload_jobs("1.0", 1, kind):
        for c in range(factor):
            jobs.append(SimJob(f"{j.id}-{c}", j.submitted_at, j.step_time, j.total_steps, j.np,
                               j.min_np, j.max_np, j.samples_per_step, elastic=j.elastic,
                               batch=j.batch))
    if policy == "goodput":
        warm_profiles()     # the profiles' interpolation, tabulated: the policy is what is timed
    tp = TimedPolicy(make_policy(policy))
    simulate(jobs, pool_of(16 * factor, 4), tp, until_s=hours * 3600, **costs)
    return {"gpus": 64 * factor, "jobs": len(jobs), "rounds": len(tp.cpu_s),
            "max_jobs_in_snapshot": max(tp.jobs),
            "round_cpu_s_median": statistics.median(tp.cpu_s), "round_cpu_s_max": max(tp.cpu_s),
            "simulated_h": hours}


def plot(path: Path, table: dict, loads, timelines: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    xs = [float(x) for x in loads]
    for key, label in [("fifo", "fifo (ours)"), ("tiresias", "tiresias (ours)"),
                       ("edl_30s", "edl, 30 s per change"), ("edl_stopfree", "edl, stop-free"),
                       ("edl_goodput", "goodput, stop-free"),
                       ("edl_goodput_30s", "goodput, 30 s per change"),
                       ("pub_tiresias", "Tiresias (published)"), ("pub_pollux", "Pollux (published)"),
                       ("pub_optimus", "Optimus (published)"),
                       ("alone_bound", "bound: each job alone, trace batch")]:
        ys = [table[ld].get(key) for ld in loads]
        if all(y is not None for y in ys):
            a.plot(xs, ys, marker="o", linestyle="--" if key.startswith("pub") else ":" if key == "alone_bound" else "-",
                   label=label)
    a.set_xlabel("job load (x)")
    a.set_ylabel("mean average JCT (s)")
    a.set_yscale("log")
    a.set_title("16 nodes x 4 GPUs, 8 workloads")
    a.legend(fontsize=8)
    for name, line in timelines.items():
        t = [x[0] / 3600 for x in line]
        b.plot(t, [sum(x[1].values()) for x in line], label=f"{name}: slots used")
        b.plot(t, [x[2] for x in line], linestyle=":", label=f"{name}: jobs queued")
    b.set_xlabel("hours (workload-1, 1.0x)")
    b.set_ylabel("slots / jobs")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--setting" in argv and argv[argv.index("--setting") + 1:][:1] == ["sia"]:
        from sia_setting import main as sia_main     # Sia's heterogeneous setting (issue 42)
        return sia_main(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", default="pollux", choices=["pollux", "sia"],
                    help="sia: Sia's heterogeneous cluster (benchmarks/cluster/sia_setting.py)")
    ap.add_argument("--workloads", default="1-8", help="workload indices, e.g. 1-8 or 1,3")
    ap.add_argument("--loads", default=",".join(LOADS))
    ap.add_argument("--out", default=None, help="default benchmarks/results/scheduler_sim.json "
                    "(scheduler_sim_users.json with --users)")
    ap.add_argument("--users", type=int, default=0,
                    help="split each workload's jobs among N users: per-user JCT with and without "
                         "fair share and with a quota (scheduler_sim_users.py)")
    ap.add_argument("--shares", default="50,25,15,10",
                    help="with --users: each user's share of the jobs, %% (N numbers, sum 100)")
    ap.add_argument("--user-quota", type=int, default=48,
                    help="with --users: slots one user may hold in the quota runs")
    ap.add_argument("--no-scale", action="store_true", help="skip the 1,024-GPU round timing")
    ap.add_argument("--procs", type=int, default=1,
                    help="simulate the workloads in this many processes (default 1)")
    ap.add_argument("--cache", metavar="DIR",
                    help="keep each simulated workload's figures in DIR and reuse them (runs per "
                         "load in parallel, then one run over all loads that writes the results)")
    args = ap.parse_args(argv)
    try:
        traces_dir()
    except FileNotFoundError as e:
        print(f"scheduler_sim: {e}", file=sys.stderr)
        return 2
    if "-" in args.workloads:
        lo, hi = args.workloads.split("-")
        wl = list(range(int(lo), int(hi) + 1))
    else:
        wl = [int(x) for x in args.workloads.split(",")]
    loads = args.loads.split(",")
    bad = [x for x in loads if x not in LOADS]
    if bad or not all(1 <= i <= 8 for i in wl):
        print(f"scheduler_sim: loads must be among {', '.join(LOADS)}, workloads 1-8", file=sys.stderr)
        return 2
    if args.users:
        try:
            shares = [float(x) / 100 for x in args.shares.split(",")]
        except ValueError:
            shares = []
        if (len(shares) != args.users or any(x <= 0 for x in shares)
                or abs(sum(shares) - 1) > 1e-6 or args.user_quota < 1):
            print(f"scheduler_sim: --shares needs {args.users} positive percentages summing to "
                  f"100 (got {args.shares!r}), --user-quota at least 1", file=sys.stderr)
            return 2
    t0 = time.process_time()
    sf = measured_switch_costs()
    ckpt = dict(restart_cost_s=PUBLISHED_RESTART_S, change_cost_s=PUBLISHED_RESTART_S)
    stopfree = dict(restart_cost_s=sf["restart_cost_s"], change_cost_s=sf["change_cost_s"],
                    stop_free=True, join_s=sf["join_s"])
    print("stop-free switch costs, from the repository's measured figures:")
    for f, v in sf["sources"].items():
        print(f"  {f}: {v}")
    print(f"  -> change (switch stall) {sf['change_cost_s']} s, joiner start-up {sf['join_s']} s, "
          f"start/resume {sf['restart_cost_s']} s ({sf['rule']})")
    if args.users:
        from scheduler_sim_users import main as users_main
        return users_main(wl, loads, shares, args.user_quota, ckpt, stopfree,
                          Path(args.out or RESULTS / "scheduler_sim_users.json"))

    table, detail = {}, {}
    procs = None
    if args.procs > 1:
        from concurrent.futures import ProcessPoolExecutor
        procs = ProcessPoolExecutor(args.procs)
    for load in loads:
        row = {}
        pubs = {p: published(p, load) for p in ("tiresias", "pollux", "optimus")}
        for p, d in pubs.items():
            row[f"pub_{p}"] = statistics.mean(d["avgs"][f"workload-{i}"] for i in wl)
        for key, pol, kind, costs in [("fifo", "fifo", "static", ckpt),
                                      ("tiresias", "tiresias", "static", ckpt),
                                      ("edl_30s", "edl", "elastic", ckpt),
                                      ("edl_stopfree", "edl", "elastic", stopfree),
                                      ("edl_goodput", "goodput", "goodput", stopfree),
                                      ("edl_goodput_30s", "goodput", "goodput", ckpt)]:
            res = run_set(pol, load, wl, kind, pool=procs, cache=args.cache, **costs)
            detail.setdefault(load, {})[key] = res
            row[key] = res["mean_avg_jct_s"]
            row[f"{key}_makespan_s"] = res["mean_makespan_s"]
            row[f"{key}_utilisation"] = res["mean_utilisation"]
            row[f"{key}_ftf_worst"] = res["mean_ftf_worst"]
            row[f"{key}_ftf_median"] = res["mean_ftf_median"]
        bound = alone_bound(load, wl, PUBLISHED_RESTART_S)
        detail.setdefault(load, {})["alone_bound"] = bound
        row["alone_bound"] = bound["mean_avg_jct_s"]
        table[load] = row
        print(f"  load {load} done ({time.process_time() - t0:.0f} s CPU)", flush=True)

    print("\nFidelity: our tiresias vs published Tiresias, mean over workloads "
          f"{wl[0]}-{wl[-1]} of the average JCT (s)")
    print(f"{'load':>5} {'ours':>8} {'published':>10} {'diff':>7}")
    fid = {}
    for load in loads:
        ours, pub = table[load]["tiresias"], table[load]["pub_tiresias"]
        fid[load] = {"ours_s": ours, "published_s": pub, "diff": ours / pub - 1}
        print(f"{load:>5} {ours:>8.0f} {pub:>10.0f} {100 * (ours / pub - 1):>+6.1f}%")

    print("\nAverage JCT (s), mean over workloads; ours simulated, Pollux/Optimus/Tiresias published")
    hdr = ["fifo", "tiresias", "edl_30s", "edl_stopfree", "edl_goodput", "edl_goodput_30s",
           "pub_pollux", "pub_optimus", "pub_tiresias"]
    print(f"{'load':>5} " + " ".join(f"{h:>15}" for h in hdr) + f" {'edl/tir':>8} {'gp/pollux':>9}")
    for load in loads:
        r = table[load]
        print(f"{load:>5} " + " ".join(f"{r[h]:>15.0f}" for h in hdr)
              + f" {r['edl_stopfree'] / r['tiresias']:>8.2f}"
              + f" {r['edl_goodput'] / r['pub_pollux']:>9.2f}")
    print("\nFinish-time fairness (Themis: JCT / JCT alone on 1/N of the cluster), worst / median, "
          "mean over workloads")
    ours = ("fifo", "tiresias", "edl_30s", "edl_stopfree", "edl_goodput", "edl_goodput_30s")
    print(f"{'load':>5} " + " ".join(f"{h:>15}" for h in ours))
    for load in loads:
        r = table[load]
        print(f"{load:>5} " + " ".join(
            f"{r[k + '_ftf_worst']:>8.1f} /{r[k + '_ftf_median']:>5.2f}" for k in ours))
    print("\nLower bound with the trace's batch (every job alone at its fastest GPU count) vs the "
          f"{GOAL_RATIO}x-tiresias target, s")
    for load in loads:
        r = table[load]
        print(f"{load:>5} bound {r['alone_bound']:>7.0f}  target {GOAL_RATIO * r['tiresias']:>7.0f}  "
              f"{'reachable in principle' if r['alone_bound'] < GOAL_RATIO * r['tiresias'] else 'UNREACHABLE'}")
    print("\nMakespan (s) / GPU utilisation, ours")
    for load in loads:
        r = table[load]
        print(f"{load:>5} " + "  ".join(
            f"{k}: {r[k + '_makespan_s']:.0f} / {r[k + '_utilisation']:.2f}"
            for k in ("fifo", "tiresias", "edl_30s", "edl_stopfree", "edl_goodput",
                      "edl_goodput_30s")))

    scale = {}
    if not args.no_scale:
        print("\nScale: workload-1 (1.0x) x16 on 1,024 GPUs, CPU s of one scheduling round")
        for pol, costs in (("fifo", ckpt), ("tiresias", ckpt), ("edl", stopfree),
                           ("goodput", stopfree)):
            cached = Path(args.cache) / f"scale-{pol}.json" if args.cache else None
            if cached is not None and cached.exists():
                scale[pol] = json.loads(cached.read_text())
            else:
                scale[pol] = scale_round(pol, costs)
                if cached is not None:
                    cached.parent.mkdir(parents=True, exist_ok=True)
                    cached.write_text(json.dumps(scale[pol]))
            s = scale[pol]
            print(f"  {pol:>9}: median {s['round_cpu_s_median']:.4f} s, max {s['round_cpu_s_max']:.4f} s "
                  f"over {s['rounds']} rounds ({s['jobs']} jobs, up to {s['max_jobs_in_snapshot']} "
                  f"in a snapshot, first {s['simulated_h']:.0f} h)", flush=True)

    goals = {}
    if "1.0" in table:
        goals["edl_1x_below_pollux_2751"] = table["1.0"]["edl_stopfree"] < GOAL_POLLUX_1X_S
    goals["fidelity_within_1pct_every_load"] = all(abs(f["diff"]) <= GOAL_FIDELITY
                                                   for f in fid.values())
    goals["edl_goodput_below_pollux_every_load"] = all(
        table[ld]["edl_goodput"] < table[ld]["pub_pollux"] for ld in loads)
    goals["edl_at_most_0.6x_tiresias_every_load"] = all(
        table[ld]["edl_stopfree"] <= GOAL_RATIO * table[ld]["tiresias"] for ld in loads)
    if scale:
        goals["round_at_most_1s_cpu"] = all(s["round_cpu_s_max"] <= GOAL_ROUND_CPU_S for s in scale.values())
    print("\nGoals: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in goals.items()))

    tl = {}
    if "1.0" in loads:
        for name, pol, kind, costs in (("tiresias", "tiresias", "static", ckpt),
                                       ("edl stop-free", "edl", "elastic", stopfree),
                                       ("goodput stop-free", "goodput", "goodput", stopfree)):
            tl[name] = simulate(workload_jobs("1.0", wl[0], kind), pool_of(16, 4),
                                make_policy(pol), timeline=True, **costs).timeline
    out = Path(args.out or RESULTS / "scheduler_sim.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "setting": {"pool": "16 nodes x 4 GPUs", "round_s": 60, "workloads": wl, "loads": loads,
                    "checkpoint_costs": ckpt, "stop_free_costs": stopfree,
                    "edl_jobs": "np = trace GPUs, min_np 1, max_np min(64, batch / smallest local batch); "
                                "global batch fixed at the trace's",
                    "goodput_jobs": "np = trace GPUs, min_np 1, B0 = trace batch, global batch in "
                                    "[smallest, largest validated] (Pollux's), local batch within "
                                    "the profiled range, accumulating above it (yolov3 8); ncf "
                                    "keeps 32,768 (Pollux's); max_np min(64, max batch / smallest "
                                    "local batch); a batch change alone: the switch stall "
                                    "stop-free, free with 30 s per change (Pollux's simulator)",
                    "work_model": "progress (Pollux's simulator)"},
        "switch_costs": sf, "table": table, "fidelity": fid, "detail": detail, "scale": scale,
        "goals": goals, "cpu_s": time.process_time() - t0}, indent=1))
    png = out.with_suffix(".png")
    plot(png, table, loads, tl)
    print(f"\nwrote {out} and {png} ({time.process_time() - t0:.0f} s CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
