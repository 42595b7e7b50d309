"""The per-round program that hvd_edl's heterogeneity-aware policies share, simulated and live:
each job takes at most one *configuration* (how many GPUs of which type), the GPUs of each
type bounded by what the round has, and the sum of the chosen configurations' values is
maximised.

Sia's shape (Jayaram Subramanya et al., SOSP 2023: one integer program per round over (job,
configuration)), and the values both policies give a job: Sia's objective (:func:`sia_values`,
the default: each job's speedup over its least, concave, on one scale for every job), or the
sum of ``1 / T`` (:func:`value`, ``T`` a job's estimated remaining time there plus the stall a
change to it costs: SRPT-like, a move only when the time it saves pays its stall).
:mod:`launcher.cluster.policies.hetero_goodput` (the simulator of Sia's cluster) and
:mod:`launcher.cluster.policies.typed` (the live service's ``typed``) both build their matrix
of values with these functions and call :func:`solve`: what is simulated is what runs.

A configuration is a mapping GPU class -> GPUs (``{"a100": 2}``; ``{"fast": 1, "slow": 1}`` for
a mixed one): :func:`solve` only needs how many of each class it uses.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np


def value(remaining: float, rate: float, stall_s: float) -> float:
    """``1 / T`` with ``T = remaining / rate + stall_s`` (seconds): what one job in one
    configuration adds to the objective; 0 where ``rate`` is not positive (it cannot run there).

    Args:
        remaining: work left (any unit: progress, samples), >= 0.
        rate: work per second in the configuration.
        stall_s: seconds of no progress a change to it costs (0 to stay).
    """
    if not rate > 0:
        return 0.0
    t = remaining / rate + stall_s
    return 1.0 / t if t > 0 else float("inf")


SIA_P = -0.5
SIA_LAMBDA_N = 1.1
SIA_CLIP = 3000.0
"""Sia's defaults (``simulator_config.py`` of siasosp23/artifacts: p, lambda_n, the clip of a
powered goodput)."""


def reallocation_factor(age_s: float, changes: int, stall_s: float) -> float:
    """Sia's re-allocation factor ``(age - changes * stall) / (age + stall)`` (clipped at 0; 1
    while the job is younger than one stall): what a configuration other than the current one
    is worth relative to staying (Jayaram Subramanya et al., SOSP 2023; ``sia.py``).

    Args:
        age_s: seconds the job has run (the live service: since its last change).
        changes: allocation changes it has had in that time.
        stall_s: seconds of no progress one change costs it.
    """
    if age_s < stall_s:
        return 1.0
    return max(age_s - changes * stall_s, 0.0) / (age_s + stall_s)


def sia_values(goodput: Sequence[float], current: Optional[int] = None, factor: float = 1.0,
               least: Optional[float] = None, p: float = SIA_P,
               lambda_n: float = SIA_LAMBDA_N) -> Tuple[np.ndarray, np.ndarray]:
    """One job's row of Sia's objective (Jayaram Subramanya et al., SOSP 2023; ``sia.py`` of
    siasosp23/artifacts, read, our code), the value every heterogeneity-aware policy here gives a
    job without an objective of its own (the simulator's ``hetero_goodput`` and the live
    ``typed``): each configuration's goodput over the job's least (``least``, default the least
    positive of ``goodput``), the configurations other than ``current`` scaled by ``factor``
    (:func:`reallocation_factor`), raised to ``p`` (< 0: concave in the speedup), rounded to 2
    decimals and clipped at :data:`SIA_CLIP`: ``A``; the value maximised is ``lambda_n - A``
    (Sia minimises ``sum A + lambda_n * jobs left without GPUs``).

    Args:
        goodput: (configurations,) the job's goodput in each (any unit: samples/s, progress/s);
            <= 0 where it cannot run.
        current: the column of the configuration it runs in (None: waiting).
        factor: Sia's re-allocation factor for the other columns, in [0, 1].
        least: the normaliser (> 0), e.g. the least over configurations not offered this round.
        p, lambda_n: Sia's exponent (< 0) and the value of leaving a job without GPUs.

    Returns:
        (values, ok): two (configurations,) arrays, the values and the mask of the
        configurations the job may take (goodput > 0); values 0 where not ok.
    """
    g = np.asarray(goodput, float)
    ok = np.isfinite(g) & (g > 0)
    val = np.zeros(len(g))
    if not ok.any():
        return val, ok
    base = least if least is not None and least > 0 else g[ok].min()
    g = np.where(ok, g, 0.0) / base
    if current is not None:
        g_cur = g[current]
        g = g * factor
        g[current] = g_cur
    a = np.full(len(g), SIA_CLIP)
    pos = ok & (g > 0)
    a[pos] = np.minimum(np.round(np.power(g[pos], p), 2), SIA_CLIP)
    val[ok] = lambda_n - a[ok]
    return val, ok


def solve(val: np.ndarray, use: Sequence[Mapping[str, int]], capacity: Mapping[str, int],
          time_limit_s: float = 5.0, mask: Optional[np.ndarray] = None,
          must: Optional[Sequence[bool]] = None) -> Dict[int, int]:
    """The round's program (the module's docstring), solved with scipy's HiGHS ``milp``.

    Args:
        val: (jobs x configurations) values, maximised (:func:`value`; any sign, e.g. Sia's
            ``lambda_n - A``); without ``mask``, 0 marks a configuration the job cannot take.
        use: per configuration, GPU class -> GPUs it takes.
        capacity: GPU class -> GPUs the round has (a class missing: none).
        time_limit_s: the solver's bound, seconds (HiGHS returns its best so far).
        mask: (jobs x configurations) booleans, the configurations each job may take (None:
            ``val > 0``).
        must: per job, whether it must get a configuration (a running job the round may move
            but never stop); None: none must.

    Returns:
        job row -> configuration column, for the jobs that get one (others are left out).
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    n_jobs, n_cfg = val.shape if val.size else (len(val), len(use))
    if not n_jobs or not n_cfg:
        return {}
    val = np.where(np.isfinite(val), val, 0.0)   # a value that is no number (a job's NaN or
    # infinite speed): that configuration is not one it can take; the other jobs' round stands
    scale = np.abs(val).max() or 1.0
    c = -(val / scale).flatten()
    rows, lo, hi = [], [], []
    for i in range(n_jobs):  # at most one configuration per job
        row = np.zeros(val.size)
        row[i * n_cfg:(i + 1) * n_cfg] = 1
        rows.append(row)
        lo.append(1 if must is not None and must[i] else 0)
        hi.append(1)
    classes = list(capacity) + sorted({t for u in use for t in u} - set(capacity))
    for t in classes:  # GPUs per class
        row = np.zeros(val.size)
        for i in range(n_jobs):
            for k, u in enumerate(use):
                row[i * n_cfg + k] = u.get(t, 0)
        if not row.any():
            continue
        rows.append(row)
        lo.append(0)
        hi.append(capacity.get(t, 0))
    ub = (val > 0 if mask is None else mask).flatten().astype(float)
    res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi),
               integrality=np.ones(val.size), bounds=Bounds(np.zeros(val.size), ub),
               options={"time_limit": time_limit_s, "mip_rel_gap": 1e-3})
    if res.x is None:
        return {}
    x = res.x.reshape(val.shape)
    out = {}
    for i in range(n_jobs):
        k = int(np.argmax(x[i]))
        if x[i, k] > 0.5:
            out[i] = k
    return out
