"""Chaos runs: seeded random faults over the digits job, which must survive them all with
exactly-once data and test accuracy >= 0.95.

Each run starts ``hvd-edl-run -np 3 --min-np 1 --max-np 4`` on the digits job in audit mode
(``HVD_EDL_AUDIT_DIR``), with a discovery script that prints a hosts file, and injects
``--faults`` faults drawn by ``random.Random(seed)`` from:

* ``kill``: ``kill -9`` of a random member (rank 0 included);
* ``term``: SIGTERM to a random member (it leaves gracefully at its next commit);
* ``hosts``: the hosts file changes to ``localhost:N`` (N in 1..4, a different N);
* ``bad``: the discovery output turns bad for a while (malformed line, zero slots, duplicate
  host, empty output, non-zero exit), then good again.

After each fault it waits until the launcher has acted on it (a new generation in the event log,
or the discovery complaint in the launcher's output), with a deadline: a fault is *survived* when
that happens and the job is still running.  At the end the job is asked to finish its epoch
(``--stop-file``); the run passes when it exits 0, every fault was survived, the audit ledger has
0 repeated and 0 missing indices in every complete epoch, no fault cost more than the steps since
the last commit (10), every rank ends with the same parameters, and test accuracy is >= 0.95.

    python benchmarks/chaos.py --runs 3 --faults 10 --seed 1  # results/chaos.json
    make chaos                                                 # the same, via pytest -m chaos
"""
from __future__ import annotations

import argparse
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
from typing import List, Optional

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hvd_edl import audit  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BIN = Path(sys.executable).parent
DIGITS = ROOT / "examples" / "train_digits.py"
DIGITS_TRAIN = 1347
BAD_OUTPUTS = {
    "malformed line": "localhost:2\nthis is not a host!\n",
    "zero slots": "localhost:0\n",
    "duplicate host": "localhost:2\nlocalhost:1\n",
    "empty output": "",
    "non-zero exit": None,  # the script exits 3
}
KINDS = ("kill", "term", "hosts", "bad")
COMPLAINT = "keeping the last good host set"
COMMIT_EVERY = 10  # train_digits.py's default --commit-every: the most one failure may cost
RECOVERED = "host discovery recovered"


@dataclass
class Fault:
    """One injected fault and what became of it."""
    kind: str
    detail: str
    survived: bool = False
    seconds_to_handled: Optional[float] = None


@dataclass
class RunResult:
    """One chaos run's figures."""
    seed: int
    faults: List[Fault] = field(default_factory=list)
    returncode: Optional[int] = None
    accuracy: Optional[float] = None
    param_spread: Optional[float] = None
    generations: int = 0
    repeated: Optional[int] = None
    missing: Optional[int] = None
    complete_epochs: int = 0
    steps_lost: int = 0
    max_steps_lost: int = 0
    wall_s: float = 0.0
    error: str = ""

    @property
    def passed(self) -> bool:
        return (self.returncode == 0 and all(f.survived for f in self.faults)
                and self.repeated == 0 and self.missing == 0
                and self.max_steps_lost <= COMMIT_EVERY and self.param_spread == 0.0
                and self.accuracy is not None and self.accuracy >= 0.95)


class ChaosJob:
    """One ``hvd-edl-run`` job with a controllable discovery script and an audit ledger."""

    def __init__(self, work: Path):
        self.work = work
        self.hosts = work / "hosts"
        self.fail_flag = work / "discovery-fails"
        self.events = work / "events.jsonl"
        self.ledger = work / "ledger"
        self.out_path = work / "launcher.out"
        self.summary = work / "summary.json"
        self.stop = work / "stop"
        self.set_hosts("localhost:3\n")
        script = work / "discover.sh"
        script.write_text(f"#!/bin/sh\n[ -e {self.fail_flag} ] && exit 3\ncat {self.hosts}\n")
        script.chmod(0o755)
        env = dict(os.environ, **{audit.ENV_AUDIT_DIR: str(self.ledger)})
        cmd = [str(BIN / "hvd-edl-run"), "-np", "3", "--min-np", "1", "--max-np", "4",
               "--discovery-interval", "0.3", "--event-log", str(self.events),
               "--blacklist-cooldown-range", "1", "2", "--host-discovery-script", str(script),
               sys.executable, str(DIGITS), "--epochs", "400", "--step-delay", "0.02",
               "--stop-file", str(self.stop), "--summary", str(self.summary)]
        self.out = open(self.out_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT,
                                     cwd=str(ROOT), env=env, start_new_session=True)

    def set_hosts(self, text: str) -> None:
        tmp = self.hosts.with_suffix(".new")
        tmp.write_text(text)
        os.replace(tmp, self.hosts)

    def generations(self) -> List[dict]:
        if not self.events.exists():
            return []
        lines = [json.loads(x) for x in self.events.read_text().splitlines() if x.strip()]
        return [e for e in lines if "generation" in e]  # not EventLog.note lines

    def output(self) -> str:
        self.out.flush()
        return self.out_path.read_text()

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
        gens = self.generations()
        return [m.split("@")[0] for m in gens[-1]["members"]] if gens else []

    def pid_of(self, worker_id: str) -> Optional[int]:
        for child in psutil.Process(self.proc.pid).children():
            try:
                if child.environ().get("HVD_EDL_WORKER_ID") == worker_id:
                    return child.pid
            except psutil.Error:
                continue
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.out.close()


def run_chaos(seed: int, n_faults: int, work: Path, fault_timeout_s: float = 120.0) -> RunResult:
    """One seeded chaos run in ``work``; see the module docstring."""
    rng = random.Random(seed)
    result = RunResult(seed=seed)
    t0 = time.monotonic()
    job = ChaosJob(work)
    try:
        if not job.wait(lambda: job.generations(), 180):
            result.error = "generation 1 never formed:\n" + job.output()[-2000:]
            return result
        capacity = 3
        job.wait(lambda: _ledger_steps(job) >= 20, 120)  # faults strike a training ring
        for _ in range(n_faults):
            kind = rng.choice(KINDS)
            gens_before = len(job.generations())
            members = job.members()
            if kind in ("kill", "term") and len(members) < 2:
                kind = "hosts"  # keep at least one worker: the job must survive, not end
            t = time.monotonic()
            if kind in ("kill", "term"):
                victim = rng.choice(members)
                pid = job.pid_of(victim)
                fault = Fault(kind, f"{'kill -9' if kind == 'kill' else 'SIGTERM'} {victim}")
                if pid is None:
                    fault.detail += " (already gone)"
                else:
                    os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGTERM)
                # acted on when a generation without the victim trains (graceful or failure)
                fault.survived = job.wait(lambda: len(job.generations()) > gens_before
                                          and victim not in job.members(), fault_timeout_s)
            elif kind == "hosts":
                capacity = rng.choice([n for n in (1, 2, 3, 4) if n != capacity])
                fault = Fault(kind, f"hosts -> localhost:{capacity}")
                job.set_hosts(f"localhost:{capacity}\n")
                # acted on when the ring has that many workers (joiners need to start first;
                # it may have that many already, e.g. while a failed slot rested)
                fault.survived = job.wait(lambda: len(job.members()) == capacity,
                                          fault_timeout_s)
            else:
                what = rng.choice(sorted(BAD_OUTPUTS))
                fault = Fault(kind, f"bad discovery output: {what}")
                good = job.hosts.read_text()
                start = len(job.output())
                complaints = job.output().count(COMPLAINT)
                recoveries = job.output().count(RECOVERED)
                if BAD_OUTPUTS[what] is None:
                    job.fail_flag.touch()
                else:
                    job.set_hosts(BAD_OUTPUTS[what])
                # acted on: one complaint logged naming the last good hosts as kept, and the
                # recovery logged once the output is good again
                fault.survived = job.wait(lambda: job.output().count(COMPLAINT) > complaints,
                                          fault_timeout_s)
                job.fail_flag.unlink(missing_ok=True)
                job.set_hosts(good)
                # (generations may still form meanwhile, e.g. a joiner of an earlier fault)
                fault.survived = (fault.survived and job.wait(
                    lambda: job.output().count(RECOVERED) > recoveries, fault_timeout_s)
                    and f"{COMPLAINT} {good.strip()}" in job.output()[start:])
            fault.seconds_to_handled = round(time.monotonic() - t, 2)
            fault.survived = fault.survived and job.proc.poll() is None
            result.faults.append(fault)
            print(f"  seed {seed}: {fault.detail}: "
                  f"{'survived' if fault.survived else 'NOT survived'} "
                  f"({fault.seconds_to_handled} s)", flush=True)
            if not fault.survived:
                result.error = job.output()[-3000:]
                break
            # let the new ring train a little before the next fault
            steps = _ledger_steps(job)
            job.wait(lambda: _ledger_steps(job) >= steps + 20, 60)
        # make sure some worker is running, then finish the epoch
        if not job.members():
            job.set_hosts("localhost:2\n")
        job.stop.touch()
        try:
            result.returncode = job.proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            result.error = "did not finish within 600 s after the stop file"
    finally:
        job.close()
        result.wall_s = round(time.monotonic() - t0, 1)
    result.generations = len(job.generations())
    if job.summary.exists():
        summary = json.loads(job.summary.read_text())
        result.accuracy = summary["test_accuracy"]
        result.param_spread = summary.get("param_spread")
    if job.ledger.exists():
        lost = _steps_lost(job.ledger)
        result.steps_lost, result.max_steps_lost = sum(lost), max(lost, default=0)
        report = audit.check(job.ledger, DIGITS_TRAIN)
        result.repeated = report.repeated
        result.missing = report.missing
        result.complete_epochs = sum(1 for e in report.epochs if e.complete)
    if result.returncode != 0 and not result.error:
        result.error = job.output()[-3000:]
    return result


def _steps_lost(ledger: Path) -> List[int]:
    """Per generation: steps trained before it that it does not resume from (the work a fault
    cost), from the ledger's step and sync lines."""
    records = audit.read_records(ledger)
    resumes = {}
    for r in records:
        if r["kind"] == "sync":
            resumes[r["gen"]] = min(r["step"], resumes.get(r["gen"], r["step"]))
    lost = []
    for gen, s0 in sorted(resumes.items()):
        before = max((r["step"] for r in records if r["kind"] == "step" and r["gen"] < gen),
                     default=0)
        lost.append(max(0, before - s0))
    return lost


def _ledger_steps(job: ChaosJob) -> int:
    """Highest step any worker has written to the ledger (0 before any)."""
    best = 0
    for path in job.ledger.glob("*.jsonl"):
        try:
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - 4096))
                tail = f.read().decode(errors="replace").splitlines()
        except OSError:
            continue
        for line in reversed(tail):
            try:
                best = max(best, json.loads(line).get("step", 0))
                break
            except json.JSONDecodeError:
                continue
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--faults", type=int, default=10, help="faults per run (default 10)")
    p.add_argument("--seed", type=int, default=1, help="run i uses seed + i")
    p.add_argument("--out", default=str(RESULTS / "chaos.json"))
    a = p.parse_args(argv)
    if a.runs < 1 or a.faults < 1:
        p.error("--runs and --faults must be >= 1")
    results = []
    with tempfile.TemporaryDirectory(prefix="hvd_edl_chaos_") as tmp:
        for i in range(a.runs):
            work = Path(tmp) / f"run{i}"
            work.mkdir()
            r = run_chaos(a.seed + i, a.faults, work)
            results.append(r)
            print(f"run {i} (seed {r.seed}): {sum(f.survived for f in r.faults)}/{len(r.faults)} "
                  f"faults survived, {r.generations} generations, exit {r.returncode}, "
                  f"repeated {r.repeated}, missing {r.missing} ({r.complete_epochs} complete "
                  f"epochs), steps lost {r.steps_lost} (at most {r.max_steps_lost} at once), "
                  f"accuracy {r.accuracy}, parameter spread across ranks {r.param_spread}, "
                  f"{r.wall_s} s: "
                  f"{'PASS' if r.passed else 'FAIL'}", flush=True)
            if r.error and not r.passed:
                print(r.error[-2000:])
    injected = sum(len(r.faults) for r in results)
    survived = sum(sum(f.survived for f in r.faults) for r in results)
    print(f"chaos: {injected} faults injected over {len(results)} runs, {survived} survived; "
          f"repeated {sum(r.repeated or 0 for r in results)}, missing "
          f"{sum(r.missing or 0 for r in results)}; "
          f"{'PASS' if all(r.passed for r in results) else 'FAIL'}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "benchmark": "chaos", "runs": [dict(asdict(r), passed=r.passed) for r in results],
        "faults_injected": injected, "faults_survived": survived}, indent=1) + "\n")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
