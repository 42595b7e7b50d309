"""Fair share between users: the order in which the policies consider jobs, and the per-user quota.

A team's cluster is shared by several Unix users (DESIGN.md, round 4, "Users"); without this,
Tiresias's least attained service is fair per *job*, so one user's ten jobs take ten times the
GPUs of another's one.  The rule, one level up from Tiresias (Gu et al., NSDI 2019):

* **Progressive filling between users** (max-min fairness of slots, as DRF's progressive filling
  for one resource, Ghodsi et al., NSDI 2011, and Slurm's fair-tree ordering do).  Each user's
  jobs keep the policy's own order (fifo: priority then submission; tiresias and edl: 2D-LAS).
  A job's *slots ahead* is what its user's earlier jobs in that order ask for; jobs are then taken
  by (the policy's tier, the job's slots ahead, its user's attained-service band, the policy's own
  key).  So every user's first job comes before anyone's second one, a user with ten 4-slot jobs
  gets its third one considered only after every other user has had 8 slots' worth: one user's
  ten jobs do not starve another's one.  The tier is Tiresias's queue (tiresias, edl; none for
  fifo): a long-running job of a light user still yields to everyone's short jobs, as in 2D-LAS.
* **Lending** (edl, goodput): spare slots go first to a user holding less than an equal share
  (the pool / the users with admitted jobs), the fewest slots first, then to the best increment
  of anyone's, as without users (:class:`launcher.cluster.policies.edl.EdlPolicy`).
* **Attained service per user** breaks ties between users at equal slots ahead: a user's
  GPU-seconds (every job it ever ran, ended ones included, :attr:`Snapshot.user_attained_gpu_s`)
  in bands that double in GPU-hours (0, 1, 3, 7, 15, ... GPU-h: the band is
  ``floor(log2(1 + GPU-h))``), least first.  Bands, not the raw figure, for Tiresias's own reason:
  an order that flips whenever two users' totals cross would preempt and restart jobs every
  round; a band changes at most once per doubling of a user's usage.
* **Quota** (``user_quota``, Slurm's ``MaxTRESPerUser``): no user holds more than that many
  slots.  A job that would take its user past it is passed over (it does not block the jobs
  behind it, as Slurm holds a job at a QOS limit); :func:`launcher.cluster.policy.check_allocation`
  enforces it.

With one user (every :attr:`JobView.user` the default) the slots ahead grow along the policy's
own order and the band is the same for all jobs, so the order, and every allocation, is today's.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

from launcher.cluster.policy import Allocation, JobView, Snapshot

OwnKey = Callable[[JobView], Tuple]
"""A policy's own sort key of a job (fifo: priority, submission; tiresias: queue, ...)."""


def user_attained(snap: Snapshot) -> Dict[str, float]:
    """user -> attained service, GPU-seconds: :attr:`Snapshot.user_attained_gpu_s` (ended jobs
    included) where the snapshot carries it, else (or where it is less) the sum over the user's
    jobs in the snapshot."""
    out: Dict[str, float] = {}
    for j in snap.jobs:
        out[j.user] = out.get(j.user, 0.0) + j.attained_gpu_s
    for u, s in snap.user_attained_gpu_s.items():
        out[u] = max(out.get(u, 0.0), float(s))
    return out


def attained_band(gpu_s: float) -> int:
    """The attained-service band of a user: ``floor(log2(1 + GPU-hours))`` (0 below 1 GPU-h,
    1 below 3, 2 below 7, ...)."""
    return int(math.floor(math.log2(1.0 + max(0.0, gpu_s) / 3600.0)))


def user_bands(snap: Snapshot) -> Dict[str, int]:
    """user -> :func:`attained_band` of its attained service (:func:`user_attained`)."""
    return {u: attained_band(s) for u, s in user_attained(snap).items()}


def fair_order(snap: Snapshot, own_key: OwnKey, size: Callable[[JobView], int],
               tier: Optional[Callable[[JobView], int]] = None) -> List[JobView]:
    """The jobs of ``snap`` in fair-share order (the module's docstring).

    Args:
        own_key: the policy's order of one user's jobs.
        size: slots a job asks for (its start size: ``np`` when gang scheduled, ``min_np`` under
            edl); what counts toward its user's later jobs' slots ahead.
        tier: an order above fairness (Tiresias's queue); None: none.
    Returns every job once.  One user: the same order as ``sorted(jobs, key=own_key)``.
    """
    band = user_bands(snap)
    ahead: Dict[str, int] = {}
    keyed = []
    for j in sorted(snap.jobs, key=own_key):
        a = ahead.get(j.user, 0)
        ahead[j.user] = a + size(j)
        keyed.append(((tier(j) if tier else 0, a, band.get(j.user, 0)) + tuple(own_key(j)), j))
    keyed.sort(key=lambda kj: kj[0])
    return [j for _, j in keyed]


class Quota:
    """Slots each user may still take this round under a per-user cap.

    Args:
        user_quota: most slots one user holds (None: no cap; else >= 1).
    """

    def __init__(self, user_quota: Optional[int]):
        self.user_quota = user_quota
        self.held: Dict[str, int] = {}

    def room(self, user: str) -> float:
        """Slots ``user`` may still take (inf without a cap)."""
        if self.user_quota is None:
            return math.inf
        return max(0, self.user_quota - self.held.get(user, 0))

    def holds(self, user: str) -> int:
        """Slots counted against ``user`` so far this round."""
        return self.held.get(user, 0)

    def fits(self, user: str, n: int) -> bool:
        """Whether ``user`` may take ``n`` more slots."""
        return n <= self.room(user)

    def take(self, user: str, n: int) -> None:
        """Count ``n`` more slots against ``user``."""
        self.held[user] = self.held.get(user, 0) + n


def check_user_quota(user_quota: Optional[int]) -> Optional[int]:
    """``user_quota`` if None or an int >= 1; ValueError (one line) otherwise."""
    if user_quota is None:
        return None
    if isinstance(user_quota, bool) or not isinstance(user_quota, int) or user_quota < 1:
        raise ValueError(f"user quota must be a whole number of slots >= 1, got {user_quota!r}")
    return user_quota


def slots_per_user(snap: Snapshot, alloc: Allocation) -> Dict[str, int]:
    """user -> slots ``alloc`` gives that user's jobs."""
    users = {j.id: j.user for j in snap.jobs}
    out: Dict[str, int] = {}
    for job_id, hosts in alloc.items():
        if job_id in users:
            out[users[job_id]] = out.get(users[job_id], 0) + sum(hosts.values())
    return out

