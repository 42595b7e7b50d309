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
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set, Tuple

from hvd_edl import messages
from launcher.serve.coordinator_server import CoordinatorServer  # noqa: F401 - served from here
from launcher.observe.progress import ProgressBoard
from launcher.observe.events import EventLog, GenerationEvent
from launcher.job.formation import Formation, Generation
from launcher.job.liveness import END_SILENT_S, LivenessMonitor, MemberLiveness
from launcher.job.polls import CountingDict, NotifyingCondition, Polls
from launcher.job.registry import WorkerRecord, WorkerState
from launcher.job.rendezvous import GenerationRendezvous
from launcher.observe.telemetry import Telemetry

log = logging.getLogger(__name__)

EVENT_REPORT_TIMEOUT_S = 30.0  # a generation's event is logged this long after it formed, at the
                              # latest, with the reports that came (seconds)


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


class JobFailed(RuntimeError):
    """The job cannot go on (below --min-np for too long, reset limit); message says why."""


class Coordinator(Formation, Polls, MemberLiveness):
    """Membership state machine of one job: the driver's and the workers' calls are here; when a
    generation forms is :class:`launcher.job.formation.Formation`, the long polls
    :class:`launcher.job.polls.Polls`, silence and fencing :class:`launcher.job.liveness.MemberLiveness`.

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
        # as N^2 per switch (1,024 workers: benchmarks/job/control_plane.py)
        self._ready_ids: set = set()
        self.finishing = False
        self.ended = False  # a worker's exit ended the job (finishing can no longer be undone)
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
        # --checkpoint-dir (a launcher.job.checkpoint_dir.CheckpointDir; None: no checkpoints) and
        # how many checkpoints hvd-edl-ctl asked for (the watchers' replies carry it)
        self.checkpoints = None
        self.checkpoint_request = 0
        # the global batch asked for through the control API (/ctl/batch; 0: none): stamped on
        # every generation formed from now on (messages.Assignment.batch); a script that opted
        # in to an adaptive batch applies it when it enters the generation
        self.batch_request = 0
        # workers held back from joining (a migration's or a straggler replacement's new
        # workers, launcher/apps/migration.py): pending or ready, not counted as ready until
        # swap() releases them in the same switch as the workers they replace
        self.reserved: set = set()

    # ---- driver side ---------------------------------------------------------------------------

    def add_worker(self, rec: WorkerRecord) -> None:
        with self.cond:
            self.workers[rec.worker_id] = rec
            if rec.state == WorkerState.READY:
                self._ready_ids.add(rec.worker_id)
        self.telemetry.add_worker(rec.worker_id, rec.host, rec.slot, rec.gpu)

    def live_workers(self) -> List[WorkerRecord]:
        with self.lock:
            return [w for w in self.workers.values() if w.state.alive]

    def occupied_slots(self) -> Set[Tuple[str, int]]:
        """``(host, slot)`` no new worker may take: those of live workers and of workers fenced
        whose slot the driver has not rested yet (:attr:`WorkerRecord.fence_pending`)."""
        with self.lock:
            return {(w.host, w.slot) for w in self.workers.values()
                    if w.state.alive or w.fence_pending}

    def on_exit(self, worker_id: str, code: int) -> str:
        """A worker process ended with ``code`` (negative: killed by that signal).

        Returns what its end means for the job, for the driver's line: "finished" (training is
        over), "left" (a member whose script entered ``hvd.elastic.run`` exited 0 before its
        training function returned: a leave, its peers go on without it; issue 26),
        "ended_early" (the same, by the last member alive: the script ended its training
        itself, and the job ends), or ""."""
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
                    elif self.elastic and rec.elastic_run and not self.stopping \
                            and any(self.workers[w].state.alive for w in self.current.members):
                        # exit 0 inside the training function (sys.exit(0) at step 58 of 333):
                        # not the end of training, whose data would go untrained; a leave,
                        # without notice: its peers are released and go on without it
                        self._member_lost(rec)
                        verdict = "left"
                    elif self.elastic and rec.elastic_run and not self.stopping:
                        # the last member alive exited 0 inside training (every rank called
                        # sys.exit(0)): nobody holds the state; the script ended its training
                        # itself, and the job ends as under horovodrun (restarting it from
                        # scratch would do the same for ever)
                        self.finishing = True
                        verdict = "ended_early"
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
                self.ended = self.ended or verdict in ("finished", "ended_early")
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
            if not msg.done:
                # it entered an elastic function again: training goes on, unless the job's end
                # was decided otherwise (a member exited after training: the job is ending)
                rec.finished = False
                if self.finishing and not self.ended and not any(
                        w.finished and w.state.alive for w in self.workers.values()):
                    log.info("%s: entered an elastic function again: training goes on",
                             rec.label)
                    self.finishing = False
                    self._try_form()
                    self.cond.notify_all()
            elif rec.state.alive and not rec.fenced:
                rec.finished = True
                if not self.finishing:
                    log.info("%s: training function returned at step %d (generation %d): "
                             "the job is finishing", rec.label, msg.step, msg.generation)
                self.finishing = True
                self.cond.notify_all()
            return self._watch_reply(msg.generation)


    def exiting(self, msg: messages.Exiting) -> messages.WatchReply:
        """``POST /exiting``: ``msg.worker_id``'s interpreter is ending.  Its silence from now on
        is its teardown, never a fault (no fence, no failure); a member of the current ring
        whose training function had not returned (``sys.exit(0)`` inside it) is leaving
        without notice: its peers are released now instead of when its sockets close."""
        with self.cond:
            rec = self._worker(msg.worker_id)
            rec.exiting = True
            g = self.current
            released = self.assignments.get(rec.worker_id)
            if g is not None and rec.worker_id in g.members and rec.state.alive \
                    and self.elastic and rec.elastic_run and not rec.finished \
                    and not self.finishing and not (released and released.action == "exit"):
                self._member_lost(rec)
                self.cond.notify_all()
            return self._watch_reply(msg.generation)

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
            quiet = []
            if g is not None and self.finishing and not self.stopping:
                # training is over: a member silent END_SILENT_S is killed also when no other
                # member beats any more (the last one alive, frozen in its teardown)
                for w in self.liveness.silent_for(
                        [m for m in g.members if self.workers[m].state.alive
                         and m not in self.ended_silent], now, END_SILENT_S):
                    self.ended_silent.add(w)
                    quiet.append(self.workers[w])
        for rec in quiet:
            self.on_end_silent(rec, END_SILENT_S)

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
        """Rank 0's last progress report (``launcher.observe.progress``: ``at``, ``step``, ``samples``),
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

    def worker_states(self) -> Tuple[Dict[str, str], bool]:
        """Every known worker's state (worker id -> :class:`WorkerState` value) and whether the
        job is finishing, read together (one hold of the lock)."""
        with self.lock:
            return ({w.worker_id: w.state.value for w in self.workers.values()},
                    self.finishing)

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
                             "gpu": w.gpu, "state": w.state.value,
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
            rec.stream_addr, rec.stream_port = _stream_endpoint(msg)
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


    def started(self, msg: messages.Started) -> messages.WatchReply:
        with self.cond:
            g = self.current
            if g is not None and g.number == msg.generation and msg.worker_id in g.continuing:
                g.stalls[msg.worker_id] = float(msg.stall_s)
                if isinstance(msg.phases, dict):
                    g.phases[msg.worker_id] = {str(k): round(float(v), 4)
                                               for k, v in msg.phases.items()
                                               if isinstance(v, (int, float))}
                if isinstance(msg.sync_parts, dict) and msg.sync_parts:
                    g.sync_parts[msg.worker_id] = {str(k): round(float(v), 4)
                                                   for k, v in msg.sync_parts.items()
                                                   if isinstance(v, (int, float))}
                if self._log_if_started(g):
                    self.cond.notify_all()  # leavers waiting for this generation to train
            return self._watch_reply(msg.generation)


    def request_batch(self, batch: int) -> bool:
        """Ask for global batch ``batch`` from the next generation on; when the script opted in
        (its workers report an adaptive batch) and its batch differs, a switch with the same
        members is wanted (kind "reform": nothing is synced).  Returns whether such a switch
        was wanted."""
        with self.cond:
            self.batch_request = int(batch)
            self._wanted_cache = (None, 0.0, False)
            wanted = self._change_wanted()
            self.cond.notify_all()
        return wanted

    def request_checkpoint(self) -> int:
        """``hvd-edl-ctl checkpoint``: rank 0 writes one at its next commit (the open
        ``/watch`` polls answer now, carrying the new count).  Returns the request's number."""
        with self.cond:
            self.checkpoint_request += 1
            self.progress.ask(time.monotonic())
            self.cond.notify_all()
            return self.checkpoint_request


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
            sync_parts=dict(g.sync_parts.get(slowest, {})) if g.kind != "start" else {},
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


def _stream_endpoint(msg: messages.Register) -> Tuple[str, int]:
    """The (address, port) a registering worker listens on for state syncs; ("", 0) when it
    names none or names something that is no IP address and port."""
    import ipaddress
    try:
        ipaddress.ip_address(msg.stream_addr)
    except ValueError:
        return "", 0
    if not 0 < msg.stream_port < 65536:
        return "", 0
    return msg.stream_addr, msg.stream_port
