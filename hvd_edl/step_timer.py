"""Per-step timing of one worker: how long its optimizer steps take and how much of that it
spends waiting for the ring, measured from timestamps the step takes anyway.

For each optimizer step (``DistributedOptimizer.step``): ``step_s`` is the time from the end of
the previous step (or from the (re-)entry of ``hvd.elastic.run``'s function after a switch) to
the end of this one; ``wait_s`` the part of it spent blocked in Horovod collectives (the
optimizer's ``synchronize()`` of the gradient handles, and the script's own blocking
``hvd.allreduce`` / ``broadcast`` / ``synchronize`` ... calls, and every blocking wait the
runtime itself does on the training thread: the switch agreement of ``commit()`` and
``check_host_updates()``, a ``state.sync()`` called inside the training function; see
:func:`waiting`); ``compute_s = step_s - wait_s``.  A wait inside another is counted once.
The samplers add the samples each step processed on this rank.  Nothing extra goes over the
ring: the heartbeat (:mod:`hvd_edl.heartbeat`) sends the sums since its previous beat
(``messages.Beat.steps_done / compute_s / wait_s / samples``) and the launcher keeps the windows
(``launcher/observe/telemetry.py``).

The split of a step into compute and wait is what EDL's straggler detection reads (a slow worker
waits little, its peers wait for it: EDL, Wu et al., arXiv 1909.11985) and the throughput
CM-DARE's speed models are fitted on (Li, Walls and Guo, arXiv 2004.03072).

Cost: two ``time.perf_counter()`` calls per step and two per timed collective, one tuple
assignment per step; no lock: the training thread is the only writer, and the heartbeat thread
reads a tuple that is replaced whole (an atomic reference swap in CPython).
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Optional, Tuple

_clock = time.perf_counter


class StepTimer:
    """Cumulative step timing of this process (written by the training thread only).

    ``totals``: ``(steps, compute_s, wait_s)`` over every timed step since the process started
    (seconds); ``samples``: samples the samplers recorded on this rank.  :meth:`take` (the
    heartbeat thread) returns what was added since its previous call.
    """

    def __init__(self):
        self.totals: Tuple[int, float, float] = (0, 0.0, 0.0)
        self.samples = 0
        self._since = None     # perf_counter() of the last step's end, or of a (re)start
        self._wait_s = 0.0     # seconds waited in collectives since _since
        self._sent = (0, 0.0, 0.0, 0)
        self.depth = 0         # timed waits entered and not left (a wait inside one is not added)

    def restart(self) -> None:
        """The next step's time counts from now (the user's function was (re-)entered: a switch,
        a restore or the job's start is not part of any step)."""
        self._since = _clock()
        self._wait_s = 0.0

    def add_wait(self, seconds: float) -> None:
        """``seconds`` of the current step spent blocked in a collective."""
        self._wait_s += seconds

    def step_end(self) -> None:
        """An optimizer step ended now.  The first step after process start without a
        :meth:`restart` (a script that does not use ``hvd.elastic.run``) is not timed."""
        now = _clock()
        since = self._since
        if since is not None:
            step_s = now - since
            wait_s = min(self._wait_s, step_s)
            steps, compute, wait = self.totals
            self.totals = (steps + 1, compute + step_s - wait_s, wait + wait_s)
        self._since = now
        self._wait_s = 0.0

    def add_samples(self, n: int) -> None:
        """``n`` samples of this rank were processed (the samplers' ``record_batch``)."""
        self.samples += n

    def take(self) -> Tuple[Tuple[int, float, float, int], Tuple[int, float, float, int]]:
        """``(mark, (steps, compute_s, wait_s, samples))``: what was added since the last
        :meth:`sent` mark (one caller: the heartbeat thread; a beat that got no answer is
        sent again with the next one's)."""
        steps, compute, wait = self.totals
        mark = (steps, compute, wait, self.samples)
        s0, c0, w0, n0 = self._sent
        return mark, (steps - s0, compute - c0, wait - w0, mark[3] - n0)

    def sent(self, mark: Tuple[int, float, float, int]) -> None:
        """The figures up to ``mark`` (from :meth:`take`) reached the launcher."""
        self._sent = mark


_timer: Optional[StepTimer] = None


def install(t: StepTimer) -> None:
    """Make ``t`` this process's timer: the runtime's, once ``hvd.init()`` started it under
    ``hvd-edl-run`` (:func:`hvd_edl.runtime.start`)."""
    global _timer
    _timer = t


def timer() -> Optional[StepTimer]:
    """This process's :class:`StepTimer`, or None outside ``hvd-edl-run``."""
    return _timer


def note_samples(n: int) -> None:
    """Count ``n`` samples processed by this rank (no-op outside ``hvd-edl-run``)."""
    t = timer()
    if t is not None:
        t.add_samples(n)


@contextlib.contextmanager
def waiting():
    """The block's duration counts as this step's wait (a blocking collective, the switch
    agreement, a state sync); nested in another timed wait it adds nothing (counted once).
    No-op outside ``hvd-edl-run``."""
    t = timer()
    if t is None or t.depth:
        yield
        return
    t.depth += 1
    t0 = _clock()
    try:
        yield
    finally:
        t.depth -= 1
        t.add_wait(_clock() - t0)


def timed_wait(fn: Callable) -> Callable:
    """``fn`` (a blocking Horovod call) whose duration counts as this step's wait."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with waiting():
            return fn(*args, **kwargs)
    return wrapper
