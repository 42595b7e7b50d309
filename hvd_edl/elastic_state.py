"""Elastic state and the elastic run loop (Horovod's ``horovod.common.elastic``, made generational).

Semantics follow Horovod's: ``commit()`` saves, then checks for host updates; after a failure
(``HorovodInternalError``) ``restore()`` goes back to the last save; ``sync()`` broadcasts from
rank 0.  Differences from Horovod: the host-update check is one pipelined allreduce of a flag
that the coordinator set (all ranks agree on the same step boundary, see
:meth:`State.check_host_updates`); after every generation change, removal-only ones included,
``on_reset`` repartitions the samplers (Horovod does not, horovod issue 3399), and ``sync()``
broadcasts unless the coordinator says the change only removed members after an agreed switch
(then every member already holds the same commit); and the state also carries the worker's
optimizer-step count, so the launcher can report step boundaries and rolled-back steps.
"""
from __future__ import annotations

import copy
import functools
import logging
import os
import time
from typing import Callable, Dict, List

from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

from hvd_edl import audit, runtime, step_timer

log = logging.getLogger(__name__)


class State:
    """Base elastic state (Horovod's ``State`` interface).

    Subclasses implement :meth:`save`, :meth:`restore` and :meth:`sync`.  ``bcast_object(obj,
    root_rank)`` and ``get_rank()`` are the framework's broadcast and rank functions.
    """

    def __init__(self, bcast_object: Callable, get_rank: Callable[[], int]):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: List[Callable[[], None]] = []
        self._saved_steps = 0

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Functions called (in order, no arguments) after every generation change."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run after the ring changed: re-reads rank/size in handlers, then the user callbacks."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (host memory), then check for host updates.

        Raises:
            HostsUpdatedInterrupt: the ring agreed to switch at this step boundary (caught by
                ``hvd.elastic.run``).
            HorovodInternalError: a member failed during the check (caught by ``run``).
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Agree on "the coordinator asked for a switch" with one allreduce (max) of a flag;
        raises ``HostsUpdatedInterrupt`` on every rank when any rank saw the request.

        The allreduce is pipelined (see :func:`_agree`): every rank switches at the same
        commit, the first or second after the request (the first when commits are at least
        ``SYNC_AGREE_S`` apart, and always at a generation's first commit).
        """
        rt = runtime.get()
        if rt is None or not rt.elastic or not rt.joined:
            return
        if _agree(rt, rt.change_pending):
            rt.mark_switch_start()
            raise HostsUpdatedInterrupt(False)

    def save(self) -> None:
        rt = runtime.get()
        self._saved_steps = rt.steps if rt is not None else 0

    def restore(self) -> None:
        rt = runtime.get()
        if rt is not None:
            rt.steps = self._saved_steps

    def sync(self) -> None:
        rt = runtime.get()
        if rt is not None:
            rt.steps = self._bcast_object(rt.steps, 0)

    def reset(self) -> None:
        """Hook for subclasses: refresh anything that depends on rank or size."""

    def audit_resume(self) -> None:
        """Audit mode: note in the ledger the committed step this generation resumes from
        (see :mod:`hvd_edl.audit`)."""
        ledger = audit.ledger()
        if ledger is not None:
            ledger.write("sync", **audit.position())


SYNC_AGREE_S = float(os.environ.get("HVD_EDL_SYNC_AGREE_S", "0.25"))
"""Commit period (seconds, ``HVD_EDL_SYNC_AGREE_S``) from which the agreement is waited for at
the commit that sends it instead of at the next one: a blocked allreduce of two integers (well
under a millisecond here) is nothing beside commits this far apart (Horovod blocks at every
commit), and a switch requested between slow commits then happens at the first commit after the
request, not the second.  0.5 s before the reclaim benchmark (benchmarks/reclaim.py) showed
commits 0.27-0.45 s apart paying two periods."""

SYNC_AGREE_WINDOW = max(0, min(8, int(os.environ.get("HVD_EDL_SYNC_AGREE_WINDOW", "4"))))
"""A rank votes "slow" when any of its last ``SYNC_AGREE_WINDOW`` commit periods (1-8,
``HVD_EDL_SYNC_AGREE_WINDOW``) reached :data:`SYNC_AGREE_S`.  One period (the earlier rule) let
the short period of an epoch's closing commit (Horovod's examples commit every N batches and
again at the end of the epoch) switch the next, slow period to the pipelined mode, so a switch
requested then waited two slow periods (1.7 s at 0.9 s commits).  0 is the earlier rule whole
(one period; a generation's first commit pipelined too), kept for the side-by-side benchmark
(benchmarks/reclaim.py --variant)."""


def new_ring_agreement(rt) -> None:
    """What every member of a new ring sets (``rt``: its :class:`hvd_edl.runtime.WorkerRuntime`):
    nothing in flight, the first commit waits for its own agreement (the same mode on every
    member, the joiners having no commit periods to vote with; one blocking two-integer
    allreduce per generation), the first commit period counted from now.  The commit periods
    seen are kept: they are this rank's, whatever the ring."""
    rt.pending_agreement = None
    rt.agree_now = SYNC_AGREE_WINDOW > 0
    rt.last_commit_at = time.monotonic()


def _agree(rt, change_pending: Callable[[], bool]) -> bool:
    """One check for host updates at every commit, one small allreduce (max) of two int32s:
    ``[flag, slow]``, where ``flag`` is ``change_pending()`` (the runtime's watcher flag: no
    request) and ``slow`` says one of this rank's last ``SYNC_AGREE_WINDOW`` commit periods was
    at least ``SYNC_AGREE_S``.

    Pipelined by default: the allreduce a commit sends is read at the next commit (it runs
    alongside the training steps' gradient allreduces instead of stalling the commit), so a
    switch requested before commit ``k`` is agreed at commit ``k + 1``.  The ``slow`` votes of
    the agreement read at commit ``k`` decide, identically on every rank, whether commit ``k``'s
    own agreement is waited for at once (any rank slow): then a switch requested before commit
    ``k`` is agreed at ``k``.  Every rank reads the same results, so every rank switches at the
    same commit.  A generation's first commit has nothing to read and waits for its own
    agreement (:func:`new_ring_agreement`): a switch requested in a generation's first period
    (a job just grown, as the cluster service lends and then takes back) happens there.

    Horovod checks at every commit too, with a blocking broadcast of its host messages
    (``horovod/common/elastic.py``, ``State.check_host_updates``).  An earlier version here
    thinned agreements out to one per quarter second, counted in commits learnt from the recent
    commit rate; after a pause (an evaluation pass) those commits could take minutes, so a
    requested switch came epochs late (issue 13).

    Raises:
        HorovodInternalError: a member failed.
    """
    import torch
    import horovod.torch as _hvd
    now = time.monotonic()
    if rt.last_commit_at is not None:
        rt.commit_periods.append(now - rt.last_commit_at)
    slow = any(p >= SYNC_AGREE_S for p in list(rt.commit_periods)[-max(1, SYNC_AGREE_WINDOW):])
    rt.last_commit_at = now
    previous = rt.pending_agreement
    rt.pending_agreement = None
    wait_now = rt.agree_now  # a result read at the previous commit asked for it
    rt.agree_now = False
    try:
        if previous is not None:
            with step_timer.waiting():  # waiting on the peers is no compute (straggler.py)
                result = _hvd.synchronize(previous)
            if int(result[0]) > 0:
                return True
            wait_now = int(result[1]) > 0
        flag = 1 if change_pending() else 0
        handle = _hvd.allreduce_async_(torch.tensor([flag, 1 if slow else 0],
                                                    dtype=torch.int32),
                                       op=_hvd.Max, name="hvd_edl.check_host_updates")
        if not wait_now:
            rt.pending_agreement = handle
            return False
        with step_timer.waiting():
            result = _hvd.synchronize(handle)
    except HorovodInternalError:
        # A peer whose training function returned after this same commit (its last) has shut
        # Horovod down: this rank's training ends here too, with this commit saved.  Not a
        # failure: the script goes on to its own end (a later collective would fail and end
        # this worker through the protocol, told the job is over).
        if rt.training_finished_elsewhere():
            log.info("a peer finished training at this commit: no further agreement")
            rt.pending_agreement = None
            return False
        raise
    if int(result[0]) > 0:
        return True
    rt.agree_now = int(result[1]) > 0  # still slow: the next commit waits for its own too
    return False


class ObjectState(State):
    """State of plain Python attributes (Horovod's ``ObjectState``): ``ObjectState(bcast_object,
    get_rank, epoch=0, batch=0)`` exposes ``state.epoch`` etc.; saved by deep copy."""

    def __init__(self, bcast_object: Callable, get_rank: Callable[[], int], **kwargs):
        super().__init__(bcast_object, get_rank)
        self._saved_state: Dict = kwargs
        self._set_attrs()

    def save(self) -> None:
        super().save()
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        super().restore()
        self._set_attrs()

    def sync(self) -> None:
        with step_timer.waiting():  # a broadcast from rank 0: waiting, not compute
            self._sync()

    def _sync(self) -> None:
        super().sync()
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state, 0)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for k, v in self._saved_state.items():
            setattr(self, k, copy.deepcopy(v))


def run_fn(func: Callable, reset: Callable[[], None]) -> Callable:
    """Horovod's ``run_fn`` loop, generational: sync, run ``func``; on a failure restore the last
    commit, on an agreed switch keep the state; then move to the next generation and sync again.

    Outside ``hvd-edl-run`` it behaves like Horovod's (``reset`` = shutdown + init).
    """
    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        rt = runtime.get()
        if rt is not None:
            rt.join(elastic_run=True)
            rt.entered_again()  # a second elastic function: training goes on
        while True:
            try:
                if rt is None or rt.sync_needed():
                    state.sync()
                state.audit_resume()
                if rt is not None:
                    rt.mark_first_step()
                result = func(state, *args, **kwargs)
                if rt is not None:
                    rt.finished()  # training is over: never a failure, never re-run
                return result
            except HorovodInternalError as e:
                log.warning("collective failed (%s): restoring the last commit", e)
                before = rt.steps if rt is not None else 0
                state.restore()
                reason = "failure"
            except HostsUpdatedInterrupt:
                before = rt.steps if rt is not None else 0
                reason = "update"
            if rt is not None:
                rt.rejoin(reason, before)
            else:
                reset()
            state.on_reset()
    return wrapper
