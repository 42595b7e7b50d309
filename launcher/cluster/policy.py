"""What a cluster scheduling policy sees and what it decides.

A policy is a pure function of a :class:`Snapshot` (the pool, every job not ended, the time) to an
allocation: for each job, host -> slots.  The same policy objects run in the live service
(``launcher.cluster``) and in the discrete-event simulator, so the simulator predicts what the
service will do (DESIGN.md, "The multi-tenant cluster").

An allocation names every job that is to hold slots after this round; a job absent from it (or
mapped to ``{}``) holds none: a queued job stays queued, a running job is suspended (to its
checkpoint: a preemption; only policies that preempt do that).  :func:`check_allocation` is
the one place the bounds are enforced, for every policy, live and simulated.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

Allocation = Dict[str, Dict[str, int]]
"""job id -> {host: slots}; hosts are pool hosts, slots >= 1."""

Placement = Tuple[int, ...]
"""Slots a job holds per host, largest first, hosts with none left out: ``(4, 4)`` is four on
each of two hosts (the Pollux profiles' ``44``)."""


def placement_of(hosts: Mapping[str, int]) -> Placement:
    """The :data:`Placement` of a host -> slots mapping (``{"a": 1, "b": 3}`` -> ``(3, 1)``)."""
    return tuple(sorted((n for n in hosts.values() if n > 0), reverse=True))


DEFAULT_USER = ""
"""The user of every job in a cluster without users (:attr:`JobView.user`)."""


@dataclass(frozen=True)
class JobView:
    """One job as a policy sees it.

    Attributes:
        id: the job id (unique in the cluster).
        submitted_at: Unix seconds (simulated seconds in the simulator).
        np: the world size the user asked for (``--np``; what a static scheduler gives it).
        min_np, max_np: the elastic bounds (a static job has ``min_np == max_np == np``).
        priority: larger first among equals (0 by default).
        allocation: host -> slots it holds now; empty while queued or suspended.
        attained_gpu_s: service attained so far, GPU-seconds (slots x seconds held): Tiresias's
            two-dimensional attained service (Gu et al., NSDI 2019).
        started: it has run before (a job without slots that started is *suspended*: resuming
            restarts it from its checkpoint).
        last_change_at: when its allocation last changed (seconds, same clock as ``now``); hold
            times count from here.
        throughput: samples/s at a placement, from the job's speed model (profile + telemetry,
            ``launcher.apps.speed_model``); None while nothing is known (policies then assume
            linear scaling from one slot).
        elastic: it may be resized without a restart (an hvd-edl-run job with min < max).
        user: who submitted it (a Unix user name); fair share and the quota count per user
            (:mod:`launcher.cluster.fair_share`).  The default, one user for every job, is a
            cluster without users: every policy then decides as it did before users existed.
        goodput: its goodput model (:class:`launcher.cluster.goodput.GoodputView`: gradient
            statistics, batch bounds, step times) when it reports one, else None; a job whose
            view ``adapts`` takes the batch :meth:`Policy.batch_sizes` gives it.
        goal: its objective (``launcher.cluster.choice.Goal.as_dict()`` plus ``done_samples``,
            samples trained so far); None: none (issue 42).
        speed_of: samples/s on ``n`` GPUs of a type (``launcher.cluster.speed.typed_speed``;
            None where unknown).
        spent_usd: dollars it has cost so far.
        displaced: slots its run still uses on hosts that left the pool (a drain with a
            deadline, a spot notice): it runs there until given slots elsewhere (a stop-free
            move: make-before-break, :mod:`launcher.cluster.make_before_break`) or preempted;
            0 for every other job.
    """
    id: str
    submitted_at: float
    np: int
    min_np: int
    max_np: int
    priority: int = 0
    allocation: Mapping[str, int] = field(default_factory=dict)
    attained_gpu_s: float = 0.0
    started: bool = False
    last_change_at: float = 0.0
    throughput: Optional[Callable[[Placement], float]] = None
    elastic: bool = True
    user: str = DEFAULT_USER
    goodput: Optional[object] = None
    goal: Optional[Mapping[str, object]] = None
    speed_of: Optional[Callable[[str, int], Optional[float]]] = None
    spent_usd: float = 0.0
    displaced: int = 0

    @property
    def world_size(self) -> int:
        """Slots held now."""
        return sum(self.allocation.values())


@dataclass(frozen=True)
class Snapshot:
    """The state a policy decides on.

    Attributes:
        now: seconds (Unix live, simulated in the simulator).
        pool: host -> usable slots (hosts leaving the pool are already gone).
        jobs: every job not ended (queued, running, suspended), in submission order.
        change_cost_s: seconds of no progress that one allocation change costs a job (start,
            grow, shrink, suspend, resume): 30 s for a checkpoint restart, a fraction of a second
            for a stop-free switch.
        restart_cost_s: seconds a (re)start from nothing or from a checkpoint costs a job.
        user_attained_gpu_s: user -> GPU-seconds its jobs attained, ended jobs included (fair
            share's attained service per user); a user missing counts its jobs in ``jobs``.
        hosts: host -> its terms (``launcher.discovery.prices.HostTerms``: GPU type, price per
            GPU-hour, spot, revocations per hour, a replacement's start-up); empty: an untyped
            pool where every host counts the same.
    """
    now: float
    pool: Mapping[str, int]
    jobs: Tuple[JobView, ...]
    change_cost_s: float = 30.0
    restart_cost_s: float = 30.0
    user_attained_gpu_s: Mapping[str, float] = field(default_factory=dict)
    hosts: Mapping[str, object] = field(default_factory=dict)

    def job(self, job_id: str) -> JobView:
        """The job with that id (KeyError if none)."""
        for j in self.jobs:
            if j.id == job_id:
                return j
        raise KeyError(job_id)


class AllocationError(ValueError):
    """A policy's allocation breaks a bound (one line, naming the job and the bound)."""


def check_allocation(snap: Snapshot, alloc: Allocation, user_quota: Optional[int] = None) -> None:
    """Raise :class:`AllocationError` unless ``alloc`` keeps every bound of ``snap``: every job is
    known, every host is in the pool, no host's slots are promised beyond its capacity (so never
    one slot to two jobs), a job that holds slots holds between its ``min_np`` and ``max_np``,
    and no user holds more than ``user_quota`` slots (None: no cap; the policy's
    :attr:`Policy.user_quota`)."""
    used: Dict[str, int] = {}
    per_user: Dict[str, int] = {}
    ids = {j.id: j for j in snap.jobs}
    for job_id, hosts in alloc.items():
        if job_id not in ids:
            raise AllocationError(f"allocation for unknown job {job_id!r}")
        n = 0
        for host, k in hosts.items():
            if host not in snap.pool:
                raise AllocationError(f"job {job_id}: host {host!r} is not in the pool")
            if not isinstance(k, int) or k < 1:
                raise AllocationError(f"job {job_id}: {k!r} slots on {host}")
            used[host] = used.get(host, 0) + k
            n += k
        j = ids[job_id]
        if n and not j.min_np <= n <= j.max_np:
            raise AllocationError(f"job {job_id}: {n} slots outside [{j.min_np}, {j.max_np}]")
        per_user[j.user] = per_user.get(j.user, 0) + n
    if user_quota is not None:
        for user, n in per_user.items():
            if n > user_quota:
                raise AllocationError(f"user {user or '(default)'}: {n} slots, over the "
                                      f"quota of {user_quota}")
    for host, k in used.items():
        if k > snap.pool[host]:
            raise AllocationError(f"host {host}: {k} slots promised, {snap.pool[host]} exist")


class Policy(abc.ABC):
    """A scheduling policy: :meth:`allocate` is called once per scheduling round (and on every
    arrival, end and pool change); it must be deterministic for a given snapshot and may keep
    no state that the snapshot does not carry (the service restarts it from the store).

    Attributes:
        fair_share: it orders jobs fair between users (:mod:`launcher.cluster.fair_share`; no
            effect with one user); False for a policy that does not.
        user_quota: most slots one user holds (None: no cap); every allocation keeps it.
    """

    name: str = "policy"
    fair_share: bool = False
    user_quota: Optional[int] = None

    @abc.abstractmethod
    def allocate(self, snap: Snapshot) -> Allocation:
        """The allocation after this round (see the module's docstring)."""

    def batch_sizes(self, snap: Snapshot, alloc: Allocation) -> Dict[str, int]:
        """The global batch (samples) each job whose ``goodput`` view adapts is to run at with
        ``alloc`` (job id -> batch; a job left out keeps its batch).  The default chooses none:
        only goodput policies (Pollux, OSDI 2021) co-adapt the batch with the allocation."""
        return {}


def fill_hosts(free: Dict[str, int], n: int, prefer: Sequence[str] = ()) -> Optional[Dict[str, int]]:
    """Take ``n`` slots out of ``free`` (host -> free slots, changed in place), packed onto as few
    hosts as possible, hosts in ``prefer`` first (a job's current hosts: fewer moves); None, and
    ``free`` unchanged, when fewer than ``n`` are free (a negative count, a host over-held,
    counts as 0: it does not hide another host's free slots)."""
    if n <= 0:
        return {}
    if sum(max(0, k) for k in free.values()) < n:
        return None
    taken: Dict[str, int] = {}
    order = [h for h in prefer if free.get(h, 0) > 0]
    # then the host with the most free slots first, so a job lands on as few hosts as possible
    order += sorted((h for h in free if h not in order and free[h] > 0), key=lambda h: (-free[h], h))
    for h in order:
        k = min(free[h], n - sum(taken.values()))
        if k > 0:
            taken[h] = k
        if sum(taken.values()) == n:
            break
    for h, k in taken.items():
        free[h] -= k
    return taken
