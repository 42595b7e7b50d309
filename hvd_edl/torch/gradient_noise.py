"""The gradient noise scale measured inside ``hvd.DistributedOptimizer`` (the estimator:
:mod:`hvd_edl.gradient_noise`).

Where the norms come from, on the paths a Horovod step takes anyway:

* each backward pass's local squared norm: a tensor hook on every parameter sees the pass's
  gradient before it is accumulated into ``.grad`` (and before Horovod's in-place allreduce
  overwrites it): one ``vector_norm`` per parameter and pass.  With ``a`` backward passes per
  step (Horovod's ``backward_passes_per_step``, the adaptive batch's accumulation) a rank
  contributes ``a`` independent micro-batch gradients (AdaptDL counts them the same way);
* their mean over the ranks: one float64 scalar allreduced asynchronously at the start of
  ``synchronize()``, so it travels while the gradients' allreduces are still in flight, and is
  read once ``poll`` says it is done (after a later step's gradients: never waited for; the
  estimate is a step or two behind);
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
import os
import time
from collections import deque
from typing import Deque, List, Optional

import horovod.torch as _hvd
import torch

from hvd_edl import runtime as _runtime
from hvd_edl.gradient_noise import NoiseScale

log = logging.getLogger(__name__)

ENV_OFF = "HVD_EDL_GRADIENT_NOISE"
"""``HVD_EDL_GRADIENT_NOISE=0`` in a worker's environment turns the measurement off (nothing
computed, no scalar allreduce; for benchmarks of its cost)."""
ENV_SMOOTHING = "HVD_EDL_NOISE_SMOOTHING"
"""The estimator's theta per step of the initial batch (default
:data:`hvd_edl.gradient_noise.DEFAULT_SMOOTHING`, 0.99: about 100 steps of memory; AdaptDL's
0.999 remembers 1,000: steadier, slower to follow training)."""
ENV_EVERY = "HVD_EDL_GRADIENT_NOISE_EVERY"
"""Measure every k-th optimizer step only (default 1: every step): 1/k of the cost, k times
fewer samples for the average (its memory stays the same number of steps).  The steps are
chosen by the step count, the same on every rank (no collective can be left unmatched); one
rank alone measures the pairs (k-1, k) of consecutive steps."""
NAMES = 16  # the scalar allreduces' names rotate over this many steps
_batch = [0]   # the global batch (samples) of the step being computed; 0 unknown
_meters = itertools.count()  # names of the scalar allreduces: the same on every rank
_current: List[Optional["GradientNoiseMeter"]] = [None]  # the last meter made (telemetry)


def _generation() -> int:
    """The ring this process is in (0 outside hvd-edl-run: one ring for the process's life)."""
    rt = _runtime.get()
    return rt.generation if rt is not None else 0


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
        enabled: False turns the measurement off (nothing computed, no scalar allreduce);
            starts False when ``HVD_EDL_GRADIENT_NOISE=0``.
        cost_s, cost_steps: seconds the measurement took on the training thread (hooks, the
            norms, waiting for the scalar; not Horovod's own synchronize) over that many steps
            (its cost per step, timed by two ``perf_counter()`` calls per hook).
        local_scale, total_scale: factors on a backward pass's and on the averaged gradient's
            squared norms, so that both are norms of *means* over their samples.  Defaults: 1,
            and ``1 / a^2`` with ``a`` backward passes per step (Horovod accumulates the sum of
            ``a`` micro-batch means); the adaptive optimizer sets them (a micro-batch's loss
            weighted by ``n / B`` needs ``a^2`` on the first and 1 on the second).
    """

    def __init__(self, opt, smoothing: Optional[float] = None):
        self.opt = opt
        if smoothing is None and os.environ.get(ENV_SMOOTHING):
            smoothing = float(os.environ[ENV_SMOOTHING])
        self.noise = NoiseScale() if smoothing is None else NoiseScale(smoothing)
        self.enabled = os.environ.get(ENV_OFF, "1") != "0"
        self.every = max(int(os.environ.get(ENV_EVERY, "1") or 1), 1)
        self._calls = 0  # synchronize calls (the step count outside hvd-edl-run)
        self.cost_s = 0.0  # seconds the measurement took on the training thread, in all
        self.cost_steps = 0  # synchronized steps it was measured over
        self.local_scale = 1.0  # factor on each backward pass's squared norm
        self.total_scale: Optional[float] = None  # on the averaged gradient's (None: 1/passes^2)
        self.name = f"hvd_edl.gradient_noise.{next(_meters)}"
        self._local: List[torch.Tensor] = []
        self._prev: Optional[List[torch.Tensor]] = None  # size 1: the previous step's grads
        self._prev_sqr = 0.0
        # (handle, total, count, batch, generation) of steps whose scalar is still in flight
        self._pending: Deque[tuple] = deque()
        self._prev_step = -2  # the step whose gradients _prev holds (one rank)
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
            step = self._step_id()
            self._calls += 1
            if not self.enabled or not _hvd.is_initialized():
                self._local = []
                self._pending.clear()
                return inner()
            size = _hvd.size()
            count = size * self._passes()
            if not self._armed(step, count):
                self._local = []
                return inner()
            t0 = time.perf_counter()
            handle = None
            local = self._local_sum()
            if count > 1 and local is not None:
                if size == 1:
                    handle = local
                else:
                    try:  # every rank sends on the same steps, under the same name
                        handle = _hvd.allreduce_async(local, name=f"{self.name}.{step % NAMES}",
                                                      op=_hvd.Average)
                    except Exception as e:  # noqa: BLE001 - never fails a step
                        log.debug("gradient noise scalar not sent: %s", e)
            t1 = time.perf_counter()
            result = inner()
            t2 = time.perf_counter()
            self._local = []
            try:
                self._measure(size, count, handle, step)
                self._finish_pending()
            except Exception as e:  # noqa: BLE001 - the measurement never fails a step
                log.warning("gradient noise not measured this step: %s", e)
            self.cost_s += (t1 - t0) + (time.perf_counter() - t2)
            self.cost_steps += 1
            return result

        opt.synchronize = synchronize

    def _step_id(self) -> int:
        """This step's number, the same on every rank: the runtime's optimizer step count
        (synced to joiners, restored at a rollback), else the synchronize calls so far."""
        rt = _runtime.get()
        return rt.steps if rt is not None else self._calls

    def _armed(self, step: int, count: Optional[int] = None) -> bool:
        """Whether step ``step`` is measured (:data:`ENV_EVERY`): every k-th step; with one
        gradient per step (one rank, one pass) also the step before it, to pair them."""
        k = self.every
        if k == 1:
            return True
        if count is None:
            count = (_hvd.size() if _hvd.is_initialized() else 1) * self._passes()
        return step % k == 0 or (count == 1 and step % k == k - 1)

    def _finish_pending(self) -> None:
        """Add the figures of earlier steps whose scalar allreduce is done (``poll``: never
        waited for; it completes with a later step's gradients), oldest first."""
        gen = _generation()
        while self._pending:
            handle, total, count, batch, generation = self._pending[0]
            if generation != gen:  # that ring is gone (a switch): its handle means nothing now
                self._pending.popleft()
                continue
            try:
                if not _hvd.poll(handle):
                    return
                local = float(_hvd.synchronize(handle))
            except Exception as e:  # noqa: BLE001 - the measurement never fails a step
                log.debug("gradient noise of an earlier step lost: %s", e)
                self._pending.popleft()
                continue
            self._pending.popleft()
            self.noise.update(local, total, count, batch)

    def _grad_hook(self, grad):
        if self.enabled and not grad.is_sparse and (self.every == 1
                                                    or self._armed(self._step_id())):
            t0 = time.perf_counter()
            g = grad.detach().reshape(-1)
            # on the CPU a Python float at once (no stacking later); on a GPU a tensor (an
            # .item() would wait for the device)
            self._local.append(float(torch.dot(g, g)) if g.device.type == "cpu"
                               else torch.dot(g, g))
            self.cost_s += time.perf_counter() - t0
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
        scale = self.local_scale / self._passes()
        if isinstance(local[0], float):
            return torch.tensor(sum(local) * scale, dtype=torch.float64)
        return torch.stack(local).double().sum() * scale

    def _grads(self) -> List[torch.Tensor]:
        return [p.grad.detach() for p in self._params
                if p.grad is not None and not p.grad.is_sparse]

    def _measure(self, size: int, count: int, handle, step: int = 0) -> None:
        grads = self._grads()
        if not grads:
            return
        k = self.total_scale if self.total_scale is not None else 1.0 / self._passes() ** 2
        total = k * float(torch.nn.utils.get_total_norm(grads)) ** 2
        batch = _batch[0]
        if count > 1:
            self._prev = None
            if handle is None:
                return
            if size == 1:
                self.noise.update(float(handle), total, count, max(batch, count))
            else:  # the ranks' mean is read once done (polled): never waited for
                if len(self._pending) >= NAMES - 1:
                    self._pending.popleft()  # far too late: forgotten (never waited for)
                self._pending.append((handle, total, count, max(batch, count), _generation()))
            return
        # one rank: pair this step with the previous one (same batch), as two "ranks"
        if self._prev is not None and batch == self._prev_batch and len(self._prev) == len(grads) \
                and (self.every == 1 or self._prev_step == step - 1):
            dot = k * float(sum(torch.dot(a.flatten(), b.flatten()).double()
                            for a, b in zip(self._prev, grads)))
            local = (self._prev_sqr + total) / 2.0
            mean = (self._prev_sqr + total + 2.0 * dot) / 4.0
            self.noise.update(local, mean, 2, max(2 * batch, 2), step_batch=batch)
            for a, b in zip(self._prev, grads):
                a.copy_(b)
        else:
            self._prev = [g.clone() for g in grads]
        self._prev_sqr, self._prev_batch, self._prev_step = total, batch, step
