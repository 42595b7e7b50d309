"""hvd_edl against Horovod Elastic and static Horovod, side by side, on this machine (``make bench``).

The same workload (``benchmarks/common/workload.py``: the digits CNN, batch 16 per rank, commit
every 10 steps) runs under ``hvd-edl-run`` and under ``horovodrun --gloo`` with the same
discovery script (``cat`` of a hosts file the harness rewrites: ``localhost:N``).  The harness
follows one timetable for both systems, each change made once the ring trained
``--settle-steps`` steps at the size before.  Everything is measured the same way for every
system, from the per-step timelines the workers write (wall time, rank, size, step counter):

* stall of a change = for workers present before and after it, the gap from the end of a
  worker's last step at the old size to the start of its first step at the new size; the largest;
* rolled-back steps = last step counter at the old size minus (first at the new size - 1);
* kill -9 of the highest rank of 3: survives (any step after the kill), time from the kill to the
  start of the first step of the new ring, steps lost (highest counter before the kill minus
  (first counter after - 1));
* throughput = samples/s of rank 0 in steady training at 2 workers, interleaved: the three jobs
  stay alive, each runs alone for 2 s slices while the other two are SIGSTOPped, the rounds
  going through the 6 orders of the three systems in turn (each system as often in each place
  and, within a round, right after each other system), ratios also per round.  Measured twice:
  48 rounds with every worker's threads bound to one CPU (rank r -> CPU r, the same for all
  three systems; the ratios of record), then 18 rounds with the threads left to the scheduler.
  On this 2-core machine the scheduler's placement of a 2-worker job's ~8 busy threads makes
  1 s throughput vary by 14 % (coefficient of variation) against 4 % when bound, so unbound
  ratios move by +-8 % between runs of the same code (static Horovod against itself:
  0.92-1.03).

Runs, per repetition, systems alternated A B A B:
  changes     2 -> 3 (scale-out, the joiner builds its model at once) -> 2 (scale-in) -> 3 -> 2
              -> 3 (scale-out, the joiner takes 8 s to build its model) -> kill -9 of one
then throughput at 2 workers (hvd_edl, static Horovod = horovodrun -np 2, Horovod Elastic),
interleaved as above, bound then unbound, then hvd_edl's switch breakdown (from its event log:
boundary, shutdown, wait, init, sync, rest) for 2 -> 3 -> 4 -> 3 -> 2 with about 1, 10 and 100 MB
of frozen parameters.

Writes benchmarks/results/latest.json and benchmarks/results/timeline.png (``--quick`` and
``--only``: quick.json and quick.png unless ``--out`` says otherwise).

    .venv/bin/python benchmarks/job/bench.py            # full: 3 repetitions (about 15 minutes)
    .venv/bin/python benchmarks/job/bench.py --quick    # 1 repetition, short windows
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common.jobs import (BATCH, RESULTS, Job, change_stall,  # noqa: E402
                                    kill_outcome, machine_info)

SYSTEMS = ("hvd_edl", "horovod_elastic")
SLICE_SKIP_S = 0.3  # seconds of each throughput slice left out (the job resuming)


# ---- scenarios ---------------------------------------------------------------------------------

CHANGES = ((2, 3, 0.0), (3, 2, 0.0), (2, 3, 0.0), (3, 2, 0.0), (2, 3, 8.0))
"""The timetable of one run: (workers before, after, joiner build delay in seconds)."""


def run_changes(system: str, a) -> dict:
    """2 -> 3 (joiner build 0 s) -> 2 -> 3 -> 2 -> 3 (joiner build 8 s) -> kill -9 of the highest
    rank: two scale-ins and two immediate scale-outs per run."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Job(system, Path(tmp), 2, step_delay=a.step_delay)
        res: Dict[str, object] = {"changes": []}
        try:
            if not job.wait_settled(2, a.settle_steps, 0, a.start_timeout):
                raise RuntimeError(f"{system}: ring of 2 never formed: {job.output_tail()}")
            marks = []
            for old, new, delay in CHANGES:
                job.set_joiner_build_delay(delay)
                t = job.change(new)
                ok = job.wait_settled(new, a.settle_steps, t, a.change_timeout + delay)
                marks.append((old, new, t, ok))
            t_kill = job.kill_highest_rank()
            killed = job.killed_pid
            job.wait_settled(2, a.settle_steps, t_kill, a.change_timeout)
            tl = job.timelines()
            for (old, new, t, ok), (_, _, delay) in zip(marks, CHANGES):
                res["changes"].append({"from": old, "to": new, "time": t,
                                       "joiner_build_delay_s": delay,
                                       **(change_stall(tl, old, new, t) or {"stall_s": None})})
            res["kill"] = {"time": t_kill, **kill_outcome(tl, killed, t_kill, 3)}
            if not res["kill"]["survives"]:
                res["kill"]["reason"] = job.output_tail(6)
            res["timeline"] = {str(p): [[r["t"], r["size"], r["step"]] for r in recs]
                               for p, recs in tl.items()}
            res["events"] = job.events()
        finally:
            job.finish()
        return res


def _signal_job(job: Job, sig: int) -> None:
    for p in job.processes():
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def slice_throughput(tl: Dict[int, List[dict]], t0: float, t1: float) -> Optional[float]:
    """Samples/s of rank 0 between unix times ``t0`` and ``t1`` (at 2 workers)."""
    recs = next((r for r in tl.values() if r and r[-1]["rank"] == 0 and r[-1]["size"] == 2),
                None)
    window = [r for r in (recs or []) if t0 <= r["t"] <= t1 and r["size"] == 2]
    if len(window) < 3:
        return None
    return round((len(window) - 1) * BATCH * 2 / (window[-1]["t"] - window[0]["t"]), 2)


def bind_workers(job: Job) -> List[int]:
    """Bind every thread of each live worker of ``job`` to one CPU: rank r -> the r-th CPU this
    process may use (mod their number); threads created later inherit it.  Returns the pids
    bound.  ``os.sched_setaffinity(pid)`` binds one thread only, hence the walk over
    ``/proc/PID/task``."""
    cpus = sorted(os.sched_getaffinity(0))
    bound = []
    for pid, recs in job.timelines().items():
        if not recs or not psutil.pid_exists(pid):
            continue
        cpu = cpus[recs[-1]["rank"] % len(cpus)]
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    os.sched_setaffinity(int(tid), {cpu})
                except ProcessLookupError:
                    pass  # a thread that ended
        except FileNotFoundError:
            continue  # the worker ended
        bound.append(pid)
    return bound


def run_throughput_interleaved(a, bind: bool, rounds: int) -> Dict[str, List[Optional[float]]]:
    """Steady-state throughput of the three systems, interleaved in time.

    Sequential runs on this shared 2-core machine drift by +-15% within seconds, more than the
    differences being measured.  So the three jobs (2 workers each) are started one after the
    other and all kept alive; each is SIGSTOPped (launcher and workers) once it trains.  Then,
    for ``rounds`` rounds, each job in turn is
    continued alone for ``a.throughput_slice_s`` seconds and stopped again; its throughput in
    that slice is rank 0's samples/s after ``SLICE_SKIP_S`` of warm-up.  The systems see the
    same machine conditions within a round, and the ratios are taken per round (paired).  The
    rounds go through the 6 orders of the systems in turn, so over every 6 rounds each system
    runs as often first, second and third, and within a round as often right after each of the
    others (a cyclic rotation put hvd_edl right after Horovod Elastic in 2 rounds of 3).  With
    ``bind``, each job's workers are bound to one CPU each (:func:`bind_workers`) before the
    rounds.

    Returns {system: [samples/s per round]} for "hvd_edl", "static_horovod", "horovod_elastic".
    """
    systems = {"hvd_edl": "hvd_edl", "static_horovod": "static",
               "horovod_elastic": "horovod_elastic"}
    out: Dict[str, List[Optional[float]]] = {s: [] for s in systems}
    jobs: Dict[str, Job] = {}
    tmps = []
    try:
        for name, system in systems.items():
            tmp = tempfile.TemporaryDirectory()
            tmps.append(tmp)
            job = Job(system, Path(tmp.name), 2)
            jobs[name] = job
            if not job.wait_settled(2, 20, 0, a.start_timeout):
                raise RuntimeError(f"{system}: ring of 2 never formed: {job.output_tail()}")
            if bind and len(bind_workers(job)) != 2:
                raise RuntimeError(f"{system}: could not bind its 2 workers")
            _signal_job(job, signal.SIGSTOP)
        orders = list(itertools.permutations(systems))
        for r in range(rounds):
            for name in orders[r % len(orders)]:
                job = jobs[name]
                _signal_job(job, signal.SIGCONT)
                t0 = time.time()
                time.sleep(a.throughput_slice_s)
                t1 = time.time()
                _signal_job(job, signal.SIGSTOP)
                out[name].append(slice_throughput(job.timelines(), t0 + SLICE_SKIP_S, t1))
    finally:
        for job in jobs.values():
            _signal_job(job, signal.SIGCONT)
            job.finish()
        for tmp in tmps:
            tmp.cleanup()
    return out


def paired_ratios(a: List[Optional[float]], b: List[Optional[float]]) -> List[float]:
    return [round(x / y, 4) for x, y in zip(a, b) if x and y]


def run_breakdown(model_mb: float, a) -> List[dict]:
    """hvd_edl only: 2 -> 3 -> 4 -> 3 -> 2, the event log's phases per switch."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Job("hvd_edl", Path(tmp), 2, step_delay=a.step_delay, model_mb=model_mb)
        try:
            if not job.wait_settled(2, a.settle_steps, 0, a.start_timeout):
                raise RuntimeError(f"breakdown: ring of 2 never formed: {job.output_tail()}")
            for new in (3, 4, 3, 2):
                t = job.change(new)
                job.wait_settled(new, a.settle_steps, t, a.change_timeout)
            time.sleep(0.5)
            return [{"from": e["previous_world_size"], "to": e["world_size"], "kind": e["kind"],
                     "stall_s": e["stall_s"], "phases": e.get("phases", {})}
                    for e in job.events() if e["kind"] != "start"]
        finally:
            job.finish()


# ---- summary -----------------------------------------------------------------------------------

def spread(values) -> dict:
    v = [x for x in values if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {"median": round(statistics.median(v), 4), "min": round(min(v), 4),
            "max": round(max(v), 4), "n": len(v), "values": v}


def summarise_system(runs: List[dict], tput: List[Optional[float]]) -> dict:
    def of(kind, key):
        out_ = []
        for r in runs:
            for c in r["changes"]:
                grow = c["to"] > c["from"]
                if (kind == "in" and not grow) or (grow and kind == "out0" and
                                                   not c["joiner_build_delay_s"]) \
                        or (grow and kind == "out8" and c["joiner_build_delay_s"]):
                    out_.append(c.get(key))
        return out_
    kills = [r["kill"] for r in runs]
    out = {
        "scale_out_stall_delay0_s": spread(of("out0", "stall_s")),
        "scale_out_stall_delay8_s": spread(of("out8", "stall_s")),
        "scale_in_stall_s": spread(of("in", "stall_s")),
        "scale_in_rolled_back_steps": spread(of("in", "rolled_back_steps")),
        "scale_out_rolled_back_steps": spread(of("out0", "rolled_back_steps")
                                              + of("out8", "rolled_back_steps")),
        "kill": {"survives": [k["survives"] for k in kills],
                 "recovery_s": spread([k.get("recovery_s") for k in kills]),
                 "steps_lost": spread([k.get("steps_lost") for k in kills]),
                 "reasons": [k["reason"] for k in kills if "reason" in k][:1]},
        "throughput_samples_per_s": spread(tput),
    }
    return out


def summarise_breakdown(runs: Dict[str, List[List[dict]]]) -> dict:
    """Median phases per (model size, switch)."""
    out = {}
    for mb, reps in runs.items():
        rows = []
        for i in range(max((len(r) for r in reps), default=0)):
            evs = [r[i] for r in reps if len(r) > i]
            names = sorted({k for e in evs for k in e["phases"]})
            rows.append({"from": evs[0]["from"], "to": evs[0]["to"], "kind": evs[0]["kind"],
                         "stall_s": spread([e["stall_s"] for e in evs]),
                         "phases_median_s": {k: round(statistics.median(
                             [e["phases"].get(k, 0.0) for e in evs]), 4) for k in names}})
        out[mb] = rows
    return out


def throughput_ratios(tput: Dict[str, List[Optional[float]]], suffix: str) -> dict:
    """hvd_edl and Horovod Elastic against static Horovod from one interleaved measurement
    ({system: samples/s per round}): ratios of medians and hvd_edl's median per-round ratio;
    ``suffix`` names the measurement in the keys ("" bound, "_unbound")."""
    med = {s: spread(v)["median"] for s, v in tput.items()}
    return {
        f"throughput_vs_static{suffix}": ratio(med["hvd_edl"], med["static_horovod"]),
        f"throughput_vs_static{suffix}_paired_median": _median(paired_ratios(
            tput["hvd_edl"], tput["static_horovod"])),
        f"horovod_elastic_throughput_vs_static{suffix}": ratio(med["horovod_elastic"],
                                                                med["static_horovod"]),
    }


def _median(values: List[float]) -> Optional[float]:
    return round(statistics.median(values), 4) if values else None


def ratio(a, b) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 4)


# ---- the picture -------------------------------------------------------------------------------

def plot(timelines: Dict[str, dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 3.6 * len(timelines)), squeeze=False)
    for ax, (system, run) in zip(axes[:, 0], timelines.items()):
        tl = run["timeline"]
        t0 = min(recs[0][0] for recs in tl.values() if recs)
        for i, (pid, recs) in enumerate(sorted(tl.items(), key=lambda kv: kv[1][0][0])):
            ax.plot([r[0] - t0 for r in recs], [i + 1] * len(recs), "|", ms=9,
                    label=f"worker {i + 1} (pid {pid})")
        for c in run["changes"]:
            ax.axvline(c["time"] - t0, color="grey", ls="--", lw=0.8)
            stall = "?" if c.get("stall_s") is None else f"{c['stall_s']:.2f} s"
            build = f" (build {c['joiner_build_delay_s']} s)" if c["joiner_build_delay_s"] else ""
            ax.annotate(f"{c['from']}->{c['to']}{build}\nstall {stall}", (c["time"] - t0, 0.1),
                        xytext=(3, 5), textcoords="offset points", fontsize=8, va="bottom")
        k = run["kill"]
        ax.axvline(k["time"] - t0, color="red", ls="--", lw=0.8)
        text = (f"kill -9\nrecovery {k['recovery_s']:.2f} s, lost {k['steps_lost']}"
                if k["survives"] else "kill -9\njob ended")
        ax.annotate(text, (k["time"] - t0, 0.1), xytext=(3, 5), textcoords="offset points",
                    fontsize=8, va="bottom", color="red")
        ax.set_title(f"{system}: steps of each worker (2 -> 3 -> 2 -> 3 -> 2 -> 3 workers, the "
                     f"last joiner building its model for 8 s; then kill -9 of one)")
        ax.set_xlabel("seconds since the first step")
        ax.set_ylabel("worker (one tick per step)")
        ax.set_ylim(-0.2, len(tl) + 0.6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- main --------------------------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="1 repetition, short windows, "
                   "breakdown at 1 MB only")
    p.add_argument("--step-delay", type=float, default=0.01,
                   help="extra seconds per step in the change runs (throughput runs use 0)")
    p.add_argument("--settle-steps", type=int, default=25)
    p.add_argument("--throughput-rounds", type=int, default=48,
                   help="interleaved throughput, workers bound to one CPU each: rounds of one "
                   "slice per system (a multiple of 6 balances the orders)")
    p.add_argument("--throughput-unbound-rounds", type=int, default=18,
                   help="interleaved throughput, workers left to the scheduler: rounds")
    p.add_argument("--throughput-slice-s", type=float, default=2.0,
                   help="seconds each system runs alone per round")
    p.add_argument("--model-mb", default="1,10,100", help="breakdown model sizes (MB)")
    p.add_argument("--breakdown-reps", type=int, default=1)
    p.add_argument("--only", choices=["changes", "throughput", "breakdown"],
                   action="append", help="run only these parts (repeatable)")
    p.add_argument("--out", help="where to write the JSON (default: benchmarks/results/"
                   "latest.json for a full run, quick.json with --quick or --only)")
    a = p.parse_args()
    if a.out is None:
        a.out = str(RESULTS / ("quick.json" if a.quick or a.only else "latest.json"))
    if a.quick:
        a.reps, a.settle_steps, a.model_mb = 1, 15, "1"
        a.throughput_rounds, a.throughput_unbound_rounds = 6, 6
    a.start_timeout, a.change_timeout = 120.0, 60.0
    parts = set(a.only or ["changes", "throughput", "breakdown"])
    t_start = time.time()
    machine = machine_info()
    changes = {s: [] for s in SYSTEMS}
    tput = {s: [] for s in SYSTEMS + ("static_horovod",)}
    tput_unbound = {s: [] for s in SYSTEMS + ("static_horovod",)}

    def log(msg):
        print(f"[{time.time() - t_start:6.0f} s] {msg}", flush=True)

    for rep in range(a.reps):
        if "changes" in parts:
            for s in SYSTEMS:
                r = run_changes(s, a)
                changes[s].append(r)
                log(f"rep {rep} {s} changes: " + ", ".join(
                    f"{c['from']}->{c['to']} stall {c.get('stall_s')} rb {c.get('rolled_back_steps')}"
                    for c in r["changes"]) + f"; kill {json.dumps(r['kill'])[:200]}")
    if "throughput" in parts:
        tput = run_throughput_interleaved(a, bind=True, rounds=a.throughput_rounds)
        for name, values in tput.items():
            log(f"throughput bound {name}: " + " ".join(str(v) for v in values) + " samples/s")
        tput_unbound = run_throughput_interleaved(a, bind=False,
                                                  rounds=a.throughput_unbound_rounds)
        for name, values in tput_unbound.items():
            log(f"throughput unbound {name}: " + " ".join(str(v) for v in values)
                + " samples/s")
    breakdown: Dict[str, List[List[dict]]] = {}
    if "breakdown" in parts:
        for rep in range(a.breakdown_reps):
            for mb in [float(x) for x in a.model_mb.split(",")]:
                evs = run_breakdown(mb, a)
                breakdown.setdefault(f"{mb:g}MB", []).append(evs)
                log(f"breakdown {mb:g} MB: " + "; ".join(
                    f"{e['from']}->{e['to']} {e['stall_s']} {e['phases']}" for e in evs))

    result = {}
    for s in SYSTEMS:
        result[s] = summarise_system(changes[s], tput[s])
        result[s]["throughput_unbound_samples_per_s"] = spread(tput_unbound[s])
    result["hvd_edl"]["switch_breakdown"] = summarise_breakdown(breakdown)
    result["hvd_edl"]["switch_breakdown_runs"] = breakdown
    result["static_horovod"] = {
        "throughput_samples_per_s": spread(tput["static_horovod"]),
        "throughput_unbound_samples_per_s": spread(tput_unbound["static_horovod"])}
    ours, theirs = result["hvd_edl"], result["horovod_elastic"]
    result["ratios"] = {
        "scale_out_stall_delay8": ratio(ours["scale_out_stall_delay8_s"]["median"],
                                        theirs["scale_out_stall_delay8_s"]["median"]),
        "scale_out_stall_delay0": ratio(ours["scale_out_stall_delay0_s"]["median"],
                                        theirs["scale_out_stall_delay0_s"]["median"]),
        "scale_in_stall": ratio(ours["scale_in_stall_s"]["median"],
                                theirs["scale_in_stall_s"]["median"]),
        **throughput_ratios(tput, ""),
        **throughput_ratios(tput_unbound, "_unbound"),
    }
    machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    machine["bench_wall_s"] = round(time.time() - t_start, 1)
    result["machine"] = machine
    result["repetitions"] = a.reps
    result["method"] = {"step_delay_s_in_change_runs": a.step_delay,
                        "settle_steps": a.settle_steps,
                        "throughput": (f"interleaved: each system alone for "
                                       f"{a.throughput_slice_s} s per round (the others "
                                       f"SIGSTOPped), first {SLICE_SKIP_S} s of a slice left "
                                       f"out; rounds through the 6 orders of the systems in "
                                       f"turn; {a.throughput_rounds} rounds with each worker "
                                       f"bound to one CPU (rank r -> CPU r; the ratios of "
                                       f"record), then {a.throughput_unbound_rounds} rounds "
                                       f"unbound (*_unbound)"),
                        "batch_per_rank": BATCH, "commit_every": 10, "order": "A B A B per rep"}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if changes["hvd_edl"]:
        result["timeline_runs"] = {s: changes[s][-1] for s in SYSTEMS if changes[s]}
        plot(result["timeline_runs"], out.with_name("timeline.png") if out.name == "latest.json"
             else out.with_suffix(".png"))
    out.write_text(json.dumps(result, indent=1))
    log(f"wrote {out} ({machine['bench_wall_s']} s)")
    print(json.dumps({"ratios": result["ratios"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
