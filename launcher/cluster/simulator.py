"""A discrete-event simulator that drives the cluster's scheduling policies with simulated jobs.

The same :class:`launcher.cluster.policy.Policy` objects the service runs decide here, on the same
:class:`~launcher.cluster.policy.Snapshot`; the simulator replaces the jobs: each job is a number
of optimizer steps to do and a step time per placement.  It follows the published setting of
Pollux's simulator (Qiao et al., OSDI 2021): a scheduling round every ``round_s`` (60 s) seconds,
jobs seen from the first round at or after their submission, every allocation change costing the
job a stall with no progress.  ``event_rounds=True`` also runs a round at every arrival and
completion (what the live service does).

Costs of an allocation change (seconds, parameters of :func:`simulate`):

* ``restart_cost_s``: a start or a resume from a checkpoint (after a preemption): no progress for
  that long, the slots held.
* ``change_cost_s``: a resize.  With ``stop_free=False`` (checkpoint-restart rescaling, the
  published setting) the whole job stalls that long.  With ``stop_free=True`` (hvd_edl's switch,
  an elastic job) it is the switch stall: a job that grows keeps training on its old workers while
  the joiners build (``join_s``, their start-up time), then stalls ``change_cost_s`` while they
  enter the ring; a job that shrinks stalls ``change_cost_s`` and goes on at once on the smaller
  ring, its freed slots free at once.  A non-elastic job always restarts (``change_cost_s``).

Custom jobs (what the live service's benchmark predicts a real stream with)::

    from launcher.cluster.simulator import SimJob, simulate, pool_of
    from launcher.cluster.policies import make_policy
    jobs = [SimJob("j0", submitted_at=0.0, step_time=lambda pl: 0.1 / sum(pl) + 0.02,
                   total_steps=3000, np=2, min_np=1, max_np=4, samples_per_step=64),
            SimJob.from_samples("j1", 30.0, step_time=f, total_samples=96_000,
                                batch_size=64, np=2, min_np=1, max_np=4)]
    res = simulate(jobs, {"localhost": 4, "h1": 4}, make_policy("edl"),   # or pool_of(2, 4)
                   restart_cost_s=5.0, change_cost_s=0.3, stop_free=True, join_s=4.0,
                   event_rounds=True, timeline=True)
    res.avg_jct_s, res.makespan_s, res.utilisation, res.jobs["j0"].jct_s, res.to_dict()

``step_time(placement)`` is seconds per optimizer step at a placement (slots per host, largest
first, e.g. ``(4, 2)``); a job's throughput for the policies is ``samples_per_step /
step_time``.  Times are seconds from 0; JCT is completion minus submission.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from launcher.cluster.policy import (DEFAULT_USER, Allocation, JobView, Placement, Policy,
                                     Snapshot, check_allocation, placement_of)


def pool_of(nodes: int, slots: int, prefix: str = "n") -> Dict[str, int]:
    """A pool of ``nodes`` hosts of ``slots`` slots each: ``{"n000": 4, ...}``."""
    return {f"{prefix}{i:03d}": slots for i in range(nodes)}


@dataclass
class SimJob:
    """A simulated job.

    Attributes:
        id: unique job id.
        submitted_at: submission time, seconds.
        step_time: seconds per optimizer step at a placement (slots per host, largest first).
        total_steps: optimizer steps to complete.
        np, min_np, max_np: the requested size and the elastic bounds (None: ``np``).
        samples_per_step: global batch, samples (throughput = samples_per_step / step_time).
        priority: larger first among equals.
        elastic: resized without a restart when the simulation is ``stop_free``.
        user: who submitted it (fair share and the quota count per user; the default: one
            user for every job).
        batch: the job adapts its global batch (a :class:`launcher.cluster.progress.BatchModel`:
            Pollux's progress model; ``step_time`` and ``total_steps`` then follow its batch,
            ``samples_per_step`` is ignored) or None: a fixed batch.
    """
    id: str
    submitted_at: float
    step_time: Callable[[Placement], float]
    total_steps: float
    np: int
    min_np: Optional[int] = None
    max_np: Optional[int] = None
    samples_per_step: float = 1.0
    priority: int = 0
    elastic: bool = True
    user: str = DEFAULT_USER
    batch: Optional[object] = None

    def __post_init__(self):
        self.min_np = self.np if self.min_np is None else self.min_np
        self.max_np = self.np if self.max_np is None else self.max_np
        if not (1 <= self.min_np <= self.np <= self.max_np):
            raise ValueError(f"job {self.id}: need 1 <= min_np <= np <= max_np, got "
                             f"{self.min_np}, {self.np}, {self.max_np}")
        if self.total_steps <= 0:
            raise ValueError(f"job {self.id}: total_steps must be > 0, got {self.total_steps}")

    @classmethod
    def from_samples(cls, id: str, submitted_at: float, step_time: Callable[[Placement], float],
                     total_samples: float, batch_size: float, np: int, **kw) -> "SimJob":
        """A job that trains ``total_samples`` samples at global ``batch_size`` (fixed)."""
        return cls(id, submitted_at, step_time, total_samples / batch_size, np,
                   samples_per_step=batch_size, **kw)


@dataclass
class JobResult:
    """One job's outcome: times in seconds, ``gpu_s`` slot-seconds held."""
    id: str
    submitted_at: float
    started_at: Optional[float] = None
    finished_at: Optional[float] = None
    changes: int = 0
    batch_changes: int = 0
    preemptions: int = 0
    gpu_s: float = 0.0

    @property
    def jct_s(self) -> Optional[float]:
        """Completion minus submission (None while unfinished)."""
        return None if self.finished_at is None else self.finished_at - self.submitted_at


@dataclass
class SimResult:
    """What :func:`simulate` returns.

    Attributes:
        jobs: id -> :class:`JobResult`.
        avg_jct_s: mean JCT over the jobs.
        makespan_s: last completion minus first submission.
        utilisation: slot-seconds held by jobs / (pool slots x makespan).
        timeline: per round ``(t, {job: slots}, queued)`` when asked for.
    """
    jobs: Dict[str, JobResult]
    avg_jct_s: float
    makespan_s: float
    utilisation: float
    rounds: int
    timeline: List[Tuple[float, Dict[str, int], int]] = field(default_factory=list)

    def to_dict(self) -> Dict:
        """JSON-ready."""
        return {"avg_jct_s": self.avg_jct_s, "makespan_s": self.makespan_s,
                "utilisation": self.utilisation, "rounds": self.rounds,
                "jobs": {k: {"jct_s": j.jct_s, "submitted_at": j.submitted_at,
                             "started_at": j.started_at, "finished_at": j.finished_at,
                             "changes": j.changes, "batch_changes": j.batch_changes,
                             "preemptions": j.preemptions,
                             "gpu_s": j.gpu_s} for k, j in self.jobs.items()},
                "timeline": [[t, a, q] for t, a, q in self.timeline]}


class _Run:
    """A job's simulated state: progress, allocation, and the phases (until, steps/s) its last
    change set before it runs at its placement's rate."""

    def __init__(self, job: SimJob):
        self.job = job
        self.res = JobResult(job.id, job.submitted_at)
        self.hosts: Dict[str, int] = {}
        self.done = 0.0
        self.rate = 0.0
        self.phases: List[Tuple[float, float]] = []
        self.last_change_at = job.submitted_at
        self._rates: Dict[Tuple[Placement, Optional[int]], float] = {}
        self.batch = job.batch.b0 if job.batch is not None else None
        self.total = (job.batch.model.total_steps(self.batch) if job.batch is not None
                      else job.total_steps)       # optimizer steps to its end at its batch
        self.end_at: Optional[float] = None  # its last step done: it ends then (``end_s``)
        self.stop_at: Optional[float] = None  # preempted: it trains on and holds its slots
        #                                      until then (``stop_s``), then is suspended

    def rate_at(self, pl: Placement) -> float:
        if not pl:
            return 0.0
        r = self._rates.get((pl, self.batch))
        if r is None:
            st = (self.job.step_time(pl) if self.batch is None
                  else self.job.batch.step_time(pl, self.batch))
            r = self._rates[(pl, self.batch)] = 1.0 / st
        return r

    def view(self):
        """The goodput view a policy sees of an adapting job (None for a fixed batch)."""
        if self.batch is None:
            return None
        m = self.job.batch
        return m.view(m.model.progress(self.batch, self.done), self.batch)

    def set_batch(self, batch: int, t: float, stall_s: float) -> bool:
        """Run at global ``batch`` from ``t`` on (as run at its slots, whole micro-batches): the steps
        done and to do are converted at the progress reached, and a running job stalls
        ``stall_s`` (the switch that carries the change).  False if nothing changes."""
        m = self.job.batch
        n = sum(self.hosts.values())
        if batch == self.batch:
            return False
        p = m.model.progress(self.batch, self.done)
        e = m.model.epoch(p)
        factor = m.model.gain(self.batch, e) / m.model.gain(batch, e)
        self.phases = [(u, r * factor) for u, r in self.phases]
        self.batch = batch
        self.done = m.model.steps(batch, p)
        self.total = m.model.total_steps(batch)
        self.res.batch_changes += 1
        if n:
            self.rate = self.rate_at(placement_of(self.hosts))
            if stall_s > 0 and self.end_at is None:
                self.phases = [(t + stall_s, 0.0)] + [(u, r) for u, r in self.phases
                                                      if u > t + stall_s]
        return True

    def throughput(self, pl: Placement) -> float:
        return self.rate_at(tuple(pl)) * self.job.samples_per_step

    def rate_now(self, t: float) -> float:
        for until, r in self.phases:
            if t < until:
                return r
        return self.rate

    def finish_time(self, t0: float, end_s: float = 0.0) -> float:
        """When it ends if nothing changes (inf if never): its last step, plus ``end_s``."""
        if self.end_at is not None:
            return self.end_at
        return self._last_step_time(t0) + end_s

    def _last_step_time(self, t0: float) -> float:
        left, t = self.total - self.done, t0
        for until, r in self.phases:
            if until <= t:
                continue
            if r > 0 and left <= r * (until - t):
                return t + left / r
            left -= r * (until - t)
            t = until
        return t + left / self.rate if self.rate > 0 else math.inf

    def advance(self, t0: float, t1: float, end_s: float = 0.0) -> Optional[float]:
        """Progress over [t0, t1]; the completion time if it ends by t1 (its last step plus
        ``end_s``, the slots held meanwhile)."""
        n = sum(self.hosts.values())
        if self.end_at is None and not n:
            return None
        if self.end_at is None:
            last = self._last_step_time(t0)
            if last <= t1:
                self.done = self.total
                self.end_at = last + end_s
        if self.end_at is not None:
            self.res.gpu_s += n * max(0.0, min(self.end_at, t1) - t0)
            return self.end_at if self.end_at <= t1 else None
        self.res.gpu_s += n * (t1 - t0)
        t = t0
        for until, r in self.phases:
            if until <= t:
                continue
            seg = min(until, t1) - t
            self.done += r * seg
            t += seg
            if t >= t1:
                break
        if t < t1:
            self.done += self.rate * (t1 - t)
        self.phases = [(u, r) for u, r in self.phases if u > t1]
        return None


def simulate(jobs: Iterable[SimJob], pool: Dict[str, int], policy: Policy, *,
             round_s: float = 60.0, restart_cost_s: float = 30.0, change_cost_s: float = 30.0,
             stop_free: bool = False, join_s: float = 0.0, end_s: float = 0.0,
             stop_s: float = 0.0, event_rounds: bool = False,
             timeline: bool = False, max_time_s: float = 1e8,
             until_s: Optional[float] = None,
             batch_change_cost_s: Optional[float] = None) -> SimResult:
    """Run ``jobs`` on ``pool`` (host -> slots) under ``policy`` (the module's docstring).

    ``end_s``: seconds from a job's last step to its end (its script's last lines, the
    workers' and the launcher's exit), its slots held meanwhile.
    ``stop_s``: seconds from a preemption's decision to the job's suspension (the live
    service's checkpoint request and SIGTERM, honoured at a commit): the job trains on and
    holds its slots meanwhile, out of the policy's sight; one that finishes then ends done.
    ``until_s``: stop there (the averages then cover the jobs finished by then).
    ``batch_change_cost_s``: the stall of a running job whose batch alone changes (jobs with a
    ``batch`` model, as the policy's :meth:`~launcher.cluster.policy.Policy.batch_sizes` says);
    None: ``change_cost_s`` when ``stop_free``, else 0 (Pollux's simulator changes the batch at
    no cost).  A batch change with an allocation change costs what that change costs.
    Every allocation is checked (:func:`check_allocation`, AllocationError on a broken bound).
    Raises ValueError for duplicate job ids, RuntimeError (one line) if jobs remain that the
    policy never runs (e.g. larger than the pool) or past ``max_time_s``.
    """
    runs = sorted((_Run(j) for j in jobs), key=lambda r: (r.job.submitted_at, r.job.id))
    if len({r.job.id for r in runs}) != len(runs):
        raise ValueError("duplicate job ids")
    if not runs:
        return SimResult({}, 0.0, 0.0, 0.0, 0)
    capacity = sum(pool.values())
    if batch_change_cost_s is None:
        batch_change_cost_s = change_cost_s if stop_free else 0.0
    arrivals = list(runs)
    arrivals.reverse()                       # pop() the earliest
    active: List[_Run] = []
    t = 0.0
    next_round = 0.0
    n_rounds = 0
    idle_rounds = 0
    line: List[Tuple[float, Dict[str, int], int]] = []
    while arrivals or active:
        if until_s is not None and t >= until_s:
            break
        if not active and arrivals[-1].job.submitted_at > next_round:
            # nothing to do until the next arrival: skip the empty rounds
            at = arrivals[-1].job.submitted_at
            next_round = at if event_rounds else math.ceil(at / round_s) * round_s
        t_next = next_round
        if event_rounds:
            if arrivals:
                t_next = min(t_next, arrivals[-1].job.submitted_at)
            for r in active:
                if r.hosts or r.end_at is not None:
                    t_next = min(t_next, r.finish_time(t, end_s))
        for r in active:
            if r.stop_at is not None:
                t_next = min(t_next, r.stop_at)
        if t_next > max_time_s:
            raise RuntimeError(f"simulation passed {max_time_s:.0f} s with {len(active)} jobs left")
        ended = False
        for r in active:
            fin = r.advance(t, t_next, end_s)
            if fin is not None:
                r.res.finished_at = fin
                r.hosts = {}
                ended = True
        active = [r for r in active if r.res.finished_at is None]
        t = t_next
        for r in active:
            if r.stop_at is not None and r.stop_at <= t:   # the preempted run is suspended
                r.stop_at = None
                _change(r, {}, t, restart_cost_s, change_cost_s, stop_free, join_s)
                ended = True
        arrived = False
        while arrivals and arrivals[-1].job.submitted_at <= t:
            active.append(arrivals.pop())
            arrived = True
        is_round = t >= next_round
        if is_round:
            next_round = (math.floor(t / round_s) + 1) * round_s
        if not (is_round or (event_rounds and (ended or arrived))) or not active:
            continue
        n_rounds += 1
        for _ in range(len(active) + 1):   # again while preemptions hold slots (stop_s)
            stopping = [r for r in active if r.stop_at is not None]
            free_pool = dict(pool)
            for r in stopping:
                for h, k in r.hosts.items():
                    free_pool[h] -= k
            seen = [r for r in active if r.stop_at is None]
            views = {r.job.id: r.view() for r in seen}
            snap = Snapshot(now=t, pool=free_pool, jobs=tuple(
                JobView(id=r.job.id, submitted_at=r.job.submitted_at, np=r.job.np,
                        min_np=r.job.min_np, max_np=r.job.max_np, priority=r.job.priority,
                        allocation=dict(r.hosts), attained_gpu_s=r.res.gpu_s,
                        started=r.res.started_at is not None, last_change_at=r.last_change_at,
                        throughput=(r.throughput if views[r.job.id] is None
                                    else views[r.job.id].speed),
                        elastic=r.job.elastic and stop_free, goodput=views[r.job.id],
                        user=r.job.user)
                for r in seen), change_cost_s=change_cost_s, restart_cost_s=restart_cost_s,
                user_attained_gpu_s=_user_attained(runs))
            alloc: Allocation = policy.allocate(snap)
            check_allocation(snap, alloc, getattr(policy, "user_quota", None))
            # preempted with stop_s: it trains on and holds its slots until it stops (see
            # above), so the round is decided again without them
            stops = [r for r in seen if stop_s > 0 and r.hosts
                     and not any(alloc.get(r.job.id, {}).values())]
            for r in stops:
                r.stop_at = t + stop_s
            if not stops:
                break
        batches = policy.batch_sizes(snap, alloc)
        for r in seen:
            new = {h: k for h, k in alloc.get(r.job.id, {}).items() if k > 0}
            b = batches.get(r.job.id)
            if b is not None and r.batch is not None and r.job.batch.adapts:
                # the batch is carried by the allocation's change when there is one, else by
                # a switch of its own (``batch_change_cost_s``)
                n = sum(new.values())
                r.set_batch(r.job.batch.run_batch(n, b)[0] if n else b, t,
                            batch_change_cost_s if new == r.hosts else 0.0)
            if new != r.hosts:
                _change(r, new, t, restart_cost_s, change_cost_s, stop_free, join_s)
        if timeline:
            line.append((t, {r.job.id: sum(r.hosts.values()) for r in active if r.hosts},
                         sum(1 for r in active if not r.hosts)))
        if any(r.hosts for r in active) or arrivals:
            idle_rounds = 0
        else:
            idle_rounds += 1
            if idle_rounds > 2:
                raise RuntimeError(f"policy {policy.name} runs none of the {len(active)} jobs "
                                   f"left (first: {active[0].job.id}, np {active[0].job.np})")
    res = {r.job.id: r.res for r in runs}
    done = [j for j in res.values() if j.finished_at is not None]
    first = min(r.job.submitted_at for r in runs)
    last = max((j.finished_at for j in done), default=first)
    makespan = last - first
    busy = sum(r.res.gpu_s for r in runs)
    return SimResult(res, sum(j.jct_s for j in done) / len(done) if done else 0.0, makespan,
                     busy / (capacity * makespan) if makespan > 0 else 0.0, n_rounds, line)


def _user_attained(runs: List[_Run]) -> Dict[str, float]:
    """user -> GPU-seconds its jobs held so far, ended jobs included."""
    out: Dict[str, float] = {}
    for r in runs:
        if r.res.gpu_s:
            out[r.job.user] = out.get(r.job.user, 0.0) + r.res.gpu_s
    return out


def _change(r: _Run, new: Dict[str, int], t: float, restart_cost_s: float,
            change_cost_s: float, stop_free: bool, join_s: float) -> None:
    """Apply an allocation change to a job at ``t`` with its cost (the module's docstring)."""
    old = r.hosts
    old_rate = r.rate_now(t)
    r.hosts = dict(new)
    r.rate = r.rate_at(placement_of(new))
    r.last_change_at = t
    r.res.changes += 1
    if not new:                                   # suspended to its checkpoint
        r.res.preemptions += 1
        r.phases = []
        return
    if not old:                                   # start, or resume from the checkpoint
        if r.res.started_at is None:
            r.res.started_at = t
        r.phases = [(t + restart_cost_s, 0.0)]
        return
    kept = {h: min(k, new.get(h, 0)) for h, k in old.items() if new.get(h, 0) > 0}
    if not (stop_free and r.job.elastic):
        r.phases = [(t + change_cost_s, 0.0)]
        return
    if not kept:                                  # nothing stays: a restart elsewhere
        r.phases = [(t + restart_cost_s, 0.0)]
        return
    leaves = any(k > new.get(h, 0) for h, k in old.items())
    joins = any(k > old.get(h, 0) for h, k in new.items())
    phases: List[Tuple[float, float]] = []
    at = t
    rate = old_rate
    if leaves:                                    # the leavers go: a stall, then the kept ring
        at += change_cost_s
        phases.append((at, 0.0))
        rate = r.rate_at(placement_of(kept))
    if joins:                                     # joiners build while the ring trains
        if join_s > 0:
            at += join_s
            phases.append((at, rate))
        at += change_cost_s
        phases.append((at, 0.0))
    r.phases = phases
