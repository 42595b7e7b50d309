"""hvd_edl's heterogeneity-aware goodput policy for the simulated Sia cluster
(:mod:`launcher.cluster.hetero_sim`): which jobs run, on which GPU type, on how many GPUs, at which
batch, every round.

Ideas from Sia (Jayaram Subramanya et al., SOSP 2023: goodput per GPU type, one type per job,
its objective) and Pollux (Qiao et al., OSDI 2021: the batch that maximises goodput at each
size); what is ours is the change cost it weighs, hvd_edl's measured stop-free switch:

One mixed-integer program per round (:mod:`launcher.cluster.round_program`, shared with the live
``typed`` policy; scipy's HiGHS ``milp``): each active job takes at most one configuration
``c = (type, GPUs)`` (sizes Sia allows: one node up to its GPUs, whole nodes above), the GPUs of
each type bounded by the cluster's.  Two objectives:

``objective="sia"`` (the default since issue 42's round 6): Sia's own (``sia-simulator/sia.py``
of siasosp23/artifacts, read, our code): each job's goodput per configuration (the best batch,
Pollux's) normalised by its least over all configurations, raised to ``p`` (-0.5), the
configurations other than the current one scaled by Sia's re-allocation factor ``(age - changes
* stall) / (age + stall)`` (1 while the job is younger than a stall), clipped at 3000; the
program minimises the sum of the chosen terms plus ``lambda_n`` (1.1) per job left without GPUs.
Every job's terms are on the same scale whatever its length, and ``p < 0`` makes them concave in
the speedup: GPUs are spread where they are used efficiently, a long job is not starved by a
stream of short ones.  With hvd_edl's 0.59 s switch the re-allocation factor is 1 for nearly
every job: it re-plans every round at almost no cost, where Sia pays 15-250 s per change.
(In Sia's setting this beat ``remaining`` on all three traces: docs/heterogeneous_sim.md.)

``objective="remaining"`` (the default of rounds 4-5): the sum over jobs of ``1 / T_jc`` is
maximised, ``T_jc`` the job's estimated remaining time at ``c``: its remaining progress over its
goodput there plus the stall a change to ``c`` costs it (none to stay, the start for a new job,
Sia's restart per application or hvd_edl's measured switch for a running one).  Maximising
completions per second favours short jobs first (SRPT), a GPU type to the job gaining most from
it, growth where it cuts remaining time most, and a move only when the time it saves pays its
stall.  Its weight ``1 / remaining`` makes a job 100x longer worth 100x less, so on a busy trace
(Sia's newTrace) long jobs wait behind short ones that run at poor efficiency on many GPUs.  The
live ``typed`` policy values its jobs without an objective with the same functions
(:func:`launcher.cluster.round_program.sia_values` by default; ``remaining`` over a horizon,
a live job's remaining work being unknown, as ``serve --policy typed --objective remaining``).
Mixed types within one job are not used: Sia's profiles measure no mixed placement and its
setting forbids them.

Fairness (``ftf_weight`` k, ``remaining`` only, default 0): each job's term is multiplied by
``max(1, rho_j) ** k``, ``rho_j`` its predicted finish-time fairness if it ran from now at its
isolated rate (Themis' ratio as Sia measures it, :mod:`launcher.cluster.hetero_fairness`: alone
on ``G / N`` GPUs of each type, the types weighted by their GPUs; the current epoch's rates):
``(elapsed * r_iso + remaining) / total``.  A job falling behind its fair finish gains weight, as
the response ratio of highest-response-ratio-next scheduling (Brinch Hansen 1971) grows with
waiting; k = 0 is the SRPT-like objective above.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import numpy as np

from launcher.cluster.hetero_sim import CLUSTER, Alloc, Costs, SimJobState, pack, sizes
from launcher.cluster.round_program import (SIA_LAMBDA_N, SIA_P, reallocation_factor,
                                            sia_values, solve)

TYPE_ORDER = ("a100", "rtx", "t4")
"""Types tried for a job the packing could not place, fastest first."""


def hetero_goodput_policy(costs: Costs, ftf_weight: float = 0.0, objective: str = "sia",
                          p: float = SIA_P, lambda_n: float = SIA_LAMBDA_N) -> Callable:
    """The policy (the module's docstring) for :func:`launcher.cluster.hetero_sim.simulate`;
    ``costs`` are the change costs it weighs moves against; ``ftf_weight`` the fairness exponent
    k (>= 0, ``remaining`` only); ``objective`` ``"sia"`` (Sia's, with ``p`` < 0 and
    ``lambda_n``; the default) or ``"remaining"`` (the sum of ``1 / T``).  ValueError (one
    line) for a bad objective, a negative k or p >= 0, or a weight k > 0 with ``"sia"``."""
    if objective not in ("remaining", "sia"):
        raise ValueError(f"unknown objective {objective!r} (remaining, sia)")
    if ftf_weight < 0 or p >= 0:
        raise ValueError(f"ftf_weight must be >= 0 and p < 0 (got {ftf_weight}, {p})")
    if ftf_weight and objective != "remaining":
        raise ValueError(f"ftf_weight applies to objective 'remaining' only (got {objective!r})")

    def policy(now: float, jobs: List[SimJobState], prof) -> Dict[str, Alloc]:
        want = choose(jobs, prof, costs, now=now, ftf_weight=ftf_weight, objective=objective,
                      p=p, lambda_n=lambda_n)
        return place(want)
    return policy


def configs() -> List[Tuple[str, int]]:
    """Every (type, GPUs) a job may take in Sia's cluster."""
    return [(t, n) for t in CLUSTER for n in sizes(t)]


def predicted_ftf(j: SimJobState, prof, now: float, contention: int) -> float:
    """``rho_j`` of the fairness weight (the module's docstring): the job's predicted finish-time
    fairness if it ran from ``now`` at its isolated rate with ``contention`` jobs in the system."""
    pm = prof.progress[j.app]
    e = pm.epoch(j.progress)
    total = sum(CLUSTER[t][0] * CLUSTER[t][1] for t in CLUSTER)
    share = total / max(1, contention)
    inv = wsum = 0.0
    for t, (nodes, per) in CLUSTER.items():
        ok = [n for n in sizes(t) if n <= max(1.0, share)]
        r = max((prof.best(j.app, t, n, e)[0] for n in ok), default=0.0)
        if r > 0:
            inv += nodes * per / r
            wsum += nodes * per
    if not wsum:
        return 1.0
    r_iso = wsum / inv
    return ((now - j.submitted) * r_iso + pm.end - j.progress) / pm.end


def _remaining_values(jobs, prof, costs, cfg, now, ftf_weight):
    val = np.zeros((len(jobs), len(cfg)))
    for i, j in enumerate(jobs):
        pm = prof.progress[j.app]
        e = pm.epoch(j.progress)
        rem = pm.end - j.progress
        cur = None if j.alloc is None else (j.alloc.gpu_type, j.alloc.n)
        w = max(1.0, predicted_ftf(j, prof, now, len(jobs))) ** ftf_weight if ftf_weight else 1.0
        for k, (t, n) in enumerate(cfg):
            r = prof.best(j.app, t, n, e)[0]
            if r <= 0:
                continue
            stall = 0.0 if cur == (t, n) else costs.stall(j.app, first=cur is None)
            val[i, k] = w / (rem / r + stall)
    return val, val > 0


def _sia_values(jobs, prof, costs, cfg, now, p, lambda_n):
    """``lambda_n - A_jc`` (maximised: Sia's minimisation of ``sum A + lambda_n * unallocated``)
    and the mask of configurations with goodput: each job's row by
    :func:`launcher.cluster.round_program.sia_values`, the function the live ``typed`` uses."""
    val = np.zeros((len(jobs), len(cfg)))
    ok = np.zeros(val.shape, bool)
    for i, j in enumerate(jobs):
        e = prof.progress[j.app].epoch(j.progress)
        g = [prof.best(j.app, t, n, e)[0] for t, n in cfg]
        cur = None if j.alloc is None else (j.alloc.gpu_type, j.alloc.n)
        col = next((k for k, c in enumerate(cfg) if c == cur), None)
        f = 1.0
        if col is not None:
            age = now - (j.started if j.started is not None else now)
            f = reallocation_factor(age, j.changes, costs.stall(j.app, first=False))
        val[i], ok[i] = sia_values(g, col, f, p=p, lambda_n=lambda_n)
    return val, ok


def choose(jobs: List[SimJobState], prof, costs: Costs, now: float = 0.0,
           ftf_weight: float = 0.0, objective: str = "sia", p: float = SIA_P,
           lambda_n: float = SIA_LAMBDA_N) -> Dict[str, Tuple[str, int]]:
    """The round's program (the module's docstring) at time ``now`` (s): job name -> (type,
    GPUs) for the jobs that run; solved by :func:`launcher.cluster.round_program.solve`, the code
    the live ``typed`` policy runs too."""
    cfg = configs()
    cap = {t: CLUSTER[t][0] * CLUSTER[t][1] for t in CLUSTER}
    if not len(jobs):
        return {}
    if objective == "sia":
        val, mask = _sia_values(jobs, prof, costs, cfg, now, p, lambda_n)
    else:
        val, mask = _remaining_values(jobs, prof, costs, cfg, now, ftf_weight)
    got = solve(val, [{t: n} for t, n in cfg], cap, mask=mask)
    return {jobs[i].name: cfg[k] for i, k in got.items()}


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
