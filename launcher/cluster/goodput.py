"""Goodput: a job's useful training speed, throughput x statistical efficiency, and the batch
that maximises it.

Pollux (Qiao et al., "Pollux: Co-adaptive Cluster Scheduling for Goodput-Optimized Deep
Learning", OSDI 2021; AdaptDL's ``goodput.py`` is the reference implementation, Apache-2.0) with
AdaScale's gain (Johnson et al., "AdaScale SGD", ICML 2020):

* ``sqr`` estimates |G|^2 (the true gradient's squared norm) and ``var`` tr(Sigma) of the
  gradient at the base batch ``B0`` (both as the job measures them, McCandlish et al. 2018).
* At a global batch ``B``, scale ``S = B / B0``, one optimizer step makes
  ``gain = (var + sqr) / (var / S + sqr)`` steps' worth of progress at ``B0`` (AdaScale's r,
  "scale-invariant iterations"): 1 at S = 1, at most S.  Efficiency ``gain / S``.
* Goodput at a configuration = samples/s x efficiency = ``B0 x gain / step seconds``: the
  samples/s a job at ``B0`` would need to progress as fast.
* The batch: ~50 geometric candidates between the smallest and the largest allowed global batch
  (the local batch within ``[min_local, max_local]``, accumulating gradients above
  ``max_local``), the one with the highest goodput wins (AdaptDL's ``GoodputFunction.optimize``).

Pure maths on numbers and callables: the job side (its own model), the cluster policies and the
simulator share it.  No trace or service state here.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

CANDIDATES = 50
"""Global batch sizes tried per size, geometric between the bounds (AdaptDL's ``geomspace``)."""

SWITCH_GAIN = 0.05
"""A running job's batch changes only for more than this relative goodput gain (AdaptDL)."""


def gain(sqr, var, scale):
    """AdaScale's gain r at ``scale`` = B / B0 (scalars or numpy arrays, broadcast): the progress,
    in optimizer steps at B0, of one step at B.  ``sqr``, ``var``: |G|^2 and tr(Sigma) at B0
    (any consistent unit).  1.0 where ``var / scale + sqr`` is not positive (nothing measured)."""
    sqr, var, scale = np.asarray(sqr, float), np.asarray(var, float), np.asarray(scale, float)
    den = var / scale + sqr
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(den > 0, (var + sqr) / np.where(den > 0, den, 1.0), 1.0)
    return r.item() if r.ndim == 0 else r


def efficiency(sqr, var, batch, base_batch):
    """Statistical efficiency ``gain / scale`` of a step at global ``batch`` against
    ``base_batch`` (B0), in (0, 1] for batch >= B0 (McCandlish's
    ``(B_noise + B0) / (B_noise + B)`` with ``B_noise = B0 var / sqr``)."""
    scale = np.asarray(batch, float) / float(base_batch)
    return gain(sqr, var, scale) / scale


def noise_scale_samples(sqr: float, var: float, base_batch: float) -> float:
    """McCandlish's B_simple in samples: ``base_batch x var / sqr`` (inf when sqr <= 0)."""
    return base_batch * var / sqr if sqr > 0 else math.inf


def split_batch(batch: int, replicas: int, max_local: int) -> Tuple[int, int]:
    """(micro-batch per replica, accumulation steps) for a global ``batch`` over ``replicas``:
    the local batch ``ceil(batch / replicas)`` in ``accum + 1`` micro-batches of at most
    ``max_local`` each.  The batch actually run is ``replicas x micro x (accum + 1)``."""
    if replicas < 1 or batch < 1 or max_local < 1:
        raise ValueError(f"split_batch needs positive batch, replicas, max_local; got "
                         f"{batch}, {replicas}, {max_local}")
    local = math.ceil(batch / replicas - 1e-8)
    accum = math.ceil(local / max_local - 1e-8) - 1
    micro = math.ceil(local / (accum + 1) - 1e-8)
    return micro, accum


def batch_candidates(replicas: int, min_batch: int, max_batch: int, min_local: int,
                     max_local: int, n: int = CANDIDATES) -> Sequence[Tuple[int, int, int]]:
    """The configurations to try at ``replicas`` replicas: ``(global batch run, micro-batch,
    accumulation steps)``, deduplicated, from ``n`` geometric global batches between
    ``max(min_batch, min_local x replicas)`` and ``max_batch``; empty when even the smallest
    local batch exceeds ``max_batch``."""
    lo = max(min_batch, min_local * replicas)
    if lo > max_batch:
        return []
    out, seen = [], set()
    for b in np.geomspace(lo, max_batch, n) if max_batch > lo else [lo]:
        micro, accum = split_batch(int(round(b)), replicas, max_local)
        micro = min(micro, max_batch // (replicas * (accum + 1)))   # Pollux: never above max
        if micro < min_local or (micro, accum) in seen:
            continue
        seen.add((micro, accum))
        out.append((replicas * micro * (accum + 1), micro, accum))
    return out


def step_seconds(step_s: float, sync_s: float, accum: int) -> float:
    """Seconds of one optimizer step of ``accum + 1`` micro-batches when one micro-batch step
    takes ``step_s`` of which ``sync_s`` is the allreduce (only the last one syncs; Pollux's
    model)."""
    return step_s + accum * (step_s - sync_s)


def best_batch(candidates: Sequence[Tuple[int, int, int]],
               seconds: Callable[[int, int], float], sqr: float, var: float,
               base_batch: float) -> Optional[Tuple[float, int, int, int]]:
    """The candidate with the highest goodput: ``(goodput, global batch, micro-batch, accum)``,
    or None when there are none.  ``seconds(micro, accum)`` is an optimizer step's time;
    goodput is ``base_batch x gain / seconds`` (samples/s at B0, the module's docstring)."""
    if not candidates:
        return None
    b = np.array([c[0] for c in candidates], float)
    t = np.array([seconds(c[1], c[2]) for c in candidates], float)
    g = base_batch * np.asarray(gain(sqr, var, b / base_batch)) / t
    i = int(np.argmax(g))
    return float(g[i]), candidates[i][0], candidates[i][1], candidates[i][2]


class GoodputView:
    """A job's goodput as a policy sees it for one round: its gradient statistics now, its batch
    bounds, and its optimizer step times.

    Args:
        sqr, var: |G|^2 and tr(Sigma) at ``base_batch`` (the job's latest estimates).
        base_batch: B0 of the gain (samples).
        batch: the global batch it runs now (samples).
        configs: placement -> ``(batches, seconds)``: the candidate global batches at that
            placement (numpy array, samples) and an optimizer step's seconds at each (the job's
            throughput model, or the simulator's profiles); empty arrays where none fits.
        adapts: the job changes its batch when told (else it keeps ``batch``).
    :meth:`best` and :meth:`goodput` are memoised per placement for the round.
    """

    def __init__(self, sqr: float, var: float, base_batch: float, batch: int,
                 configs: Callable[[Tuple[int, ...]], Tuple[np.ndarray, np.ndarray]],
                 adapts: bool = True):
        self.sqr, self.var, self.base_batch, self.batch = sqr, var, base_batch, batch
        self.configs = configs
        self.adapts = adapts
        self._best = {}

    def best(self, placement: Tuple[int, ...]) -> Tuple[float, int]:
        """(goodput, global batch) of the best candidate at ``placement`` (slots per host,
        largest first); (0.0, batch) where none fits or the placement is empty.  A job that does
        not adapt is judged at the candidate nearest its own batch."""
        got = self._best.get(placement)
        if got is None:
            pl = tuple(placement)
            b, t = self.configs(pl) if pl else (np.empty(0), np.empty(0))
            if not len(b):
                got = (0.0, self.batch)
            else:
                g = self._goodputs(b, t)
                if not self.adapts:
                    i = int(np.argmin(np.abs(np.log(b / self.batch))))
                else:
                    i = int(np.argmax(g))
                got = (float(g[i]), int(b[i]))
            self._best[pl] = got
        return got

    def _goodputs(self, b: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Goodput of candidate batches ``b`` (samples) at step seconds ``t``."""
        if self.sqr > 0 or self.var > 0:           # the common case, without gain()'s guards
            return self.base_batch * (self.var + self.sqr) / (
                self.var * self.base_batch / b + self.sqr) / t
        return self.base_batch / t

    def speed(self, placement: Tuple[int, ...]) -> float:
        """Goodput (samples/s at B0) at ``placement`` with the best batch: what the policies
        compare (``JobView.throughput``)."""
        return self.best(placement)[0]

    def at(self, placement: Tuple[int, ...], batch: int) -> float:
        """Goodput at ``placement`` with the candidate batch nearest ``batch`` (0.0 where none
        fits)."""
        pl = tuple(placement)
        b, t = self.configs(pl) if pl else (np.empty(0), np.empty(0))
        if not len(b):
            return 0.0
        i = int(np.argmin(np.abs(np.log(b / batch))))
        return float(self._goodputs(b[i:i + 1], t[i:i + 1])[0])
