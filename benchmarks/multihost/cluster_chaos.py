"""Chaos on the namespace cluster (tests/cluster.py): seeded faults over a multi-host digits job,
which must survive them all with exactly-once data.

Each run builds on one 4-host cluster (``h1`` .. ``h4``, one slot each, the launcher in its own
namespace, real ssh, Gloo over the bridge) and starts ``hvd-edl-run -np 3 --min-np 1 --max-np 4``
on the digits job in audit mode, with a discovery script that prints a hosts file (first
``h1 h2 h3``).  A run injects ``--faults`` faults: a seeded permutation of every kind (then seeded
draws), so each run sees each kind once (a fault that needs two members waits up to 45 s for the
ring to regrow, else a ``hosts`` fault that adds a host comes first):

* ``kill``: ``kill -9`` of a random member's training process on its host;
* ``term``: SIGTERM to it (it leaves gracefully at its next commit);
* ``vanish``: the member's host taken off the bridge (no FIN, no reset), back once the others
  trained again without it;
* ``freeze``: every process of the member's host SIGSTOPped, thawed the same way;
* ``partition``: the launcher <-> host path silenced (the host still reaches the others), healed
  the same way;
* ``hosts``: discovery adds an unlisted host, or drops a listed one (a spot notice);
* ``bad``: the discovery output turns bad (malformed line, zero slots, duplicate host, empty
  output, non-zero exit), then good again.

A fault is *survived* when the launcher acted on it within ``--fault-timeout`` s and the job
still runs: a generation without the victim (``failure`` and not ``state_lost`` for the silent
and killed ones), the ring at the new host set, or the discovery complaint and recovery; for a
silent host also: the fenced worker's process gone from it after the fault is undone, and the
fenced worker in no later generation (no split brain).  At the end the job is asked to finish
its epoch (``--stop-file``); a run passes when it exits 0, every fault was survived, the audit has
0 repeated and 0 missing indices in every complete epoch and no generation lost more than one
commit interval (10 steps).  Every run is bounded (``--run-bound`` s).  A survivors' stall above
5 s is noted ``SLOW`` (the goal is 3 s; not a failure here: the bench measures it).

    sudo .venv/bin/python benchmarks/multihost/cluster_chaos.py --runs 3 --faults 7 --seed 1
        # benchmarks/results/cluster_chaos.json; about 10 minutes on 2 cores
"""
from __future__ import annotations

import functools
import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common import chaos_harness as harness  # noqa: E402
from benchmarks.common.chaos_harness import DIGITS, RESULTS  # noqa: E402
from benchmarks.common.namespace_cluster import (Cluster, ClusterUnavailable,  # noqa: E402
                                                 reset_hosts)

KINDS = ("kill", "term", "vanish", "freeze", "partition", "hosts", "bad")
SILENT = ("vanish", "freeze", "partition")
HOSTS = ("h1", "h2", "h3", "h4")
REGROW_S = 45.0   # before a fault that needs two members: how long the ring may take to regrow
SLOW_STALL_S = 5.0  # a survivors' stall above this is reported (the goal is 3 s)
BAD_OUTPUTS = harness.bad_outputs("h1", 1)


@dataclass
class Fault(harness.Fault):
    """One injected fault and what became of it."""
    new_generation: Optional[int] = None
    stall_s: Optional[float] = None              # the survivors' stall (event log)
    rolled_back_steps: Optional[int] = None
    fenced_gone_s: Optional[float] = None        # fault undone -> the fenced process gone
    note: str = ""

    def outcome(self) -> str:
        gone = ("" if self.fenced_gone_s is None else
                f", fenced worker gone {self.fenced_gone_s} s after the undo")
        return (f"(handled {self.seconds_to_handled} s, stall {self.stall_s} s, rolled back "
                f"{self.rolled_back_steps}{gone}){' ' + self.note if self.note else ''}")


@dataclass
class RunResult:
    """One chaos run's figures."""
    seed: int
    faults: List[Fault] = field(default_factory=list)
    returncode: Optional[int] = None
    generations: int = 0
    repeated: Optional[int] = None
    missing: Optional[int] = None
    complete_epochs: int = 0
    steps_lost: List[int] = field(default_factory=list)
    max_steps_lost: int = 0
    accuracy: Optional[float] = None
    split_brain: List[str] = field(default_factory=list)
    wall_s: float = 0.0
    error: str = ""

    @property
    def passed(self) -> bool:
        return harness.checks_pass(self) and bool(self.faults) and not self.split_brain

    def details(self) -> str:
        return (f"steps lost per generation {self.steps_lost} (at most {self.max_steps_lost}), "
                f"split brain {self.split_brain or 'none'}, accuracy {self.accuracy}")


class ClusterChaosJob(harness.Job):
    """The job in the launcher namespace, one slot per listed host."""

    def __init__(self, c: Cluster, work: Path, hosts: List[str]):
        self.c = c
        self.listed: List[str] = list(hosts)
        super().__init__(work, _lines(hosts),
                         ["--network-interface", c.nic, "-i", c.identity_file],
                         popen=functools.partial(c.popen, "launcher"), cwd=work)

    def set_hosts(self, hosts: List[str]) -> None:
        self.listed = list(hosts)
        self.write_discovery(_lines(hosts))

    def training_pid(self, host: str, worker_id: str) -> Optional[int]:
        """The training process of ``worker_id`` on ``host`` (not its supervisor or ssh)."""
        return self.c.training_pid(host, worker_id, DIGITS)


def _lines(hosts: List[str]) -> str:
    return "".join(f"{h}:1\n" for h in hosts)


def _ring_without(job: ClusterChaosJob, worker: str, after: int, timeout_s: float):
    found: Dict[str, dict] = {}

    def pred():
        ev = next((e for e in job.generations() if e["generation"] > after and
                   all(not m.startswith(f"{worker}@") for m in e["members"])), None)
        if ev:
            found["ev"] = ev
        return ev
    job.wait(pred, timeout_s)
    return found.get("ev")


def _undo(c: Cluster, kind: str, host: str) -> None:
    {"vanish": c.reconnect, "freeze": c.thaw, "partition": c.heal}[kind](host)


def _strike(c: Cluster, job: ClusterChaosJob, rng: random.Random, kind: str,
            timeout_s: float) -> Fault:
    """Inject one fault of ``kind`` and wait until the launcher acted on it."""
    gens = job.generations()
    last = gens[-1]["generation"] if gens else 0
    t = time.monotonic()
    wall = time.time()
    if kind in ("kill", "term") + SILENT:
        victim, host = rng.choice(job.members()).split("@")
        fault = Fault(kind, f"{kind} {victim}@{host}")
        if kind in ("kill", "term"):
            pid = job.training_pid(host, victim)
            if pid is None:
                fault.note = "its training process was already gone"
            else:
                os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGTERM)
        else:
            {"vanish": c.cut, "freeze": c.freeze, "partition": c.partition}[kind](host)
        try:
            ev = _ring_without(job, victim, last, timeout_s)
        finally:
            if kind in SILENT:
                undone = time.monotonic()
                _undo(c, kind, host)
        fault.survived = ev is not None and (kind == "term" or (
            ev["kind"] == "failure" and not ev["state_lost"]))
        if ev is not None:
            fault.seconds_to_handled = round(ev["time"] - wall, 2)
            fault.new_generation = ev["generation"]
            fault.stall_s, fault.rolled_back_steps = ev["stall_s"], ev["rolled_back_steps"]
            if ev["stall_s"] > SLOW_STALL_S:
                fault.note = f"SLOW: the survivors stalled {ev['stall_s']:.1f} s"
        if kind in SILENT and fault.survived:
            gone = job.wait(lambda: job.training_pid(host, victim) is None, 60)
            fault.fenced_gone_s = round(time.monotonic() - undone, 2)
            if not gone:
                fault.survived, fault.note = False, "the fenced worker still runs 60 s later"
    elif kind == "hosts":
        spare = [h for h in HOSTS if h not in job.listed]
        if spare and (len(job.listed) <= 2 or rng.random() < 0.5):
            new = rng.choice(spare)
            fault = Fault(kind, f"discovery adds {new}")
            job.set_hosts(sorted(job.listed + [new]))
            ok = job.wait(lambda: any(m.endswith(f"@{new}") for m in job.members()), timeout_s)
        else:
            gone = rng.choice(job.listed)
            fault = Fault(kind, f"discovery drops {gone}")
            job.set_hosts([h for h in job.listed if h != gone])
            ok = job.wait(lambda: job.members() and not any(
                m.endswith(f"@{gone}") for m in job.members()), timeout_s)
        fault.survived = ok
        ev = job.generations()[-1]
        if ok and ev["generation"] > last:
            fault.seconds_to_handled = round(ev["time"] - wall, 2)
            fault.new_generation = ev["generation"]
            fault.stall_s, fault.rolled_back_steps = ev["stall_s"], ev["rolled_back_steps"]
    else:
        fault = harness.strike_bad_discovery(job, rng, BAD_OUTPUTS, timeout_s, fault=Fault)
        fault.seconds_to_handled = round(time.monotonic() - t, 2)
    fault.survived = fault.survived and job.proc.poll() is None
    return fault


def _split_brain(job: ClusterChaosJob, faults: List[Fault]) -> List[str]:
    """Fenced or killed workers that are members of a generation after the one that dropped
    them."""
    bad = []
    gens = job.generations()
    for f in faults:
        if f.kind in ("kill",) + SILENT and f.new_generation is not None:
            victim = f.detail.split()[1].split("@")[0]
            bad += [f"{victim} in generation {e['generation']}" for e in gens
                    if e["generation"] >= f.new_generation
                    and any(m.startswith(f"{victim}@") for m in e["members"])]
    return bad


def _faults(c: Cluster, job: ClusterChaosJob, rng: random.Random, kinds: List[str],
            result: RunResult, started: float, timeout_s: float,
            run_bound_s: float) -> Iterator[Fault]:
    """A fault of each of ``kinds`` in turn, each struck when asked for; none after the run
    bound (``result.error`` says so)."""
    for kind in kinds:
        if time.monotonic() - started > run_bound_s:
            result.error = f"run bound ({run_bound_s:g} s) reached before {kind}"
            return
        if kind not in ("hosts", "bad") and not job.wait(lambda: len(job.members()) >= 2,
                                                         REGROW_S):
            # keep a worker (the job must survive, not end): first grow the ring
            yield _strike(c, job, rng, "hosts", timeout_s)
            if not job.wait(lambda: len(job.members()) >= 2, REGROW_S):
                kind = "hosts"
        yield _strike(c, job, rng, kind, timeout_s)
        harness.settle(job)


def run_chaos(c: Cluster, seed: int, n_faults: int, work: Path, fault_timeout_s: float = 60.0,
              run_bound_s: float = 300.0) -> RunResult:
    """One seeded chaos run on cluster ``c`` in ``work``; see the module docstring."""
    rng = random.Random(seed)
    kinds = rng.sample(KINDS, len(KINDS))
    kinds = (kinds + [rng.choice(KINDS) for _ in range(n_faults)])[:n_faults]
    result = RunResult(seed=seed)
    t0 = time.monotonic()
    job = ClusterChaosJob(c, work, ["h1", "h2", "h3"])
    faults = _faults(c, job, rng, kinds, result, t0, fault_timeout_s, run_bound_s)
    lost = harness.run(job, result, faults, started=t0, revive=_lines(["h1", "h2"]),
                       stop_timeout_s=180, teardown=lambda: reset_hosts(c))
    if lost is None:
        return result
    result.steps_lost = lost
    result.split_brain = _split_brain(job, result.faults)
    result.accuracy = job.read_summary().get("test_accuracy")
    (work / "result.json").write_text(json.dumps(asdict(result), indent=1))
    return result


def main(argv=None) -> int:
    p = harness.arguments(__doc__, faults=7)
    p.add_argument("--fault-timeout", type=float, default=60.0)
    p.add_argument("--run-bound", type=float, default=300.0,
                   help="no new fault after this many seconds of a run")
    p.add_argument("--keep", help="keep each run's directory (launcher output, events, ledger) "
                   "under this directory")
    p.add_argument("--out", default=str(RESULTS / "cluster_chaos.json"))
    a = harness.parse(p, argv)
    try:
        c = Cluster(hosts=len(HOSTS))
    except ClusterUnavailable as e:
        print(f"cluster chaos skipped: {e}", file=sys.stderr)
        return 0
    results = []
    base = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="hvd_edl_cluster_chaos_"))
    with c:
        for i in range(a.runs):
            work = base / f"run{i}"
            work.mkdir(parents=True)
            os.chmod(work, 0o755)
            r = run_chaos(c, a.seed + i, a.faults, work, a.fault_timeout, a.run_bound)
            results.append(r)
            harness.print_run(i, r)
    return harness.finish("cluster_chaos", results, a.out, note=f" (runs kept in {base})",
                          hosts=len(HOSTS))


if __name__ == "__main__":
    sys.exit(main())
