"""Training progress as members report it (``hvd-edl-ctl status``: current step, epoch,
samples/s): the step count, epoch and samples each worker sent with its last ``/watch`` long
poll.

Nothing is added to the training path: the watcher thread already keeps one long poll open;
it now carries ``step``, ``epoch`` and ``samples`` (see :class:`hvd_edl.messages.WatchRequest`).
A status request makes the coordinator answer the open polls at once (:meth:`ProgressBoard.ask`),
so every watcher asks again with fresh figures; the status waits a moment for them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Optional

RATE_WINDOW_S = 1.0  # a rate is measured over at least this many seconds


@dataclass(frozen=True)
class Progress:
    """One report: optimizer ``step``; sampler ``epoch`` and ``samples`` (samples of every rank
    since the start of epoch 0, -1 when the script has no ElasticSampler in its state);
    ``at``: monotonic seconds when it arrived."""
    step: int
    epoch: int
    samples: int
    at: float


class ProgressBoard:
    """The last reports per worker and one older report each, for rates.  Not thread-safe: the
    coordinator calls it with its lock held."""

    def __init__(self) -> None:
        self.latest: Dict[str, Progress] = {}
        self.earlier: Dict[str, Progress] = {}
        self.asked_at: Optional[float] = None  # when a status last asked for fresh reports
        self.asks = 0                          # bumped by every ask (the open polls answer)
        self.waiting = 0                       # status requests waiting for fresh reports

    def ask(self, now: float) -> None:
        """A status wants fresh figures: the open long polls are answered (see the module)."""
        self.asked_at = now
        self.asks += 1

    def record(self, worker_id: str, step: int, epoch: int, samples: int, now: float) -> None:
        """Keep a report; ``step`` < 0 means the worker sent none (an older worker)."""
        if step < 0:
            return
        prev = self.latest.get(worker_id)
        first = self.earlier.get(worker_id)
        # the rate's start: a report at least a second back, with known samples, not rolled back
        if prev is not None and (first is None or now - prev.at >= RATE_WINDOW_S
                                 or first.samples < 0 <= prev.samples or prev.step < first.step):
            self.earlier[worker_id] = prev
        self.latest[worker_id] = Progress(step, epoch, samples, now)

    def fresh(self, workers: Iterable[str], since: float) -> bool:
        """True when every one of ``workers`` reported at or after ``since``."""
        return all(w in self.latest and self.latest[w].at >= since for w in workers)

    def summary(self, worker_id: Optional[str], now: float) -> Optional[dict]:
        """``{"step", "epoch", "samples", "steps_per_s", "samples_per_s", "age_s"}`` of one
        worker (the rank 0 member), rates None until two reports at least ``RATE_WINDOW_S``
        apart exist (or when the count went back: a failure rolled it back); None when it
        never reported."""
        last = self.latest.get(worker_id) if worker_id else None
        if last is None:
            return None
        first = self.earlier.get(worker_id)
        span = last.at - first.at if first is not None else 0.0
        steps_per_s = samples_per_s = None
        if first is not None and span > 0:
            if last.step >= first.step:
                steps_per_s = round((last.step - first.step) / span, 3)
            if last.samples >= first.samples >= 0:
                samples_per_s = round((last.samples - first.samples) / span, 3)
        return {"step": last.step, "epoch": None if last.epoch < 0 else last.epoch,
                "samples": None if last.samples < 0 else last.samples,
                "steps_per_s": steps_per_s, "samples_per_s": samples_per_s,
                "age_s": round(now - last.at, 3)}
