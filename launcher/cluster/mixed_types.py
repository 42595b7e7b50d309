"""Mixed GPU types within one job: only where the slowest type does not hold the ring back more
than it adds (issue 42, section 3).

Synchronous data parallel (Horovod's allreduce every step): every worker processes the same
local batch and waits for the others, so a step takes the slowest worker's time.  A ring of
``N`` workers over several types therefore trains at ``N`` times the slowest type's per-worker
speed at that size, i.e. at ``min over its types of speed(type, N)`` when ``speed(type, N)`` is
the samples/s of ``N`` workers of one type (its sync cost at ``N`` included: the speed model's,
:mod:`launcher.cluster.speed`).  Adding ``m`` slower workers to ``n`` fast ones pays only if

    speed(slow, n + m) > speed(fast, n)

which for linear speeds is ``(n + m) * v_slow > n * v_fast`` (Sia, SOSP 2023, forbids mixed
placements for this reason; we allow the ones that pay).  Pure functions of a speed model.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

Speed = Callable[[str, int], Optional[float]]
"""samples/s of ``n`` workers of one GPU type (None where unknown)."""


def single_speed(speed_of: Optional[Speed], gpu_type: str, n: int) -> float:
    """samples/s of ``n`` workers of ``gpu_type``; where the model knows nothing, ``n`` (every
    type alike, linear: what policies assume of an unmeasured job)."""
    s = speed_of(gpu_type, n) if speed_of is not None and n > 0 else None
    return float(s) if s is not None else float(n)


def ring_speed(speed_of: Optional[Speed], parts: Mapping[str, int]) -> float:
    """samples/s of one synchronous ring with ``parts[type]`` workers of each type: its size
    ``N`` at the slowest type's speed at ``N`` (the module's docstring); 0 for no workers."""
    n = sum(k for k in parts.values() if k > 0)
    if not n:
        return 0.0
    return min(single_speed(speed_of, t, n) for t, k in parts.items() if k > 0)


def mixed_pays(speed_of: Optional[Speed], fast: str, n_fast: int, slow: str,
               n_slow: int) -> bool:
    """Whether ``n_slow`` workers of ``slow`` added to ``n_fast`` of ``fast`` train faster than
    the ``n_fast`` alone: ``speed(slow, n_fast + n_slow) > speed(fast, n_fast)`` (strictly; the
    module's docstring).  ``fast`` is whichever type is faster at ``n_fast``: the rule is
    checked both ways round, so the caller need not know which."""
    if n_fast <= 0 or n_slow <= 0:
        return False
    mixed = ring_speed(speed_of, {fast: n_fast, slow: n_slow}) if fast != slow else \
        single_speed(speed_of, fast, n_fast + n_slow)
    return mixed > single_speed(speed_of, fast, n_fast) and \
        mixed > single_speed(speed_of, slow, n_slow)
