"""The per-round program that hvd_edl's heterogeneity-aware policies share, simulated and live:
each job takes at most one *configuration* (how many GPUs of which type), the GPUs of each
type bounded by what the round has, and the sum over jobs of ``1 / T`` is maximised, ``T`` a
job's estimated remaining time in that configuration plus the stall a change to it costs.

Sia's shape (Jayaram Subramanya et al., SOSP 2023: one integer program per round over (job,
configuration)), with our objective: maximising completions per second favours short jobs first
(SRPT, the order that minimises average JCT), a GPU type to the job gaining most from it, and a
move only when the time it saves pays its stall.  :mod:`launcher.cluster.policies.hetero_goodput`
(the simulator of Sia's cluster) and :mod:`launcher.cluster.policies.typed` (the live service's
``typed``) both build their matrix of values and call :func:`solve`: what is simulated is what
runs.

A configuration is a mapping GPU class -> GPUs (``{"a100": 2}``; ``{"fast": 1, "slow": 1}`` for
a mixed one): :func:`solve` only needs how many of each class it uses.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence

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
