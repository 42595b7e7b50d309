"""The event log (``--event-log PATH``): one JSON line per generation and per decision, each
with its kind in ``"event"`` (see :class:`EventLog`), plus one human line on the output."""
from __future__ import annotations

import json
import logging
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

log = logging.getLogger(__name__)

GENERATION = "generation"  # the "event" of a GenerationEvent's line


@dataclass
class GenerationEvent:
    """One generation change.

    ``kind``: "start" | "scale_out" | "scale_in" | "replace" (as many workers left as joined,
    e.g. a job moved to other hosts) | "reform" (the same members again: the joiner the ring
    switched for was lost before its generation formed) | "failure".  ``left`` / ``joined``: the workers
    (``id@host:slot``) that left the previous ring and that joined this one.  ``step``:
    optimizer step boundary at which it took effect.  ``stall_s``: the longest pause (seconds)
    among workers that trained in both generations, from the end of their last step in the old
    ring to the start of their first in the new one (0 for "start").  ``rolled_back_steps``:
    steps redone after a failure. ``time``: unix seconds when the generation formed.
    ``phases``: where the stall went, as the slowest continuing worker reported it
    (``messages.Started.phases``: boundary, shutdown, wait, init, sync, rest; seconds), and
    ``sync_parts`` how its sync went (``messages.Started.sync_parts``: header, skeleton,
    transfer, load; seconds).
    ``state_lost``: a failure after which no member of the previous ring was left, so training
    restarted from the joiners' initial state (``rolled_back_steps`` is then at least the step
    the previous ring started at, a lower bound of the work lost).  ``restored_from``: the
    checkpoint (``--checkpoint-dir``) a generation without any holder of the state resumes
    from, at step ``restored_step`` ("" and -1 otherwise; ``state_lost`` is then False).
    """
    generation: int
    kind: str
    world_size: int
    members: List[str]
    step: int
    stall_s: float
    rolled_back_steps: int
    time: float
    previous_world_size: int = 0
    phases: Dict[str, float] = field(default_factory=dict)
    state_lost: bool = False
    left: List[str] = field(default_factory=list)
    joined: List[str] = field(default_factory=list)
    restored_from: str = ""
    restored_step: int = -1
    sync_parts: Dict[str, float] = field(default_factory=dict)


class EventLog:
    """Appends :class:`GenerationEvent` lines to ``path`` (if given) and prints a human line.

    Every line carries its kind in ``"event"``: ``"generation"`` for a :class:`GenerationEvent`
    (its fields follow), and for the decisions that are not generations, logged through
    :meth:`note`, ``"straggler"``, ``"eviction"``, ``"migration"``, ``"replace"``,
    ``"autoscale"`` or ``"profile"``.  Readers use :func:`read` / :func:`is_generation`, which
    also read logs written before the kind was added (their generation lines had no
    ``"event"``)."""

    def __init__(self, path: Optional[str], out=sys.stdout):
        self.path = path
        self.out = out
        self._lock = threading.Lock()
        if path:
            open(path, "w").close()

    def write(self, ev: GenerationEvent) -> None:
        with self._lock:
            if self.path:
                with open(self.path, "a") as f:
                    f.write(json.dumps({"event": GENERATION, **asdict(ev)}) + "\n")
            if ev.kind == "start":
                text = (f"generation {ev.generation} (start): {ev.world_size} "
                        f"worker{'s' if ev.world_size != 1 else ''}")
            else:
                text = (f"generation {ev.generation} ({ev.kind}): {ev.previous_world_size} -> "
                        f"{ev.world_size} workers at step {ev.step}, stall {ev.stall_s:.3f} s, "
                        f"rolled back {ev.rolled_back_steps} steps")
                moved = [f"{what}: {', '.join(who)}" for what, who in
                         (("left", ev.left), ("joined", ev.joined)) if who]
                if moved:
                    text += f" ({'; '.join(moved)})"
                if ev.state_lost:
                    text += (" -- STATE LOST: no member of the previous ring survived, training "
                             "restarts from the initial state")
            if ev.restored_from:
                text += f" -- resumed from checkpoint {ev.restored_from} (step {ev.restored_step})"
            print(f"hvd-edl-run: {text}", file=self.out, flush=True)

    def note(self, kind: str, text: str, **fields) -> dict:
        """Log one decision: ``{"event": kind, "time": unix seconds, **fields}`` to the file and
        ``hvd-edl-run: <kind>: <text>`` to the output.  ``kind`` is e.g. "straggler",
        "eviction", "migration", "autoscale", "profile".  Returns the record written."""
        rec = {"event": kind, "time": time.time(), **fields}
        with self._lock:
            if self.path:
                with open(self.path, "a") as f:
                    f.write(json.dumps(rec, default=str) + "\n")
            print(f"hvd-edl-run: {kind}: {text}", file=self.out, flush=True)
        return rec


def is_generation(record: dict) -> bool:
    """True for an event-log line that is a :class:`GenerationEvent` (not a :meth:`EventLog.note`):
    ``"event": "generation"``, or, in a log written before lines carried their kind, a line
    with a ``"generation"`` field and no ``"event"``."""
    return record.get("event", GENERATION) == GENERATION and "generation" in record


def read(path) -> Tuple[List[dict], List[dict]]:
    """An event log's lines as (generations, notes), in file order; a line being written (not
    yet valid JSON) and a missing file are skipped.  Notes are the :meth:`EventLog.note`
    records (their ``"event"`` is their kind)."""
    generations: List[dict] = []
    notes: List[dict] = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    (generations if is_generation(rec) else notes).append(rec)
    except OSError:
        pass
    return generations, notes
