"""The workers' long polls: ``POST /switch`` (a worker at a step boundary waits for its next
assignment) and ``POST /watch`` (a member's watcher waits until a switch is wanted).

A poll is data (:class:`Poll`: a ``check`` that answers or says "wait", a deadline), so the HTTP
server waits for thousands of them on its event loop without a thread each; :meth:`Polls.
wait_poll` blocks on the coordinator's condition for callers that want a plain call.

:class:`Polls` is one part of :class:`launcher.job.coordinator.Coordinator` (with
:class:`launcher.job.formation.Formation` and :class:`launcher.job.liveness.MemberLiveness`).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from hvd_edl import messages

WANTED_CACHE_S = 0.05  # longest the replies' "change wanted" is reused without a state change


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


class Polls:
    """The long polls of :class:`launcher.job.coordinator.Coordinator`."""

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

    def expire_poll(self, poll: Poll):
        """The reply of ``poll`` at its deadline (for a caller that waited without the lock,
        ``CoordinatorServer``): its answer if it has one by now, else its timeout reply."""
        with self.cond:
            return poll.check() or poll.timeout()

    def answer_polls(self, signature: Optional[tuple], switch_polls: Iterable[Poll],
                     group_polls: Iterable[Poll]) -> Tuple[tuple, Dict[Poll, object]]:
        """One pass over the polls a caller keeps waiting without a thread each
        (``CoordinatorServer``), in one hold of the lock: the ``/switch`` polls are checked only
        when :meth:`poll_signature` differs from ``signature`` (the caller's last), and one
        poll of each group stands for its group (``group_polls``: one per group).  Returns the
        current signature and the replies of the polls answered now (poll -> reply)."""
        replies: Dict[Poll, object] = {}
        with self.cond:
            now = self.poll_signature()
            if now != signature:
                for poll in switch_polls:
                    reply = poll.check()
                    if reply is not None:
                        replies[poll] = reply
            for poll in group_polls:
                reply = poll.check()
                if reply is not None:
                    replies[poll] = reply
        return now, replies

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

    def _change_wanted_now(self) -> bool:
        """``_change_wanted()`` for the workers' replies (lock held), computed at most once per
        state change (every change notifies the condition; adding or reserving a worker does
        not, hence their counts in the key) and per ``WANTED_CACHE_S`` (the join batch's wait
        ends with time alone).  Each ``/started``, ``/ready`` and new ``/watch`` poll asked it
        anew: O(N) each, O(N^2) per switch (benchmarks/job/control_plane.py)."""
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
