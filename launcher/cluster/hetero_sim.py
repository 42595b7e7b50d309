"""A round-based simulator of Sia's heterogeneous cluster (Jayaram Subramanya et al., "Sia:
Heterogeneity-aware, goodput-optimized ML-cluster scheduling", SOSP 2023), written from the
paper's and the data README's description (no code of Sia's copied).

Setting (``../shared/traces/sia-sosp23/README.md``): 6 t4 nodes of 4 GPUs, 3 rtx nodes of 8,
2 a100 nodes of 8; a job runs on one GPU type; a partial-node allocation stays on one node,
larger ones take whole nodes; a scheduling round every ``round_s`` seconds.

Work: Pollux's progress model (:class:`launcher.cluster.progress.ProgressModel`: AdaScale's gain
per optimizer step at batch B, epochs from the validation runs, the job ends after its
application's epochs).  Step time: the type's own profile (``placements-<type>.csv``,
``scalability-<type>.csv`` through :class:`launcher.cluster.workload.Application`), times Sia's
calibration slowdown per application (:data:`SLOWDOWN`).  Within a round, a job progresses at
``gain(B, epoch) / step_s`` from the end of its stall until the round ends or it finishes.

Costs of an allocation change (per job, :class:`Costs`): ``restart``: Sia's simulated restart per
application (seconds of no progress, GPUs held, at every start and every change of type or size);
``stop_free``: hvd_edl's measured costs: a start costs ``start_s`` (a fresh launch to its first
step), a change of size or type costs ``switch_s`` of stall, the joiners' start-up (``join_s``)
overlapping training on the old workers (their GPUs held for it, counted in GPU time).

A policy is a callable ``policy(now, jobs, cluster) -> {job name: Alloc}`` over the active jobs
(:class:`SimJobState`); the simulator packs allocations onto nodes (:func:`pack`), drops what does
not fit, and advances time.  Policies: :mod:`launcher.cluster.policies.hetero_goodput` (ours) and
:func:`gavel_policy` here (the Gavel + TunedJobs baseline).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from launcher.cluster import goodput as gp
from launcher.cluster.progress import ProgressModel
from launcher.cluster.type_profiles import SIA_TYPES, sia_dir
from launcher.cluster.workload import EPOCHS, Application, TraceJob, traces_dir

CLUSTER: Dict[str, Tuple[int, int]] = {"t4": (6, 4), "rtx": (3, 8), "a100": (2, 8)}
"""Sia's heterogeneous cluster: type -> (nodes, GPUs per node)."""

SLOWDOWN: Dict[str, float] = {"cifar10": 1.8, "imagenet": 1.2, "yolov3": 1.2, "bert": 1.2,
                              "deepspeech2": 1.2, "ncf": 1.5}
"""Sia's calibration: simulated step times are multiplied by these (``SLOWDOWNS``)."""

SIA_RESTART_S: Dict[str, float] = {"cifar10": 50, "deepspeech2": 25, "bert": 120, "yolov3": 80,
                                   "imagenet": 250, "ncf": 15}
"""Sia's simulated restart cost per application (``rescale_time``), seconds."""


@dataclass(frozen=True)
class Costs:
    """What an allocation change costs a job (the module's docstring), seconds."""
    mode: str                       # "restart" or "stop_free"
    start_s: float = 0.0
    switch_s: float = 0.0
    join_s: float = 0.0

    def stall(self, app: str, first: bool) -> float:
        """Seconds of no progress for a start (``first``) or a change of ``app``'s job."""
        if self.mode == "restart":
            return float(SIA_RESTART_S.get(app, 30.0))
        return self.start_s if first else self.switch_s


@dataclass(frozen=True)
class Alloc:
    """``n`` GPUs of ``gpu_type`` at global ``batch`` (0: the job's own trace batch; -1: the best
    batch for goodput in each epoch, Pollux's choice)."""
    gpu_type: str
    n: int
    batch: int = 0


@dataclass
class SimJobState:
    """One trace job during a simulation (times in seconds)."""
    name: str
    app: str
    submitted: float
    tj_n: int
    tj_batch: int
    progress: float = 0.0
    alloc: Optional[Alloc] = None
    batch: int = 0
    started: Optional[float] = None
    finished: Optional[float] = None
    gpu_s: float = 0.0
    changes: int = 0
    contention: List[int] = field(default_factory=list)
    service: Dict[str, float] = field(default_factory=dict)   # type -> seconds run there


def placement(gpu_type: str, n: int) -> Tuple[int, ...]:
    """GPUs per node of ``n`` GPUs of ``gpu_type``: one node up to its size, else full nodes and
    the rest on one more."""
    per = CLUSTER[gpu_type][1]
    if n <= per:
        return (n,)
    return (per,) * (n // per) + ((n % per,) if n % per else ())


def sizes(gpu_type: str) -> List[int]:
    """The sizes Sia allows on ``gpu_type``: 1..GPUs per node, then whole nodes."""
    nodes, per = CLUSTER[gpu_type]
    return list(range(1, per + 1)) + [per * k for k in range(2, nodes + 1)]


def pack(allocs: List[Tuple[str, Alloc]], cluster: Dict[str, Tuple[int, int]] = CLUSTER
         ) -> Dict[str, Alloc]:
    """Place allocations on nodes in the given order: a whole free node for each full node of a
    multi-node placement, the node with the least room that fits (best fit) for a partial part;
    what does not fit is dropped.  Returns the placed ones by job name."""
    free = {t: [per] * nodes for t, (nodes, per) in cluster.items()}
    out = {}
    for name, a in allocs:
        per = cluster[a.gpu_type][1]
        pl = placement(a.gpu_type, a.n)
        trial = list(free[a.gpu_type])
        ok = True
        for g in sorted(pl, reverse=True):
            if len(pl) > 1 and g == per:
                cands = [i for i, f in enumerate(trial) if f == per]
            else:
                cands = [i for i, f in enumerate(trial) if f >= g]
            if not cands:
                ok = False
                break
            i = min(cands, key=lambda i: trial[i])
            trial[i] -= g
        if ok:
            free[a.gpu_type] = trial
            out[name] = a
    return out


class Profiles:
    """Per-type step times and Pollux progress for Sia's applications (memoised).

    Args:
        sia: Sia's data folder; pollux: Pollux's (its validation runs, identical to Sia's).
    """

    def __init__(self, sia: Optional[str] = None, pollux: Optional[str] = None):
        root, proot = sia_dir(sia) / "traces", traces_dir(pollux) / "traces"
        self.apps: Dict[Tuple[str, str], Application] = {}
        for app in ("cifar10", "imagenet", "bert", "deepspeech2", "yolov3"):
            for t, suffix in SIA_TYPES.items():
                self.apps[(app, t)] = Application(root / app, EPOCHS[app], profile=f"-{suffix}",
                                                  validation=proot / app)
        self.progress = {app: ProgressModel(self.apps[(app, "rtx")])
                         for app in ("cifar10", "imagenet", "bert", "deepspeech2", "yolov3")}

    @functools.lru_cache(maxsize=None)
    def step_s(self, app: str, gpu_type: str, n: int, batch: int) -> float:
        """Seconds of one optimizer step of global ``batch`` on ``n`` GPUs of ``gpu_type``
        (accumulating above the largest local batch), calibration slowdown included."""
        a = self.apps[(app, gpu_type)]
        micro, accum = gp.split_batch(batch, n, a.max_local_bsz)
        micro = max(micro, a.min_local_bsz)
        st, sy = a.step_time(placement(gpu_type, n), micro)
        return gp.step_seconds(st, sy, accum) * SLOWDOWN[app]

    @functools.lru_cache(maxsize=None)
    def _configs(self, app: str, gpu_type: str, n: int) -> Tuple[np.ndarray, np.ndarray]:
        """(candidate global batches, their step seconds) on ``n`` GPUs of ``gpu_type``."""
        a, pm = self.apps[(app, gpu_type)], self.progress[app]
        cands = gp.batch_candidates(n, pm.base_batch, max(a.validation), a.min_local_bsz,
                                    a.max_local_bsz)
        b = np.array([c[0] for c in cands], float)
        if not len(b):
            return b, b
        micro = np.array([max(c[1], a.min_local_bsz) for c in cands], float)
        accum = np.array([c[2] for c in cands], float)
        st, sy = a.step_times(placement(gpu_type, n), micro)
        return b, (st + accum * (st - sy)) * SLOWDOWN[app]

    @functools.lru_cache(maxsize=None)
    def _stats(self, app: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(validated batches, grad_sqr [epoch, batch], grad_var [epoch, batch])."""
        v = self.progress[app].app.validation
        bs = sorted(v)
        epochs = min(len(v[b]) for b in bs)
        sqr = np.array([[v[b][e]["grad_sqr"] for b in bs] for e in range(epochs)])
        var = np.array([[v[b][e]["grad_var"] for b in bs] for e in range(epochs)])
        return np.array(bs, float), sqr, var

    @functools.lru_cache(maxsize=None)
    def best(self, app: str, gpu_type: str, n: int, epoch: int) -> Tuple[float, int]:
        """(progress per second, global batch) of the best batch on ``n`` GPUs of ``gpu_type``
        in ``epoch`` (Pollux's candidates between the smallest and largest validated batch; the
        gradient statistics interpolated linearly in the batch, clamped, as
        :meth:`launcher.cluster.progress.ProgressModel.gain`); (0, 0) where none fits."""
        b, t = self._configs(app, gpu_type, n)
        if not len(b):
            return 0.0, 0
        vb, sqr, var = self._stats(app)
        e = min(epoch, sqr.shape[0] - 1, self.progress[app].app.epochs - 1)
        g = np.asarray(gp.gain(np.interp(b, vb, sqr[e]), np.interp(b, vb, var[e]),
                               b / self.progress[app].base_batch)) / t
        i = int(np.argmax(g))
        return (float(g[i]), int(b[i])) if g[i] > 0 else (0.0, 0)

    def rate(self, app: str, gpu_type: str, n: int, batch: int, epoch: int) -> float:
        """Progress per second at a fixed global ``batch``."""
        return self.progress[app].gain(batch, epoch) / self.step_s(app, gpu_type, n, batch)


@dataclass
class Result:
    """A simulation's outcome: per-job states and the summary figures (seconds / GPU-hours)."""
    jobs: List[SimJobState]
    avg_jct_s: float
    p99_jct_s: float
    makespan_s: float
    gpu_h_per_job: float
    unfinished: int

    def jcts(self) -> List[float]:
        """JCT of every finished job, seconds."""
        return [j.finished - j.submitted for j in self.jobs if j.finished is not None]


Policy = Callable[[float, List[SimJobState], "Profiles"], Dict[str, Alloc]]


def simulate(trace: List[TraceJob], policy: Policy, profiles: Profiles, costs: Costs,
             round_s: float = 60.0, limit_s: float = 30 * 86400.0) -> Result:
    """Run ``trace`` under ``policy`` (the module's docstring).  Jobs are seen from the first
    round at or after their submission; the run stops when every job finished or at ``limit_s``."""
    jobs = [SimJobState(tj.name, tj.application, tj.time, tj.num_replicas, tj.batch_size)
            for tj in sorted(trace, key=lambda t: (t.time, t.name))]
    now = 0.0
    while now < limit_s:
        active = [j for j in jobs if j.submitted <= now and j.finished is None]
        if not active and all(j.finished is not None for j in jobs):
            break
        if not active:
            now = math.ceil(min(j.submitted for j in jobs if j.finished is None) / round_s) * round_s
            continue
        want = policy(now, active, profiles)
        order = sorted(want.items(), key=lambda kv: (-kv[1].n, kv[0]))
        placed = pack(order)
        for j in active:
            j.contention.append(len(active))
            a = placed.get(j.name)
            _advance(j, a, now, round_s, profiles, costs)
        now += round_s
    done = [j.finished - j.submitted for j in jobs if j.finished is not None]
    first = min(j.submitted for j in jobs)
    last = max((j.finished for j in jobs if j.finished is not None), default=now)
    return Result(jobs, float(np.mean(done)) if done else math.inf,
                  float(np.percentile(done, 99)) if done else math.inf, last - first,
                  sum(j.gpu_s for j in jobs) / 3600.0 / len(jobs),
                  sum(1 for j in jobs if j.finished is None))


def _advance(j: SimJobState, a: Optional[Alloc], now: float, round_s: float,
             profiles: Profiles, costs: Costs) -> None:
    prev = j.alloc
    if a is None:
        j.alloc = None
        return
    batch = a.batch or j.tj_batch
    changed = prev is None or (prev.gpu_type, prev.n) != (a.gpu_type, a.n)
    stall = 0.0
    if changed:
        stall = costs.stall(j.app, first=prev is None)
        j.changes += 1
        if costs.mode == "stop_free" and prev is not None and prev.gpu_type != a.gpu_type:
            j.gpu_s += prev.n * min(costs.join_s, round_s)      # old GPUs held while joiners start
    if j.started is None:
        j.started = now
    j.alloc, j.batch = a, batch
    pm = profiles.progress[j.app]
    t = now + min(stall, round_s)
    end = now + round_s
    while t < end and j.progress < pm.end:
        e = pm.epoch(j.progress)
        if a.batch < 0:
            r, j.batch = profiles.best(j.app, a.gpu_type, a.n, e)
        else:
            r = profiles.rate(j.app, a.gpu_type, a.n, batch, e)
        if r <= 0:
            break
        bound = pm.bounds[e + 1] if e + 1 < len(pm.bounds) else pm.end
        need = (bound - j.progress) / r
        dt = min(need, end - t)
        j.progress = min(pm.end, j.progress + r * dt) if dt < need else bound
        t += dt
        if j.progress >= pm.end - 1e-9:
            j.finished = t
            break
    held = (j.finished if j.finished is not None else end) - now
    j.gpu_s += a.n * held
    j.service[a.gpu_type] = j.service.get(a.gpu_type, 0.0) + held


def gavel_policy(profiles_: Optional[Profiles] = None) -> Policy:
    """Gavel's max-sum-throughput policy (Narayanan et al., OSDI 2020) with the trace's hand-tuned
    sizes (TunedJobs: each job's ``num_replicas`` and ``batch_size``, never changed): an LP gives
    each job a time share ``X[j, t]`` of each type (sum over types <= 1, per-type GPU capacity),
    maximising the sum of shares times the job's throughput on the type normalised by its best;
    each round jobs are placed in the order of ``X[j, t]`` over the share of rounds they already
    got there (Gavel's priorities), one type per job.  A job larger than a type's capacity cannot
    use it; a size above a node's GPUs may span nodes (a looser rule than Sia's, in the
    baseline's favour)."""
    from scipy.optimize import linprog
    rounds: Dict[str, Dict[str, int]] = {}
    total: Dict[str, int] = {}

    def policy(now: float, jobs: List[SimJobState], prof: Profiles) -> Dict[str, Alloc]:
        types = list(CLUSTER)
        cap = {t: CLUSTER[t][0] * CLUSTER[t][1] for t in types}
        thr = np.zeros((len(jobs), len(types)))
        for i, j in enumerate(jobs):
            e = prof.progress[j.app].epoch(j.progress)
            for k, t in enumerate(types):
                if j.tj_n <= cap[t]:
                    thr[i, k] = prof.rate(j.app, t, j.tj_n, j.tj_batch, e)
        norm = thr / np.maximum(thr.max(axis=1, keepdims=True), 1e-12)
        nv = thr.size
        a_ub, b_ub = [], []
        for i in range(len(jobs)):
            row = np.zeros(nv)
            row[i * len(types):(i + 1) * len(types)] = 1
            a_ub.append(row)
            b_ub.append(1.0)
        for k, t in enumerate(types):
            row = np.zeros(nv)
            for i, j in enumerate(jobs):
                row[i * len(types) + k] = j.tj_n
            a_ub.append(row)
            b_ub.append(cap[t])
        bounds = [(0, 1 if thr.flat[v] > 0 else 0) for v in range(nv)]
        sol = linprog(-norm.flatten(), A_ub=np.array(a_ub), b_ub=b_ub, bounds=bounds,
                      method="highs")
        x = sol.x.reshape(thr.shape) if sol.success else norm
        prio = []
        for i, j in enumerate(jobs):
            got = rounds.setdefault(j.name, {})
            n_r = max(1, total.get(j.name, 0))
            for k, t in enumerate(types):
                if x[i, k] > 1e-6:
                    prio.append((x[i, k] / max(got.get(t, 0) / n_r, 1e-3), i, t))
        prio.sort(key=lambda p: -p[0])
        free = dict(cap)
        out = {}
        for _, i, t in prio:
            j = jobs[i]
            if j.name in out or free[t] < j.tj_n:
                continue
            free[t] -= j.tj_n
            out[j.name] = Alloc(t, j.tj_n, j.tj_batch)
        for j in jobs:
            total[j.name] = total.get(j.name, 0) + 1
            if j.name in out:
                rounds[j.name][out[j.name].gpu_type] = rounds[j.name].get(out[j.name].gpu_type,
                                                                           0) + 1
        return out
    return policy
