"""Audit mode: a ledger of every index each rank consumed per step, and its checker.

Set ``HVD_EDL_AUDIT_DIR=DIR`` in the launcher's environment (``hvd-edl-run`` passes it on to
every worker).  Each worker then appends JSON lines to ``DIR/<worker>.jsonl``, one ``write()`` per
line, so a ``kill -9`` loses at most the line being written:

* ``{"kind": "step", "gen", "step", "epoch", "rank", "size", "sampler", "indices", "repeats"}``
  after each step, written by the elastic sampler's ``record_batch`` / ``record_indices`` with the
  indices its iterator actually yielded for that step (``repeats``: indices it yielded only to
  keep the ranks in step at an epoch's tiny final global batch).
* ``{"kind": "sync", "gen", "step", "epoch"}`` when a generation starts (after ``state.sync()``):
  ``step`` is the committed step the new ring resumes from.

Under ``hvd-edl-run`` every record also has ``run``, the launcher's start (unix seconds): a job
resumed from its checkpoint by a new launcher (a preemption, a cluster service's suspend and
resume) numbers its generations from 1 again, so generations are ordered by ``(run, gen)``.
* ``{"kind": "epoch", "gen", "step", "epoch", "skipped"}`` at ``set_epoch``: the previous epoch is
  complete; ``skipped`` samples were dropped by ``drop_last``.

The checker (``python -m hvd_edl.audit DIR --dataset-size N``) keeps the *committed progress*: a
generation that resumes from step ``s0`` supersedes every line of earlier generations with a step
after ``s0`` (work rolled back by a failure).  Per epoch it counts indices used more than once
(``repeated``, besides the sampler's declared ``repeats``) and, for complete epochs, indices never
used (``missing``).  An epoch is complete once ``set_epoch`` started a later one (or once its
committed steps used all N indices).  An epoch never completed (the job failed or was stopped
halfway) cannot be proved exactly-once, so it fails the audit, as does a ledger without a single
step, unless ``--allow-incomplete`` is given (a job meant to end mid-epoch: its incomplete epochs
are then checked for repeats only).  Exit status 1 when any epoch has repeated or missing
indices, or is incomplete and not allowed; 2 for a usage error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional

ENV_AUDIT_DIR = "HVD_EDL_AUDIT_DIR"


class Ledger:
    """Append-only JSON-lines ledger of one process (``path``); thread-safe."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def write(self, kind: str, **fields) -> None:
        """Append one record ``{"kind": kind, **fields}`` with a single ``write(2)``; under
        ``hvd-edl-run`` it carries ``run``, the launcher's start (unix seconds: a job resumed
        by a new launcher from its checkpoint restarts its generations at 1, and the checker
        orders generations by ``(run, gen)``)."""
        from hvd_edl import messages
        run = os.environ.get(messages.ENV_LAUNCHED_AT)
        if run and "run" not in fields:
            try:
                fields["run"] = float(run)
            except ValueError:
                pass
        line = (json.dumps({"kind": kind, **fields}, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)


_ledger: Optional[Ledger] = None
_ledger_lock = threading.Lock()


def ledger() -> Optional[Ledger]:
    """This process's ledger when ``HVD_EDL_AUDIT_DIR`` is set, else None."""
    global _ledger
    directory = os.environ.get(ENV_AUDIT_DIR)
    if not directory:
        return None
    with _ledger_lock:
        if _ledger is None:
            from hvd_edl import messages
            name = os.environ.get(messages.ENV_WORKER_ID) or f"pid{os.getpid()}"
            _ledger = Ledger(Path(directory) / f"{name}.jsonl")
        return _ledger


# ---- the checker -------------------------------------------------------------------------------

@dataclass
class EpochReport:
    """Exactly-once figures of one epoch of one sampler (counts of sample indices)."""
    sampler: str
    epoch: int
    complete: bool
    used: int = 0
    distinct: int = 0
    repeated: int = 0
    missing: int = 0
    declared_repeats: int = 0
    skipped: int = 0
    rolled_back_steps: int = 0


@dataclass
class AuditReport:
    """All epochs; ``ok`` when no epoch has repeated or missing indices, and every epoch is
    complete (or ``allow_incomplete``)."""
    dataset_size: int
    epochs: List[EpochReport] = field(default_factory=list)
    allow_incomplete: bool = False

    @property
    def incomplete(self) -> List[EpochReport]:
        """Epochs with steps that were never completed (see :func:`check`)."""
        return [e for e in self.epochs if not e.complete]

    @property
    def repeated(self) -> int:
        return sum(e.repeated for e in self.epochs)

    @property
    def missing(self) -> int:
        return sum(e.missing for e in self.epochs)

    @property
    def ok(self) -> bool:
        """No repeated or missing index; unless ``allow_incomplete``, also at least one epoch
        audited and none incomplete."""
        if self.repeated or self.missing:
            return False
        return self.allow_incomplete or (bool(self.epochs) and not self.incomplete)

    def verdict(self) -> str:
        """The one-line outcome: ``OK``, or ``FAILED`` and why."""
        if self.ok:
            return "OK" + (f" ({_names(self.incomplete)} incomplete, allowed)"
                           if self.incomplete else "")
        why = []
        if self.repeated or self.missing:
            why.append(f"{self.repeated} repeated, {self.missing} missing")
        if not self.allow_incomplete and not self.epochs:
            why.append("no step recorded")
        elif not self.allow_incomplete and self.incomplete:
            why.append(f"{_names(self.incomplete)} incomplete (the job ended mid-epoch: its "
                       f"missing indices cannot be counted; --allow-incomplete accepts that)")
        return "FAILED: " + "; ".join(why)

    def to_dict(self) -> dict:
        return {"dataset_size": self.dataset_size, "repeated": self.repeated,
                "missing": self.missing,
                "incomplete": [{"sampler": e.sampler, "epoch": e.epoch} for e in self.incomplete],
                "allow_incomplete": self.allow_incomplete, "ok": self.ok,
                "epochs": [asdict(e) for e in self.epochs]}


def _names(epochs: List[EpochReport]) -> str:
    """``"sampler epoch 3"``, ``"train epoch 1, val epoch 1"`` (at most 10 named)."""
    text = ", ".join(f"{e.sampler or 'sampler'} epoch {e.epoch}" for e in epochs[:10])
    return text + (f" and {len(epochs) - 10} more" if len(epochs) > 10 else "")


def read_records(directory: Path) -> List[dict]:
    """Every record of every ``*.jsonl`` ledger in ``directory``; a torn last line (a process
    killed mid-write) is skipped."""
    records = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def generation(record: dict) -> tuple:
    """The order of ``record``'s generation among a job's: ``(run, gen)``, the launcher's start
    first (a resumed run numbers its generations from 1 again; 0 for records without one)."""
    return (record.get("run", 0.0), record["gen"])


def committed(records: Iterable[dict]) -> List[dict]:
    """The records that belong to committed progress.

    A generation ``g`` whose ``sync`` resumed from step ``s0`` supersedes the records of every
    earlier generation with ``step > s0``; applied in generation order (:func:`generation`:
    ``(run, gen)``; any sortable ``gen`` works, e.g. rank 0's clock at the sync).
    """
    records = list(records)
    resume: Dict = {}
    for r in records:
        if r["kind"] == "sync":
            g = generation(r)
            resume[g] = min(r["step"], resume.get(g, r["step"]))
    alive = [True] * len(records)
    for g in sorted(resume):
        s0 = resume[g]
        for i, r in enumerate(records):
            if alive[i] and generation(r) < g and r["step"] > s0:
                alive[i] = False
    return [r for r, a in zip(records, alive) if a]


def check(directory: Path, dataset_size: int, allow_incomplete: bool = False) -> AuditReport:
    """Count repeated and missing indices per epoch in the committed progress of a ledger
    directory.  ``dataset_size``: N, the sampler's ``len(dataset)``; ``allow_incomplete``: the
    report is ``ok`` even with incomplete epochs (a job meant to end mid-epoch).

    An epoch is complete when ``set_epoch`` started a later one (its ``epoch`` record), or when
    its committed steps used every one of the N indices (a script that calls ``set_epoch`` at
    the start of each epoch never closes its last one).

    Raises:
        FileNotFoundError: ``directory`` does not exist.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no ledger directory {directory}")
    records = read_records(directory)
    kept = committed(records)
    kept_ids = {id(r) for r in kept}
    rolled_back = defaultdict(set)
    for r in records:
        if r["kind"] == "step" and id(r) not in kept_ids:
            rolled_back[(r.get("sampler", ""), r["epoch"])].add((generation(r), r["step"]))
    steps = defaultdict(list)
    complete, skipped = set(), {}
    for r in kept:
        if r["kind"] == "step":
            steps[(r.get("sampler", ""), r["epoch"])].append(r)
        elif r["kind"] == "epoch" and r["epoch"] > 0:
            key = (r.get("sampler", ""), r["epoch"] - 1)
            complete.add(key)
            skipped[key] = r.get("skipped", 0)
    report = AuditReport(dataset_size, allow_incomplete=allow_incomplete)
    for key in sorted(steps):
        seen_steps = set()
        counts: Counter = Counter()
        declared = 0
        for r in steps[key]:
            # one line per (step, rank); a rank writes a step once per generation
            ident = (generation(r), r["step"], r["rank"])
            if ident in seen_steps:
                continue
            seen_steps.add(ident)
            counts.update(r["indices"])
            declared += len(r.get("repeats", ()))
        e = EpochReport(sampler=key[0], epoch=key[1],
                        complete=key in complete or len(counts) >= dataset_size,
                        used=sum(counts.values()), distinct=len(counts),
                        repeated=sum(c - 1 for c in counts.values() if c > 1),
                        declared_repeats=declared, skipped=skipped.get(key, 0),
                        rolled_back_steps=len(rolled_back[key]))
        if e.complete:
            e.missing = dataset_size - e.skipped - e.distinct
        report.epochs.append(e)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hvd_edl.audit",
                                description="Check an audit ledger for exactly-once data.")
    p.add_argument("directory", type=Path)
    p.add_argument("--dataset-size", type=int, required=True, help="N, len(dataset)")
    p.add_argument("--allow-incomplete", action="store_true",
                   help="pass a job that ended mid-epoch (its last epoch is checked for repeats "
                        "only); without it an incomplete epoch fails the audit")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    a = p.parse_args(argv)
    if a.dataset_size < 1:
        p.error(f"--dataset-size must be >= 1, got {a.dataset_size}")
    try:
        report = check(a.directory, a.dataset_size, a.allow_incomplete)
    except FileNotFoundError as e:
        p.error(str(e))
    if a.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        for e in report.epochs:
            print(f"{e.sampler or 'sampler'} epoch {e.epoch}: {e.distinct} distinct of "
                  f"{a.dataset_size}, repeated {e.repeated}, "
                  f"missing {e.missing if e.complete else '- (incomplete)'}, declared repeats "
                  f"{e.declared_repeats}, rolled-back steps {e.rolled_back_steps}")
        print(f"audit: repeated {report.repeated}, missing {report.missing}, incomplete "
              f"epochs {len(report.incomplete)}: {report.verdict()}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
