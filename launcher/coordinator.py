"""The coordinator: generation-numbered membership and the HTTP API workers talk to.

A *generation* is one Horovod ring: a numbered, ordered member list (rank = position; older
members first, so rank 0 always holds the state).  Generation g+1 is formed when

* there is a reason: the first generation, a READY joiner and room under ``max_np``, a LEAVING
  member, or a member that died; and
* every live member of g has reported at the same step boundary (``POST /switch``), and
* at least ``min_np`` workers take part.

Members learn that a switch is wanted through ``POST /watch`` (a long poll their background
thread keeps open) and agree on the step boundary among themselves (one allreduce at commit).
All state lives under one lock; the HTTP handlers and the driver's loop call the methods below.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from hvd_edl import messages
from launcher.coordinator_server import CoordinatorServer  # noqa: F401 - served from here
from launcher.progress import ProgressBoard
from launcher.checkpoint_dir import CheckpointDirError
from launcher.events import EventLog, GenerationEvent
from launcher.liveness import LivenessMonitor
from launcher.registry import WorkerRecord, WorkerState
from launcher.rendezvous import GenerationRendezvous
from launcher.telemetry import Telemetry

log = logging.getLogger(__name__)

EVENT_REPORT_TIMEOUT_S = 30.0
WANTED_CACHE_S = 0.05  # longest the replies' "change wanted" is reused without a state change
SILENCE_CHECK_S = 0.1  # the members' silence is checked at most this often (on a beat)
END_SILENT_S = 30.0  # once training finished, a member this long silent is killed (seconds): its
                     # script's last lines and teardown beat from their own thread; a frozen or
                     # vanished member must not hold the job's end for ever
STATE_LOST_LIMIT = 3  # generations in a row a job may start without any holder of the state
                      # (from the initial state, or the same checkpoint again) after a failure


@dataclass
class Generation:
    """A formed generation and what is known of its switch."""
    number: int
    members: List[str]
    kind: str
    step: int
    rolled_back_steps: int
    formed_at: float
    previous_size: int
    continuing: List[str]
    member_labels: List[str] = field(default_factory=list)
    stalls: Dict[str, float] = field(default_factory=dict)
    phases: Dict[str, Dict[str, float]] = field(default_factory=dict)
    logged: bool = False
    state_lost: bool = False
    restored_from: str = ""   # the checkpoint its rank 0 resumes from (--checkpoint-dir)
    restored_step: int = -1


@dataclass(frozen=True)
class GenerationSummary:
    """One generation as the applications see it (a copy): ``stall_s`` is the longest pause of
    its continuing members (seconds; 0 until they reported)."""
    number: int
    kind: str
    members: Tuple[str, ...]
    logged: bool
    stall_s: float
    rolled_back_steps: int


@dataclass(frozen=True)
class RingSnapshot:
    """The membership at one instant, copied under the coordinator's lock (:meth:`Coordinator.
    ring`): what the applications (migration, stragglers, profiler, autoscaler) and the control
    API read instead of taking the lock.  ``generation`` 0: none formed yet.  ``logged``: the
    current generation's switch is over (every continuing member trained in it);
    ``at_boundary``: a member reached a step boundary for the next one; ``settled``:
    :meth:`Coordinator.settled`.  ``history``: the generations after the ``since`` asked for."""
    generation: int
    kind: str
    members: Tuple[str, ...]
    formed_at: float          # unix seconds
    logged: bool
    at_boundary: bool
    settled: bool
    finishing: bool
    failure: Optional[str]
    stopping: bool
    history: Tuple[GenerationSummary, ...] = ()

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def switch_over(self) -> bool:
        """Formed, its switch over, no member at a boundary for the next one."""
        return self.generation > 0 and self.logged and not self.at_boundary

    @property
    def job_over(self) -> bool:
        return bool(self.finishing or self.failure or self.stopping)


class NotifyingCondition(threading.Condition):
    """A condition whose ``notify_all`` also calls ``listeners`` (lock held): the HTTP server's
    long polls wait on its event loop, not in ``wait()`` on a thread each."""

    def __init__(self, lock):
        super().__init__(lock)
        self.listeners: List[Callable[[], None]] = []
        self.notifies = 0  # how many times the state changed (a cache's key)

    def notify_all(self) -> None:
        self.notifies += 1
        super().notify_all()
        for listener in self.listeners:
            listener()


class CountingDict(dict):
    """A dict that counts its writes (``serial``): pending ``/switch`` polls are checked again
    only when an assignment was written, not at every change of the coordinator."""
    serial = 0

    def __setitem__(self, key, value) -> None:
        self.serial += 1
        super().__setitem__(key, value)


@dataclass(eq=False)
class Poll:
    """One long poll (``/switch``, ``/watch``) as data, so a caller can wait for it without a
    thread of its own (``CoordinatorServer``) or block on the condition (:meth:`Coordinator.
    wait_poll`).  ``check()`` (lock held) answers the reply, or None while it must wait;
    ``timeout()`` (lock held) the reply at ``deadline`` (monotonic seconds).  Polls with the
    same ``group`` have the same answer at any moment (checked once for all); a ``/switch``
    poll's group is None: its answer changes only with ``Coordinator.poll_signature()``."""
    check: Callable[[], object]
    timeout: Callable[[], object]
    deadline: float
    group: Optional[tuple] = None
    answer: object = None   # the answer at creation, if there was one


class JobFailed(RuntimeError):
    """The job cannot go on (below --min-np for too long, reset limit); message says why."""


class Coordinator:
    """Membership state machine of one job.

    Args:
        min_np, max_np: bounds on the world size (workers).
        elastic: False for a static job (one generation, any failure ends the job).
        events: where generation events go.
        rendezvous: hands out a Gloo rendezvous per generation.
        rendezvous_addr: address workers use to reach it.
        reset_limit: most generation changes after the first (None: unlimited).
    """

    def __init__(self, *, min_np: int, max_np: int, elastic: bool, events: EventLog,
                 rendezvous: GenerationRendezvous, rendezvous_addr: str,
                 reset_limit: Optional[int] = None):
        self.min_np = min_np
        self.max_np = max_np
        self.elastic = elastic
        self.events = events
        self.rendezvous = rendezvous
        self.rendezvous_addr = rendezvous_addr
        self.reset_limit = reset_limit
        self.lock = threading.Lock()
        self.cond = NotifyingCondition(self.lock)
        self.workers: Dict[str, WorkerRecord] = {}
        self.current: Optional[Generation] = None
        self.history: List[Generation] = []
        self.reports: Dict[str, messages.SwitchRequest] = {}
        self.first_report_at: Optional[float] = None
        self.assignments: Dict[str, messages.Assignment] = CountingDict()
        self.departures = 0  # workers that exited or were fenced (a /switch poll's answer)
        self._reported_upto = 0  # members of the current generation [0, this) need no report
        self._wanted_cache = (None, 0.0, False)  # (key, when, _change_wanted()) for the replies
        # workers in state READY (kept by _move): a scan of every worker per _ready() call grew
        # as N^2 per switch (1,024 workers: benchmarks/control_plane.py)
        self._ready_ids: set = set()
        self.finishing = False
        self.stopping = False  # the launcher is terminating every worker (SIGTERM means die)
        self.failure: Optional[str] = None
        self.failed_worker: Optional[str] = None  # whose exit code the job ends with
        self.first_loss: Optional[str] = None  # the current generation's first member lost
        self.state_lost_restarts = 0  # in a row, without a newer checkpoint to resume from
        self.last_restore = ""  # the checkpoint the last resumed generation started from
        self.liveness = LivenessMonitor()
        self._silence_checked_at = float("-inf")
        self.released: set = set()  # generations a member of which was declared dead or died
        self.on_fence: Callable[[WorkerRecord, float], None] = lambda rec, silent_s: None
        # after training finished: members silent for END_SILENT_S, handed to on_end_silent
        # (the driver kills them; not a failure of the job)
        self.ended_silent: set = set()
        self.on_end_silent: Callable[[WorkerRecord, float], None] = lambda rec, silent_s: None
        self._beat_step = -1  # see _last_reported_step
        self.progress = ProgressBoard()  # steps / epoch / samples the watchers report
        self.telemetry = Telemetry()  # step / compute / wait times the heartbeats carry
        # --checkpoint-dir (a launcher.checkpoint_dir.CheckpointDir; None: no checkpoints) and
        # how many checkpoints hvd-edl-ctl asked for (the watchers' replies carry it)
        self.checkpoints = None
        self.checkpoint_request = 0
        # workers held back from joining (a migration's or a straggler replacement's new
        # workers, launcher/migration.py): pending or ready, not counted as ready until
        # swap() releases them in the same switch as the workers they replace
        self.reserved: set = set()

    # ---- driver side ---------------------------------------------------------------------------

    def add_worker(self, rec: WorkerRecord) -> None:
        with self.cond:
            self.workers[rec.worker_id] = rec
            if rec.state == WorkerState.READY:
                self._ready_ids.add(rec.worker_id)
        self.telemetry.add_worker(rec.worker_id, rec.host, rec.slot)

    def live_workers(self) -> List[WorkerRecord]:
        with self.lock:
            return [w for w in self.workers.values() if w.state.alive]

    def on_exit(self, worker_id: str, code: int) -> str:
        """A worker process ended with ``code`` (negative: killed by that signal).

        Returns what its end means for the job, for the driver's line: "finished" (training is
        over), "left" (a member whose script entered ``hvd.elastic.run`` exited 0 before its
        training function returned: a leave, its peers go on without it; issue 26), or ""."""
        verdict = ""
        with self.cond:
            rec = self.workers[worker_id]
            was = rec.state
            rec.exit_code = code
            self.departures += 1
            in_ring = self.current is not None and worker_id in self.current.members
            if code == 0:
                self._move(rec, WorkerState.EXITED)
                if rec.finished:
                    # its training function returned (messages.Finished): training is over.  A
                    # leaver that trained on as the last holder of the state until its
                    # replacement was ready ends here too, if its script finished meanwhile
                    self.finishing = True
                    verdict = "finished"
                elif self.finishing:
                    verdict = "finished"  # training is over: every exit 0 is its end
                elif was in (WorkerState.MEMBER, WorkerState.LEAVING) and in_ring:
                    released = self.assignments.get(worker_id)
                    if released is not None and released.action == "exit":
                        pass  # a leaver released through the protocol (below --min-np)
                    elif self.elastic and rec.elastic_run:
                        # exit 0 inside the training function (sys.exit(0) at step 58 of 333):
                        # not the end of training, whose data would go untrained; a leave,
                        # without notice: its peers are released and go on without it
                        self._member_lost(rec)
                        verdict = "left"
                    else:
                        # a script without hvd.elastic.run (or a static job): its end is the
                        # job's end, as under horovodrun
                        self.finishing = True
                        verdict = "finished"
                elif was in (WorkerState.PENDING, WorkerState.READY) and self.current is None:
                    # the script ended successfully without ever joining a ring (nothing to
                    # train): the job is over, as under horovodrun; do not respawn it forever
                    self.finishing = True
                    verdict = "finished"
            else:
                fenced = rec.fenced
                self._move(rec, WorkerState.DEAD)
                if not fenced:
                    self._member_lost(rec)
                    self._check_script_failure(rec)
            self._log_if_started(self.current)
            self._try_form()
            self.cond.notify_all()
        self.telemetry.forget(worker_id)
        return verdict

    def finished(self, msg: messages.Finished) -> messages.WatchReply:
        """``POST /finished``: ``msg.worker_id``'s training function returned: training is over.
        No generation forms after this (a peer whose collective fails now is told "exit" at its
        step boundary instead of re-running the script's last steps), and no member is declared
        dead for its silence, only killed after ``END_SILENT_S`` of it (see :meth:`beat`)."""
        with self.cond:
            rec = self._worker(msg.worker_id)
            if rec.state.alive and not rec.fenced:
                rec.finished = True
                if not self.finishing:
                    log.info("%s: training function returned at step %d (generation %d): "
                             "the job is finishing", rec.label, msg.step, msg.generation)
                self.finishing = True
                self.cond.notify_all()
            return self._watch_reply(msg.generation)

    def _member_lost(self, rec: WorkerRecord) -> None:
        """A member of the current generation is gone (lock held): its peers are released (their
        next heartbeat answer says so) and its rendezvous refuses further requests, so that a
        ring set-up waiting on it fails in seconds (see launcher/liveness.py)."""
        g = self.current
        if g is not None and rec.worker_id in g.members and self.first_loss is None:
            self.first_loss = rec.worker_id
        if g is not None and rec.worker_id in g.members and g.number not in self.released:
            self.released.add(g.number)
            self.rendezvous.abort(g.number)

    def beat(self, msg: messages.Beat) -> messages.BeatReply:
        """A worker's heartbeat: note it, and declare dead the members of the current generation
        that fell silent while a peer beat (``launcher.liveness``); answer whether this worker
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
                live = [w for w in g.members if self.workers[w].state.alive]
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
        for fenced_rec, at in silent:
            self.on_fence(fenced_rec, self.liveness.silent_after_s)
        for quiet in end_silent:
            self.on_end_silent(quiet, END_SILENT_S)
        return reply

    def _fence(self, rec: WorkerRecord) -> WorkerRecord:
        """Declare a silent member dead (lock held): it is never a member again (its requests are
        answered "exit" or "fenced"), its generation is released and re-formed without it."""
        rec.fenced = True
        self._move(rec, WorkerState.DEAD)
        self.departures += 1
        self._member_lost(rec)
        self.liveness.forget(rec.worker_id)
        self._try_form()
        self.cond.notify_all()
        return rec

    def _check_script_failure(self, rec: WorkerRecord) -> None:
        """End the job when every member of the current generation has died and at least one
        ended with an exit status > 0 (an error of the script itself, not a signal): nobody
        holds the committed state, and a new ring would start the script over from its
        initial state, only to fail the same way (Horovod's expectation for "all ranks
        failing" is a failed job; issue 13).  Members killed by signals (a revoked VM, an OOM
        kill) do not end the job here; see ``STATE_LOST_LIMIT``."""
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
        self.failed_worker = culprit.worker_id
        self.failure = (f"every worker of generation {g.number} failed, the first with exit "
                        f"code {culprit.exit_code} (rank {culprit.rank} on host {culprit.host}, "
                        f"{culprit.label}): no worker holds the committed state, and restarting "
                        f"the script from its initial state would fail the same way")

    def request_leave(self, worker_id: str) -> bool:
        """Ask a worker to leave gracefully (scale-in).  A member leaves at the next step
        boundary; a worker not yet in a ring is told to exit at once.  Returns True when the
        worker is not a member (the driver may terminate it right away)."""
        with self.cond:
            not_member = self._leave_locked(worker_id)
            self._try_form()
            self.cond.notify_all()
            return not_member

    def _leave_locked(self, worker_id: str) -> bool:
        """:meth:`request_leave` without forming (lock held)."""
        rec = self.workers[worker_id]
        if rec.state not in (WorkerState.PENDING, WorkerState.READY, WorkerState.MEMBER):
            return False
        is_member = self.current is not None and worker_id in self.current.members
        self._move(rec, WorkerState.LEAVING)
        if not is_member:
            self.assignments[worker_id] = messages.Assignment(action="exit",
                                                              reason="scaled in")
        return not is_member

    def reserve(self, worker_id: str) -> None:
        """Hold ``worker_id`` back: it builds and reports ready, but no generation takes it in
        until :meth:`swap` (or :meth:`unreserve`) releases it.  Call before the process starts."""
        with self.cond:
            self.reserved.add(worker_id)

    def unreserve(self, worker_id: str) -> None:
        """Release a reserved worker as an ordinary joiner (or forget a gone one)."""
        with self.cond:
            self.reserved.discard(worker_id)
            self._try_form()
            self.cond.notify_all()

    def swap(self, leavers: List[str], joiners: List[str]) -> List[str]:
        """One stop-free switch in which ``leavers`` leave and the reserved ``joiners`` join
        (EDL's job migration and straggler replacement, arXiv 1909.11985 section 5): under one
        lock hold, the leavers are asked to leave (members at the next step boundary) and the
        joiners released, so the coordinator forms a single generation with both changes
        (kind "replace" when as many join as leave).  Returns the leavers that were not
        members (the driver terminates them)."""
        with self.cond:
            gone = [w for w in leavers if self._leave_locked(w)]
            self.reserved.difference_update(joiners)
            self._try_form()
            self.cond.notify_all()
            return gone

    def leave(self, msg: messages.Leave) -> messages.Assignment:
        """A worker asks to leave on its own (it got SIGTERM after reporting ready).  Answers
        "wait": it is told to exit through the protocol (a member at the next step boundary,
        nothing rolled back; a worker not in a ring in its pending ``/switch``); or "exit": die
        now (the launcher is stopping the job, or the worker is already gone)."""
        rec = self._worker(msg.worker_id)  # unknown ids are refused like elsewhere
        if self.stopping:
            return messages.Assignment(action="exit", reason="the job is stopping")
        self.request_leave(msg.worker_id)
        if rec.state in (WorkerState.EXITED, WorkerState.DEAD):
            return messages.Assignment(action="exit", reason=f"worker is {rec.state.name}")
        return messages.Assignment(action="wait", reason="leaving through the protocol")

    def tick(self, now: float) -> None:
        """Periodic checks: finalise generation events whose reports are overdue; wake the
        watchers while joiners are ready (a joiner batch's wait, ``JOIN_BATCH_S``, may end)."""
        with self.cond:
            if self._ready():
                self.cond.notify_all()
            g = self.current
            if g is not None and not g.logged \
                    and time.time() - g.formed_at > EVENT_REPORT_TIMEOUT_S:  # formed_at: wall
                self._log_event(g)
            self._try_form()

    def settled(self) -> bool:
        """True while nothing is in flight: every live worker is a member of the current
        generation, that generation's switch is over (its event logged) and no member has
        reached a step boundary for the next one.  The driver then needs no periodic pass
        (see ``driver.IDLE_LOOP_S``)."""
        with self.lock:
            return self._settled()

    def _settled(self) -> bool:
        g = self.current
        if g is None or not g.logged or self.reports or self.finishing or self.failure:
            return False
        members = set(g.members)
        return all(w.state == WorkerState.MEMBER and w.worker_id in members
                   for w in self.workers.values() if w.state.alive)

    def ring(self, since: Optional[int] = None) -> RingSnapshot:
        """The membership now, as a :class:`RingSnapshot` (with the generations numbered above
        ``since`` in ``history`` when given)."""
        with self.lock:
            g = self.current
            history = () if since is None else tuple(
                GenerationSummary(h.number, h.kind, tuple(h.members), h.logged,
                                  round(max((h.stalls.get(w, 0.0) for w in h.continuing),
                                            default=0.0), 4), h.rolled_back_steps)
                for h in self.history if h.number > since)
            return RingSnapshot(
                generation=g.number if g else 0, kind=g.kind if g else "",
                members=tuple(g.members) if g else (), formed_at=g.formed_at if g else 0.0,
                logged=bool(g and g.logged), at_boundary=bool(self.reports),
                settled=self._settled(), finishing=self.finishing, failure=self.failure,
                stopping=self.stopping, history=history)

    def rank0_progress(self):
        """Rank 0's last progress report (``launcher.progress``: ``at``, ``step``, ``samples``),
        None before any."""
        with self.lock:
            g = self.current
            return self.progress.latest.get(g.members[0]) if g is not None else None

    def overdue_reporters(self, now: float, timeout_s: float) -> List[WorkerRecord]:
        """Live members that have not reached the step boundary ``timeout_s`` seconds after the
        first member did (stuck; the driver kills them)."""
        with self.lock:
            if self.first_report_at is None or now - self.first_report_at < timeout_s:
                return []
            return [self.workers[w] for w in self._live_members() if w not in self.reports]

    def usable_count(self) -> int:
        """Workers that are or can become members (pending, ready or member, not leaving)."""
        with self.lock:
            return sum(1 for w in self.workers.values() if w.state in (
                WorkerState.PENDING, WorkerState.READY, WorkerState.MEMBER))

    def snapshot(self) -> dict:
        """What ``hvd-edl-ctl status`` shows, as a JSON-ready dict: the current generation
        (number, world size, the step it formed at), the last switch's stall (seconds, None
        before the first change) and every live worker (id, host, slot, state, rank)."""
        with self.lock:
            g = self.current
            last = next((h for h in reversed(self.history) if h.kind != "start" and h.logged),
                        None)
            members = set(g.members) if g else set()
            workers = sorted((w for w in self.workers.values() if w.state.alive),
                             key=lambda w: w.order)
            return {
                "generation": g.number if g else 0,
                "world_size": len(g.members) if g else 0,
                "step": g.step if g else 0,
                "last_change": None if last is None else {
                    "generation": last.number, "kind": last.kind,
                    "stall_s": round(max((last.stalls.get(w, 0.0) for w in last.continuing),
                                         default=0.0), 4)},
                "workers": [{"worker_id": w.worker_id, "host": w.host, "slot": w.slot,
                             "state": w.state.value,
                             "rank": w.rank if w.worker_id in members else None}
                            for w in workers],
                "finishing": self.finishing,
                # rank 0's last report (step, epoch, samples, rates); seconds since the
                # current generation formed
                "progress": self.progress.summary(g.members[0] if g else None,
                                                  time.monotonic()),
                "since_change_s": round(time.time() - g.formed_at, 1) if g else None,
            }

    # ---- worker side (HTTP) --------------------------------------------------------------------

    def provisional(self, worker_id: str, initial_np: int = 0) -> Tuple[int, int]:
        """(rank, size) a worker would have if the next generation formed now: before the first
        generation, its place among the workers not leaving by spawn order (``initial_np``:
        how many are being started, when the caller knows it before all are added); later,
        after the staying members and the joiners spawned before it.  What ``HOROVOD_RANK/SIZE`` say before the worker joins."""
        with self.lock:
            rec = self._worker(worker_id)
            if self.current is None:  # every worker not leaving, by spawn order
                waiting = sorted((w for w in self.workers.values() if w is rec or w.state in (
                    WorkerState.PENDING, WorkerState.READY)), key=lambda w: w.order)
                size = max(len(waiting), initial_np, 1)
                prov_rank = next((i for i, w in enumerate(waiting) if w is rec), 0)
            else:  # after the staying members and the joiners spawned before it
                staying = [w for w in self.current.members
                           if self.workers[w].state == WorkerState.MEMBER]
                earlier = [w for w in self.workers.values() if w.order < rec.order
                           and w.state in (WorkerState.PENDING, WorkerState.READY)]
                size = len(staying) + len(earlier) + 1
                prov_rank = size - 1
            return prov_rank, min(size, self.max_np)

    def register(self, msg: messages.Register) -> messages.Registered:
        prov_rank, size = self.provisional(msg.worker_id)
        with self.cond:
            rec = self._worker(msg.worker_id)
            return messages.Registered(rec.worker_id, rec.host, rec.slot, prov_rank, size,
                                       self.current.number if self.current else 0)

    def ready(self, msg: messages.Ready) -> messages.WatchReply:
        with self.cond:
            rec = self._worker(msg.worker_id)
            rec.elastic_run = rec.elastic_run or bool(msg.elastic_run)
            if rec.state == WorkerState.PENDING:
                self._move(rec, WorkerState.READY)
                rec.ready_at = time.monotonic()
            self._try_form()
            self.cond.notify_all()
            return self._watch_reply(0)

    def switch(self, msg: messages.SwitchRequest) -> messages.Assignment:
        """Long poll: record that the worker is at a step boundary; answer its next assignment."""
        return self.wait_poll(self.poll_switch(msg))

    def poll_switch(self, msg: messages.SwitchRequest) -> Poll:
        """:meth:`switch` without the wait: the report is recorded now (a generation may form);
        the :class:`Poll` answers the worker's next assignment ("wait" at its deadline)."""
        deadline = time.monotonic() + min(max(msg.wait_s, 0.0), 30.0)
        with self.cond:
            rec = self._worker(msg.worker_id)
            if self.current is not None and msg.generation == self.current.number \
                    and msg.worker_id in self.current.members:
                self.reports[msg.worker_id] = msg
                if self.first_report_at is None:
                    self.first_report_at = time.monotonic()
                self._try_form()  # forming notifies the waiters; a mere report changes nothing

            def check():
                a = self.assignments.get(msg.worker_id)
                if a is not None and (a.action == "exit" or a.generation > msg.generation):
                    return a
                if self.finishing or self.failure or not rec.state.alive:
                    return messages.Assignment(action="exit", reason="the job is over")
                return None
            return Poll(check, lambda: messages.Assignment(action="wait"), deadline,
                        answer=check())

    def poll_signature(self) -> tuple:
        """What a pending ``/switch`` poll's answer depends on besides its own worker (lock
        held): the assignments written, the job's end, departures."""
        return (self.assignments.serial, self.finishing, self.failure is not None,
                self.stopping, self.departures)

    def wait_poll(self, poll: Poll):
        """Block (on the condition) until ``poll`` answers or its deadline passes."""
        with self.cond:
            while True:
                reply = poll.check()
                if reply is not None:
                    return reply
                left = poll.deadline - time.monotonic()
                if left <= 0:
                    return poll.timeout()
                self.cond.wait(left)

    def started(self, msg: messages.Started) -> messages.WatchReply:
        with self.cond:
            g = self.current
            if g is not None and g.number == msg.generation and msg.worker_id in g.continuing:
                g.stalls[msg.worker_id] = float(msg.stall_s)
                if isinstance(msg.phases, dict):
                    g.phases[msg.worker_id] = {str(k): round(float(v), 4)
                                               for k, v in msg.phases.items()
                                               if isinstance(v, (int, float))}
                if self._log_if_started(g):
                    self.cond.notify_all()  # leavers waiting for this generation to train
            return self._watch_reply(msg.generation)

    def watch(self, msg: messages.WatchRequest) -> messages.WatchReply:
        """Long poll: answer as soon as a switch is wanted after ``msg.generation``."""
        return self.wait_poll(self.poll_watch(msg))

    def poll_watch(self, msg: messages.WatchRequest) -> Poll:
        """:meth:`watch` without the wait: the progress is recorded now; the :class:`Poll`
        answers when a switch is wanted (with ``until_started``: when the generation trains or
        is over), the reply as it stands at its deadline."""
        deadline = time.monotonic() + min(max(msg.wait_s, 0.0), 30.0)
        with self.cond:
            self.progress.record(msg.worker_id, msg.step, msg.epoch, msg.samples,
                                 time.monotonic())
            if self.progress.waiting:
                self.cond.notify_all()  # a status waits for fresh reports
            asks = self.progress.asks

            def timeout():
                return self._watch_reply(msg.generation)

            if msg.until_started:
                def check():
                    g = self.current
                    if g is None or g.number != msg.generation or g.logged \
                            or self.finishing or self.failure or self.stopping:
                        return self._watch_reply(msg.generation)
                    return None
                group = ("until_started", msg.generation)
            else:
                def check():
                    reply = self._watch_reply(msg.generation)
                    if reply.change_pending or reply.latest_generation != msg.generation \
                            or self.progress.asks != asks:  # a status: ask again, fresh figures
                        return reply
                    return None
                group = ("watch", msg.generation, asks)
            return Poll(check, timeout, deadline, group, answer=check())

    def request_checkpoint(self) -> int:
        """``hvd-edl-ctl checkpoint``: rank 0 writes one at its next commit (the open
        ``/watch`` polls answer now, carrying the new count).  Returns the request's number."""
        with self.cond:
            self.checkpoint_request += 1
            self.progress.ask(time.monotonic())
            self.cond.notify_all()
            return self.checkpoint_request

    def fresh_progress(self, wait_s: float = 0.5) -> None:
        """Have every member of the current generation report its progress now (their open
        ``/watch`` polls are answered and come back with fresh figures); returns when all did
        or after ``wait_s`` seconds (a member in a switch or a long step does not poll)."""
        with self.cond:
            now = time.monotonic()
            self.progress.ask(now)
            self.progress.waiting += 1
            try:
                self.cond.notify_all()
                deadline = now + wait_s
                while self.current is not None and \
                        not self.progress.fresh(self._live_members(), now):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.cond.wait(left)
            finally:
                self.progress.waiting -= 1

    # ---- internals (lock held) -----------------------------------------------------------------

    def _worker(self, worker_id: str) -> WorkerRecord:
        rec = self.workers.get(worker_id)
        if rec is None:
            raise KeyError(f"unknown worker {worker_id!r}")
        return rec

    def _live_members(self) -> List[str]:
        if self.current is None:
            return []
        return [w for w in self.current.members if self.workers[w].state in (
            WorkerState.MEMBER, WorkerState.LEAVING)]

    def _all_reported(self) -> bool:
        """Whether every live member of the current generation reported at the step boundary
        (lock held).  Amortised O(1) per report: reports are only added within a generation
        and members only die, so the members before ``_reported_upto`` never need another
        look (a scan per report grew as N^2 per switch with the job)."""
        members = self.current.members
        i = self._reported_upto
        while i < len(members):
            w = members[i]
            if w not in self.reports and self.workers[w].state in (WorkerState.MEMBER,
                                                                   WorkerState.LEAVING):
                break
            i += 1
        self._reported_upto = i
        return i >= len(members)

    def _move(self, rec: WorkerRecord, state: WorkerState) -> None:
        """``rec.move(state)`` (lock held), keeping the index of READY workers.

        Raises:
            ValueError: a transition the life cycle does not have.
        """
        rec.move(state)
        if rec.state == WorkerState.READY:
            self._ready_ids.add(rec.worker_id)
        else:
            self._ready_ids.discard(rec.worker_id)

    def _ready(self) -> List[WorkerRecord]:
        return sorted((self.workers[w] for w in self._ready_ids if w not in self.reserved),
                      key=lambda w: w.order)

    def _change_wanted(self) -> bool:
        if self.current is None or self.finishing or self.failure or not self.elastic:
            return False
        members = self.current.members
        ready = self._ready()
        states = [self.workers[w].state for w in members]
        if WorkerState.DEAD in states or WorkerState.EXITED in states:
            return True  # a member died (or ended): the ring is broken, switch now
        if WorkerState.LEAVING in states:
            # if every member leaves, they train on until a replacement is ready to take the
            # state over (the oldest hands it on, see _try_form) instead of idling at a boundary
            return WorkerState.MEMBER in states or bool(ready) or not any(
                w.state == WorkerState.PENDING for w in self.workers.values())
        return bool(ready) and len(members) < self.max_np and not self._siblings_coming(ready)

    def _siblings_coming(self, ready: List[WorkerRecord]) -> bool:
        """True while joiners spawned together with the first ready one are still building,
        for at most ``JOIN_BATCH_S`` after it became ready: they then join in the same switch
        (one stall for the ring instead of one per joiner).  The ring trains on meanwhile."""
        first = min(ready, key=lambda w: w.ready_at or 0.0)
        if first.ready_at is None or time.monotonic() - first.ready_at >= JOIN_BATCH_S:
            return False
        return any(w.state == WorkerState.PENDING and w.worker_id not in self.reserved
                   and abs(w.spawned_at - first.spawned_at) < JOIN_BATCH_S
                   for w in self.workers.values())

    def _change_wanted_now(self) -> bool:
        """``_change_wanted()`` for the workers' replies (lock held), computed at most once per
        state change (every change notifies the condition; adding or reserving a worker does
        not, hence their counts in the key) and per ``WANTED_CACHE_S`` (the join batch's wait
        ends with time alone).  Each ``/started``, ``/ready`` and new ``/watch`` poll asked it
        anew: O(N) each, O(N^2) per switch (benchmarks/control_plane.py)."""
        key = (self.cond.notifies, len(self.workers), len(self.reserved))
        now = time.monotonic()
        cached_key, at, wanted = self._wanted_cache
        if cached_key != key or now - at >= WANTED_CACHE_S:
            wanted = self._change_wanted()
            self._wanted_cache = (key, now, wanted)
        return wanted

    def _watch_reply(self, generation: int) -> messages.WatchReply:
        latest = self.current.number if self.current else 0
        return messages.WatchReply(change_pending=(generation == latest
                                                   and self._change_wanted_now()),
                                   latest_generation=latest,
                                   checkpoint_request=self.checkpoint_request,
                                   finishing=self.finishing)

    def _try_form(self) -> None:
        if self.finishing or self.failure or self.stopping:
            return
        ready = self._ready()
        if self.current is None:
            if any(w.initial and w.state == WorkerState.PENDING for w in self.workers.values()):
                return  # the initial workers are still starting
            previous: List[str] = []
        else:
            if not self._all_reported():
                return  # not every member is at the boundary yet (checked first: O(1) mostly)
            # Every live member is at the boundary: each has shut its ring down, so a
            # generation must form even when the change it switched for is gone (a READY
            # joiner killed, or removed by discovery, before its generation formed: the ring
            # re-forms without it, kind "reform"; horovod 3014's class).  Waiting for a change
            # to be wanted again froze the ring until some other joiner came, or for ever.
            previous = self._live_members()
            if any(w not in self.reports for w in previous):
                return  # not every member is at the boundary yet
        staying = [w for w in previous if self.workers[w].state == WorkerState.MEMBER]
        if previous and not staying and not ready \
                and any(w.state == WorkerState.PENDING and w.worker_id not in self.reserved
                        for w in self.workers.values()):
            return  # every member leaves: the oldest hands the state to a replacement, building
        handover = bool(previous and not staying and ready)
        if handover:
            # every member leaves and only joiners would remain: the oldest leaver stays one
            # more generation as rank 0 to hand the committed state over (sync), and leaves at
            # the next boundary; otherwise the joiners would start from their initial state.
            staying = previous[:1]
        room = self.max_np - len(staying)
        if handover:
            # at --max-np 1 the handover member would leave no room for the joiner, and the
            # ring would re-form around the leaver at every boundary: one joiner comes in
            room = max(room, 1)
        joiners = [w.worker_id for w in ready[:max(room, 0)]]
        participants = staying + joiners
        if len(participants) < self.min_np:
            # below --min-np: no ring forms; the members wait at the boundary holding their
            # state (at most --elastic-timeout, the driver's bound) and the next generation forms
            # as soon as enough workers are ready.  Leavers leave now, so that their slots can
            # be reused when they come back (horovod 3494's class: a short dip ended the job);
            # when nobody stays, the oldest leaver keeps the state until a replacement joins.
            self._release_leavers(previous, staying or previous[:1])
            return
        if self.current is not None and self.reset_limit is not None \
                and len(self.history) > self.reset_limit:
            # Horovod's words (horovod.runner.elastic.constants.RESET_LIMIT_EXCEEDED_MESSAGE)
            self.failure = (f"Horovod was shutdown because number of resets during elastic job "
                            f"exceeded limit: {self.reset_limit} (--reset-limit; this would "
                            f"have been change {len(self.history)})")
            self.cond.notify_all()
            return
        if self.current is not None and not any(w in self.current.members for w in staying) \
                and self.state_lost_restarts >= STATE_LOST_LIMIT:
            self.failure = (f"every holder of the committed state died {STATE_LOST_LIMIT + 1} "
                            f"times in a row with no newer checkpoint to resume from: not "
                            f"restarting the script again")
            self.cond.notify_all()
            return
        self._form(participants, previous)

    def _release_leavers(self, previous: List[str], holders: List[str]) -> None:
        """Tell the leaving members of ``previous`` other than ``holders`` to exit now, while no
        generation can form (lock held).  Their exit is a leave, not the job's end
        (:meth:`on_exit`)."""
        for w in previous:
            if w not in holders and self.workers[w].state == WorkerState.LEAVING \
                    and getattr(self.assignments.get(w), "action", "") != "exit":
                self.assignments[w] = messages.Assignment(
                    action="exit", reason="scaled in (below --min-np: the others wait for "
                                          "enough workers)")

    def _restore_paths(self, participants: List[str], previous: List[str]) -> Optional[list]:
        """The checkpoints (path, sidecar; newest good first) a generation of ``participants``
        resumes from: with ``--checkpoint-dir``, when none of them holds the committed state
        (the job's first generation, or every member died).  [] when there is nothing to
        resume; None when the directory has only bad checkpoints (``failure`` says so: a
        silent start from scratch would throw the job's progress away)."""
        if self.checkpoints is None or any(w in previous for w in participants):
            return []
        try:
            return self.checkpoints.restore_candidates()
        except CheckpointDirError as e:
            self.failure = str(e)
            self.cond.notify_all()
            return None

    def _last_reported_step(self) -> int:
        """The highest step the current generation's members reported (watch polls, and the
        heartbeats: a status may be long past when every member is killed at once)."""
        g = self.current
        steps = [self.progress.latest[w].step for w in g.members if w in self.progress.latest]
        return max(steps + [g.step, self._beat_step])

    def _form(self, participants: List[str], previous: List[str]) -> None:
        restore = self._restore_paths(participants, previous)
        if restore is None:
            return
        number = (self.current.number if self.current else 0) + 1
        port = self.rendezvous.open(number, {self.workers[w].host for w in participants},
                                    size=len(participants))
        hosts: List[str] = []
        for w in participants:
            if self.workers[w].host not in hosts:
                hosts.append(self.workers[w].host)
        local_counts = {h: 0 for h in hosts}
        per_host = {h: sum(1 for w in participants if self.workers[w].host == h) for h in hosts}
        kind, step, rolled_back = self._classify(previous, participants)
        # one decision for every member (a rank that skipped the broadcast others wait in would
        # hang them): skip sync only after an agreed switch that removed members and added none
        sync = kind in ("start", "failure") or not set(participants) <= set(self.current.members)
        labels = []
        for rank, w in enumerate(participants):
            rec = self.workers[w]
            if rec.state == WorkerState.READY:
                self._move(rec, WorkerState.MEMBER)
            rec.rank = rank
            labels.append(rec.label)
            local_rank = local_counts[rec.host]
            # Horovod's cross communicator of local rank k spans the hosts that have a k-th
            # worker (horovodrun's host allocation plan does the same)
            cross_hosts = [h for h in hosts if per_host[h] > local_rank]
            self.assignments[w] = messages.Assignment(
                action="join", generation=number, rank=rank, size=len(participants),
                local_rank=local_rank, local_size=per_host[rec.host],
                cross_rank=cross_hosts.index(rec.host), cross_size=len(cross_hosts),
                hostname=rec.host,
                rendezvous_addr=self.rendezvous_addr, rendezvous_port=port,
                rendezvous_token=self.rendezvous.token(number),
                members=list(participants), sync=sync,
                restore_paths=[str(p) for p, _ in restore])
            local_counts[rec.host] += 1
        for w in previous:
            if w not in participants:
                self.assignments[w] = messages.Assignment(action="exit", reason="scaled in",
                                                          generation=number)
        prev_size = len(self.current.members) if self.current else 0
        continuing = [w for w in participants if w in previous]
        state_lost = self.current is not None and kind == "failure" and not continuing
        if state_lost:  # every holder of the state died: the joiners start from scratch
            rolled_back = max(rolled_back, self.current.step)
            if restore and str(restore[0][0]) != self.last_restore:
                self.state_lost_restarts = 0  # a newer checkpoint: progress since the last one
            else:
                self.state_lost_restarts += 1
            if restore:  # ... or from a checkpoint: the steps since it are redone
                rolled_back = max(0, self._last_reported_step() - restore[0][1]["steps"])
        if restore:
            step = restore[0][1]["steps"]
            self.last_restore = str(restore[0][0])
        self.first_loss = None
        now = time.monotonic()
        self.liveness.set_members(len(participants), now)
        for w in participants:
            self.liveness.expect(w, now)
        gen = Generation(number, list(participants), kind, step, rolled_back, time.time(),
                         prev_size, continuing, labels, state_lost=state_lost and not restore,
                         restored_from=str(restore[0][0]) if restore else "",
                         restored_step=restore[0][1]["steps"] if restore else -1)
        self.current = gen
        self._beat_step = -1  # the highest step a member of this generation beat with
        self.history.append(gen)
        self.telemetry.on_members(number, participants)
        self.reports = {}
        self._reported_upto = 0
        self.first_report_at = None
        if kind == "start" or not continuing:
            self._log_event(gen)
        self.cond.notify_all()

    def _classify(self, previous: List[str], participants: List[str]):
        if self.current is None:
            return "start", 0, 0
        reps = [self.reports[w] for w in previous if w in self.reports]
        failed = any(r.reason == "failure" for r in reps) or any(
            self.workers[w].state == WorkerState.DEAD for w in self.current.members)
        step = max((r.step for r in reps), default=0)
        rolled_back = max((r.steps_before_restore - r.step for r in reps), default=0)
        if failed:
            # the step every survivor restored to; a report below the generation's start comes
            # from a joiner that never finished its sync (it holds no commit of this ring)
            synced = [r.step for r in reps if r.step >= self.current.step]
            return "failure", min(synced or [r.step for r in reps] or [0]), max(rolled_back, 0)
        size, before = len(participants), len(self.current.members)
        if participants == self.current.members:
            kind = "reform"  # the same ring again: the change it switched for went away
        elif size == before:  # as many left as joined (a job moving hosts, a slot swapped)
            kind = "replace"
        else:
            kind = "scale_out" if size > before else "scale_in"
        return kind, step, 0

    def _log_if_started(self, g: Optional[Generation]) -> bool:
        """Log ``g``'s event once every continuing member has reported its first step in it or
        is gone (lock held): checked at each ``/started`` and at each exit, so that a member
        lost before it reported does not leave the line unwritten.  True when it logged."""
        if g is None or g.logged or not all(w in g.stalls or not self.workers[w].state.alive
                                            for w in g.continuing):
            return False
        self._log_event(g)
        return True

    def flush_events(self) -> None:
        """Write the event of every generation not logged yet (the job is ending: a line whose
        members' reports never came is written with what is known)."""
        with self.cond:
            for g in self.history:
                if not g.logged:
                    self._log_event(g)

    def _log_event(self, g: Generation) -> None:
        g.logged = True
        stall = max((g.stalls.get(w, 0.0) for w in g.continuing), default=0.0)
        slowest = max(g.continuing, key=lambda w: g.stalls.get(w, -1.0), default=None)
        ev = GenerationEvent(
            generation=g.number, kind=g.kind, world_size=len(g.members),
            members=list(g.member_labels), step=g.step,
            stall_s=round(stall if g.kind != "start" else 0.0, 4),
            rolled_back_steps=g.rolled_back_steps, time=g.formed_at,
            previous_world_size=g.previous_size,
            phases=dict(g.phases.get(slowest, {})) if g.kind != "start" else {},
            state_lost=g.state_lost, restored_from=g.restored_from,
            restored_step=g.restored_step, **self._membership_change(g))
        self.events.write(ev)
        self.telemetry.on_generation(ev)

    def _membership_change(self, g: Generation) -> Dict[str, List[str]]:
        """Who left and who joined between the generation before ``g`` and ``g`` (labels)."""
        i = next((k for k, h in enumerate(self.history) if h is g), 0)
        before = self.history[i - 1].members if i > 0 else []
        return {"left": [self.workers[w].label for w in before if w not in g.members],
                "joined": [self.workers[w].label for w in g.members if w not in before]}


# ---- HTTP: launcher/coordinator_server.py -------------------------------------------------------

JOIN_BATCH_S = 2.0  # how long a ready joiner waits for siblings spawned with it (seconds)
