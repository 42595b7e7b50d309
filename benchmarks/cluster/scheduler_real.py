"""The cluster service on a real stream (issue 28): ``fifo``, ``tiresias`` and ``edl`` one after
another on the same 8 real jobs, on a pool of localhost slots (and namespace hosts: see below).

    .venv/bin/python benchmarks/cluster/scheduler_real.py [--jobs 8] [--slots 6] [--span 40]

The stream: the first ``--jobs`` jobs of Pollux's workload-1
(``/work/shared/traces/pollux-osdi21/workloads/workload-1.csv``), their arrivals compressed to
``--span`` seconds, each job the synthetic MLP (examples/train_synthetic.py, 1 MB) or the digits
model (examples/train_digits.py) in turn, with sleeping compute (``--compute-s`` /
``--step-delay``: 2 cores measure scheduling, not CPU contention), a fixed number of samples,
``--np`` from the trace's GPU count (1, 2 or 3), ``--min-np 1 --max-np 4``.  Tiresias's queue
threshold and EDL's hold are compressed with the time (``--queue-thresholds 42``, ``--hold 5``).

Printed and written to benchmarks/results/scheduler_real.json: per policy the average JCT,
makespan, utilisation (slot-seconds held / pool x makespan), every job's exactly-once audit
(repeated / missing), decisions; the reclaim latency of edl (a job's submission to the lent
slots being free for it: the shrunk jobs' leavers out of their rings); the kill -9 of the
service in the middle of the edl run (restarted at once: every job ends exactly once); and the
simulator's prediction (launcher.cluster.simulator) of the same stream with the step times
and start-up cost measured in the run.  The plot (slots per job over time, queue length) goes
to benchmarks/results/scheduler_real.png.

``--cluster-hosts K`` (as root; figures to scheduler_real_cluster.json / .png): the pool is
``localhost`` with ``--slots`` minus K slots plus K hosts of the namespace test cluster
(tests/cluster.py) with one slot each; the benchmark then
runs inside the cluster's launcher namespace, the service reaches the hosts over ssh
(``serve -i KEY --network-interface NIC``), and the cluster is torn down at the end (also
after a crash).
"""
from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common.cluster_service import (QUEUE_THRESHOLD_GPU_S, Serve,  # noqa: E402
                                               argv_of, in_cluster, reclaim_latencies,
                                               reclaim_parts, speed_points)
from hvd_edl import audit  # noqa: E402

TRACE = Path("/work/shared/traces/pollux-osdi21/workloads/workload-1.csv")
RESULTS = ROOT / "benchmarks" / "results"
SYNTH_SAMPLES, SYNTH_EPOCHS, SYNTH_BATCH = 512, 6, 8
DIGITS_TRAIN, DIGITS_EPOCHS, DIGITS_BATCH = 512, 8, 16


def stream(n_jobs: int, span_s: float):
    """[(at_s, name, np, kind)] from the trace's first ``n_jobs`` rows."""
    rows = list(csv.DictReader(TRACE.open()))[:n_jobs]
    t0, t1 = float(rows[0]["time"]), float(rows[-1]["time"])
    scale = span_s / max(1.0, t1 - t0)
    out = []
    for i, r in enumerate(rows):
        g = int(r["num_replicas"])
        np_ = 1 if g <= 2 else 2 if g <= 8 else 3
        out.append(((float(r["time"]) - t0) * scale, r["name"], np_,
                    "synthetic" if i % 2 == 0 else "digits"))
    return out


def job_command(kind: str, tmp: Path, name: str):
    if kind == "synthetic":
        return [sys.executable, str(ROOT / "examples" / "train_synthetic.py"), "--params-mb", "1",
                "--samples", str(SYNTH_SAMPLES), "--epochs", str(SYNTH_EPOCHS),
                "--batch-size", str(SYNTH_BATCH), "--compute-s", "0.08"]
    return [sys.executable, str(ROOT / "examples" / "train_digits.py"), "--train-size",
            str(DIGITS_TRAIN), "--epochs", str(DIGITS_EPOCHS), "--batch-size", str(DIGITS_BATCH),
            "--step-delay", "0.08", "--summary", str(tmp / f"{name}.summary.json")]


def samples_of(kind: str) -> int:
    return SYNTH_SAMPLES if kind == "synthetic" else DIGITS_TRAIN


def run_policy(policy: str, jobs, pool: dict, tmp: Path, kill_at: int = -1) -> dict:
    """Run the stream under ``policy`` on ``pool`` (``{"hosts": {host: slots}, "ssh": [serve's
    ssh flags]}``); returns the figures."""
    slots = sum(pool["hosts"].values())
    svc = Serve(tmp, policy, pool)
    svc.start()
    t0 = time.time()
    ids = {}
    timeline = []
    done = threading.Event()
    killed = {}

    def sample():
        while not done.is_set():
            try:
                st = svc.call("status")
                timeline.append((time.time() - t0, {j["id"]: j["world_size"] for j in st["jobs"]
                                                    if j["state"] == "running"},
                                 len(st["queue"])))
            except Exception:  # noqa: BLE001 - a sample missed across the restart
                pass
            time.sleep(0.5)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for i, (at, name, np_, kind) in enumerate(jobs):
        wait = t0 + at - time.time()
        if wait > 0:
            time.sleep(wait)
        if i == kill_at:
            svc.proc.kill()
            svc.proc.wait(10)
            killed["at_s"] = time.time() - t0
            killed["running"] = [j for j, r in ids.items()]
            svc.start()
            killed["restarted_after_s"] = time.time() - t0 - killed["at_s"]
        adir = tmp / "audit" / name
        r = svc.call("submit", argv=job_command(kind, tmp, name), cwd=str(ROOT),
                     env={audit.ENV_AUDIT_DIR: str(adir)}, name=name, np=np_, min_np=1,
                     max_np=4, priority=0, checkpoint_dir=None)
        ids[r["id"]] = (name, kind, adir)
    deadline = time.monotonic() + 900
    while True:
        st = svc.call("status")
        if all(j["state"] in ("done", "failed", "cancelled") for j in st["jobs"]):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{policy}: jobs did not end in 900 s: {st['jobs']}")
        time.sleep(0.5)
    done.set()
    sampler.join(5)
    events = svc.call("events", since=0)["events"]
    svc.stop()
    by_id = {j["id"]: j for j in st["jobs"]}
    jct = [j["finished_at"] - j["submitted_at"] for j in st["jobs"]]
    first = min(j["submitted_at"] for j in st["jobs"])
    last = max(j["finished_at"] for j in st["jobs"])
    held = sum(j["attained_gpu_s"] for j in st["jobs"])
    audits = {}
    for jid, (name, kind, adir) in ids.items():
        rep = audit.check(adir, samples_of(kind))
        audits[jid] = {"repeated": rep.repeated, "missing": rep.missing, "ok": rep.ok}
    ends = {jid: sum(1 for e in events if e["job"] == jid and e["kind"] == "end") for jid in ids}
    # a job's end: its last ledger line (the newest audit file's mtime: its last step or epoch)
    # to the service recording it done (the final evaluation, the workers' and launcher's exit)
    ends_s = [by_id[jid]["finished_at"] - max(f.stat().st_mtime for f in adir.glob("*.jsonl"))
              for jid, (_, _, adir) in ids.items() if list(adir.glob("*.jsonl"))]
    out = {
        "policy": policy, "avg_jct_s": statistics.mean(jct), "makespan_s": last - first,
        "utilisation": held / (slots * (last - first)),
        "jobs": {jid: {"name": by_id[jid]["name"], "state": by_id[jid]["state"],
                       "exit_code": by_id[jid]["exit_code"], "runs": by_id[jid]["runs"],
                       "jct_s": by_id[jid]["finished_at"] - by_id[jid]["submitted_at"],
                       "np": by_id[jid]["np"], "ends": ends[jid], "audit": audits[jid]}
                 for jid in ids},
        "decisions": {k: sum(1 for e in events if e["kind"] == k)
                      for k in ("start", "grow", "shrink", "move", "preempt", "resume",
                                "released", "adopt")},
        "all_done_once": all(by_id[j]["state"] == "done" and ends[j] == 1 for j in ids),
        "audit_repeated": sum(a["repeated"] for a in audits.values()),
        "audit_missing": sum(a["missing"] for a in audits.values()),
        "timeline": timeline,
        "reclaim_s": reclaim_latencies(events),
        "reclaim_parts": reclaim_parts(tmp, events),
        "measured": measured_costs(tmp, ids, events),
    }
    out["measured"]["end_s"] = statistics.median(ends_s) if ends_s else None
    out["workers_per_host"] = workers_per_host(tmp, ids)
    if killed:
        out["service_kill9"] = dict(killed, adopted=sum(1 for e in events if e["kind"] == "adopt"))
    return out


def workers_per_host(tmp: Path, ids) -> dict:
    """How many workers the runs started on each host (their logs' "started on HOST" lines)."""
    import re
    count: dict = {}
    for jid in ids:
        for log in (tmp / "state" / "jobs" / jid).glob("run*.log"):
            for host in re.findall(r"worker w\d+ started on (\S+) slot", log.read_text()):
                count[host] = count.get(host, 0) + 1
    return count


def measured_costs(tmp: Path, ids, events) -> dict:
    """Medians over the runs: the start-up cost (a run's start to its first generation, from
    that run's own event log), the joiners' build (a ``grow`` decision to the run's next
    scale-out), the switch stall (scale-ins and scale-outs) and the preemption's stop (a
    ``suspend`` to ``suspended``: the checkpoint and the run's exit, its slots held)."""
    startup, joins, stalls, stops = [], [], [], []
    for jid in ids:
        mine = [e for e in events if e["job"] == jid]
        for r in (e for e in mine if e["kind"] == "run"):
            log = tmp / "state" / "jobs" / jid / f"run{r['run']}.events.jsonl"
            gens = [json.loads(x) for x in log.read_text().splitlines()
                    if '"generation"' in x] if log.exists() else []
            if gens:
                startup.append(gens[0]["time"] - r["at"])
            stalls += [g["stall_s"] for g in gens if g.get("kind") in ("scale_in", "scale_out")]
            for grow in (e for e in mine if e["kind"] == "grow" and e["at"] > r["at"]):
                out = next((g for g in gens if g["kind"] == "scale_out"
                            and g["time"] > grow["at"]), None)
                if out is not None:
                    joins.append(out["time"] - grow["at"])
        for sus in (e for e in mine if e["kind"] == "suspend"):
            done = next((e for e in mine if e["kind"] == "suspended" and e["at"] >= sus["at"]),
                        None)
            if done is not None:
                stops.append(done["at"] - sus["at"])

    def med(xs):
        return statistics.median(xs) if xs else None
    return {"startup_s": med(startup), "join_s": med(joins), "stall_s": med(stalls),
            "stop_s": med(stops), "startups": len(startup), "joins": len(joins)}


def predict(policy: str, jobs, hosts: dict, steps: dict, m: dict) -> dict:
    """The simulator's run of the same stream (per-rank batch fixed: rank-steps of one slot's
    batch, a step's seconds from the nearest measured size) with the costs ``m`` measured in
    the run (:func:`measured_costs`; a cost not seen in the run: the start-up's)."""
    startup_s = m["startup_s"] or 8.0
    join_s = m["join_s"] or startup_s
    stall_s = m["stall_s"] or 0.1
    end_s = m.get("end_s") or 0.0
    stop_s = m.get("stop_s") or 0.0
    from launcher.cluster.policies import make_policy
    from launcher.cluster.simulator import SimJob, simulate
    pol = make_policy(policy)
    if policy == "tiresias":
        pol.thresholds_gpu_s = (QUEUE_THRESHOLD_GPU_S,)
    if policy == "edl":
        pol.hold_s = 5.0
    sims = []
    for i, (at, name, np_, kind) in enumerate(jobs):
        pts = steps.get(f"j{i + 1}") or {}
        default = 0.1 if kind == "synthetic" else 0.1

        def step_time(pl, pts=pts, default=default):
            n = sum(pl)
            if not pts:
                return default / n
            near = min(pts, key=lambda m: abs(m - n))
            return pts[near] / n
        batch = SYNTH_BATCH if kind == "synthetic" else DIGITS_BATCH
        epochs = SYNTH_EPOCHS if kind == "synthetic" else DIGITS_EPOCHS
        sims.append(SimJob(name, at, step_time, samples_of(kind) * epochs / batch, np_,
                           min_np=1, max_np=4, samples_per_step=batch))
    res = simulate(sims, dict(hosts), pol, round_s=5.0, restart_cost_s=startup_s,
                   change_cost_s=stall_s, stop_free=True, join_s=join_s, end_s=end_s,
                   stop_s=stop_s,
                   event_rounds=True)
    return {"avg_jct_s": res.avg_jct_s, "makespan_s": res.makespan_s,
            "utilisation": res.utilisation,
            "jct_s": {f"j{i + 1}": res.jobs[name].jct_s for i, (_, name, _, _) in enumerate(jobs)}}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.6 * len(results)), sharex=True,
                             squeeze=False)
    axes = axes[:, 0]
    for ax, (policy, r) in zip(axes, results.items()):
        ts = [t for t, _, _ in r["timeline"]]
        ids = sorted({j for _, w, _ in r["timeline"] for j in w}, key=lambda j: int(j[1:]))
        ys = [[w.get(j, 0) for _, w, _ in r["timeline"]] for j in ids]
        if ts:
            ax.stackplot(ts, ys, labels=ids, step="post")
            ax.step(ts, [q for _, _, q in r["timeline"]], where="post", color="k", lw=1.2,
                    label="queue")
        ax.set_ylabel("slots")
        ax.set_title(f"{policy}: avg JCT {r['avg_jct_s']:.0f} s, makespan "
                     f"{r['makespan_s']:.0f} s, utilisation {100 * r['utilisation']:.0f} %",
                     fontsize=9)
        ax.legend(fontsize=6, ncol=10, loc="upper right")
    axes[-1].set_xlabel("seconds since the first submission")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--slots", type=int, default=6)
    p.add_argument("--span", type=float, default=40.0, help="seconds the arrivals span")
    p.add_argument("--policies", default="fifo,tiresias,edl")
    p.add_argument("--keep", action="store_true", help="keep the state dirs (printed)")
    p.add_argument("--cluster-hosts", type=int, default=0, metavar="K",
                   help="K namespace hosts of one slot each join the pool (as root); localhost "
                        "keeps --slots minus K")
    p.add_argument("--pool-json", help=argparse.SUPPRESS)  # set inside the launcher namespace
    a = p.parse_args()
    if a.cluster_hosts and not a.pool_json:
        return in_cluster(a.cluster_hosts, a.slots, __file__)
    pool = json.loads(a.pool_json) if a.pool_json else {"hosts": {"localhost": a.slots}}
    jobs = stream(a.jobs, a.span)
    print("stream:", [(round(at, 1), name, np_, kind) for at, name, np_, kind in jobs])
    results = {}
    base = Path(tempfile.mkdtemp(prefix="scheduler_real-"))
    for policy in a.policies.split(","):
        tmp = base / policy
        tmp.mkdir()
        t = time.time()
        r = run_policy(policy, jobs, pool, tmp, kill_at=a.jobs // 2 if policy == "edl"
                       else -1)
        m = r["measured"]
        try:
            r["simulated"] = predict(policy, jobs, pool["hosts"], speed_points(tmp), m)
        except Exception as e:  # noqa: BLE001 - the prediction is a figure beside the run
            r["simulated"] = {"error": str(e)}
        results[policy] = r
        sim = r["simulated"].get("avg_jct_s")
        print(f"{policy:9s} avg JCT {r['avg_jct_s']:6.1f} s (simulated "
              f"{sim if sim is None else round(sim, 1)} s), makespan {r['makespan_s']:6.1f} s, "
              f"utilisation {100 * r['utilisation']:4.1f} %, all done once "
              f"{r['all_done_once']}, audit repeated {r['audit_repeated']} missing "
              f"{r['audit_missing']}, decisions {r['decisions']}, wall {time.time() - t:.0f} s",
              flush=True)
        print(f"          workers started per host: {r['workers_per_host']}", flush=True)
        if r["reclaim_s"]:
            print(f"          reclaim latency (submission -> lent slots free): "
                  f"{r['reclaim_s']} s", flush=True)
            for part in r["reclaim_parts"]:
                print(f"            {part}", flush=True)
        if "service_kill9" in r:
            print(f"          service kill -9: {r['service_kill9']}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "scheduler_real" + ("_cluster" if a.pool_json else "")  # the namespace hosts' run
    plot(results, RESULTS / f"{stem}.png")
    for r in results.values():
        r["timeline"] = r["timeline"][::2]
    (RESULTS / f"{stem}.json").write_text(json.dumps(
        {"command": " ".join(["benchmarks/cluster/scheduler_real.py"] + argv_of(sys.argv[1:])),
         "slots": a.slots, "pool": pool["hosts"], "stream": jobs, "results": results},
        indent=1))
    if all(r["all_done_once"] for r in results.values()) and not a.keep:
        shutil.rmtree(base, ignore_errors=True)
    else:  # keep the state dirs (jobs' run logs, event logs, database) of a run that failed
        print(f"state kept in {base}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
