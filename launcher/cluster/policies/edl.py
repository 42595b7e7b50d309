"""``edl``: elastic scheduling, EDL's "elastic Tiresias".

Wu et al., "Elastic deep learning in multi-tenant GPU cluster" (arXiv 1909.11985): jobs start as
soon as their minimum fits, spare GPUs are lent to running jobs where they add the most, and when
work arrives the lent GPUs are taken back at once by stop-free scale-in instead of preempting.
One round, a pure function of the snapshot:

1. **Admission, 2D-LAS.** Jobs in Tiresias's order (attained-service queues, then submission;
   :func:`launcher.cluster.policies.tiresias.las_order`); each whose ``min_np`` fits in what is
   left of the pool is admitted at ``min_np``.  A running job that is not admitted is suspended
   (preempted to its checkpoint); an arrival therefore first reclaims lent slots, and only when
   every admitted job is at its minimum does it preempt the lowest in the order.
2. **Hold.** A running job changed less than ``hold_s`` ago keeps its size (as far as the slots
   left after admission allow): no job is resized twice within a hold, so no oscillation.
3. **Lending.** The slots left go one increment at a time to the admitted job whose speed model
   (``JobView.throughput``; linear in the slots when unknown) says the next increment of
   ``k`` slots (up to filling two hosts, so that a job may cross onto a new host) adds the most:
   ``jct``: the relative throughput gain per slot, weighted ``queue_weight ** queue`` (least
   attained service first); ``throughput``: the samples/s gained per slot; ``efficiency:E``: as
   ``jct``, never an increment whose workers add less than ``E`` x a lone worker's samples/s.
   Slots a job already holds are kept at no cost; new slots for a running job must pay back the
   switch: the gain over ``payback_s`` must beat the samples lost in ``snap.change_cost_s``
   (``gain x (payback_s - c) > throughput x c``), else the change is not made.
4. **Placement.** Sizes are judged at compact placements (fewest hosts); a job that shrinks gives
   back its slots on its least-used hosts first (it compacts), one that grows takes slots on its
   own hosts first, then on the hosts with the most free slots; new jobs are placed largest first.
   A job spread over more hosts than it needs moves onto fewer (a stop-free shrink and grow
   where it keeps a host, a restart where it keeps none) when its speed model says that pays back
   the move over ``payback_s``.

Every job stays within ``[min_np, max_np]`` while it holds slots and no slot goes to two jobs
(:func:`launcher.cluster.policy.check_allocation`).

Several users (``fair_share``, on by default): admission takes the jobs fair between users within
each 2D-LAS queue (:func:`launcher.cluster.fair_share.fair_order`, a job's size its ``min_np``), so
another user's arrival takes back lent slots before the first user's later jobs are admitted.
``user_quota`` caps the slots one user holds: admission, hold and lending all stop at it.  With
one user both change nothing.
"""
from __future__ import annotations

import heapq
from typing import Dict, List, Optional, Sequence, Tuple

from launcher.cluster.fair_share import Quota, check_user_quota, user_bands
from launcher.cluster.policy import (Allocation, JobView, Placement, Policy, Snapshot, fill_hosts,
                                     placement_of)
from launcher.cluster.policies.fifo import keep_hosts
from launcher.cluster.policies.tiresias import DEFAULT_THRESHOLDS_GPU_S, las_order, queue_index

OBJECTIVES = ("jct", "throughput", "efficiency")


def compact_placement(n: int, host_slots: int) -> Placement:
    """``n`` slots on as few hosts of ``host_slots`` slots as possible: ``(4, 4, 2)`` for 10 on
    4-slot hosts."""
    full, rest = divmod(n, host_slots)
    return tuple([host_slots] * full + ([rest] if rest else []))


class EdlPolicy(Policy):
    """Elastic Tiresias (the module's docstring).

    Args:
        objective: ``jct``, ``throughput`` or ``efficiency``.
        efficiency: E of ``efficiency:E`` (0 < E <= 1); only with that objective.
        thresholds_gpu_s: 2D-LAS queue thresholds, GPU-seconds.
        hold_s: seconds a job keeps its size after a change (None: the larger of 60 s and 20 x
            the snapshot's change cost).
        payback_s: horizon a change must pay back its switch cost over (None: the larger of
            600 s and the hold time).
        queue_weight: per-queue weight of the ``jct`` objective (0 < w <= 1).
        fair_share: admission fair between users (the module's docstring).
        user_quota: most slots one user holds (None: no cap).
    Raises ValueError (one line) for a bad objective or parameter.
    """

    name = "edl"

    def __init__(self, objective: str = "jct", efficiency: Optional[float] = None,
                 thresholds_gpu_s: Sequence[float] = DEFAULT_THRESHOLDS_GPU_S,
                 hold_s: Optional[float] = None, payback_s: Optional[float] = None,
                 queue_weight: float = 0.5, fair_share: bool = True,
                 user_quota: Optional[int] = None):
        if objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {objective!r} (jct, throughput or efficiency:E)")
        if (objective == "efficiency") != (efficiency is not None):
            raise ValueError("efficiency:E needs E, and only that objective takes one")
        if efficiency is not None and not 0 < efficiency <= 1:
            raise ValueError(f"efficiency E must be in (0, 1], got {efficiency}")
        if not 0 < queue_weight <= 1:
            raise ValueError(f"queue_weight must be in (0, 1], got {queue_weight}")
        self.objective = objective
        self.efficiency = efficiency
        self.thresholds_gpu_s = tuple(thresholds_gpu_s)
        self.hold_s = hold_s
        self.payback_s = payback_s
        self.queue_weight = queue_weight
        self.fair_share = bool(fair_share)
        self.user_quota = check_user_quota(user_quota)

    def order(self, snap: Snapshot) -> List[JobView]:
        """The jobs in admission order (2D-LAS, fair between users at each job's ``min_np``)."""
        return las_order(snap, self.thresholds_gpu_s, fair_share=self.fair_share,
                         size=lambda j: j.min_np)

    # -- the speed model -------------------------------------------------------------------------
    @staticmethod
    def _speed(j: JobView, n: int, host_slots: int) -> float:
        if n <= 0:
            return 0.0
        if j.throughput is None:
            return float(n)
        return j.throughput(compact_placement(n, host_slots))

    def _best_increment(self, j: JobView, n: int, cur: int, spare: int, host_slots: int,
                        weight: float, threshold: float, may_grow: bool
                        ) -> Optional[Tuple[float, int]]:
        """(score per slot, k) of the best next increment of ``j`` from ``n`` slots, or None."""
        top = min(j.max_np, n + spare)
        if not may_grow:
            top = min(top, max(cur, n))
        if top <= n:
            return None
        x0 = self._speed(j, n, host_slots)
        lone = self._speed(j, 1, host_slots)
        best: Optional[Tuple[float, int]] = None
        for m in range(n + 1, min(top, n + 2 * host_slots) + 1):
            k = m - n
            gain = self._speed(j, m, host_slots) - x0
            new = max(0, m - max(cur, n))            # slots beyond what it holds now
            if new and cur:                          # a change of a running job: pay it back
                gain -= threshold * x0
            if gain <= 0:
                continue
            if self.efficiency is not None and gain / k < self.efficiency * lone:
                continue
            if self.objective == "throughput":
                score = gain / k
            else:
                score = weight * gain / k / (x0 if x0 > 0 else lone)
            if best is None or score > best[0] + 1e-12:
                best = (score, k)
        return best

    # -- one round -------------------------------------------------------------------------------
    def allocate(self, snap: Snapshot) -> Allocation:
        pool = dict(snap.pool)
        capacity = sum(pool.values())
        host_slots = max(pool.values(), default=1)
        cost = snap.change_cost_s
        hold_s = self.hold_s if self.hold_s is not None else max(60.0, 20.0 * cost)
        payback_s = self.payback_s if self.payback_s is not None else max(600.0, hold_s)
        threshold = cost / (payback_s - cost) if payback_s > cost else float("inf")

        order = self.order(snap)
        size: Dict[str, int] = {}
        left = capacity
        quota = Quota(self.user_quota)
        for j in order:                               # 1. admission at min_np, 2D-LAS order
            if j.min_np <= left and quota.fits(j.user, j.min_np):
                size[j.id] = j.min_np
                left -= j.min_np
                quota.take(j.user, j.min_np)
        admitted = [j for j in order if j.id in size]
        cur = {j.id: min(j.world_size, j.max_np) for j in admitted}
        for j in admitted:                            # 2. hold: keep the size of a recent change
            if cur[j.id] > size[j.id] and snap.now - j.last_change_at < hold_s:
                extra = int(min(cur[j.id] - size[j.id], left, quota.room(j.user)))
                size[j.id] += extra
                left -= extra
                quota.take(j.user, extra)
        held = {j.id for j in admitted if j.world_size and snap.now - j.last_change_at < hold_s}
        weight = {j.id: self.queue_weight ** queue_index(j, snap.now, self.thresholds_gpu_s)
                  for j in admitted}
        # 3. lending, best increment first; fair between users: one heap per user, the user
        # holding the fewest slots so far lends next (progressive filling; one user: one heap)
        heaps: Dict[str, List[Tuple[float, int, int]]] = {}
        rank = {j.id: i for i, j in enumerate(admitted)}
        band = user_bands(snap)
        share = capacity / max(1, len({j.user for j in admitted}))

        def push(j: JobView) -> None:
            spare = int(min(left, quota.room(j.user)))
            b = self._best_increment(j, size[j.id], cur[j.id], spare, host_slots, weight[j.id],
                                     threshold, j.id not in held)
            if b is not None:
                # ties: what it holds first (no change), then the 2D-LAS order
                heapq.heappush(heaps.setdefault(j.user if self.fair_share else "", []),
                               (-b[0], b[1], rank[j.id]))

        for j in admitted:
            push(j)
        while left > 0:
            lenders = [u for u, h in heaps.items() if h]
            if not lenders:
                break
            below = [u for u in lenders if quota.holds(u) < share]
            if below:                                 # a user under its share lends first
                u = min(below, key=lambda u: (quota.holds(u), band.get(u, 0), u))
            else:                                     # then the best increment of anyone's
                u = min(lenders, key=lambda u: heaps[u][0])
            _, k, i = heapq.heappop(heaps[u])
            j = admitted[i]
            if k > left or not quota.fits(j.user, k):   # stale: fewer slots left than it wanted
                push(j)
                continue
            size[j.id] += k
            left -= k
            quota.take(j.user, k)
            push(j)
        return self._place(snap, admitted, size, hold_s, payback_s)

    def _place(self, snap: Snapshot, admitted: List[JobView], size: Dict[str, int],
               hold_s: float, payback_s: float) -> Allocation:
        """4. Hosts for the sizes: keep, compact, then pack (the module's docstring)."""
        free = dict(snap.pool)
        alloc: Allocation = {}
        for j in admitted:                            # what each keeps, its largest hosts first
            if j.allocation:
                alloc[j.id] = keep_hosts(j, free, size[j.id])
        growers = [j for j in admitted if alloc.get(j.id)]
        starters = sorted((j for j in admitted if not alloc.get(j.id)),
                          key=lambda j: -size[j.id])
        for j in growers + starters:
            have = alloc.get(j.id, {})
            need = size[j.id] - sum(have.values())
            mine = sorted(have, key=lambda h: -have[h])
            trial = dict(free)
            more = fill_hosts(trial, need, prefer=mine) if need > 0 else {}
            if more is None:                          # cannot happen: sizes fit the pool
                raise AssertionError(f"edl: {need} slots for {j.id} not free")
            got = dict(have)
            for h, k in more.items():
                got[h] = got.get(h, 0) + k
            if have and j.throughput is not None and (
                    need > 0 or snap.now - j.last_change_at >= hold_s):
                # a scattered job moves onto fewer hosts where that pays back the move
                moved, rest = _compact(free, have, size[j.id])
                if len(moved) < len(got):
                    overlap = any(h in have for h in moved)
                    cost = snap.change_cost_s if overlap else snap.restart_cost_s
                    x_got, x_moved = j.throughput(placement_of(got)), j.throughput(placement_of(moved))
                    if payback_s > cost and (x_moved - x_got) * (payback_s - cost) > x_got * cost:
                        got, trial = moved, rest
            free = trial
            alloc[j.id] = got
        return {k: v for k, v in alloc.items() if v}


def _compact(free: Dict[str, int], have: Dict[str, int], n: int):
    """``n`` slots on the fewest hosts out of ``free`` plus the job's own ``have`` (its own hosts
    first among equals): (hosts -> slots, what stays free)."""
    avail = dict(free)
    for h, k in have.items():
        avail[h] = avail.get(h, 0) + k
    out: Dict[str, int] = {}
    for h in sorted(avail, key=lambda h: (-avail[h], h not in have, h)):
        k = min(avail[h], n - sum(out.values()))
        if k <= 0:
            break
        out[h] = k
        avail[h] -= k
    return out, avail
