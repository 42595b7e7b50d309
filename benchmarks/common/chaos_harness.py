"""What the two chaos runners share (library, not a benchmark: benchmarks/faults/chaos.py on
this host, benchmarks/multihost/cluster_chaos.py on the namespace cluster): the digits job in
audit mode with a discovery script that prints a hosts file, the run from the first ring to the
job's exit with the faults a runner strikes in between, the bad-discovery fault, the checks
every run passes (exit 0, every fault survived, exactly-once data, no more lost than a commit
interval) and the report.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from hvd_edl import audit  # noqa: E402
from launcher.observe.events import read as read_events  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BIN = Path(sys.executable).parent
DIGITS = str(ROOT / "examples" / "train_digits.py")
DIGITS_TRAIN = 1347
COMMIT_EVERY = 10  # train_digits.py's default --commit-every: the most one failure may cost
COMPLAINT = "keeping the last good host set"
RECOVERED = "host discovery recovered"


@dataclass
class Fault:
    """One injected fault and what became of it."""
    kind: str
    detail: str
    survived: bool = False
    seconds_to_handled: Optional[float] = None

    def outcome(self) -> str:
        """What the report line says after "survived" / "NOT survived"."""
        return f"({self.seconds_to_handled} s)"


class Job:
    """One ``hvd-edl-run -np 3 --min-np 1 --max-np 4`` on the digits job in audit mode
    (``HVD_EDL_AUDIT_DIR``), its discovery script printing the hosts file (exit 3 while
    ``fail_flag`` exists); ``launcher_args`` go before the discovery flags, ``popen`` starts it
    (in ``cwd``)."""

    def __init__(self, work: Path, discovery: str, launcher_args: Sequence[str] = (),
                 popen: Callable[..., subprocess.Popen] = subprocess.Popen, cwd: Path = ROOT):
        self.work = work
        self.hosts_path = work / "hosts"
        self.fail_flag = work / "discovery-fails"
        self.events = work / "events.jsonl"
        self.ledger = work / "ledger"
        self.out_path = work / "launcher.out"
        self.summary = work / "summary.json"
        self.stop = work / "stop"
        self.write_discovery(discovery)
        script = work / "discover.sh"
        script.write_text(f"#!/bin/sh\n[ -e {self.fail_flag} ] && exit 3\ncat {self.hosts_path}\n")
        script.chmod(0o755)
        env = dict(os.environ, **{audit.ENV_AUDIT_DIR: str(self.ledger)})
        cmd = [str(BIN / "hvd-edl-run"), "-np", "3", "--min-np", "1", "--max-np", "4",
               *launcher_args,
               "--discovery-interval", "0.3", "--event-log", str(self.events),
               "--blacklist-cooldown-range", "1", "2", "--host-discovery-script", str(script),
               sys.executable, DIGITS, "--epochs", "400", "--step-delay", "0.02",
               "--stop-file", str(self.stop), "--summary", str(self.summary)]
        self.out = open(self.out_path, "w")
        self.proc = popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, cwd=str(cwd), env=env,
                          start_new_session=True)

    def write_discovery(self, text: str) -> None:
        tmp = self.hosts_path.with_suffix(".new")
        tmp.write_text(text)
        os.replace(tmp, self.hosts_path)  # atomic: discovery never reads half a file

    def generations(self) -> List[dict]:
        return read_events(self.events)[0]  # not EventLog.note lines

    def members(self) -> List[str]:
        """The current ring's members as ``worker@host`` ("w3@h2")."""
        gens = self.generations()
        return [m.split(":")[0] for m in gens[-1]["members"]] if gens else []

    def output(self) -> str:
        self.out.flush()
        return self.out_path.read_text(errors="replace")

    def read_summary(self) -> dict:
        """The job's summary (``--summary``), {} before it wrote one."""
        return json.loads(self.summary.read_text()) if self.summary.exists() else {}

    def wait(self, pred, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pred():
                return True
            if self.proc.poll() is not None:
                return bool(pred())
            time.sleep(0.1)
        return False

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.out.close()


def run(job: Job, result, faults: Iterable[Fault], *, started: float, revive: str,
        stop_timeout_s: float, teardown: Callable[[], None] = lambda: None
        ) -> Optional[List[int]]:
    """One chaos run of ``job`` (started at ``time.monotonic()`` ``started``) into ``result``.

    Waits for the first ring and 20 trained steps, then takes ``faults`` one by one: a
    generator that strikes each fault when asked for the next (so it may wait on the job
    between them); each is reported, and one not survived ends the faults.  Then, with no
    member left, discovery prints ``revive``; the job is asked to finish its epoch and waited
    for ``stop_timeout_s``; it is closed and ``teardown()`` run whatever happened.  Then the
    checks: generations, the audit (repeated, missing, complete epochs), the most steps one
    generation lost, and the launcher's last output where it failed without a reason.

    Returns the steps each generation lost, or None when the first generation never formed
    (nothing checked).
    """
    try:
        if not job.wait(lambda: job.generations(), 180):
            result.error = "generation 1 never formed:\n" + job.output()[-2000:]
            return None
        job.wait(lambda: ledger_steps(job) >= 20, 120)  # faults strike a training ring
        for fault in faults:
            result.faults.append(fault)
            print(f"  seed {result.seed}: {fault.detail}: "
                  f"{'survived' if fault.survived else 'NOT survived'} {fault.outcome()}",
                  flush=True)
            if not fault.survived:
                result.error = job.output()[-3000:]
                break
        if not job.members():  # make sure some worker is running, then finish the epoch
            job.write_discovery(revive)
        job.stop.touch()
        try:
            result.returncode = job.proc.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            result.error = (result.error or
                            f"did not finish within {stop_timeout_s:g} s after the stop file")
    finally:
        job.close()
        teardown()
        result.wall_s = round(time.monotonic() - started, 1)
    result.generations = len(job.generations())
    lost: List[int] = []
    if job.ledger.exists():
        lost = steps_lost(job.ledger)
        result.max_steps_lost = max(lost, default=0)
        report = audit.check(job.ledger, DIGITS_TRAIN)
        result.repeated, result.missing = report.repeated, report.missing
        result.complete_epochs = sum(1 for e in report.epochs if e.complete)
    if result.returncode != 0 and not result.error:
        result.error = job.output()[-3000:]
    return lost


def settle(job: Job) -> None:
    """Let the new ring train a little (20 steps, at most 60 s) before the next fault."""
    steps = ledger_steps(job)
    job.wait(lambda: ledger_steps(job) >= steps + 20, 60)


def bad_outputs(host: str, slots: int) -> Dict[str, Optional[str]]:
    """The bad discovery outputs a ``bad`` fault draws from, around ``host:slots`` (None: the
    script exits 3)."""
    return {
        "malformed line": f"{host}:{slots}\nthis is not a host!\n",
        "zero slots": f"{host}:0\n",
        "duplicate host": f"{host}:{slots}\n{host}:1\n",
        "empty output": "",
        "non-zero exit": None,
    }


def strike_bad_discovery(job: Job, rng: random.Random, bad_outputs: Dict[str, Optional[str]],
                         timeout_s: float, kept: str = "", fault=Fault) -> Fault:
    """The discovery output turns bad (one of ``bad_outputs`` drawn by ``rng``; None: the script
    exits 3), then good again.  Survived: one complaint logged naming the last good hosts as
    kept (``kept``: the host set it must name, "" for any), and the recovery logged once the
    output is good again.  ``fault``: the class of the fault returned."""
    what = rng.choice(sorted(bad_outputs))
    f = fault("bad", f"bad discovery output: {what}")
    good = job.hosts_path.read_text()
    start = len(job.output())
    complaints = job.output().count(COMPLAINT)
    recoveries = job.output().count(RECOVERED)
    if bad_outputs[what] is None:
        job.fail_flag.touch()
    else:
        job.write_discovery(bad_outputs[what])
    f.survived = job.wait(lambda: job.output().count(COMPLAINT) > complaints, timeout_s)
    job.fail_flag.unlink(missing_ok=True)
    job.write_discovery(good)
    # (generations may still form meanwhile, e.g. a joiner of an earlier fault)
    f.survived = (f.survived and job.wait(
        lambda: job.output().count(RECOVERED) > recoveries, timeout_s)
        and (f"{COMPLAINT} {kept}" if kept else COMPLAINT) in job.output()[start:])
    return f


def steps_lost(ledger: Path) -> List[int]:
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


def ledger_steps(job: Job) -> int:
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


def checks_pass(r) -> bool:
    """What every chaos run must show: exit 0, every fault survived, no index repeated or
    missing, no generation lost more than one commit interval."""
    return (r.returncode == 0 and all(f.survived for f in r.faults)
            and r.repeated == 0 and r.missing == 0 and r.max_steps_lost <= COMMIT_EVERY)


# ---- the command line and the report ----------------------------------------------------------

def arguments(doc: str, faults: int) -> argparse.ArgumentParser:
    """A runner's parser with the flags both have: --runs, --faults (default ``faults``),
    --seed."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--faults", type=int, default=faults, help=f"faults per run (default {faults})")
    p.add_argument("--seed", type=int, default=1, help="run i uses seed + i")
    return p


def parse(p: argparse.ArgumentParser, argv) -> argparse.Namespace:
    a = p.parse_args(argv)
    if a.runs < 1 or a.faults < 1:
        p.error("--runs and --faults must be >= 1")
    return a


def print_run(i: int, r) -> None:
    """Run ``i``'s line (``r.details()``: what this runner adds), and its error if it failed."""
    print(f"run {i} (seed {r.seed}): {sum(f.survived for f in r.faults)}/{len(r.faults)} "
          f"faults survived, {r.generations} generations, exit {r.returncode}, "
          f"repeated {r.repeated}, missing {r.missing} ({r.complete_epochs} complete "
          f"epochs), {r.details()}, {r.wall_s} s: {'PASS' if r.passed else 'FAIL'}", flush=True)
    if r.error and not r.passed:
        print(r.error[-2000:])


def finish(benchmark: str, results: list, out: str, note: str = "", **extra) -> int:
    """The totals line (``note`` at its end), ``out``'s JSON (``extra`` after "benchmark");
    the exit code: 0 when every run passed."""
    injected = sum(len(r.faults) for r in results)
    survived = sum(sum(f.survived for f in r.faults) for r in results)
    passed = all(r.passed for r in results)
    print(f"{benchmark.replace('_', ' ')}: {injected} faults injected over {len(results)} runs, "
          f"{survived} survived; repeated {sum(r.repeated or 0 for r in results)}, missing "
          f"{sum(r.missing or 0 for r in results)}; {'PASS' if passed else 'FAIL'}{note}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({
        "benchmark": benchmark, **extra,
        "runs": [dict(asdict(r), passed=r.passed) for r in results],
        "faults_injected": injected, "faults_survived": survived}, indent=1) + "\n")
    return 0 if passed else 1
