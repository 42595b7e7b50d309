"""The cluster service driven from a benchmark (library, not a benchmark): what
benchmarks/cluster/scheduler_real.py and benchmarks/cluster/reclaim.py share.

* :class:`Serve`: one ``hvd-edl-cluster serve`` on a pool (its state directory, cluster file,
  restart, calls that ride over a restart);
* :func:`reclaim_latencies`, :func:`reclaim_parts`: how fast lent slots came back and where
  the time went, from the service's events and the leaving job's event logs;
* :func:`speed_points`: the step times the service's telemetry recorded per job and size;
* :func:`in_cluster`, :func:`argv_of`: run a benchmark inside the namespace test cluster's
  launcher namespace (``--cluster-hosts K``), the command line as the user gave it.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from launcher.cluster import cluster_file  # noqa: E402
from launcher.cluster.server import ClusterClient, ClusterRefused  # noqa: E402

CLI = [sys.executable, "-m", "launcher.cluster.cli"]
# Tiresias's queue threshold compressed with the time.  Not 40: 40 GPU-s put the first two
# jobs' demotion (2 slots x 20 s) exactly on a 5 s round, where the service's once-a-second
# accounting and the simulator's exact one differ by a fraction of a second and the whole
# prediction flips (the simulator preempted j1 at 20 s, the service at 25 s, as it ended).
QUEUE_THRESHOLD_GPU_S = 42.0


def wait_for(what: str, predicate, timeout_s: float, poll_s: float = 0.2):
    """``predicate()``'s first truthy value, polled every ``poll_s`` seconds; RuntimeError
    naming ``what`` after ``timeout_s`` seconds (every wait of a benchmark is bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not within {timeout_s:.0f} s")
        time.sleep(poll_s)


class Serve:
    def __init__(self, tmp: Path, policy: str, pool: dict):
        self.tmp, self.policy, self.pool = tmp, policy, pool
        self.state = tmp / "state"
        self.cluster = tmp / "cluster.json"
        self.proc = None
        self.n = 0
        self.extra = None  # serve's policy flags (None: the stream's compressed ones below)
        self.cli = CLI  # serve's command (another Python: a team install every user can run)
        self.cwd = ROOT

    def start(self):
        if self.cluster.exists():
            self.cluster.unlink()
        extra = self.extra if self.extra is not None else {
            "tiresias": ["--queue-thresholds", f"{QUEUE_THRESHOLD_GPU_S:g}"],
            "edl": ["--hold", "5"]}.get(self.policy, [])
        hosts = ",".join(f"{h}:{n}" for h, n in self.pool["hosts"].items())
        self.proc = subprocess.Popen(self.cli + ["serve", "-H", hosts, *self.pool.get("ssh", []),
                                            "--state-dir", str(self.state), "--cluster-file",
                                            str(self.cluster), "--policy", self.policy] + extra,
                                     stdout=open(self.tmp / f"serve{self.n}.log", "w"),
                                     stderr=subprocess.STDOUT, cwd=str(self.cwd))
        self.n += 1
        deadline = time.monotonic() + 60
        while not self.cluster.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the service did not start: "
                                   + (self.tmp / f"serve{self.n - 1}.log").read_text())
            time.sleep(0.1)

    def client(self):
        return ClusterClient(cluster_file.read(self.cluster), timeout_s=10)

    def call(self, route, **args):
        deadline = time.monotonic() + 60
        while True:  # across a restart of the service
            try:
                return self.client().call(route, **args)
            except (ClusterRefused, cluster_file.ClusterFileError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


def _reclaims(events):
    """(run event, its job's submission, its start decision, the ``released`` events between
    that decision and the run's start) for every first run that started on slots taken back
    from others within 1 s of its submission."""
    for e in events:
        if e["kind"] != "run" or not e.get("reason", "").startswith("run 1"):
            continue
        sub = next(x for x in events if x["kind"] == "submit" and x["job"] == e["job"])
        start = next((x for x in events if x["kind"] == "start" and x["job"] == e["job"]), None)
        if start is None or start["at"] - sub["at"] >= 1.0:
            continue
        rel = [x for x in events if x["kind"] == "released" and start["at"] - 0.01 <= x["at"]
               <= e["at"] + 0.01]
        if rel:
            yield e, sub, start, rel


def reclaim_latencies(events) -> list:
    """Per job that started on slots taken back from others: its submission to the moment
    those slots were released (the last ``released`` event between its start decision and
    its run's start)."""
    return [round(max(x["at"] for x in rel) - sub["at"], 3)
            for _, sub, _, rel in _reclaims(events)]


def reclaim_parts(tmp: Path, events) -> list:
    """Where each reclaim's time goes (seconds, one dict per reclaim of
    :func:`reclaim_latencies`): ``decide`` (the submission to the shrink written into the
    leaving job's allocation file), ``to_switch`` (that write to the leaving job's scale-in
    generation forming: its discovery poll, the wait for its script's next commit and the
    agreement there), ``after`` (the generation formed to the service counting the slots free:
    the leaver out of the ring, seen by the service's telemetry poll).  ``how`` is ``switch``
    (a scale-in generation formed), ``ended`` (the leaving job had finished training: its
    workers were past their last commit and the slots came free with its exit, which the
    service recorded within 3 s) or ``not_in_ring`` (the workers on those slots were still
    starting, not yet members: the launcher dropped them at once)."""
    out = []
    for e, sub, start, rel in _reclaims(events):
        last = max(rel, key=lambda x: x["at"])
        shrink = max((x for x in events if x["kind"] == "shrink" and x["job"] == last["job"]
                      and x["at"] <= last["at"]), key=lambda x: x["at"], default=None)
        if shrink is None:
            continue
        gens = []
        for log in (tmp / "state" / "jobs" / last["job"]).glob("run*.events.jsonl"):
            gens += [g for g in map(json.loads, log.read_text().splitlines())
                     if g.get("kind") == "scale_in" and shrink["at"] - 0.01 <= g["time"]
                     <= last["at"] + 0.01]
        switch = min((g["time"] for g in gens), default=None)
        ended = any(x["kind"] == "end" and x["job"] == last["job"]
                    and 0 <= x["at"] - last["at"] <= 3.0 for x in events)
        out.append({
            "job": e["job"], "leaver": last["job"], "total_s": round(last["at"] - sub["at"], 3),
            "decide_s": round(shrink["at"] - sub["at"], 3),
            "to_switch_s": None if switch is None else round(switch - shrink["at"], 3),
            "after_s": round(last["at"] - (switch if switch is not None else shrink["at"]), 3),
            "how": "switch" if switch is not None else "ended" if ended else "not_in_ring"})
    return out


def speed_points(tmp: Path) -> dict:
    """job id -> {world size: step_s} from the store the service kept (telemetry)."""
    import sqlite3
    db = sqlite3.connect(str(tmp / "state" / "cluster.db"))
    out = {}
    for jid, sp in db.execute("SELECT id, speed FROM jobs"):
        out[jid] = {int(n): p["step_s"] for n, p in json.loads(sp).items() if p.get("step_s")}
    return out


def argv_of(args):
    """The command line as the user gave it (without the inner ``--pool-json``)."""
    out, skip = [], False
    for x in args:
        if skip:
            skip = False
        elif x == "--pool-json":
            skip = True
        else:
            out.append(x)
    return out


def in_cluster(k: int, slots: int, script: str) -> int:
    """Build a namespace cluster of ``k`` hosts, run ``script`` (a benchmark that takes
    ``--pool-json``: scheduler_real.py, reclaim.py) with this process's arguments inside its
    launcher namespace with the pool ``localhost:slots-k,h1:1,...,hk:1``, tear the cluster
    down."""
    prog = Path(script).name
    if not 0 < k < slots:
        raise SystemExit(f"{prog}: --cluster-hosts {k} must be in 1..{slots - 1} "
                         f"(--slots {slots} includes localhost's)")
    sys.path.insert(0, str(ROOT / "tests"))
    from cluster import Cluster
    with Cluster(hosts=k) as c:
        hosts = {"localhost": slots - k, **{name: 1 for name in c.hosts}}
        pool = {"hosts": hosts, "ssh": ["-i", c.identity_file, "--network-interface", c.nic]}
        inner = [sys.executable, str(Path(script).resolve()), *sys.argv[1:],
                 "--pool-json", json.dumps(pool)]
        return subprocess.run(c.exec_argv("launcher", inner), cwd=str(ROOT)).returncode
