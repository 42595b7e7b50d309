"""When and how the next generation forms (the coordinator's formation rules, lock held).

Generation g+1 forms when there is a reason (the first generation, a READY joiner and room
under ``max_np``, a LEAVING member, a member that died) and every live member of g has reported
at the same step boundary (``POST /switch``), with at least ``min_np`` workers taking part.
Once every live member is at the boundary its ring is shut down, so a generation always forms
then, also when the change it switched for went away (kind "reform").  Ranks follow age: the
oldest staying member is rank 0, so the state always syncs from a worker that holds it.

:class:`Formation` is one part of :class:`launcher.job.coordinator.Coordinator` (with
:class:`launcher.job.polls.Polls` and :class:`launcher.job.liveness.MemberLiveness`); every method runs
with the coordinator's lock held and reads and writes its state.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from hvd_edl import messages
from launcher.job.checkpoint_dir import CheckpointDirError
from launcher.job.registry import WorkerRecord, WorkerState

JOIN_BATCH_S = 2.0  # how long a ready joiner waits for siblings spawned with it (seconds)
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
    sync_parts: Dict[str, Dict[str, float]] = field(default_factory=dict)
    logged: bool = False
    state_lost: bool = False
    restored_from: str = ""   # the checkpoint its rank 0 resumes from (--checkpoint-dir)
    restored_step: int = -1
    batch: int = 0            # the global batch asked for it (Assignment.batch; 0: none)


class Formation:
    """The formation rules of :class:`launcher.job.coordinator.Coordinator` (lock held)."""

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
        if bool(ready) and len(members) < self.max_np and not self._siblings_coming(ready):
            return True
        return self._batch_change_wanted()

    def _batch_change_wanted(self) -> bool:
        """A global batch was asked for (``/ctl/batch``) that the current generation does not
        have, and the script opted in (a member reported its adaptive batch, at another size):
        the members switch to a generation of the same ring that carries it."""
        want = self.batch_request
        if not want or want == self.current.batch:
            return False
        plan = self.telemetry.adaptive_batch()
        if plan is None:
            return False
        applied = max(min(max(want, plan.get("min_batch", want)), plan.get("max_batch", want)),
                      len(self.current.members))  # as the sampler clamps it
        return plan.get("batch") != applied

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
        # rank 0's listener for the state sync: every member connects to it at once after
        # hvd.init() (the sync's header comes over it: no broadcast), keys from this token
        head = self.workers[participants[0]]
        state_token = secrets.token_hex(16) if head.stream_port else ""
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
                restore_paths=[str(p) for p, _ in restore],
                state_addr=head.stream_addr, state_port=head.stream_port,
                state_token=state_token, batch=self.batch_request)
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
                         restored_step=restore[0][1]["steps"] if restore else -1,
                         batch=self.batch_request)
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
