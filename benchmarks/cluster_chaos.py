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

    sudo .venv/bin/python benchmarks/cluster_chaos.py --runs 3 --faults 7 --seed 1
        # results/cluster_chaos.json; about 10 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from hvd_edl import audit  # noqa: E402
from hvd_edl.messages import ENV_WORKER_ID  # noqa: E402
import chaos  # noqa: E402  (its ledger helpers and discovery markers)


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# benchmarks/cluster.py loads tests/cluster.py; both are named "cluster": load by path
_bench_cluster = _load("hvd_edl_bench_cluster", ROOT / "benchmarks" / "cluster.py")
Cluster, ClusterUnavailable = _bench_cluster.Cluster, _bench_cluster.ClusterUnavailable
reset_hosts = _bench_cluster.reset_hosts

RESULTS = ROOT / "benchmarks" / "results"
BIN = Path(sys.executable).parent
DIGITS = str(ROOT / "examples" / "train_digits.py")
DIGITS_TRAIN = chaos.DIGITS_TRAIN
COMMIT_EVERY = chaos.COMMIT_EVERY
KINDS = ("kill", "term", "vanish", "freeze", "partition", "hosts", "bad")
SILENT = ("vanish", "freeze", "partition")
HOSTS = ("h1", "h2", "h3", "h4")
REGROW_S = 45.0   # before a fault that needs two members: how long the ring may take to regrow
SLOW_STALL_S = 5.0  # a survivors' stall above this is reported (the goal is 3 s)
BAD_OUTPUTS = {
    "malformed line": "h1:1\nthis is not a host!\n",
    "zero slots": "h1:0\n",
    "duplicate host": "h1:1\nh1:1\n",
    "empty output": "",
    "non-zero exit": None,  # the script exits 3
}


@dataclass
class Fault:
    """One injected fault and what became of it."""
    kind: str
    detail: str
    survived: bool = False
    seconds_to_handled: Optional[float] = None   # fault -> the launcher acted (new ring, ...)
    new_generation: Optional[int] = None
    stall_s: Optional[float] = None              # the survivors' stall (event log)
    rolled_back_steps: Optional[int] = None
    fenced_gone_s: Optional[float] = None        # fault undone -> the fenced process gone
    note: str = ""


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
        return (self.returncode == 0 and bool(self.faults) and all(f.survived for f in self.faults)
                and self.repeated == 0 and self.missing == 0 and not self.split_brain
                and self.max_steps_lost <= COMMIT_EVERY)


class ClusterChaosJob:
    """One ``hvd-edl-run`` in the launcher namespace, a controllable discovery script and an
    audit ledger (the attributes :mod:`chaos`'s ledger helpers read)."""

    def __init__(self, c: Cluster, work: Path, hosts: List[str]):
        self.c, self.work = c, work
        self.hosts_path = work / "hosts"
        self.fail_flag = work / "discovery-fails"
        self.events = work / "events.jsonl"
        self.ledger = work / "ledger"
        self.out_path = work / "launcher.out"
        self.summary = work / "summary.json"
        self.stop = work / "stop"
        self.listed: List[str] = []
        self.set_hosts(hosts)
        script = work / "discover.sh"
        script.write_text(f"#!/bin/sh\n[ -e {self.fail_flag} ] && exit 3\ncat {self.hosts_path}\n")
        script.chmod(0o755)
        env = dict(os.environ, **{audit.ENV_AUDIT_DIR: str(self.ledger)})
        cmd = [str(BIN / "hvd-edl-run"), "-np", "3", "--min-np", "1", "--max-np", "4",
               "--network-interface", c.nic, "-i", c.identity_file,
               "--discovery-interval", "0.3", "--event-log", str(self.events),
               "--blacklist-cooldown-range", "1", "2", "--host-discovery-script", str(script),
               sys.executable, DIGITS, "--epochs", "400", "--step-delay", "0.02",
               "--stop-file", str(self.stop), "--summary", str(self.summary)]
        self.out = open(self.out_path, "w")
        self.proc = c.popen("launcher", cmd, stdout=self.out, stderr=subprocess.STDOUT,
                            cwd=str(work), env=env, start_new_session=True)

    def set_hosts(self, hosts: List[str]) -> None:
        self.listed = list(hosts)
        self.write_discovery("".join(f"{h}:1\n" for h in hosts))

    def write_discovery(self, text: str) -> None:
        tmp = self.hosts_path.with_suffix(".new")
        tmp.write_text(text)
        os.replace(tmp, self.hosts_path)  # atomic: discovery never reads half a file

    def generations(self) -> List[dict]:
        if not self.events.exists():
            return []
        lines = [json.loads(x) for x in self.events.read_text().splitlines() if x.strip()]
        return [e for e in lines if "generation" in e]  # not EventLog.note lines

    def output(self) -> str:
        self.out.flush()
        return self.out_path.read_text(errors="replace")

    def wait(self, pred, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pred():
                return True
            if self.proc.poll() is not None:
                return bool(pred())
            time.sleep(0.1)
        return False

    def members(self) -> List[str]:
        """The current ring's members as ``worker@host`` ("w3@h2")."""
        gens = self.generations()
        return [m.split(":")[0] for m in gens[-1]["members"]] if gens else []

    def training_pid(self, host: str, worker_id: str) -> Optional[int]:
        """The training process of ``worker_id`` on ``host`` (not its supervisor or ssh)."""
        found = []
        for pid in self.c.pids(host):
            try:
                p = psutil.Process(pid)
                if p.environ().get(ENV_WORKER_ID) == worker_id and \
                        any(DIGITS in a for a in p.cmdline()):
                    found.append(p)
            except psutil.Error:
                continue
        pids = {p.pid for p in found}
        top = [p for p in found if p.ppid() not in pids]
        return top[0].pid if top else None

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.out.close()


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
        what = rng.choice(sorted(BAD_OUTPUTS))
        fault = Fault(kind, f"bad discovery output: {what}")
        good = job.hosts_path.read_text()
        start = len(job.output())
        complaints = job.output().count(chaos.COMPLAINT)
        recoveries = job.output().count(chaos.RECOVERED)
        if BAD_OUTPUTS[what] is None:
            job.fail_flag.touch()
        else:
            job.write_discovery(BAD_OUTPUTS[what])
        fault.survived = job.wait(lambda: job.output().count(chaos.COMPLAINT) > complaints,
                                  timeout_s)
        job.fail_flag.unlink(missing_ok=True)
        job.write_discovery(good)
        fault.survived = (fault.survived and job.wait(
            lambda: job.output().count(chaos.RECOVERED) > recoveries, timeout_s)
            and chaos.COMPLAINT in job.output()[start:])
        fault.seconds_to_handled = round(time.monotonic() - t, 2)
    fault.survived = fault.survived and job.proc.poll() is None
    return fault


def _report(seed: int, fault: Fault) -> None:
    gone = ("" if fault.fenced_gone_s is None else
            f", fenced worker gone {fault.fenced_gone_s} s after the undo")
    print(f"  seed {seed}: {fault.detail}: {'survived' if fault.survived else 'NOT survived'} "
          f"(handled {fault.seconds_to_handled} s, stall {fault.stall_s} s, rolled back "
          f"{fault.rolled_back_steps}{gone}){' ' + fault.note if fault.note else ''}", flush=True)


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


def run_chaos(c: Cluster, seed: int, n_faults: int, work: Path, fault_timeout_s: float = 60.0,
              run_bound_s: float = 300.0) -> RunResult:
    """One seeded chaos run on cluster ``c`` in ``work``; see the module docstring."""
    rng = random.Random(seed)
    kinds = rng.sample(KINDS, len(KINDS))
    kinds = (kinds + [rng.choice(KINDS) for _ in range(n_faults)])[:n_faults]
    result = RunResult(seed=seed)
    t0 = time.monotonic()
    job = ClusterChaosJob(c, work, ["h1", "h2", "h3"])
    try:
        if not job.wait(lambda: job.generations(), 180):
            result.error = "generation 1 never formed:\n" + job.output()[-2000:]
            return result
        job.wait(lambda: chaos._ledger_steps(job) >= 20, 120)  # faults strike a training ring
        for kind in kinds:
            if time.monotonic() - t0 > run_bound_s:
                result.error = f"run bound ({run_bound_s:g} s) reached before {kind}"
                break
            if kind not in ("hosts", "bad") and not job.wait(lambda: len(job.members()) >= 2,
                                                             REGROW_S):
                # keep a worker (the job must survive, not end): first grow the ring
                fault = _strike(c, job, rng, "hosts", fault_timeout_s)
                result.faults.append(fault)
                _report(seed, fault)
                if not fault.survived:
                    result.error = job.output()[-3000:]
                    break
                if not job.wait(lambda: len(job.members()) >= 2, REGROW_S):
                    kind = "hosts"
            fault = _strike(c, job, rng, kind, fault_timeout_s)
            result.faults.append(fault)
            _report(seed, fault)
            if not fault.survived:
                result.error = job.output()[-3000:]
                break
            steps = chaos._ledger_steps(job)  # the new ring trains a little before the next
            job.wait(lambda: chaos._ledger_steps(job) >= steps + 20, 60)
        if not job.members():
            job.set_hosts(["h1", "h2"])
        job.stop.touch()
        try:
            result.returncode = job.proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            result.error = result.error or "did not finish within 180 s after the stop file"
    finally:
        job.close()
        reset_hosts(c)
        result.wall_s = round(time.monotonic() - t0, 1)
    result.generations = len(job.generations())
    result.split_brain = _split_brain(job, result.faults)
    if job.summary.exists():
        result.accuracy = json.loads(job.summary.read_text()).get("test_accuracy")
    if job.ledger.exists():
        result.steps_lost = chaos._steps_lost(job.ledger)
        result.max_steps_lost = max(result.steps_lost, default=0)
        report = audit.check(job.ledger, DIGITS_TRAIN)
        result.repeated, result.missing = report.repeated, report.missing
        result.complete_epochs = sum(1 for e in report.epochs if e.complete)
    if result.returncode != 0 and not result.error:
        result.error = job.output()[-3000:]
    (work / "result.json").write_text(json.dumps(asdict(result), indent=1))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--faults", type=int, default=7, help="faults per run (default 7)")
    p.add_argument("--seed", type=int, default=1, help="run i uses seed + i")
    p.add_argument("--fault-timeout", type=float, default=60.0)
    p.add_argument("--run-bound", type=float, default=300.0,
                   help="no new fault after this many seconds of a run")
    p.add_argument("--keep", help="keep each run's directory (launcher output, events, ledger) "
                   "under this directory")
    p.add_argument("--out", default=str(RESULTS / "cluster_chaos.json"))
    a = p.parse_args(argv)
    if a.runs < 1 or a.faults < 1:
        p.error("--runs and --faults must be >= 1")
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
            print(f"run {i} (seed {r.seed}): {sum(f.survived for f in r.faults)}/{len(r.faults)} "
                  f"faults survived, {r.generations} generations, exit {r.returncode}, "
                  f"repeated {r.repeated}, missing {r.missing} ({r.complete_epochs} complete "
                  f"epochs), steps lost per generation {r.steps_lost} (at most "
                  f"{r.max_steps_lost}), split brain {r.split_brain or 'none'}, accuracy "
                  f"{r.accuracy}, {r.wall_s} s: {'PASS' if r.passed else 'FAIL'}", flush=True)
            if r.error and not r.passed:
                print(r.error[-2000:])
    injected = sum(len(r.faults) for r in results)
    survived = sum(sum(f.survived for f in r.faults) for r in results)
    print(f"cluster chaos: {injected} faults injected over {len(results)} runs, {survived} "
          f"survived; repeated {sum(r.repeated or 0 for r in results)}, missing "
          f"{sum(r.missing or 0 for r in results)}; "
          f"{'PASS' if all(r.passed for r in results) else 'FAIL'} (runs kept in {base})")
    RESULTS.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "benchmark": "cluster_chaos", "hosts": len(HOSTS),
        "runs": [dict(asdict(r), passed=r.passed) for r in results],
        "faults_injected": injected, "faults_survived": survived}, indent=1) + "\n")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
