"""The cluster service's event log: every decision and what became of every job, each with its
reason, as a row of the store's ``events`` table (``hvd-edl-cluster events``) and a line of
``STATE_DIR/events.jsonl`` (a file that outlives the database: ``tail -f`` it, keep it); and the
count of decisions per kind that ``/metrics`` shows (``hvd_edl_cluster_decisions_total``,
:mod:`launcher.cluster.metrics`).

Written by the service's loop thread only (the store's one writer).  A transition whose event
goes into the store in the same transaction as the job's new state (``Store.update(...,
event=...)``) writes only its line here (:meth:`EventLog.write`).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Dict, Optional

from launcher.cluster.store import Store

# kinds :meth:`EventLog.note` counts itself (the policy's decisions are counted where they are
# taken, :meth:`EventLog.count`)
COUNTED = ("released", "adopt")


class EventLog:
    """The event log of one service.

    Args:
        store: the service's store (its ``events`` table).
        path: ``STATE_DIR/events.jsonl`` (appended to, mode 0600).
        decisions: kind -> count, the dictionary ``/metrics`` reads (the service's
            ``decisions``).
    """

    def __init__(self, store: Store, path: Path, decisions: Dict[str, int]):
        self.store = store
        self.path = Path(path)
        self.decisions = decisions

    def note(self, job_id: Optional[str], kind: str, reason: str, **detail) -> None:
        """An event in the store and in ``events.jsonl`` (a ``released`` or ``adopt`` one
        counted as a decision)."""
        self.store.add_event(job_id, kind, reason, **detail)
        self.write({"job": job_id, "kind": kind, "reason": reason, **detail})
        if kind in COUNTED:
            self.count(kind)

    def write(self, event: dict) -> None:
        """Append ``event`` to ``events.jsonl`` only (``at`` now unless it has one)."""
        event.setdefault("at", time.time())
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (json.dumps(event, default=str) + "\n").encode())
        finally:
            os.close(fd)

    def count(self, kind: str) -> None:
        """One more decision of ``kind`` (start, grow, shrink, move, preempt, resume, ...)."""
        self.decisions[kind] = self.decisions.get(kind, 0) + 1
