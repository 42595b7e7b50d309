"""``goodput``: elastic scheduling that co-adapts every job's GPUs and global batch for goodput.

Pollux (Qiao et al., "Pollux: Co-adaptive Cluster Scheduling for Goodput-Optimized Deep
Learning", OSDI 2021) chooses each job's GPUs to maximise a fairness-weighted power mean of the
jobs' speed-ups of *goodput* (throughput x statistical efficiency at the best batch for those
GPUs), and each job then trains at that best batch; it pays a checkpoint-restart for every
change, so it changes rarely.  Here a change is a stop-free switch (a fraction of a second), so
the rest of ``edl``'s round (:mod:`launcher.cluster.policies.edl`) applies unchanged, with
goodput as the speed:

1. **Speed = goodput.** A job that reports a goodput model (``JobView.goodput``, a
   :class:`launcher.cluster.goodput.GoodputView`) is judged at every placement by its goodput at
   the best batch for that placement (~50 geometric candidates within its bounds); admission in
   2D-LAS order, lending of spare slots by the relative goodput gain per slot weighted by the
   attained-service queue, the hold and the pay-back of the switch cost are ``edl``'s.
2. **The batch** (:meth:`GoodputPolicy.batch_sizes`): a job that adapts runs at the best batch
   for the placement it gets; while its placement stays, its batch changes only for more than
   :data:`launcher.cluster.goodput.SWITCH_GAIN` (5 %) more goodput (AdaptDL's rule), since a
   batch change alone costs a switch.  A job that did not opt in keeps its batch (and is judged
   at it).

Jobs without a goodput model are scheduled exactly as by ``edl``.
"""
from __future__ import annotations

from typing import Dict

from launcher.cluster.goodput import SWITCH_GAIN
from launcher.cluster.policy import Allocation, Snapshot, placement_of
from launcher.cluster.policies.edl import EdlPolicy


class GoodputPolicy(EdlPolicy):
    """``edl`` with goodput as each job's speed and the batch chosen with the allocation (the
    module's docstring).  Same arguments as :class:`~launcher.cluster.policies.edl.EdlPolicy`
    (``objective`` jct by default)."""

    name = "goodput"

    def batch_sizes(self, snap: Snapshot, alloc: Allocation) -> Dict[str, int]:
        """Job id -> global batch for every job whose goodput view adapts and that holds slots
        in ``alloc``: the best batch at its placement, kept while the placement is unchanged
        unless the best gains over 5 %."""
        out: Dict[str, int] = {}
        for j in snap.jobs:
            v = j.goodput
            hosts = {h: k for h, k in alloc.get(j.id, {}).items() if k > 0}
            if v is None or not v.adapts or not hosts:
                continue
            pl = placement_of(hosts)
            g, b = v.best(pl)
            if g <= 0:
                continue
            if hosts == dict(j.allocation) and g <= (1 + SWITCH_GAIN) * v.at(pl, v.batch):
                continue
            out[j.id] = b
        return out
