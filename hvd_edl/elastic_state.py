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
from typing import Callable, Dict, List

from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

from hvd_edl import audit, runtime, step_timer
from hvd_edl.switch_agreement import agree

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

        The allreduce is pipelined (see :func:`hvd_edl.switch_agreement.agree`): every rank
        switches at the same commit, the first or second after the request (the first when
        commits are at least ``SYNC_AGREE_S`` apart, and always at a generation's first commit).
        """
        rt = runtime.get()
        if rt is None or not rt.elastic or not rt.joined:
            return
        if agree(rt, rt.change_pending):
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
            ledger.write("sync", **runtime.position())


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
