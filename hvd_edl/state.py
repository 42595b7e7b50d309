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

from hvd_edl import audit, runtime

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

        The allreduce is pipelined: the flags sent at one agreement commit are read at the
        next (it runs alongside the training steps' gradient allreduces instead of stalling
        the commit), and commits closer together than ``AGREE_PERIOD_S`` share one agreement
        (see :func:`_agree`), so every rank switches at the same commit, at most two agreement
        periods after the request.  A generation's first commit only sends.
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


AGREE_PERIOD_S = float(os.environ.get("HVD_EDL_AGREE_PERIOD_S", "0.25"))
"""Target seconds between two switch agreements (``HVD_EDL_AGREE_PERIOD_S``): commits closer
together than this share one agreement allreduce."""
MAX_AGREE_EVERY = 64  # commits between two agreements, at most


def _agree(rt, change_pending: Callable[[], bool]) -> bool:
    """One check for host updates, pipelined and thinned out: at an *agreement commit*, read the
    flags allreduced at the previous one (False at a generation's first), then send this one's
    flag (``change_pending()``: the runtime's watcher flag, no request); at other commits do
    nothing.

    Every agreement carries, besides the flag, each rank's proposal for how many commits apart
    the next agreement should be (commits per ``AGREE_PERIOD_S`` from its own commit period, at
    most ``MAX_AGREE_EVERY``); the allreduce takes the smallest proposal (the max of the
    negated ones), so every rank reads the same spacing and the same commits are agreement
    commits on all of them, and one rank's stale or odd estimate can only make agreements more
    frequent.  With commits every 60 ms this costs one small allreduce per quarter second
    instead of one per commit, and a switch is agreed at most two agreement periods after the
    coordinator asked for it.  ``rt.pending_agreement`` holds the in-flight handle; the runtime
    clears it and the commit count when a generation starts.

    Raises:
        HorovodInternalError: a member failed.
    """
    import torch
    import horovod.torch as _hvd
    now = time.monotonic()
    if rt.last_commit_at is not None:
        dt = now - rt.last_commit_at
        prev = rt.commit_period_s
        rt.commit_period_s = dt if prev is None else 0.8 * prev + 0.2 * dt
    rt.last_commit_at = now
    n = rt.commits_in_generation
    rt.commits_in_generation += 1
    if n < rt.next_agreement_commit:
        return False
    previous = rt.pending_agreement
    rt.pending_agreement = None
    every = 1
    if previous is not None:
        result = _hvd.synchronize(previous)
        if int(result[0]) > 0:
            return True
        every = max(1, min(-int(result[1]), MAX_AGREE_EVERY))
    rt.next_agreement_commit = n + every
    proposal = 1
    if rt.commit_period_s:
        proposal = max(1, min(int(AGREE_PERIOD_S / rt.commit_period_s), MAX_AGREE_EVERY))
    flag = 1 if change_pending() else 0
    rt.pending_agreement = _hvd.allreduce_async_(
        torch.tensor([flag, -proposal], dtype=torch.int32), op=_hvd.Max,
        name="hvd_edl.check_host_updates")
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
            rt.join()
        while True:
            try:
                if rt is None or rt.sync_needed():
                    state.sync()
                state.audit_resume()
                if rt is not None:
                    rt.mark_first_step()
                return func(state, *args, **kwargs)
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
