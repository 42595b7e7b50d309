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

    .venv/bin/python benchmarks/faults/chaos.py --runs 3 --faults 10 --seed 1
        # writes benchmarks/results/chaos.json
    make chaos      # the same, via pytest -m chaos (tests/test_chaos.py)
"""
from __future__ import annotations

import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common import chaos_harness as harness  # noqa: E402
from benchmarks.common.chaos_harness import RESULTS, Fault  # noqa: E402

BAD_OUTPUTS = harness.bad_outputs("localhost", 2)
KINDS = ("kill", "term", "hosts", "bad")


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
        return (harness.checks_pass(self) and self.param_spread == 0.0
                and self.accuracy is not None and self.accuracy >= 0.95)

    def details(self) -> str:
        return (f"steps lost {self.steps_lost} (at most {self.max_steps_lost} at once), "
                f"accuracy {self.accuracy}, parameter spread across ranks {self.param_spread}")


class ChaosJob(harness.Job):
    """The job on this host (``localhost:3`` to begin with)."""

    def __init__(self, work: Path):
        super().__init__(work, "localhost:3\n")

    def workers(self) -> List[str]:
        """The current ring's worker ids."""
        return [m.split("@")[0] for m in self.members()]

    def pid_of(self, worker_id: str) -> Optional[int]:
        """The training process of ``worker_id``: the launcher's child, or the zygote's (not
        the stub that stands for it: docs/zygote.md)."""
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if child.environ().get("HVD_EDL_WORKER_ID") == worker_id and \
                        not any(a.endswith("zygote_client.py") for a in child.cmdline()):
                    return child.pid
            except psutil.Error:
                continue
        return None


def _faults(job: ChaosJob, rng: random.Random, n_faults: int,
            timeout_s: float) -> Iterator[Fault]:
    """``n_faults`` faults drawn by ``rng``, each struck when asked for, then waited on until
    the launcher acted on it."""
    capacity = 3
    for _ in range(n_faults):
        kind = rng.choice(KINDS)
        gens_before = len(job.generations())
        members = job.workers()
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
                                      and victim not in job.workers(), timeout_s)
        elif kind == "hosts":
            capacity = rng.choice([n for n in (1, 2, 3, 4) if n != capacity])
            fault = Fault(kind, f"hosts -> localhost:{capacity}")
            job.write_discovery(f"localhost:{capacity}\n")
            # acted on when the ring has that many workers (joiners need to start first;
            # it may have that many already, e.g. while a failed slot rested)
            fault.survived = job.wait(lambda: len(job.members()) == capacity, timeout_s)
        else:
            fault = harness.strike_bad_discovery(job, rng, BAD_OUTPUTS, timeout_s,
                                                 kept=job.hosts_path.read_text().strip())
        fault.seconds_to_handled = round(time.monotonic() - t, 2)
        fault.survived = fault.survived and job.proc.poll() is None
        yield fault
        harness.settle(job)


def run_chaos(seed: int, n_faults: int, work: Path, fault_timeout_s: float = 120.0) -> RunResult:
    """One seeded chaos run in ``work``; see the module docstring."""
    rng = random.Random(seed)
    result = RunResult(seed=seed)
    t0 = time.monotonic()
    job = ChaosJob(work)
    lost = harness.run(job, result, _faults(job, rng, n_faults, fault_timeout_s), started=t0,
                       revive="localhost:2\n", stop_timeout_s=600)
    if lost is None:
        return result
    result.steps_lost = sum(lost)
    summary = job.read_summary()
    if summary:
        result.accuracy = summary["test_accuracy"]
        result.param_spread = summary.get("param_spread")
    return result


def main(argv=None) -> int:
    p = harness.arguments(__doc__, faults=10)
    p.add_argument("--out", default=str(RESULTS / "chaos.json"))
    a = harness.parse(p, argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="hvd_edl_chaos_") as tmp:
        for i in range(a.runs):
            work = Path(tmp) / f"run{i}"
            work.mkdir()
            r = run_chaos(a.seed + i, a.faults, work)
            results.append(r)
            harness.print_run(i, r)
    return harness.finish("chaos", results, a.out)


if __name__ == "__main__":
    sys.exit(main())
