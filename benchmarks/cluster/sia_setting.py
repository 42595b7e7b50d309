"""Simulated scheduling in Sia's heterogeneous setting (SOSP 2023): fidelity of our Gavel +
TunedJobs against Sia's published figures, then our heterogeneity-aware goodput policy's JCT
against Sia's, with our measured stop-free switch costs and with Sia's restart costs.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/cluster/scheduler_sim.py --setting sia \
        [--traces philly,saturn,newtrace] [--workloads 'philly=1-8;saturn=1-10;newtrace=1-10']

Cluster: 6 t4 nodes x 4 GPUs, 3 rtx x 8, 2 a100 x 8 (:mod:`launcher.cluster.hetero_sim`), Sia's
per-type profiles and calibration slowdowns, Pollux's progress model, its three workload sets
(TunedJobs GPU counts and batches).  Per trace (the mean over the workloads run):

* ``gavel``: Gavel max-sum-throughput with the TunedJobs sizes, 360 s rounds, Sia's restart cost
  per application (fidelity: published 1.9 / 2.5 / 11.3 h);
* ``ours_s``: :mod:`launcher.cluster.policies.hetero_goodput` (its default: Sia's objective in
  our program) with our measured costs (start = the slowest measured fresh launch to first step,
  change = the largest measured switch stall, read by scheduler_sim.measured_switch_costs from
  benchmarks/results/, never tuned), 60 s rounds;
* ``ours_sia_restart_s``: the same policy paying Sia's restart per application at every change;
* p99 JCT, makespan, GPU-hours per job, finish-time fairness (JCT over the job's time alone,
  :mod:`launcher.cluster.hetero_fairness`; worst and median over all jobs of the workloads run):
  ``ftf_sia_*`` as Sia measures it (alone on 64 / its mean contention GPUs of each type, the
  types weighted by their GPUs), ``ftf_*`` against the best type alone (stricter), beside Sia /
  Pollux / Gavel published (Table 3; Sia's worst FTF 1.2 on Helios);
* variants (``--policies``): ``remaining`` (hetero_goodput's sum of 1 / T, the default of
  rounds 4-5), ``remaining_ftf<k>`` (with the fairness weight k), ``sia_objective`` (the name
  ``ours`` ran under before it became the default), each also ``..._sia_restart``.

Writes ``benchmarks/results/scheduler_sim_sia.json`` (``table[trace]``, merged per trace under a
file lock so traces may run as separate processes).
"""
from __future__ import annotations

import csv
import json
import pickle
import statistics
import sys
import time
from pathlib import Path

from filelock import FileLock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launcher.cluster.hetero_sim import Costs, Profiles, gavel_policy, simulate  # noqa: E402
from launcher.cluster.hetero_fairness import finish_time_fairness           # noqa: E402
from launcher.cluster.policies.hetero_goodput import hetero_goodput_policy  # noqa: E402
from launcher.cluster.type_profiles import sia_dir                          # noqa: E402
from launcher.cluster.workload import TraceJob                              # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
OUT = RESULTS / "scheduler_sim_sia.json"
TRACE_KEY = {"philly": "philly", "saturn": "helios", "newtrace": "newtrace"}
COUNTS = {"philly": 8, "saturn": 10, "newtrace": 10}


def published() -> dict:
    """Sia's Table 3: {trace key: {policy: row}} (hours)."""
    out = {}
    with open(sia_dir() / "published" / "table3-heterogeneous.csv", newline="") as f:
        for r in csv.DictReader(f):
            out.setdefault(r["trace"], {})[r["policy"]] = r
    return out


def load(trace: str, i: int):
    """Workload ``i`` of Sia's ``trace`` set as TraceJobs."""
    with open(sia_dir() / "workloads" / trace / f"workload-{i}.csv", newline="") as f:
        return [TraceJob(r["name"], float(r["time"]), r["application"], int(r["num_replicas"]),
                         int(r["batch_size"])) for r in csv.DictReader(f)]


def policy_costs(name: str, sw: dict):
    """(policy, Costs, round seconds) of a policy name: ``gavel``; ``ours``
    (:mod:`launcher.cluster.policies.hetero_goodput` as it is by default: Sia's objective in our
    program; ``sia_objective`` is the same policy under the name of the runs that chose it),
    ``remaining`` (the sum of 1 / T, the default of rounds 4-5), ``remaining_ftf<k>`` (with the
    fairness weight k), each with our measured costs, or with Sia's restart costs when suffixed
    ``_sia_restart``.  ValueError (one line) for another name."""
    if name == "gavel":
        return gavel_policy(), Costs("restart"), 360.0
    core = name[:-len("_sia_restart")] if name.endswith("_sia_restart") else name
    if core == name:
        c = Costs("stop_free", sw["join_s"], sw["change_cost_s"], sw["join_s"])
    else:
        c = Costs("restart")
    if core in ("ours", "sia_objective"):
        return hetero_goodput_policy(c), c, 60.0
    if core == "remaining":
        return hetero_goodput_policy(c, objective="remaining"), c, 60.0
    if core.startswith("remaining_ftf"):
        try:
            k = float(core[len("remaining_ftf"):])
        except ValueError:
            k = -1.0
        if k >= 0:
            return hetero_goodput_policy(c, ftf_weight=k, objective="remaining"), c, 60.0
    raise ValueError(f"unknown policy {name!r} (gavel, ours, sia_objective, remaining, "
                     "remaining_ftf<k>; suffix _sia_restart for Sia's restart costs)")


def run_policy(name: str, trace, prof, sw: dict):
    """One policy (:func:`policy_costs`) on one workload: the Result."""
    pol, c, round_s = policy_costs(name, sw)
    return simulate(trace, pol, prof, c, round_s=round_s)


def run_cached(name: str, trace: str, i: int, prof, sw: dict, cache, cache_only: bool = False):
    """:func:`run_policy` on workload ``i`` of ``trace`` (the Result, its CPU seconds as
    ``cpu_s``); pickled in folder ``cache`` (keyed by the policy's objective, the trace, the
    workload and the measured costs: ``ours`` is kept as ``sia_objective``, so a folder from
    before round 6, whose ``ours-*`` files hold today's ``remaining``, is never read as ours)
    and reused when there; ``cache_only``: None instead of simulating a missing one."""
    path = None
    if cache:
        tag = f"{sw['join_s']}-{sw['change_cost_s']}"
        key = "sia_objective" + name[len("ours"):] if name in ("ours", "ours_sia_restart") \
            else name
        path = Path(cache) / f"{key}-{trace}-{i}-{tag}.pkl"
        if path.exists():
            return pickle.loads(path.read_bytes())
    if cache_only:
        return None
    t0 = time.process_time()
    res = run_policy(name, load(trace, i), prof, sw)
    res.cpu_s = time.process_time() - t0
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(res))
        tmp.replace(path)
    return res


def summarise(results: list, prof, costs=None, round_s: float = 60.0) -> dict:
    """Mean figures over workloads (seconds; GPU-hours per job; FTF worst / median: ``ftf_*``
    against the best type, ``ftf_sia_*`` as Sia measures it, with the run's ``costs`` and
    ``round_s``)."""
    f = [x for r in results for x in finish_time_fairness(r, prof, Costs("restart"),
                                                          definition="best_type")]
    fs = [x for r in results for x in finish_time_fairness(r, prof, costs, round_s)] \
        if costs is not None else []
    return {"avg_jct_s": round(statistics.mean(r.avg_jct_s for r in results), 1),
            "p99_jct_s": round(statistics.mean(r.p99_jct_s for r in results), 1),
            "makespan_s": round(statistics.mean(r.makespan_s for r in results), 1),
            "gpu_h_per_job": round(statistics.mean(r.gpu_h_per_job for r in results), 3),
            "ftf_worst": round(max(f), 2) if f else None,
            "ftf_median": round(statistics.median(f), 3) if f else None,
            "ftf_sia_worst": round(max(fs), 2) if fs else None,
            "ftf_sia_median": round(statistics.median(fs), 3) if fs else None,
            "unfinished": sum(r.unfinished for r in results),
            "per_workload_avg_jct_s": [round(r.avg_jct_s, 1) for r in results],
            "cpu_s": (round(sum(r.cpu_s for r in results), 1)
                      if all(hasattr(r, "cpu_s") for r in results) else None)}


def _indices(spec: str):
    out = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def main(argv=None) -> int:
    import argparse
    sys.path.insert(0, str(ROOT / "benchmarks" / "cluster"))
    from scheduler_sim import measured_switch_costs
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", default="sia")
    ap.add_argument("--traces", default="philly,saturn,newtrace")
    ap.add_argument("--workloads", default="",
                    help="per trace, e.g. 'philly=1-8;saturn=1,3' (default: every workload)")
    ap.add_argument("--policies", default="ours,ours_sia_restart,remaining,gavel")
    ap.add_argument("--out", default=str(OUT), help="results file (merged per trace)")
    ap.add_argument("--cache", metavar="DIR",
                    help="keep each simulated workload's result in DIR and reuse it (runs may be "
                         "split across processes, then one run over all writes the results)")
    ap.add_argument("--cache-only", action="store_true",
                    help="with --cache: summarise only the workloads already in DIR, simulate none")
    a = ap.parse_args(argv)
    if a.cache_only and not a.cache:
        print("scheduler_sim: --cache-only needs --cache DIR", file=sys.stderr)
        return 2
    globals()["OUT"] = Path(a.out)
    spec = dict(p.split("=", 1) for p in a.workloads.split(";") if "=" in p) if a.workloads else {}
    sw = measured_switch_costs()
    prof = Profiles()
    pub = published()
    for pol in a.policies.split(","):
        try:
            policy_costs(pol, sw)
        except ValueError as e:
            print(f"scheduler_sim: {e}", file=sys.stderr)
            return 2
    for trace in a.traces.split(","):
        if trace not in COUNTS:
            print(f"unknown trace {trace!r} (philly, saturn, newtrace)", file=sys.stderr)
            return 2
        idx = _indices(spec.get(trace, f"1-{COUNTS[trace]}"))
        row = {"workloads": idx}
        for pol in a.policies.split(","):
            got = [(i, run_cached(pol, trace, i, prof, sw, a.cache, a.cache_only)) for i in idx]
            got = [(i, r) for i, r in got if r is not None]
            if not got:
                print(f"{trace} {pol}: no workload in the cache", flush=True)
                continue
            _, c, round_s = policy_costs(pol, sw)
            row[pol] = summarise([r for _, r in got], prof, c, round_s)
            row[pol]["workloads"] = [i for i, _ in got]
            print(f"{trace} {pol}: {row[pol]}", flush=True)
            _write(trace, row, pub, sw)
    print_table()
    return 0


def _write(trace: str, row: dict, pub: dict, sw: dict) -> None:
    """Add the published figures and the headline keys to ``row``; merge it into the results
    file under its lock (the trace's row replaced, except a ``gavel`` run this one did not
    redo: kept with its workloads, Gavel's runs take ten times longer and do not depend on our
    policy)."""
    p = pub[TRACE_KEY[trace]]
    row["pub_sia_s"] = float(p["sia"]["avg_jct_h"]) * 3600
    row["pub_pollux_s"] = float(p["pollux"]["avg_jct_h"]) * 3600
    row["pub_gavel_s"] = float(p["gavel+tunedjobs"]["avg_jct_h"]) * 3600
    row["published_h"] = {k: {kk: v[kk] for kk in ("avg_jct_h", "p99_jct_h", "makespan_h",
                                                     "gpu_hours_per_job")} for k, v in p.items()}
    if "ours" in row:
        row["ours_s"] = row["ours"]["avg_jct_s"]
    if "ours_sia_restart" in row:
        row["ours_sia_restart_s"] = row["ours_sia_restart"]["avg_jct_s"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    with FileLock(str(OUT) + ".lock", timeout=60):
        doc = json.loads(OUT.read_text()) if OUT.exists() else {}
        old = doc.get("table", {}).get(trace, {})
        if "gavel" not in row and "gavel" in old:
            row["gavel"] = old["gavel"]
            row["gavel"].setdefault("workloads", old.get("gavel_workloads", old.get("workloads")))
        if "gavel" in row:
            row["gavel_s"] = row["gavel"]["avg_jct_s"]
            row["gavel_vs_published"] = round(row["gavel_s"] / row["pub_gavel_s"] - 1, 3)
        doc.setdefault("table", {})[trace] = row
        doc["switch_costs"] = sw
        doc["setting"] = ("Sia heterogeneous: 6 t4 x 4, 3 rtx x 8, 2 a100 x 8; Sia's per-type "
                          "profiles, calibration slowdowns, TunedJobs workloads")
        OUT.write_text(json.dumps(doc, indent=1) + "\n")


def print_table() -> None:
    """The Sia-setting table from the results file (hours), then every policy run per trace."""
    doc = json.loads(OUT.read_text())
    h = lambda s: f"{s / 3600:6.2f}" if isinstance(s, (int, float)) else "     -"  # noqa: E731
    print(f"{'trace':<9}{'wl':>5} {'ours':>6} {'ours/sia-rs':>11} {'Sia pub':>7} {'Pollux pub':>10}"
          f" {'gavel':>6} {'Gavel pub':>9}  p99/makespan/GPUh-job ours  FTF worst/median ours"
          " (best type | Sia's)")
    for tr, r in doc["table"].items():
        o = r.get("ours", {})
        print(f"{tr:<9}{len(o.get('workloads', r['workloads'])):>5} {h(r.get('ours_s'))}"
              f" {h(r.get('ours_sia_restart_s')):>11}"
              f" {h(r['pub_sia_s']):>7} {h(r['pub_pollux_s']):>10} {h(r.get('gavel_s'))}"
              f" {h(r['pub_gavel_s']):>9}  {h(o.get('p99_jct_s'))}/{h(o.get('makespan_s'))}/"
              f"{o.get('gpu_h_per_job', '-')}  {o.get('ftf_worst', '-')}/{o.get('ftf_median', '-')}"
              f" | {o.get('ftf_sia_worst', '-')}/{o.get('ftf_sia_median', '-')}")
    print(f"\n{'trace':<9}{'policy':<28}{'wl':>4} {'avg h':>6} {'p99 h':>6} {'GPUh/job':>8}"
          f" {'FTF best-type worst/med':>24} {'FTF Sia worst/med':>18}")
    for tr, r in doc["table"].items():
        for pol, v in r.items():
            if isinstance(v, dict) and "avg_jct_s" in v:
                print(f"{tr:<9}{pol:<28}{len(v.get('workloads', r['workloads'])):>4}"
                      f" {h(v['avg_jct_s'])} {h(v['p99_jct_s'])} {v['gpu_h_per_job']:>8}"
                      f" {str(v['ftf_worst']) + ' / ' + str(v['ftf_median']):>24}"
                      f" {str(v.get('ftf_sia_worst')) + ' / ' + str(v.get('ftf_sia_median')):>18}")


if __name__ == "__main__":
    sys.exit(main())
