"""Where a silent peer is detected: the coordinator's view of its members' heartbeats.

On one host a dead process's sockets answer with a reset at once; a revoked VM, a frozen process
(SIGSTOP) or a host cut off by a partition sends nothing, and its peers would block inside a Gloo
collective until Gloo's timeout (30 s), then in the switch.  Liveness therefore comes from what
the coordinator can see: every worker's heartbeat thread sends ``POST /beat`` every
:data:`hvd_edl.messages.BEAT_S` seconds, off the training thread, so a worker that computes a long
step, syncs 100 MB or waits in a collective still beats, and one that is frozen or cut off does
not.  The decision is taken in one place (here, read by the coordinator): a member is declared
dead when it has been silent for ``silent_after_s`` while at least one other member of its
generation beat within that time (its peers are alive and may be waiting on it).  The
coordinator then fences it (never a member again), the driver kills it where it can, and the
survivors, told by their next beat's answer, shut their ring's sockets down, which turns the
blocked collective or ring set-up into the failure Horovod already recovers from.

Bounds, and how detection time trades against false alarms (defaults):

* ``BEAT_S`` = 0.3 s between beats; ``SILENT_AFTER_S`` = 1.5 s of silence (5 missed beats).
  A member that stops is declared dead 1.2-1.9 s later; the survivors train again about half a
  second after that (shutdown, the next ring's set-up, sync), within the 3 s goal.
* A false alarm needs a worker process whose heartbeat thread cannot run for 1.5 s: the Python
  GIL held that long (cloudpickle of a 100 MB state takes a fraction of a second) or a machine so
  overloaded that a runnable thread waits 1.5 s.  It costs one rollback to the last commit.
* The launcher's own starvation is not taken for silence: when no beat at all reached the
  coordinator for ``STARVED_S`` (its process did not run, or every member was cut off), the
  silence clocks restart from the next beat instead of condemning every member at once.
* Torch's ``DynamicRendezvousHandler`` beats every 5 s and declares a node dead after 3 missed
  beats (15 s); Horovod Elastic has no liveness of its own and waits for Gloo's 30 s timeout.

* Large jobs: one Python process answers about a thousand beats per second with a tenth of a
  core (benchmarks/control_plane.py), so the beat period grows with the generation's size,
  ``max(BEAT_S, size / MAX_BEATS_PER_S)`` (1.02 s at 1,024 members), and each worker learns it
  from its beats' answers (``BeatReply.beat_s``); silence is then declared after
  ``max(SILENT_AFTER_S, SILENT_BEATS x period)`` (5.1 s at 1,024: detection in 4.1-6.1 s), so the
  launcher's cost stays bounded as the job grows, as a large system's leader leases do.  After a
  generation shrinks, the longer bound holds for two old periods (workers still beat at the old
  period until their next answer).

``HVD_EDL_SILENT_AFTER_S`` overrides the silence bound in the launcher's environment,
``HVD_EDL_MAX_BEATS_PER_S`` the beat budget.
"""
from __future__ import annotations

import os
import threading
from typing import Dict, Iterable, List, Optional

from hvd_edl.messages import BEAT_S

SILENT_AFTER_S = float(os.environ.get("HVD_EDL_SILENT_AFTER_S", "1.5"))
STARVED_S = 1.0  # no beat from anyone this long: the launcher was starved, restart the clocks
MAX_BEATS_PER_S = float(os.environ.get("HVD_EDL_MAX_BEATS_PER_S", "1000"))
SILENT_BEATS = 5  # missed beats (at the grown period) before a member is declared dead


def beat_period_s(members: int, max_beats_per_s: float = MAX_BEATS_PER_S) -> float:
    """Seconds between each worker's beats for a generation of ``members``: ``BEAT_S``, longer
    when ``members`` beats would exceed ``max_beats_per_s`` beats per second in all."""
    return max(BEAT_S, members / max_beats_per_s)


class LivenessMonitor:
    """Last heartbeat time (monotonic seconds) of each worker, and who is silent.

    Args:
        silent_after_s: seconds of silence after which a member is declared dead (> BEAT_S).

    Raises:
        ValueError: ``silent_after_s`` not larger than two beat periods.
    """

    def __init__(self, silent_after_s: float = SILENT_AFTER_S):
        if silent_after_s <= 2 * BEAT_S:
            raise ValueError(f"silent_after_s must exceed 2 x BEAT_S ({2 * BEAT_S} s), got "
                             f"{silent_after_s}")
        self.base_silent_after_s = silent_after_s
        self.silent_after_s = silent_after_s
        self.period_s = BEAT_S                # the beat period the workers are told
        self._previous_period_s = BEAT_S
        self._period_changed_at = float("-inf")
        self._last: Dict[str, float] = {}
        self._any_beat_at: float = float("-inf")
        self._lock = threading.Lock()

    def beat(self, worker_id: str, now: float) -> None:
        """Record a heartbeat of ``worker_id`` at ``now``."""
        with self._lock:
            if now - self._any_beat_at > STARVED_S:
                # nothing reached us for a while: our own stall, or a partition of everyone;
                # nobody's silence counts from before it
                for w in self._last:
                    self._last[w] = max(self._last[w], now)
            self._any_beat_at = now
            self._last[worker_id] = now

    def expect(self, worker_id: str, now: float) -> None:
        """A worker became a member at ``now``: its silence counts from here at the earliest."""
        with self._lock:
            self._last[worker_id] = max(self._last.get(worker_id, now), now)

    def set_members(self, members: int, now: float) -> None:
        """A generation of ``members`` formed at ``now``: the beat period and the silence bound
        follow its size (see the module docstring)."""
        with self._lock:
            period = beat_period_s(members)
            if period != self.period_s:
                self._previous_period_s, self._period_changed_at = self.period_s, now
                self.period_s = period
            self._bound(now)

    def _bound(self, now: float) -> float:
        """The silence bound at ``now`` (lock held): the old period's while workers may still
        beat at it."""
        period = self.period_s
        if now - self._period_changed_at < 2 * self._previous_period_s:
            period = max(period, self._previous_period_s)
        self.silent_after_s = max(self.base_silent_after_s, SILENT_BEATS * period) \
            if period > BEAT_S else self.base_silent_after_s
        return self.silent_after_s

    def forget(self, worker_id: str) -> None:
        with self._lock:
            self._last.pop(worker_id, None)

    def silent(self, members: Iterable[str], now: float,
               bound_s: Optional[float] = None) -> List[str]:
        """Members silent for more than ``silent_after_s`` (or ``bound_s`` seconds, when given
        and longer) at ``now`` while at least one other member beat within ``silent_after_s``
        (a generation of one has no peer waiting on it: [])."""
        with self._lock:
            ages = {w: now - self._last.get(w, now) for w in members}
            fresh_bound = self._bound(now)
        bound = max(fresh_bound, bound_s or 0.0)
        fresh = [w for w, age in ages.items() if age <= fresh_bound]
        if not fresh:
            return []
        return [w for w, age in ages.items() if age > bound]
