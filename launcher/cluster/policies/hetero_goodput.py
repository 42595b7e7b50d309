"""hvd_edl's heterogeneity-aware goodput policy for the simulated Sia cluster
(:mod:`launcher.cluster.hetero_sim`): which jobs run, on which GPU type, on how many GPUs, at which
batch, every round.

Ideas from Sia (Jayaram Subramanya et al., SOSP 2023: goodput per GPU type, one type per job)
and Pollux (Qiao et al., OSDI 2021: the batch that maximises goodput at each size); the
allocation rule is ours:

One mixed-integer program per round (scipy's HiGHS ``milp``), Sia's shape with our objective:
each active job takes at most one configuration ``c = (type, GPUs)`` (sizes Sia allows: one node
up to its GPUs, whole nodes above), the GPUs of each type bounded by the cluster's, and the sum
over jobs of ``1 / T_jc`` is maximised, ``T_jc`` the job's estimated remaining time at ``c``:
its remaining progress over its goodput there (the best batch, Pollux's) plus the stall a change
to ``c`` costs it (none to stay, the start for a new job, Sia's restart per application or
hvd_edl's measured switch for a running one).  Maximising completions per second favours short
jobs first (SRPT, the order that minimises average JCT), a GPU type to the job gaining most
from it (a job gaining 3x from an a100 over a t4 gets it before one gaining 1.5x: 3 + 1 > 1.5 + 1
in units of ``1/T``), growth where it cuts remaining time most, and a move only when the time it
saves pays its stall (stop-free moves are nearly free, so they happen when they help).
Mixed types within one job are not used: Sia's profiles measure no mixed placement and its
setting forbids them.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import numpy as np

from launcher.cluster.hetero_sim import CLUSTER, Alloc, Costs, SimJobState, pack, sizes

TYPE_ORDER = ("a100", "rtx", "t4")
"""Types tried for a job the packing could not place, fastest first."""


def hetero_goodput_policy(costs: Costs) -> Callable:
    """The policy (the module's docstring) for :func:`launcher.cluster.hetero_sim.simulate`;
    ``costs`` are the change costs it weighs moves against."""

    def policy(now: float, jobs: List[SimJobState], prof) -> Dict[str, Alloc]:
        want = choose(jobs, prof, costs)
        return place(want)
    return policy


def configs() -> List[Tuple[str, int]]:
    """Every (type, GPUs) a job may take in Sia's cluster."""
    return [(t, n) for t in CLUSTER for n in sizes(t)]


def choose(jobs: List[SimJobState], prof, costs: Costs) -> Dict[str, Tuple[str, int]]:
    """The round's program (the module's docstring): job name -> (type, GPUs) for the jobs that
    run."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    cfg = configs()
    cap = {t: CLUSTER[t][0] * CLUSTER[t][1] for t in CLUSTER}
    val = np.zeros((len(jobs), len(cfg)))
    for i, j in enumerate(jobs):
        pm = prof.progress[j.app]
        e = pm.epoch(j.progress)
        rem = pm.end - j.progress
        cur = None if j.alloc is None else (j.alloc.gpu_type, j.alloc.n)
        for k, (t, n) in enumerate(cfg):
            r = prof.best(j.app, t, n, e)[0]
            if r <= 0:
                continue
            stall = 0.0 if cur == (t, n) else costs.stall(j.app, first=cur is None)
            val[i, k] = 1.0 / (rem / r + stall)
    if not len(jobs):
        return {}
    scale = val.max() or 1.0
    c = -(val / scale).flatten()
    rows, lo, hi = [], [], []
    for i in range(len(jobs)):
        row = np.zeros(val.size)
        row[i * len(cfg):(i + 1) * len(cfg)] = 1
        rows.append(row)
        lo.append(0)
        hi.append(1)
    for t in CLUSTER:
        row = np.zeros(val.size)
        for i in range(len(jobs)):
            for k, (tt, n) in enumerate(cfg):
                if tt == t:
                    row[i * len(cfg) + k] = n
        rows.append(row)
        lo.append(0)
        hi.append(cap[t])
    ub = (val.flatten() > 0).astype(float)
    res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi),
               integrality=np.ones(val.size), bounds=Bounds(np.zeros(val.size), ub),
               options={"time_limit": 5.0, "mip_rel_gap": 1e-3})
    if res.x is None:
        return {}
    x = res.x.reshape(val.shape)
    out = {}
    for i, j in enumerate(jobs):
        k = int(np.argmax(x[i]))
        if x[i, k] > 0.5:
            out[j.name] = cfg[k]
    return out


def place(want: Dict[str, Tuple[str, int]]) -> Dict[str, Alloc]:
    """Pack the chosen configurations onto nodes (largest first); a job that does not fit takes
    the largest size that does, on its type, then on the others."""
    placed = pack(sorted(((k, Alloc(t, n, -1)) for k, (t, n) in want.items()),
                         key=lambda kv: (-kv[1].n, kv[0])))
    for name, (t, n) in sorted(want.items(), key=lambda kv: -kv[1][1]):
        if name in placed:
            continue
        for t2 in (t,) + tuple(x for x in TYPE_ORDER if x != t):
            for n2 in sorted((s for s in sizes(t2) if s <= n), reverse=True):
                trial = dict(placed)
                trial[name] = Alloc(t2, n2, -1)
                got = pack(sorted(trial.items(), key=lambda kv: (-kv[1].n, kv[0])))
                if len(got) == len(trial):
                    placed = got
                    break
            if name in placed:
                break
    return placed
