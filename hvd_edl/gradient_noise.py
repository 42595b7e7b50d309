"""The gradient noise scale, estimated online from the squared norms a data-parallel step has
anyway (McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch Training",
appendix A.1; Pollux, Qiao et al. OSDI'21, and its reference code AdaptDL's
``gradient_noise_scale.py``, whose estimator this is, written anew).

With ``count`` gradients ``g_1..g_count``, each the mean over ``b = B / count`` samples of one
step (a rank's local gradient before the allreduce), and their mean ``g`` over the step's ``B``
samples (the averaged gradient after it):

    E|g_i|^2 = |G|^2 + tr(Sigma) / b        E|g|^2 = |G|^2 + tr(Sigma) / B

where ``G`` is the true gradient and ``Sigma`` the covariance of *one sample's* gradient.  With
``local_sqr`` the mean of the ``|g_i|^2`` and ``total_sqr = |g|^2``, unbiased estimates are

    sqr = (count * total_sqr - local_sqr) / (count - 1)          (|G|^2)
    var = (local_sqr - total_sqr) * B / (count - 1)               (tr(Sigma), per sample)

and the noise scale ``B_simple = tr(Sigma) / |G|^2`` (in samples) does not depend on the batch
or on the number of ranks it was measured with.

Those expectations hold for samples drawn *with* replacement.  Horovod's samplers (and ours) draw
an epoch's samples without replacement from a finite training set of ``N``: then
``E|g_i|^2 = |G|^2 + tr(Sigma) (1/b - 1/N)`` (the finite-population correction, with ``Sigma``
the set's sample covariance, divisor ``N - 1``), so ``var`` above stays unbiased while ``sqr``
is biased down by exactly ``tr(Sigma) / N``; ``sqr + var / N`` is unbiased again.  Late in
training, when ``|G|^2`` is small beside the noise, that term matters (digits, ``N`` 1,347:
``tr(Sigma) / N`` was 15 % of ``|G|^2`` at epoch 10).  McCandlish's and AdaptDL's estimators
assume replacement; the samplers tell the meter ``N`` (:func:`unbiased`'s ``population``).

Both are smoothed by a bias-corrected exponential average (each step weighs ``1 - theta``, ``theta = smoothing ** (B / B0)``: a step
of a batch S times larger counts as S steps), and the ratio is taken of the averages (a ratio of
noisy single-step estimates is biased).  One rank alone pairs consecutive steps instead
(``count`` 2 over ``2B`` samples; the parameters moved by one step between them, which biases
``var`` up a little: AdaptDL does the same).

The gain of a batch ``B`` over the initial ``B0`` (AdaScale, Johnson et al. 2020; Pollux's
statistical efficiency is ``gain / S``):

    r = (var / B0 + sqr) / (var / B + sqr) = (1 + B_simple / B0) / (1 + B_simple / B)

This module is numbers only (no torch): :mod:`hvd_edl.torch.gradient_noise` measures the norms
inside ``hvd.DistributedOptimizer``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

DEFAULT_SMOOTHING = 0.99
"""``theta`` per step of the initial batch: the average's memory is about 100 such steps.
AdaptDL uses 0.999 (1,000 steps); a shorter memory follows the noise scale's rise during
training (it grows several times within an epoch or two on small models) with less lag, at the
price of a noisier figure."""


@dataclass
class NoiseEstimate:
    """The smoothed estimates after ``measured_steps`` measured steps.

    ``sqr``: |G|^2 (squared norm of the true gradient); ``var``: tr(Sigma) of one sample's
    gradient; ``noise_scale_samples``: var / sqr (McCandlish's B_simple, samples; None while
    sqr <= 0: early in training the unbiased |G|^2 can average to 0 or below, the noise scale is
    then unknown, not infinite); ``batch``: the global batch (samples) of the last measured step;
    ``step``: the job's optimizer step of the last measured step (steps taken when it ended, the
    count ``hvd-edl-ctl status`` shows; a few behind the job's, since figures are read a step or
    two late and only every k-th step is measured); ``measured_steps``: steps measured so far;
    ``period``: the meter's k at the last measured step (it measures every k-th step)."""
    sqr: float
    var: float
    noise_scale_samples: Optional[float]
    batch: int
    step: int
    measured_steps: int = 0
    period: int = 1

    def as_dict(self) -> Dict[str, float]:
        """JSON-ready (``noise_scale_samples`` -1 when unknown: the message fields are floats)."""
        return {"sqr": self.sqr, "var": self.var,
                "noise_scale_samples": -1.0 if self.noise_scale_samples is None
                else self.noise_scale_samples, "batch": float(self.batch),
                "step": float(self.step), "measured_steps": float(self.measured_steps),
                "period": float(self.period)}


def unbiased(local_sqr: float, total_sqr: float, count: int, batch: int, population: int = 0):
    """One step's unbiased ``(sqr, var)`` (see the module docstring).

    Args:
        local_sqr: mean over the ``count`` gradients of their squared norms.
        total_sqr: squared norm of their mean.
        count: gradients averaged, >= 2.
        batch: samples behind the mean, >= count.
        population: the training set's size ``N`` when the step's samples were drawn from it
            without replacement (adds the finite-population term ``var / N`` to ``sqr``); 0
            (or less than ``batch``) for samples drawn with replacement: no correction.

    Raises:
        ValueError: count < 2 or batch < count.
    """
    if count < 2 or batch < count:
        raise ValueError(f"need count >= 2 and batch >= count, got count {count}, batch {batch}")
    sqr = (count * total_sqr - local_sqr) / (count - 1)
    var = (local_sqr - total_sqr) * batch / (count - 1)
    if population >= batch:
        sqr += var / population
    return sqr, var


def gain(sqr: float, var: float, batch: float, base_batch: float) -> float:
    """AdaScale's gain ``r`` of global batch ``batch`` over ``base_batch`` (Johnson et al.
    2020, eq. 3 with var per sample): 1 at ``batch == base_batch``, at most ``batch /
    base_batch``; 1 when nothing is known (``sqr`` and ``var`` both <= 0)."""
    var = max(var, 0.0)
    sqr = max(sqr, 0.0)
    if var <= 0.0 and sqr <= 0.0:
        return 1.0
    r = (var / base_batch + sqr) / (var / batch + sqr)
    scale = batch / base_batch
    return min(max(r, min(1.0, scale)), max(1.0, scale))


def efficiency(noise_scale_samples: float, batch: float, base_batch: float) -> float:
    """Pollux's statistical efficiency of ``batch`` against ``base_batch``:
    ``gain / S = (B_simple + B0) / (B_simple + B)`` (1 at B0, falling as B grows past the
    noise scale).  An unknown (negative) noise scale counts as 0: the pessimistic figure."""
    ns = max(noise_scale_samples, 0.0)
    return (ns + base_batch) / (ns + batch)


_published: list = [None]  # the latest estimate of this process (one reference, replaced whole)


def published() -> Optional[NoiseEstimate]:
    """The latest estimate any :class:`NoiseScale` of this process made (the heartbeat sends it
    to the launcher); None before the first measured step."""
    return _published[0]


class NoiseScale:
    """The running estimate (one per optimizer; the training thread is its only writer; the
    heartbeat thread reads :attr:`latest`, a reference replaced whole).

    Args:
        smoothing: theta per step of the initial batch, in (0, 1).
    """

    def __init__(self, smoothing: float = DEFAULT_SMOOTHING):
        if not 0.0 < smoothing < 1.0:
            raise ValueError(f"smoothing must be in (0, 1), got {smoothing}")
        self.smoothing = smoothing
        self.base_batch: Optional[int] = None  # B0: the first measured step's batch
        self._sqr = [0.0, 0.0]  # biased average, its weight (bias correction)
        self._var = [0.0, 0.0]
        self.steps = 0  # measured steps
        self.last_step = 0  # the job's optimizer step of the last measured step
        self.latest: Optional[NoiseEstimate] = None

    def update(self, local_sqr: float, total_sqr: float, count: int, batch: int,
               step_batch: Optional[int] = None, population: int = 0, period: int = 1,
               step: Optional[int] = None) -> None:
        """Add one step's norms (see :func:`unbiased`, also for ``population``); a step with a
        non-finite norm (an overflow, a rank that had nothing to send) is skipped.
        ``step_batch``: the step's global batch when ``batch`` covers more (one rank pairing
        two steps: ``batch`` is both steps'); reported as ``batch``.  ``period``: this
        measurement stands for that many optimizer steps (the meter measures every k-th): it
        weighs as ``period`` steps in the average (``theta ** period``), so the average's memory
        stays the same number of steps; sampling steps by their number, not by their values,
        keeps it unbiased.  ``step``: the job's optimizer step of this measurement (steps taken
        when it ended; reported as ``step``), None: the count of measured steps."""
        if not (math.isfinite(local_sqr) and math.isfinite(total_sqr)):
            return
        sqr, var = unbiased(local_sqr, total_sqr, count, batch, population)
        if self.base_batch is None:
            self.base_batch = batch
        theta = self.smoothing ** (max(int(period), 1) * batch / self.base_batch)
        for avg, value in ((self._sqr, sqr), (self._var, var)):
            avg[0] = theta * avg[0] + (1.0 - theta) * value
            avg[1] = theta * avg[1] + (1.0 - theta)
        self.steps += 1
        s, v = self.sqr, self.var
        self.last_step = self.steps if step is None else int(step)
        self.latest = NoiseEstimate(s, v, v / s if s > 0 else None, int(step_batch or batch),
                                    self.last_step, self.steps, max(int(period), 1))
        _published[0] = self.latest

    @property
    def sqr(self) -> float:
        """Smoothed |G|^2 (0 before any step)."""
        return self._sqr[0] / self._sqr[1] if self._sqr[1] else 0.0

    @property
    def var(self) -> float:
        """Smoothed tr(Sigma) per sample, clipped at 0 (0 before any step)."""
        return max(self._var[0] / self._var[1], 0.0) if self._var[1] else 0.0

    def gain(self, batch: float, base_batch: float) -> float:
        """:func:`gain` from the current averages."""
        return gain(self.sqr, self.var, batch, base_batch)

    def state_dict(self) -> Dict[str, float]:
        """What a commit keeps (floats; restored by :meth:`load_state_dict`)."""
        return {"sqr": self._sqr[0], "sqr_w": self._sqr[1], "var": self._var[0],
                "var_w": self._var[1], "steps": self.steps,
                "base_batch": self.base_batch or 0, "last_step": self.last_step}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        """Restore :meth:`state_dict`'s figures."""
        self._sqr = [float(state["sqr"]), float(state["sqr_w"])]
        self._var = [float(state["var"]), float(state["var_w"])]
        self.steps = int(state["steps"])
        self.base_batch = int(state["base_batch"]) or None
        self.last_step = int(state.get("last_step", self.steps))
        s, v = self.sqr, self.var
        self.latest = None if not self.steps else NoiseEstimate(
            s, v, v / s if s > 0 else None, self.base_batch or 0, self.last_step, self.steps)
