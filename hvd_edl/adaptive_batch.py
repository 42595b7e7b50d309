"""An adaptive global batch: how a global batch is laid out on a ring (local batch and
gradient-accumulation steps per rank), within the bounds a script gives (Pollux, Qiao et al.
OSDI'21, section 3.2; AdaptDL's ``AdaptiveDataLoader``).  Numbers only; the sampler that uses it
is :class:`hvd_edl.torch.elastic.AdaptiveBatchSampler`.

The global batch B of a generation is split over its W ranks in contiguous shares that differ by
at most one sample, and each rank's share into ``accumulation`` micro-batches of at most
``max_local_batch`` samples (the memory bound): ``accumulation = ceil(B / (W *
max_local_batch))``.  B stays within ``[min_batch, max_batch]`` and at least W (a sample per
rank).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional


@dataclass(frozen=True)
class BatchBounds:
    """What a script allows: ``base_batch`` B0 (the batch its learning rate is tuned for, the
    first generation's), ``min_batch`` and ``max_batch`` (global, samples), ``max_local_batch``
    (samples one rank computes at once; None: no bound, no accumulation).

    Raises:
        ValueError: a bound < 1, min_batch > max_batch, or base_batch outside them.
    """
    base_batch: int
    min_batch: int
    max_batch: int
    max_local_batch: Optional[int] = None

    def __post_init__(self):
        if min(self.base_batch, self.min_batch, self.max_batch) < 1 or \
                (self.max_local_batch is not None and self.max_local_batch < 1):
            raise ValueError(f"batch bounds must be >= 1: {self}")
        if not self.min_batch <= self.base_batch <= self.max_batch:
            raise ValueError(f"need min_batch <= batch <= max_batch, got {self.min_batch} <= "
                             f"{self.base_batch} <= {self.max_batch}")


@dataclass(frozen=True)
class BatchPlan:
    """One generation's layout: ``global_batch`` samples per optimizer step over
    ``world_size`` ranks, each computing ``accumulation`` micro-batches of at most
    ``local_batch`` samples."""
    global_batch: int
    world_size: int
    local_batch: int
    accumulation: int

    def as_dict(self, bounds: Optional[BatchBounds] = None) -> Dict[str, float]:
        """JSON-ready, with the bounds when given (the heartbeat's ``Beat.batch``)."""
        out = {"batch": float(self.global_batch), "local_batch": float(self.local_batch),
               "accumulation": float(self.accumulation), "world_size": float(self.world_size)}
        if bounds is not None:
            out.update(base_batch=float(bounds.base_batch), min_batch=float(bounds.min_batch),
                       max_batch=float(bounds.max_batch),
                       max_local_batch=float(bounds.max_local_batch or 0))
        return out


def clamp(batch: int, bounds: BatchBounds, world_size: int) -> int:
    """``batch`` within ``[min_batch, max_batch]`` and at least ``world_size``."""
    return max(min(max(int(batch), bounds.min_batch), bounds.max_batch), int(world_size))


def plan(batch: int, world_size: int, bounds: BatchBounds) -> BatchPlan:
    """The layout of global batch ``batch`` (clamped, :func:`clamp`) on ``world_size`` ranks.

    Raises:
        ValueError: world_size < 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    b = clamp(batch, bounds, world_size)
    share = math.ceil(b / world_size)  # the largest rank's share
    cap = bounds.max_local_batch or share
    accumulation = max(1, math.ceil(share / cap))
    return BatchPlan(b, world_size, math.ceil(share / accumulation), accumulation)


_published: list = [None]  # (plan, bounds) of this process's adaptive sampler


def publish(p: BatchPlan, bounds: BatchBounds) -> None:
    """The adaptive sampler's current layout (the heartbeat reports it: the launcher then knows
    the script opted in)."""
    _published[0] = (p, bounds)


def published() -> Dict[str, float]:
    """:meth:`BatchPlan.as_dict` of the published layout with its bounds; {} when this process
    has no adaptive sampler (the script did not opt in)."""
    got = _published[0]
    return {} if got is None else got[0].as_dict(got[1])
