"""Finish-time fairness in a heterogeneous cluster, as Sia measures it (Jayaram Subramanya et al.,
SOSP 2023, Sec. 5.2; ``sia-simulator/ftf_simulator.py`` of siasosp23/artifacts, read, not copied),
after Themis (Mahajan et al., NSDI 2020): ``rho = JCT shared / JCT isolated``.

Isolated, in a cluster of several GPU types: the job alone on ``G / N`` GPUs of *each* type in
turn (``G`` the cluster's GPUs, ``N`` the mean number of jobs contending while it was in the
system), its JCT on each, combined as the mean weighted by each type's share of the cluster's
GPUs.  Sia interpolates between the floor and the ceiling of ``G / N`` GPUs (and divides by the
share below one GPU); a type's JCT uses the sizes the type allows up to that many GPUs (never
more than its own GPUs).  Here the job alone runs at the best size and batch for goodput in each
epoch (Pollux's choice), pays ``start_s`` once and waits for the first round at or after its
submission, as in Sia's isolated runs; it never pays a change: a reference no slower than Sia's.

The stricter reference the first Sia-setting table used (``G / N`` GPUs of the *best* type) is
:func:`isolated_best_type_s`: in Sia's cluster only 16 of 64 GPUs are a100s, so no split of the
cluster gives every job ``G / N`` a100s, and short jobs that gain most from an a100 read as
treated unfairly even when they ran at once.
"""
from __future__ import annotations

import functools
import math
import statistics
from typing import Dict, List, Tuple

from launcher.cluster.hetero_sim import CLUSTER, Costs, sizes


def _gpus(cluster: Dict[str, Tuple[int, int]]) -> Dict[str, int]:
    return {t: n * g for t, (n, g) in cluster.items()}


@functools.lru_cache(maxsize=None)
def alone_on_s(prof, app: str, gpu_type: str, gpus: int) -> float:
    """Seconds of training of ``app`` alone on at most ``gpus`` GPUs of ``gpu_type`` (the best
    allowed size and batch per epoch; no start, no wait); ``math.inf`` where none fits.
    Memoised per profiles object (thousands of jobs share a few applications)."""
    pm = prof.progress[app]
    ok = [n for n in sizes(gpu_type) if n <= gpus]
    total = 0.0
    for e in range(len(pm.bounds) - 1):
        r = max((prof.best(app, gpu_type, n, e)[0] for n in ok), default=0.0)
        if r <= 0:
            return math.inf
        total += (pm.bounds[e + 1] - pm.bounds[e]) / r
    return total


def isolated_sia_s(prof, app: str, contention: float, start_s: float = 0.0,
                   wait_s: float = 0.0, cluster: Dict[str, Tuple[int, int]] = CLUSTER) -> float:
    """Sia's isolated JCT (seconds; the module's docstring) of a job of ``app`` that saw
    ``contention`` jobs on average: per type, alone on ``G / contention`` GPUs (interpolated
    between floor and ceiling, divided by the share below one GPU), plus ``start_s`` and
    ``wait_s``; the types' JCTs weighted by their GPUs."""
    g = _gpus(cluster)
    share = sum(g.values()) / max(contention, 1e-9)
    num = den = 0.0
    for t, gt in g.items():
        if share < 1:
            jct = (alone_on_s(prof, app, t, 1) + start_s) / share
        else:
            lo, hi = max(1, math.floor(share)), max(1, math.ceil(share))
            jlo = alone_on_s(prof, app, t, min(lo, gt))
            jhi = alone_on_s(prof, app, t, min(hi, gt))
            jct = jlo + (jhi - jlo) * (share - lo) + start_s
        if math.isfinite(jct):
            num += gt * jct
            den += gt
    return num / den + wait_s if den else math.inf


def isolated_best_type_s(prof, app: str, contention: float,
                         cluster: Dict[str, Tuple[int, int]] = CLUSTER) -> float:
    """The stricter reference (the module's docstring): alone on ``floor(G / contention)`` GPUs
    of the fastest type for ``app`` in each epoch (seconds; no start, no wait)."""
    g = _gpus(cluster)
    share = max(1, int(sum(g.values()) / max(contention, 1e-9)))
    return _best_type_alone_s(prof, app, share, tuple(sorted(cluster.items())))


@functools.lru_cache(maxsize=None)
def _best_type_alone_s(prof, app: str, share: int, cluster: Tuple) -> float:
    pm = prof.progress[app]
    total = 0.0
    for e in range(len(pm.bounds) - 1):
        r = max(prof.best(app, t, n, e)[0] for t, _ in cluster for n in sizes(t) if n <= share)
        total += (pm.bounds[e + 1] - pm.bounds[e]) / r
    return total


def finish_time_fairness(res, prof, costs: Costs, round_s: float = 60.0,
                         definition: str = "sia") -> List[float]:
    """``rho`` per finished job of a :class:`launcher.cluster.hetero_sim.Result`:
    ``definition`` ``"sia"`` (:func:`isolated_sia_s` with the start the run's ``costs`` charge
    and the wait for its first round of ``round_s`` seconds) or ``"best_type"``
    (:func:`isolated_best_type_s`).  ValueError (one line) for another definition."""
    if definition not in ("sia", "best_type"):
        raise ValueError(f"unknown finish-time fairness definition {definition!r} (sia, best_type)")
    out = []
    for j in res.jobs:
        if j.finished is None or not j.contention:
            continue
        n = statistics.mean(j.contention)
        if definition == "sia":
            wait = math.ceil(j.submitted / round_s) * round_s - j.submitted
            alone = isolated_sia_s(prof, j.app, n, costs.stall(j.app, first=True), wait)
        else:
            alone = isolated_best_type_s(prof, j.app, n)
        out.append((j.finished - j.submitted) / alone)
    return out
