"""The switch agreement at ``state.commit()``: every rank of a ring decides, at the same commit,
whether the coordinator asked for a switch (one small Horovod allreduce per commit, pipelined or
waited for by the commit period).  Holds only the agreement's rule and its per-ring reset; the
worker's runtime (:mod:`hvd_edl.runtime`) keeps the state it reads (``pending_agreement``,
``agree_now``, ``last_commit_at``, ``commit_periods``) and calls :func:`new_ring_agreement`
when a ring forms; :class:`hvd_edl.elastic_state.State` calls :func:`agree` at each commit.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from horovod.common.exceptions import HorovodInternalError

from hvd_edl import step_timer

log = logging.getLogger(__name__)


SYNC_AGREE_S = float(os.environ.get("HVD_EDL_SYNC_AGREE_S", "0.25"))
"""Commit period (seconds, ``HVD_EDL_SYNC_AGREE_S``) from which the agreement is waited for at
the commit that sends it instead of at the next one: a blocked allreduce of two integers (well
under a millisecond here) is nothing beside commits this far apart (Horovod blocks at every
commit), and a switch requested between slow commits then happens at the first commit after the
request, not the second.  0.5 s before the reclaim benchmark (benchmarks/cluster/reclaim.py) showed
commits 0.27-0.45 s apart paying two periods."""

SYNC_AGREE_WINDOW = max(0, min(8, int(os.environ.get("HVD_EDL_SYNC_AGREE_WINDOW", "4"))))
"""A rank votes "slow" when any of its last ``SYNC_AGREE_WINDOW`` commit periods (1-8,
``HVD_EDL_SYNC_AGREE_WINDOW``) reached :data:`SYNC_AGREE_S`.  One period (the earlier rule) let
the short period of an epoch's closing commit (Horovod's examples commit every N batches and
again at the end of the epoch) switch the next, slow period to the pipelined mode, so a switch
requested then waited two slow periods (1.7 s at 0.9 s commits).  0 is the earlier rule whole
(one period; a generation's first commit pipelined too), kept for the side-by-side benchmark
(benchmarks/cluster/reclaim.py --variant)."""


def new_ring_agreement(rt) -> None:
    """What every member of a new ring sets (``rt``: its :class:`hvd_edl.runtime.WorkerRuntime`):
    nothing in flight, the first commit waits for its own agreement (the same mode on every
    member, the joiners having no commit periods to vote with; one blocking two-integer
    allreduce per generation), the first commit period counted from now.  The commit periods
    seen are kept: they are this rank's, whatever the ring."""
    rt.pending_agreement = None
    rt.agree_now = SYNC_AGREE_WINDOW > 0
    rt.last_commit_at = time.monotonic()


def agree(rt, change_pending: Callable[[], bool]) -> bool:
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
