"""``tiresias``: two-dimensional least attained service with discrete priority queues.

Gu et al., "Tiresias: A GPU Cluster Manager for Distributed Deep Learning" (NSDI 2019), its
discretised 2D-LAS, as the baseline of Pollux's simulator (petuum/adaptdl, osdi21-artifact,
``simulator/tiresias.py``) runs it:

* a job's attained service is GPU-seconds (slots x seconds held); it sits in queue ``k`` = the
  number of thresholds it has passed (one threshold, 16 GPU-hours, two queues, by default);
* every round, jobs are taken queue by queue, in submission order within a queue, and each that
  fits in what is left of the pool runs at its requested ``np`` (gang scheduled; a job that does
  not fit is skipped, the ones behind it may still run);
* a running job that is not among them is preempted (suspended to its checkpoint; it pays the
  restart when it resumes); a running job that stays keeps its slots; a new one is packed onto the
  hosts with the most free slots;
* starvation guard: the paper promotes a job back to the top queue after it waited a multiple of
  its executed time (STARVELIMIT); Pollux's implementation ships it switched off
  (``_solve_starvation = 0``), and so do we by default (``starvation_factor=0``).  With a factor
  ``f > 0`` a suspended job that has waited ``f x`` its executed seconds (attained / np) since
  its last change is put in queue 0.

Within a queue Pollux's code orders jobs by when they entered it; a snapshot does not carry
that, so we order by submission time (the paper's FIFO within a queue).

Several users (``fair_share``, on by default): within each queue, jobs are taken fair between
users (:func:`launcher.cluster.fair_share.fair_order`: progressive filling of slots, then the
users' attained service); ``user_quota`` caps the slots one user holds, a job that would pass it
is skipped like one that does not fit.  With one user both change nothing.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

from launcher.cluster.fair_share import Quota, check_user_quota, fair_order
from launcher.cluster.policy import Allocation, JobView, Policy, Snapshot, fill_hosts
from launcher.cluster.policies.fifo import requested_size, top_up

DEFAULT_THRESHOLDS_GPU_S = (16 * 3600.0,)
"""Queue thresholds of attained service, GPU-seconds (Pollux's Tiresias: 16 GPU-hours)."""


def queue_index(j: JobView, now: float, thresholds: Sequence[float] = DEFAULT_THRESHOLDS_GPU_S,
                starvation_factor: float = 0.0) -> int:
    """The 2D-LAS queue of ``j``: how many ``thresholds`` (GPU-seconds) its attained service has
    passed; 0 for a suspended job starved past ``starvation_factor`` x its executed time."""
    q = sum(1 for t in thresholds if j.attained_gpu_s >= t)
    if q and starvation_factor > 0 and j.started and not j.allocation:
        executed_s = j.attained_gpu_s / max(1, requested_size(j))
        if now - j.last_change_at >= starvation_factor * executed_s:
            return 0
    return q


def las_order(snap: Snapshot, thresholds: Sequence[float] = DEFAULT_THRESHOLDS_GPU_S,
              starvation_factor: float = 0.0, fair_share: bool = False,
              size: Callable[[JobView], int] = requested_size) -> List[JobView]:
    """Jobs in 2D-LAS order: queue, then larger priority, then submission time, then id.  With
    ``fair_share``, fair between users within a queue
    (:func:`launcher.cluster.fair_share.fair_order`, ``size``: a job's start size); the same
    order when every job has one user."""
    queue = {j.id: queue_index(j, snap.now, thresholds, starvation_factor) for j in snap.jobs}

    def key(j: JobView):
        return (queue[j.id], -j.priority, j.submitted_at, j.id)
    if fair_share:
        return fair_order(snap, key, size, tier=lambda j: queue[j.id])
    return sorted(snap.jobs, key=key)


class TiresiasPolicy(Policy):
    """Discretised 2D-LAS with preemption (the module's docstring).

    Args:
        thresholds_gpu_s: ascending attained-service thresholds between queues, GPU-seconds.
        starvation_factor: STARVELIMIT as a multiple of executed time; 0 switches it off.
        fair_share: fair between users within a queue (the module's docstring).
        user_quota: most slots one user holds (None: no cap).
    Raises ValueError for thresholds that are not positive and ascending, or a quota below 1.
    """

    name = "tiresias"

    def __init__(self, thresholds_gpu_s: Sequence[float] = DEFAULT_THRESHOLDS_GPU_S,
                 starvation_factor: float = 0.0, fair_share: bool = True,
                 user_quota: Optional[int] = None):
        th = tuple(float(t) for t in thresholds_gpu_s)
        if any(t <= 0 for t in th) or list(th) != sorted(th):
            raise ValueError(f"queue thresholds must be positive and ascending, got {th}")
        self.thresholds_gpu_s = th
        self.starvation_factor = float(starvation_factor)
        self.fair_share = bool(fair_share)
        self.user_quota = check_user_quota(user_quota)

    def order(self, snap: Snapshot) -> List[JobView]:
        """The jobs in the order this policy considers them (2D-LAS, fair between users)."""
        return las_order(snap, self.thresholds_gpu_s, self.starvation_factor, self.fair_share)

    def allocate(self, snap: Snapshot) -> Allocation:
        left = sum(snap.pool.values())
        run: List[JobView] = []
        quota = Quota(self.user_quota)
        for j in self.order(snap):
            if requested_size(j) <= left and quota.fits(j.user, requested_size(j)):
                run.append(j)
                left -= requested_size(j)
                quota.take(j.user, requested_size(j))
        free = dict(snap.pool)
        alloc: Allocation = {}
        for j in run:                         # running jobs keep their slots
            if j.allocation:
                got = top_up(j, free, requested_size(j))
                if got:
                    alloc[j.id] = got
        for j in run:
            if j.id not in alloc:
                got = fill_hosts(free, requested_size(j))
                if got:
                    alloc[j.id] = got
        return alloc
