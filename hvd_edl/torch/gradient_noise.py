"""The gradient noise scale measured inside ``hvd.DistributedOptimizer`` (the estimator:
:mod:`hvd_edl.gradient_noise`).

Where the norms come from, on the paths a Horovod step takes anyway:

* each backward pass's local squared norm: a tensor hook on every parameter sees the pass's
  gradient before it is accumulated into ``.grad`` (and before Horovod's in-place allreduce
  overwrites it): one ``vector_norm`` per parameter and pass.  With ``a`` backward passes per
  step (Horovod's ``backward_passes_per_step``, the adaptive batch's accumulation) a rank
  contributes ``a`` independent micro-batch gradients (AdaptDL counts them the same way);
* their mean over the ranks: one float64 scalar allreduced asynchronously at the start of
  ``synchronize()``, so it travels while the gradients' allreduces are still in flight
  (Horovod fuses it into their cycle);
* the averaged gradient's squared norm: after ``synchronize()``, one ``vector_norm`` per
  parameter.  ``count`` = ranks x passes.

One rank with one pass per step pairs each step with the previous one (its gradients kept in
buffers allocated once).  The global batch of a step is what the elastic samplers noted when they
yielded it (:func:`note_batch`); a script with another sampler may call :func:`note_batch`
itself; without any, the batch counts as one sample per rank and ``noise_scale_samples`` is then
in units of a rank's batch (``batch`` reads 0).

Cost: measured by ``benchmarks/job/gradient_noise_cost.py`` (docs/adaptive_batch.md).
"""
from __future__ import annotations

import itertools
import logging
from typing import List, Optional

import horovod.torch as _hvd
import torch

from hvd_edl.gradient_noise import NoiseScale

log = logging.getLogger(__name__)

_batch = [0]   # the global batch (samples) of the step being computed; 0 unknown
_meters = itertools.count()  # names of the scalar allreduces: the same on every rank
_current: List[Optional["GradientNoiseMeter"]] = [None]  # the last meter made (telemetry)


def note_batch(global_batch: int) -> None:
    """The step now being computed has ``global_batch`` samples over all ranks (the samplers
    call it when they yield a step's share)."""
    _batch[0] = int(global_batch)


def current() -> Optional["GradientNoiseMeter"]:
    """The meter of the most recently built ``hvd.DistributedOptimizer`` (None before)."""
    return _current[0]


class GradientNoiseMeter:
    """Measures ``opt``'s gradient noise at every synchronized step (see the module).

    Args:
        opt: a Horovod ``DistributedOptimizer`` (allreduce, not Adasum).
        smoothing: the estimator's theta per step of the initial batch.

    Attributes:
        noise: the :class:`hvd_edl.gradient_noise.NoiseScale` (its ``latest`` estimate).
        enabled: False turns the measurement off (nothing computed, no scalar allreduce).
        local_scale, total_scale: factors on a backward pass's and on the averaged gradient's
            squared norms, so that both are norms of *means* over their samples.  Defaults: 1,
            and ``1 / a^2`` with ``a`` backward passes per step (Horovod accumulates the sum of
            ``a`` micro-batch means); the adaptive optimizer sets them (a micro-batch's loss
            weighted by ``n / B`` needs ``a^2`` on the first and 1 on the second).
    """

    def __init__(self, opt, smoothing: Optional[float] = None):
        self.opt = opt
        self.noise = NoiseScale() if smoothing is None else NoiseScale(smoothing)
        self.enabled = True
        self.local_scale = 1.0  # factor on each backward pass's squared norm
        self.total_scale: Optional[float] = None  # on the averaged gradient's (None: 1/passes^2)
        self.name = f"hvd_edl.gradient_noise.{next(_meters)}"
        self._local: List[torch.Tensor] = []
        self._prev: Optional[List[torch.Tensor]] = None  # size 1: the previous step's grads
        self._prev_sqr = 0.0
        self._prev_batch = 0
        self._params = [p for group in opt.param_groups for p in group["params"]
                        if p.requires_grad]
        _current[0] = self

    def install(self) -> None:
        """Hook every parameter (a tensor hook sees each backward pass's gradient before it is
        accumulated into ``.grad`` and before Horovod's allreduce overwrites it) and wrap the
        optimizer's ``synchronize`` (an instance attribute, as
        :mod:`hvd_edl.torch.distributed_optimizer` wraps it)."""
        opt = self.opt
        if not hasattr(opt, "backward_passes_per_step"):  # Adasum: no plain average to compare
            self.enabled = False
            return
        for p in self._params:
            p.register_hook(self._grad_hook)
        inner = opt.synchronize

        def synchronize():
            if not self.enabled or not _hvd.is_initialized():
                self._local = []
                return inner()
            size = _hvd.size()
            handle = None
            local = self._local_sum()
            count = size * self._passes()
            if count > 1 and local is not None:
                handle = _hvd.allreduce_async(local, name=self.name, op=_hvd.Average) \
                    if size > 1 else local
            result = inner()
            self._local = []
            try:
                self._measure(size, count, handle)
            except Exception as e:  # noqa: BLE001 - the measurement never fails a step
                log.warning("gradient noise not measured this step: %s", e)
            return result

        opt.synchronize = synchronize

    def _grad_hook(self, grad):
        if self.enabled and not grad.is_sparse:
            self._local.append(torch.linalg.vector_norm(grad.detach()))
        return None

    def _passes(self) -> int:
        """Backward passes (micro-batches) per step: Horovod's ``backward_passes_per_step``."""
        return max(int(getattr(self.opt, "backward_passes_per_step", 1) or 1), 1)

    def _local_sum(self) -> Optional[torch.Tensor]:
        """Mean over this step's backward passes of their gradients' squared norms, times
        ``local_scale`` (float64 scalar); None when no hook fired."""
        local, self._local = self._local, []
        if not local:
            return None
        return torch.stack(local).double().square().sum() * (self.local_scale / self._passes())

    def _grads(self) -> List[torch.Tensor]:
        return [p.grad.detach() for p in self._params
                if p.grad is not None and not p.grad.is_sparse]

    def _measure(self, size: int, count: int, handle) -> None:
        grads = self._grads()
        if not grads:
            return
        k = self.total_scale if self.total_scale is not None else 1.0 / self._passes() ** 2
        total = k * float(torch.stack([torch.linalg.vector_norm(g) for g in grads])
                          .double().square().sum())
        batch = _batch[0]
        if count > 1:
            self._prev = None
            if handle is None:
                return
            local = float(_hvd.synchronize(handle) if size > 1 else handle)
            self.noise.update(local, total, count, max(batch, count))
            return
        # one rank: pair this step with the previous one (same batch), as two "ranks"
        if self._prev is not None and batch == self._prev_batch and len(self._prev) == len(grads):
            dot = k * float(sum(torch.dot(a.flatten(), b.flatten()).double()
                            for a, b in zip(self._prev, grads)))
            local = (self._prev_sqr + total) / 2.0
            mean = (self._prev_sqr + total + 2.0 * dot) / 4.0
            self.noise.update(local, mean, 2, max(2 * batch, 2))
            for a, b in zip(self._prev, grads):
                a.copy_(b)
        else:
            self._prev = [g.clone() for g in grads]
        self._prev_sqr, self._prev_batch = total, batch
