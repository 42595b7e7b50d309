"""``fifo``: gang-scheduled static jobs at their requested size, first come first served.

What a Horovod user gets today from a plain queue in front of ``horovodrun -np N``: a job starts
when its ``np`` slots are free, all at once (gang scheduling), keeps them until it ends, is never
resized or preempted.  Plain FIFO, no backfilling: when the head of the queue does not fit, nothing
behind it starts (head-of-line blocking), even a job that would fit.  A job larger than the whole
pool can never start and is passed over (it would block the queue for ever).

Several users (``fair_share``, on by default): the queue is fair between users
(:func:`launcher.cluster.fair_share.fair_order`: each user's jobs in priority and submission
order, users interleaved by progressive filling of slots, then by attained service).
``user_quota`` caps the slots one user holds; a job held at its user's quota is passed over and
blocks no one (Slurm's QOS limits).  With one user both change nothing.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from launcher.cluster.fair_share import Quota, check_user_quota, fair_order
from launcher.cluster.policy import Allocation, JobView, Policy, Snapshot, fill_hosts


def requested_size(j: JobView) -> int:
    """The size a static scheduler gives ``j``: its ``np`` within ``[min_np, max_np]``."""
    return max(j.min_np, min(j.np, j.max_np))


def keep_hosts(j: JobView, free: Dict[str, int], size: int) -> Dict[str, int]:
    """Take out of ``free`` (changed in place) the slots ``j`` holds that are still in the pool
    and still free, at most ``size``, its largest hosts first; returns what it keeps."""
    kept: Dict[str, int] = {}
    left = size
    for h, k in sorted(j.allocation.items(), key=lambda hk: (-hk[1], hk[0])):
        n = min(k, free.get(h, 0), left)
        if n > 0:
            kept[h] = n
            free[h] -= n
            left -= n
    return kept


def top_up(j: JobView, free: Dict[str, int], size: int):
    """``j``'s slots at ``size``: what it holds (kept first), the rest packed from ``free``
    (changed in place); None, and ``free`` unchanged, when they are not free."""
    before = dict(free)
    kept = keep_hosts(j, free, size)
    more = fill_hosts(free, size - sum(kept.values()), prefer=sorted(kept, key=lambda h: -kept[h]))
    if more is None:
        free.clear()
        free.update(before)
        return None
    for h, k in more.items():
        kept[h] = kept.get(h, 0) + k
    return kept


def fifo_key(j: JobView):
    """FIFO's queue order of one job: larger ``priority`` first, then submission time, then id."""
    return (-j.priority, j.submitted_at, j.id)


class FifoPolicy(Policy):
    """First come first served, gang-scheduled, no backfilling (the module's docstring).  Queue
    order: larger ``priority`` first, then submission time, then id (fair between users first
    with ``fair_share``).

    Args:
        fair_share: a queue fair between users (the module's docstring).
        user_quota: most slots one user holds (None: no cap).
    Raises ValueError for a quota below 1.
    """

    name = "fifo"

    def __init__(self, fair_share: bool = True, user_quota: Optional[int] = None):
        self.fair_share = bool(fair_share)
        self.user_quota = check_user_quota(user_quota)

    def order(self, snap: Snapshot) -> List[JobView]:
        """The queue: the jobs in the order this policy considers them."""
        if self.fair_share:
            return fair_order(snap, fifo_key, requested_size)
        return sorted(snap.jobs, key=fifo_key)

    def allocate(self, snap: Snapshot) -> Allocation:
        free = dict(snap.pool)
        capacity = sum(free.values())
        alloc: Allocation = {}
        quota = Quota(self.user_quota)
        order = self.order(snap)
        for j in order:                      # running jobs keep what they hold
            if j.allocation and quota.fits(j.user, requested_size(j)):
                got = top_up(j, free, requested_size(j))
                if got:
                    alloc[j.id] = got
                    quota.take(j.user, requested_size(j))
        for j in order:
            if j.id in alloc or requested_size(j) > capacity:
                continue
            if not quota.fits(j.user, requested_size(j)):
                continue                     # held at its user's quota: blocks no one
            got = fill_hosts(free, requested_size(j))
            if got is None:
                break                        # head-of-line blocking: nothing behind it starts
            alloc[j.id] = got
            quota.take(j.user, requested_size(j))
        return alloc
