"""``fifo``: gang-scheduled static jobs at their requested size, first come first served.

What a Horovod user gets today from a plain queue in front of ``horovodrun -np N``: a job starts
when its ``np`` slots are free, all at once (gang scheduling), keeps them until it ends, is never
resized or preempted.  Plain FIFO, no backfilling: when the head of the queue does not fit, nothing
behind it starts (head-of-line blocking), even a job that would fit.  A job larger than the whole
pool can never start and is passed over (it would block the queue for ever).
"""
from __future__ import annotations

from typing import Dict

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


class FifoPolicy(Policy):
    """First come first served, gang-scheduled, no backfilling (the module's docstring).  Queue
    order: larger ``priority`` first, then submission time, then id."""

    name = "fifo"

    def allocate(self, snap: Snapshot) -> Allocation:
        free = dict(snap.pool)
        capacity = sum(free.values())
        alloc: Allocation = {}
        order = sorted(snap.jobs, key=lambda j: (-j.priority, j.submitted_at, j.id))
        for j in order:                      # running jobs keep what they hold
            if j.allocation:
                got = top_up(j, free, requested_size(j))
                if got:
                    alloc[j.id] = got
        for j in order:
            if j.id in alloc or requested_size(j) > capacity:
                continue
            got = fill_hosts(free, requested_size(j))
            if got is None:
                break                        # head-of-line blocking: nothing behind it starts
            alloc[j.id] = got
        return alloc
