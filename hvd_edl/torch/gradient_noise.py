"""The gradient noise scale measured inside ``hvd.DistributedOptimizer`` (the estimator:
:mod:`hvd_edl.gradient_noise`; which steps are measured: :mod:`hvd_edl.measuring_period`).

Where the norms come from, on the paths a Horovod step takes anyway, on measured steps only:

* each backward pass's local squared norm: a tensor hook on every parameter sees the pass's
  gradient before it is accumulated into ``.grad`` (and before Horovod's in-place allreduce
  overwrites it) and takes its norm (one op, no ``.item()``).  With ``a`` backward passes per
  step (Horovod's ``backward_passes_per_step``, the adaptive batch's accumulation) a rank
  contributes ``a`` independent micro-batch gradients (AdaptDL counts them the same way).  On
  steps that are not measured the hooks return at once (one flag read);
* their mean over the ranks: the norms stacked and summed (one op), sent in one small float64
  buffer (with the meter's own cost and the wall time since the last measured step: the
  measuring period's agreed figures) by an asynchronous allreduce at the start of
  ``synchronize()``, so it travels while the gradients' allreduces are in flight; read once
  ``poll`` says it is done (after a later step's gradients: never waited for; the estimate is a
  step or two behind);
* the averaged gradient's squared norm: after ``synchronize()``, ``torch._foreach_norm`` over
  the gradients (one fused op), kept as a tensor and read with the buffer.  ``count`` = ranks x
  passes.

Nothing is read back to Python on a step's path (no ``.item()``): figures are read when done
(on a GPU also once an event recorded after them has passed).  One rank with one pass per step
pairs a measured step with the step before it (the gradients kept in buffers allocated once,
compared with fused ``_foreach`` ops).  The global batch of a step is what the elastic samplers
noted when they yielded it (:func:`note_batch`, with the training set's size for the
finite-population term); a script with another sampler may call :func:`note_batch` itself;
without any, the batch counts as one sample per rank and ``noise_scale_samples`` is then in
units of a rank's batch (``batch`` reads 0).

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
from hvd_edl.measuring_period import DEFAULT_BUDGET, MeasuringPeriod

log = logging.getLogger(__name__)

ENV_OFF = "HVD_EDL_GRADIENT_NOISE"
"""``HVD_EDL_GRADIENT_NOISE=0`` in a worker's environment turns the measurement off (nothing
computed, no scalar allreduce; for benchmarks of its cost)."""
ENV_SMOOTHING = "HVD_EDL_NOISE_SMOOTHING"
"""The estimator's theta per step of the initial batch (default
:data:`hvd_edl.gradient_noise.DEFAULT_SMOOTHING`, 0.99: about 100 steps of memory; AdaptDL's
0.999 remembers 1,000: steadier, slower to follow training)."""
ENV_EVERY = "HVD_EDL_GRADIENT_NOISE_EVERY"
"""Measure every k-th optimizer step, k fixed (1: every step, as AdaptDL).  Unset (the default):
k is chosen from the meter's measured cost (:mod:`hvd_edl.measuring_period`), the same on every
rank.  One rank alone measures pairs of consecutive steps."""
ENV_BUDGET = "HVD_EDL_GRADIENT_NOISE_BUDGET"
"""The chosen k's target: the meter's share of the step time (default
:data:`hvd_edl.measuring_period.DEFAULT_BUDGET`, 0.005)."""
NAMES = 16  # the scalar allreduces' names rotate over this many steps; at most NAMES-1 in flight
_batch = [0, 0]  # the global batch (samples) of the step being computed (0 unknown), population
_meters = itertools.count()  # names of the scalar allreduces: the same on every rank
_current: List[Optional["GradientNoiseMeter"]] = [None]  # the last meter made (telemetry)


def _generation() -> int:
    """The ring this process is in (0 outside hvd-edl-run: one ring for the process's life)."""
    rt = _runtime.get()
    return rt.generation if rt is not None else 0


def note_batch(global_batch: int, population: int = 0) -> None:
    """The step now being computed has ``global_batch`` samples over all ranks (the samplers
    call it when they yield a step's share), drawn without replacement from a training set of
    ``population`` samples (0: unknown or with replacement; see
    :func:`hvd_edl.gradient_noise.unbiased`)."""
    _batch[0] = int(global_batch)
    _batch[1] = int(population)


def current() -> Optional["GradientNoiseMeter"]:
    """The meter of the most recently built ``hvd.DistributedOptimizer`` (None before)."""
    return _current[0]


class _Sent:
    """One measured step whose figures are not read yet: ``buf`` ([local_sqr, cost_s, wall_s],
    float64; allreduced when ``handle``), ``total`` (the averaged gradient's squared norm, a
    tensor) and what the estimator needs with them."""
    __slots__ = ("step", "handle", "buf", "total", "event", "count", "batch", "population",
                 "period", "step_batch", "local_scale", "total_scale")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


class GradientNoiseMeter:
    """Measures ``opt``'s gradient noise on the steps its :class:`~hvd_edl.measuring_period.
    MeasuringPeriod` arms (see the module).

    Args:
        opt: a Horovod ``DistributedOptimizer`` (allreduce, not Adasum).
        smoothing: the estimator's theta per step of the initial batch.

    Attributes:
        noise: the :class:`hvd_edl.gradient_noise.NoiseScale` (its ``latest`` estimate).
        period: the :class:`hvd_edl.measuring_period.MeasuringPeriod` (``period.period`` is k).
        enabled: False turns the measurement off (nothing computed, no scalar allreduce);
            starts False when ``HVD_EDL_GRADIENT_NOISE=0``.  Set it alike on every rank.
        cost_s, cost_steps: seconds the measurement took on the training thread (hooks, the
            norms, launching and reading the buffer; not Horovod's own synchronize) over that
            many steps (its cost per step, every step counted, measured or not).
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
        every = os.environ.get(ENV_EVERY, "")
        self.period = MeasuringPeriod(
            budget=float(os.environ.get(ENV_BUDGET, "") or DEFAULT_BUDGET),
            fixed=max(int(every), 1) if every else None)
        self._calls = 0  # synchronize calls (the step count outside hvd-edl-run)
        self.cost_s = 0.0  # seconds the measurement took on the training thread, in all
        self.cost_steps = 0  # synchronized steps it was measured over
        self.local_scale = 1.0  # factor on each backward pass's squared norm
        self.total_scale: Optional[float] = None  # on the averaged gradient's (None: 1/passes^2)
        self.name = f"hvd_edl.gradient_noise.{next(_meters)}"
        self._hot = True  # the hooks take norms (the coming step is measured)
        self._norms: List[torch.Tensor] = []  # this step's per-parameter, per-pass norms
        self._prev: Optional[List[torch.Tensor]] = None  # one rank: the step before's grads
        self._prev_sqr: Optional[torch.Tensor] = None
        self._prev_step = -2
        self._prev_batch = 0
        self._sent: Deque[_Sent] = deque()  # measured steps not read yet, oldest first
        self._gen: Optional[int] = None  # the ring the schedule belongs to
        self._last_step: Optional[int] = None  # the last synchronized step
        self._cost_acc = 0.0  # meter seconds since the last measured step's buffer was sent
        self._sent_at: Optional[float] = None  # perf_counter() of that send
        self._params = [p for group in opt.param_groups for p in group["params"]
                        if p.requires_grad]
        _current[0] = self

    @property
    def every(self) -> int:
        """k now: the meter measures every k-th optimizer step."""
        return self.period.period

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
                self._norms = []
                if self._sent and _hvd.is_initialized():
                    self.drain()  # turned off: read what is in flight (every rank does)
                self._sent_at = None
                return inner()
            t0 = time.perf_counter()
            size = _hvd.size()
            count = size * self._passes()
            self._follow(step)
            sent = None
            if self.period.armed(step, pair=count == 1):
                try:
                    sent = self._send(step, size, count)
                except Exception as e:  # noqa: BLE001 - the measurement never fails a step
                    log.warning("gradient noise not sent this step: %s", e)
            self._norms = []
            t1 = time.perf_counter()
            result = inner()
            t2 = time.perf_counter()
            try:
                if sent is not None:
                    self._total(sent, size, count)
                self._read()
                self._schedule(step, count)
            except Exception as e:  # noqa: BLE001 - the measurement never fails a step
                log.warning("gradient noise not measured this step: %s", e)
            spent = (t1 - t0) + (time.perf_counter() - t2)
            self.cost_s += spent
            self._cost_acc += spent
            self.cost_steps += 1
            return result

        opt.synchronize = synchronize

    # ---- the schedule ----------------------------------------------------------------------

    def _step_id(self) -> int:
        """This step's number, the same on every rank: the runtime's optimizer step count
        (synced to joiners, restored at a rollback), else the synchronize calls so far."""
        rt = _runtime.get()
        return rt.steps if rt is not None else self._calls

    def drain(self) -> None:
        """Wait for every figure in flight and add it (before the meter is turned off or its
        ``period`` replaced, so every rank's schedule has read the same figures)."""
        if self._sent:
            self._read(upto=self._sent[-1].step)

    def _follow(self, step: int) -> None:
        """At a new ring or a step count that went back (a restore): forget the old figures
        and start the schedule at ``step`` (every member of the ring shares it).  Steps skipped
        forward (measuring turned off and on again, alike on every rank) keep the schedule."""
        gen = _generation()
        if gen != self._gen or self._last_step is None or step <= self._last_step:
            self._gen = gen
            self._sent.clear()
            self._prev = None
            self.period.start(step)
            self._sent_at = None
            self._cost_acc = 0.0
        elif step != self._last_step + 1:
            self._sent_at = None  # the wall time across the gap is not a step's
        self._last_step = step

    def _schedule(self, step: int, count: int) -> None:
        """After step ``step``: take a due decision (reading the results it needs first, the
        same on every rank) and arm the hooks for the next step."""
        nxt = step + 1
        last = self.period.due(nxt)
        if last is not None:
            self._read(upto=last)
            k = self.period.decide(nxt)
            log.debug("gradient noise measured every %d steps from step %d", k, nxt)
        self._hot = count > 1 and self.period.armed(nxt)

    # ---- measuring -------------------------------------------------------------------------

    def _grad_hook(self, grad):
        if self._hot and self.enabled and not grad.is_sparse:
            t0 = time.perf_counter()
            if grad.dtype in (torch.float16, torch.bfloat16):
                self._norms.append(torch.linalg.vector_norm(grad.detach(), dtype=torch.float32))
            else:
                self._norms.append(torch.linalg.vector_norm(grad.detach()))
            dt = time.perf_counter() - t0
            self._cost_acc += dt
            self.cost_s += dt
        return None

    def _passes(self) -> int:
        """Backward passes (micro-batches) per step: Horovod's ``backward_passes_per_step``."""
        return max(int(getattr(self.opt, "backward_passes_per_step", 1) or 1), 1)

    def _send(self, step: int, size: int, count: int) -> Optional[_Sent]:
        """Before the gradients' synchronize: this step's buffer [mean over passes of the local
        squared norms (NaN when no hook fired: every rank still sends), the meter's seconds and
        the wall seconds since the last send], allreduced (average) when there are ranks."""
        now = time.perf_counter()
        wall = now - self._sent_at if self._sent_at is not None else 0.0
        self._sent_at = now
        cost, self._cost_acc = self._cost_acc, 0.0
        norms = self._norms
        device = norms[0].device if norms else (self._params[0].device if self._params
                                                else torch.device("cpu"))
        buf = torch.tensor([float("nan"), cost, wall], dtype=torch.float64, device=device)
        if count > 1 and norms:
            v = torch.stack(norms)
            buf[0] = torch.dot(v, v)  # the sum over parameters and passes (scaled when read)
        handle = None
        if size > 1:  # every rank sends on the same steps, under the same name
            if len(self._sent) >= NAMES - 1:
                self._read(upto=self._sent[0].step)  # never in practice: 15 results in flight
            handle = _hvd.allreduce_async(buf, name=f"{self.name}.{step % NAMES}",
                                          op=_hvd.Average)
        batch, population = _batch
        sent = _Sent(step=step, handle=handle, buf=buf, total=None, event=None, count=count,
                     batch=batch, population=population, period=self.period.period,
                     step_batch=None, local_scale=self.local_scale / self._passes(),
                     total_scale=1.0)
        self.period.launched(step)
        return sent

    def _grads(self) -> List[torch.Tensor]:
        return [p.grad.detach() for p in self._params
                if p.grad is not None and not p.grad.is_sparse]

    def _total(self, sent: _Sent, size: int, count: int) -> None:
        """After the gradients' synchronize: the averaged gradient's squared norm (fused), or
        for one rank with one pass the pair's figures; queues ``sent`` to be read when done."""
        grads = self._grads()
        if not grads:  # nothing to measure; still read (the schedule's figures, the handle)
            sent.total = None
            sent.count = min(sent.count, 1)
            self._sent.append(sent)
            return
        sent.total_scale = (self.total_scale if self.total_scale is not None
                            else 1.0 / self._passes() ** 2)
        v = torch.stack(torch._foreach_norm(grads))
        sqr = torch.dot(v, v)  # one fused norm per parameter, their squares summed
        if count > 1:
            self._prev = None
            sent.total = sqr
            sent.batch = max(sent.batch, count)
        else:  # one rank: pair this step with the step before (same batch), as two "ranks"
            batch = sent.batch
            paired = (self._prev is not None and self._prev_step == sent.step - 1
                      and batch == self._prev_batch and len(self._prev) == len(grads))
            if paired:
                v = torch.stack(torch._foreach_norm(torch._foreach_add(self._prev, grads)))
                sent.buf[0] = (self._prev_sqr + sqr) / 2.0
                sent.total = torch.dot(v, v) / 4.0  # |mean of the two|^2
                sent.local_scale = sent.total_scale
                sent.count, sent.batch, sent.step_batch = 2, max(2 * batch, 2), batch
                torch._foreach_copy_(self._prev, grads)
            elif self._prev is None or len(self._prev) != len(grads):
                self._prev = [g.clone() for g in grads]
            else:
                torch._foreach_copy_(self._prev, grads)
            self._prev_sqr, self._prev_batch, self._prev_step = sqr, batch, sent.step
            if not paired:
                sent.total = None  # the first of a pair: nothing to estimate, only the schedule
        if sqr.device.type == "cuda":
            sent.event = torch.cuda.Event()
            sent.event.record()
        self._sent.append(sent)

    def _read(self, upto: Optional[int] = None) -> None:
        """Add the figures of sent steps that are done (``poll``: never waited for), oldest
        first; with ``upto``, wait for those up to that step (a due decision needs them)."""
        while self._sent:
            sent = self._sent[0]
            wait = upto is not None and sent.step <= upto
            try:
                if sent.handle is not None:
                    if not wait and not _hvd.poll(sent.handle):
                        return
                    buf = _hvd.synchronize(sent.handle)
                else:
                    if not wait and sent.event is not None and not sent.event.query():
                        return
                    buf = sent.buf
                local, cost, wall = buf.tolist()
                local *= sent.local_scale
                total = (float(sent.total) * sent.total_scale if sent.total is not None
                         else float("nan"))
            except Exception as e:  # noqa: BLE001 - the measurement never fails a step
                log.debug("gradient noise of step %d lost: %s", sent.step, e)
                self._sent.popleft()
                continue
            self._sent.popleft()
            self.period.result(sent.step, cost, wall)
            if sent.count > 1:
                self.noise.update(local, total, sent.count, sent.batch,
                                  step_batch=sent.step_batch, population=sent.population,
                                  period=sent.period, step=sent.step + 1)
