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
  core (benchmarks/job/control_plane.py), so the beat period grows with the generation's size,
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
import time
from typing import Dict, Iterable, List, Optional

from hvd_edl import messages
from hvd_edl.messages import BEAT_S
from launcher.discovery.hosts import is_local
from launcher.job.registry import WorkerRecord, WorkerState
from launcher.spawn.process import SSH_FAILED

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

    def silent_for(self, members: Iterable[str], now: float, bound_s: float) -> List[str]:
        """Members whose last beat (or expectation) is more than ``bound_s`` seconds before
        ``now``, whether or not any other member beats (unknown members: none)."""
        with self._lock:
            return [w for w in members if w in self._last and now - self._last[w] > bound_s]

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


SILENCE_CHECK_S = 0.1  # the members' silence is checked at most this often (on a beat)
END_SILENT_S = 30.0  # once training finished, a member this long silent is killed (seconds): its
                     # script's last lines and teardown beat from their own thread; a frozen or
                     # vanished member must not hold the job's end for ever


class MemberLiveness:
    """The coordinator's side of liveness (one part of :class:`launcher.job.coordinator.
    Coordinator`): each ``POST /beat`` is noted in its :class:`LivenessMonitor` and, at most
    every ``SILENCE_CHECK_S``, the members silent too long are declared dead and fenced; a lost
    member's peers are released (their next beat's answer says so) and its rendezvous sealed."""

    def _member_lost(self, rec: WorkerRecord) -> None:
        """A member of the current generation is gone (lock held): its peers are released (their
        next heartbeat answer says so) and its rendezvous refuses further requests, so that a
        ring set-up waiting on it fails in seconds (see launcher/job/liveness.py)."""
        g = self.current
        if g is not None and rec.worker_id in g.members and self.first_loss is None:
            self.first_loss = rec.worker_id
        if g is not None and rec.worker_id in g.members and g.number not in self.released:
            self.released.add(g.number)
            self.rendezvous.abort(g.number)

    def beat(self, msg: messages.Beat) -> messages.BeatReply:
        """A worker's heartbeat: note it, and declare dead the members of the current generation
        that fell silent while a peer beat (``launcher.job.liveness``); answer whether this worker
        was fenced and whether its generation lost a member."""
        now = time.monotonic()
        silent: List[tuple] = []
        end_silent: List[WorkerRecord] = []
        with self.cond:
            rec = self._worker(msg.worker_id)
            if rec.fenced or rec.state == WorkerState.DEAD:
                return messages.BeatReply(fenced=True)
            self.liveness.beat(rec.worker_id, now)
            g = self.current
            if g is not None and msg.generation == g.number and msg.step > self._beat_step:
                self._beat_step = msg.step
            if g is not None and self.elastic and not self.stopping \
                    and now - self._silence_checked_at >= SILENCE_CHECK_S:
                # one scan of the members per SILENCE_CHECK_S, not one per beat (N beats
                # each scanning N members would grow as N^2 with the job)
                self._silence_checked_at = now
                # a member whose interpreter is ending (messages.Exiting) is not a silent one
                live = [w for w in g.members if self.workers[w].state.alive
                        and not self.workers[w].exiting]
                if not self.finishing:
                    for w in self.liveness.silent(live, now):
                        silent.append((self._fence(self.workers[w]), now))
                else:
                    # training is over: a member busy with the script's last lines or its
                    # interpreter's teardown is not a failure; one silent for END_SILENT_S
                    # (frozen, its host gone) would hold the job's end forever: killed
                    for w in self.liveness.silent(live, now, bound_s=END_SILENT_S):
                        if w not in self.ended_silent:
                            self.ended_silent.add(w)
                            self.liveness.forget(w)
                            end_silent.append(self.workers[w])
            reply = messages.BeatReply(release=msg.generation in self.released,
                                       beat_s=self.liveness.period_s)
        self.telemetry.observe(msg.worker_id, msg.generation, now, msg.steps_done,
                               msg.compute_s, msg.wait_s, msg.samples, step=msg.step)
        self.telemetry.note_statistics(msg.worker_id, msg.noise, msg.batch)
        for fenced_rec, at in silent:
            self.on_fence(fenced_rec, self.liveness.silent_after_s)
        for quiet in end_silent:
            self.on_end_silent(quiet, END_SILENT_S)
        return reply

    def _fence(self, rec: WorkerRecord) -> WorkerRecord:
        """Declare a silent member dead (lock held): it is never a member again (its requests are
        answered "exit" or "fenced"), its generation is released and re-formed without it."""
        rec.fenced = True
        rec.fence_pending = True  # until the driver rests its slot (Driver._on_fence)
        self._move(rec, WorkerState.DEAD)
        self.departures += 1
        self._member_lost(rec)
        self.liveness.forget(rec.worker_id)
        self._try_form()
        self.cond.notify_all()
        return rec

    def fence_host(self, host: str, but: str = "") -> List[WorkerRecord]:
        """Declare every live worker on ``host`` other than ``but`` dead now (its host was
        blacklisted: ``--failure-blacklist host``, Horovod's rule, where the blacklisted host's
        processes are stopped): never a member again, their generation released and re-formed
        without them, their exits no failures.  Returns them (the driver kills them)."""
        with self.cond:
            return [self._fence(w) for w in list(self.workers.values())
                    if w.host == host and w.worker_id != but and w.state.alive
                    and not w.fenced]

    def _check_script_failure(self, rec: WorkerRecord) -> None:
        """End the job when every member of the current generation has died and at least one
        ended with an exit status > 0 (an error of the script itself, not a signal): nobody
        holds the committed state, and a new ring would start the script over from its
        initial state, only to fail the same way (Horovod's expectation for "all ranks
        failing" is a failed job; issue 13).  Members killed by signals (a revoked VM, an OOM
        kill) do not end the job here, nor a remote member whose ssh session was lost (ssh's
        exit status 255: its host revoked or cut off, the script's own status unknown); see
        ``STATE_LOST_LIMIT``."""
        g = self.current
        if g is None or not self.elastic or rec.worker_id not in g.members:
            return
        members = [self.workers[w] for w in g.members]
        if any(w.state.alive for w in members):
            return
        # the generation's first loss decides: an error of the script (exit status > 0), not
        # a member killed or fenced first whose peers then failed in its wake
        culprit = self.workers.get(self.first_loss or "")
        if culprit is None or culprit.fenced or (culprit.exit_code or 0) <= 0:
            return
        if culprit.exit_code == SSH_FAILED and not is_local(culprit.host):
            return  # ssh's own status: its session was lost (a host revoked or cut off)
        self.failed_worker = culprit.worker_id
        self.failure = (f"every worker of generation {g.number} failed, the first with exit "
                        f"code {culprit.exit_code} (rank {culprit.rank} on host {culprit.host}, "
                        f"{culprit.label}): no worker holds the committed state, and restarting "
                        f"the script from its initial state would fail the same way")
