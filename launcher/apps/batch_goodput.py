"""A job's own goodput model and the batch it chooses with it (``hvd-edl-run --adapt-batch``).

Pollux (Qiao et al. OSDI'21, section 3.1; AdaptDL's ``goodput.py`` ``PerfParams``): the time of
one optimizer step at world size W on H hosts, local (micro-)batch l and ``a`` micro-batches per
step is fitted from the job's own telemetry, in the two parts our workers measure apart
(``launcher/observe/telemetry.py``):

* compute, per micro-batch: ``alpha_c + beta_c x l`` (forward and backward grow with the batch,
  the per-step overheads do not), plus ``gamma_c x (k - 1) x l`` with ``k = W / H`` ranks per
  host: ranks that share a host's CPU and memory bandwidth compute each sample slower the more
  of them there are (ours, not Pollux's, which assumes a device per rank and where it fits to
  0: measured on the 2 shared cores here, a rank's per-sample compute at W = 2 is 1.6-3x its
  figure alone, and a fit that pools both sizes in ``beta_c`` predicted one rank's step 2.6x
  too slow: benchmarks/job/goodput_fit_check.py);
* wait in the allreduce, once per step: ``alpha_r + beta_r x (W - 1)`` for W > 1 and
  ``alpha_n + beta_n x (H - 1)`` more for H > 1 (Pollux's sync by ranks and by nodes).  Our
  ``wait_s`` is the time blocked in ``synchronize()``, i.e. the part of the allreduce that
  backward did not hide: Pollux's overlap exponent gamma is in the measurement, not fitted.

``step_s = a x (alpha_c + beta_c l + gamma_c (k-1) l) + sync(W, H)``; all coefficients are
fitted non-negative (``scipy.optimize.nnls``) to the *relative* error, each point weighted by
one over its own seconds (AdaptDL fits the log of the step time: a point at a large batch must
not drown the small ones, where the choice is made).  One local batch seen so far leaves ``alpha_c`` and ``beta_c``
apart unknown: :func:`one_batch_prior` then splits the compute half and half (AdaptDL's
``fit_perf_params`` fixes ``alpha_c`` at half the compute time), the optimistic hypothesis that
makes a larger batch worth trying; its measured point then corrects it.  (Compute proportional
to the batch, alpha_c 0, would make throughput flat in the batch at one rank: the job would never
try a larger batch, so it would never learn that one pays.)

Efficiency comes from the gradient noise the job measures (``hvd_edl.gradient_noise``; per
sample ``var`` is ``B0 x`` the ``var`` at B0 that :mod:`launcher.cluster.goodput` takes), and
goodput = B0 x gain / step_s (:func:`launcher.cluster.goodput.best_batch`) over that module's
candidates: :meth:`GoodputModel.best` answers the batch that maximises goodput at any size.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from launcher.cluster import goodput as _goodput

log = logging.getLogger(__name__)

LOOP_S = 1.0        # seconds between the adapter's looks at the telemetry
SETTLE_S = 6.0      # a generation this old (> the telemetry's 5 s window) gives a steady point
HOLD_S = 10.0       # after a batch change, this long before the next (seconds)
MIN_LOOKS = 3       # settled looks at the batch in force before it is judged (one a LOOP_S)


@dataclass(frozen=True)
class StepPoint:
    """Steady training in one configuration: ``world_size`` ranks on ``hosts`` hosts, micro-batch
    ``local_batch`` samples, ``accumulation`` micro-batches per step; mean ``compute_s`` and
    ``wait_s`` per optimizer step (seconds)."""
    world_size: int
    hosts: int
    local_batch: int
    accumulation: int
    compute_s: float
    wait_s: float


@dataclass(frozen=True)
class PerfParams:
    """Fitted coefficients (seconds): micro-batch compute ``alpha_c + beta_c x l`` plus
    ``gamma_c x (W/H - 1) x l`` (ranks sharing a host), sync ``alpha_r + beta_r (W-1)`` (W > 1)
    plus ``alpha_n + beta_n (H-1)`` (H > 1)."""
    alpha_c: float
    beta_c: float
    alpha_r: float = 0.0
    beta_r: float = 0.0
    alpha_n: float = 0.0
    beta_n: float = 0.0
    gamma_c: float = 0.0

    def step_seconds(self, world_size: int, hosts: int, local_batch: float,
                     accumulation: int) -> float:
        """Seconds of one optimizer step (see the module)."""
        sync = 0.0
        if world_size > 1:
            sync += self.alpha_r + self.beta_r * (world_size - 1)
        if hosts > 1:
            sync += self.alpha_n + self.beta_n * (hosts - 1)
        shared = max(world_size / max(hosts, 1) - 1.0, 0.0)
        return accumulation * (self.alpha_c + (self.beta_c + self.gamma_c * shared)
                               * local_batch) + sync

    def throughput(self, world_size: int, hosts: int, local_batch: float,
                   accumulation: int) -> float:
        """Samples per second."""
        return world_size * local_batch * accumulation / self.step_seconds(
            world_size, hosts, local_batch, accumulation)


class StepPoints:
    """Steady points by configuration ``(world size, hosts, local batch, accumulation)``, each
    the mean of every look at it, in this generation and when the job comes back to it later: on
    a loaded machine one telemetry window (5 s) moves by up to 2x, and a point replaced by each
    new look made the batch go back and forth (32 -> 53 -> 32 -> 67 -> 32 in one run).  Not
    thread-safe: its owner holds its lock."""

    def __init__(self):
        self._sums: Dict[Tuple[int, int, int, int], List[float]] = {}

    def add(self, p: StepPoint) -> None:
        """One look at a configuration (its mean compute and wait seconds per step)."""
        key = (p.world_size, p.hosts, p.local_batch, p.accumulation)
        acc = self._sums.setdefault(key, [0.0, 0.0, 0])
        acc[0] += p.compute_s
        acc[1] += p.wait_s
        acc[2] += 1

    def points(self) -> List[StepPoint]:
        """One :class:`StepPoint` per configuration seen, with its mean seconds."""
        return [StepPoint(*k, c / n, w / n) for k, (c, w, n) in self._sums.items()]

    def __len__(self) -> int:
        return len(self._sums)


def one_batch_prior(micro_s, local_batches) -> Tuple[float, float]:
    """``(alpha_c, beta_c)`` when every point ran one local batch ``l``: half the mean
    micro-batch compute ``c`` fixed, half proportional to the batch (``alpha_c = c / 2``,
    ``beta_c = c / (2 l)``).  AdaptDL's ``fit_perf_params`` (Pollux, OSDI'21) fixes ``alpha_c``
    the same way: optimistic about a larger batch, so that the job tries one and measures it.

    Args:
        micro_s: seconds of one micro-batch's compute, per point (a sequence, > 0).
        local_batches: the micro-batch (samples) of each point, all equal.
    """
    c = float(np.mean(micro_s))
    return c / 2.0, c / (2.0 * float(np.mean(local_batches)))


def fit(points: List[StepPoint]) -> PerfParams:
    """:class:`PerfParams` from steady points (non-negative least squares of the relative
    error, per part; the module's docstring).  ``alpha_c`` and ``beta_c`` apart need two local
    batches at one number of ranks per host (else :func:`one_batch_prior` at the fewest ranks
    per host); ``gamma_c`` needs two numbers of ranks per host (else 0).

    Raises:
        ValueError: no point.
    """
    from scipy.optimize import nnls
    if not points:
        raise ValueError("no step point to fit a throughput model to")
    micro = np.array([p.compute_s / p.accumulation for p in points])
    batches = np.array([float(p.local_batch) for p in points])
    shared = np.array([max(p.world_size / max(p.hosts, 1) - 1.0, 0.0) for p in points])
    by_sharing: Dict[float, set] = {}
    for k, b in zip(shared.tolist(), batches.tolist()):
        by_sharing.setdefault(k, set()).add(b)
    contended = len(by_sharing) >= 2
    gamma_c = 0.0
    if any(len(b) >= 2 for b in by_sharing.values()):
        cols = [np.ones_like(batches), batches] + ([shared * batches] if contended else [])
        rel = 1.0 / micro.clip(1e-9)   # relative error: each row over its own seconds
        sol, _ = nnls(np.column_stack(cols) * rel[:, None], np.ones_like(micro))
        alpha_c, beta_c = float(sol[0]), float(sol[1])
        gamma_c = float(sol[2]) if contended else 0.0
    else:  # one batch per sharing: the prior where fewest ranks share a host
        least = min(by_sharing)
        mask = shared == least
        alpha_c, beta_c = one_batch_prior(micro[mask], batches[mask])
        if contended:
            rest = ~mask
            gamma_c = max(float(np.mean((micro[rest] - alpha_c - beta_c * batches[rest])
                                        / (shared[rest] * batches[rest]))), 0.0)
    synced = [p for p in points if p.world_size > 1]
    coef = [0.0, 0.0, 0.0, 0.0]
    if synced:
        cols = np.array([[1.0, p.world_size - 1, 1.0 if p.hosts > 1 else 0.0,
                          max(p.hosts - 1, 0)] for p in synced])
        wait = np.array([p.wait_s for p in synced])
        w = 1.0 / np.maximum(np.array([p.compute_s + p.wait_s for p in synced]), 1e-6)
        keep = [j for j in range(4) if cols[:, j].any()]
        if len({p.world_size for p in synced}) < 2:
            keep = [j for j in keep if j != 1]  # one size: a constant, no slope
        if len({p.hosts for p in synced}) < 2:
            keep = [j for j in keep if j != 3]
        sol, _ = nnls(cols[:, keep] * w[:, None], wait * w)
        for j, v in zip(keep, sol):
            coef[j] = float(v)
    return PerfParams(float(alpha_c), float(beta_c), *coef, gamma_c=gamma_c)


class GoodputModel:
    """A job's goodput: its :class:`PerfParams` and gradient noise.

    Args:
        perf: the fitted step-time model.
        sqr, var_per_sample: |G|^2 and tr(Sigma) of one sample's gradient (the job's
            ``gradient_noise``).
        base_batch, min_batch, max_batch, max_local_batch: the script's bounds (samples).
    """

    def __init__(self, perf: PerfParams, sqr: float, var_per_sample: float, base_batch: int,
                 min_batch: int, max_batch: int, max_local_batch: int):
        self.perf = perf
        self.sqr, self.var = max(sqr, 0.0), max(var_per_sample, 0.0)
        self.base_batch, self.min_batch, self.max_batch = base_batch, min_batch, max_batch
        self.max_local_batch = max_local_batch

    def goodput(self, world_size: int, hosts: int, batch: int) -> float:
        """Samples/s at B0 that progress as fast as global ``batch`` at this size."""
        micro, accum = _goodput.split_batch(batch, world_size, self.max_local_batch)
        run = world_size * micro * (accum + 1)
        t = self.perf.step_seconds(world_size, hosts, micro, accum + 1)
        return self.base_batch * _goodput.gain(self.sqr, self.var / self.base_batch,
                                               run / self.base_batch) / t

    def best(self, world_size: int, hosts: int = 1) -> Optional[Tuple[int, float]]:
        """(global batch, goodput) that maximises goodput at ``world_size`` ranks on ``hosts``
        hosts, among :func:`launcher.cluster.goodput.batch_candidates`; None where no batch
        fits (``min_batch`` larger than ``max_batch``)."""
        cands = _goodput.batch_candidates(world_size, self.min_batch, self.max_batch, 1,
                                          self.max_local_batch)
        got = _goodput.best_batch(
            cands, lambda micro, accum: self.perf.step_seconds(world_size, hosts, micro,
                                                               accum + 1),
            self.sqr, self.var / self.base_batch, self.base_batch)
        return None if got is None else (got[1], got[0])


class BatchAdapter:
    """``hvd-edl-run --adapt-batch``: in a thread of the launcher, keeps steady points from the
    job's telemetry, fits :class:`GoodputModel` and asks for the batch that maximises goodput
    at the current size (``driver.set_batch``, the control API's path) when it beats the
    current batch's by more than :data:`launcher.cluster.goodput.SWITCH_GAIN` (AdaptDL's 5 %).
    :meth:`status` is its part of ``hvd-edl-ctl status`` (the best batch at every size).

    Hysteresis (ours; on the loaded cores here the batch went 512 -> 248 -> 512 -> 248 in 20 s
    at 2 workers, each fit's prediction beating the last by 5 %): the current batch is judged by
    its *measured* goodput (the mean of its settled looks at this size, never a prediction), a
    batch already measured at this size by its measured goodput too (so the prior's optimistic
    first try, once measured worse, is not tried again while the noise scale stands), only an
    unmeasured batch by the model; a change needs :data:`MIN_LOOKS` settled looks at the batch
    in force and :data:`HOLD_S` since the last change.  A batch an operator pinned
    (``driver.batch_pinned``, ``hvd-edl-ctl batch B``) is left alone until ``batch auto``."""

    def __init__(self, driver):
        self.driver = driver
        self.points = StepPoints()
        self.model: Optional[GoodputModel] = None
        self.decisions: List[dict] = []
        self._gen = (0, 0.0)         # (generation, monotonic time it was first seen)
        self._hold_until = -math.inf
        self._looks = 0              # settled looks in this generation
        # (world size, hosts, global batch) -> [sum of step seconds, looks]: measured goodput
        self._measured: Dict[Tuple[int, int, int], List[float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._loop, name="adapt-batch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(LOOP_S):
            try:
                if self.driver.ring().job_over:
                    return
                self.tick(time.monotonic())
            except Exception:  # noqa: BLE001 - the adapter must never end the job
                log.exception("adapt-batch pass failed")

    def tick(self, now: float) -> None:
        """One look at the telemetry: add a steady point, refit, maybe ask for a batch."""
        tel = self.driver.telemetry_snapshot()
        job, plan, noise = tel["job"], tel.get("adaptive_batch"), tel.get("gradient_noise")
        if plan is None or noise is None:
            return  # the script did not opt in (yet), or nothing measured yet
        gen = job.get("generation", 0)
        if gen != self._gen[0]:
            self._gen = (gen, now)
            self._looks = 0
            return
        if now - self._gen[1] < SETTLE_S or job.get("compute_s") is None \
                or job.get("world_size") != plan["world_size"]:
            return
        hosts = max(len({w.get("host") for w in tel.get("workers", [])
                         if w.get("rank", -1) >= 0}), 1)
        p = StepPoint(plan["world_size"], hosts, plan["local_batch"], plan["accumulation"],
                      float(job["compute_s"]), float(job.get("wait_s") or 0.0))
        model = GoodputModel(None, noise["sqr"] or 0.0, noise["var"] or 0.0,
                             plan["base_batch"], plan["min_batch"], plan["max_batch"],
                             plan["max_local_batch"] or plan["max_batch"])
        batch = int(plan["batch"])
        with self._lock:
            self.points.add(p)
            acc = self._measured.setdefault((p.world_size, hosts, batch), [0.0, 0])
            acc[0] += p.compute_s + p.wait_s
            acc[1] += 1
            model.perf = fit(self.points.points())
            self.model = model
        self._looks += 1
        if now < self._hold_until or self._looks < MIN_LOOKS \
                or getattr(self.driver, "batch_pinned", None) is not None:
            return
        choice = self.choose(model, p.world_size, hosts, batch)
        if choice is None:
            return
        to, goodput, current, measured = choice
        self._hold_until = now + HOLD_S
        decision = {"at": time.time(), "world_size": p.world_size, "from": batch, "to": to,
                    "goodput": round(goodput, 2), "goodput_measured": measured,
                    "current_goodput": round(current, 2),
                    "noise_scale_samples": noise.get("noise_scale_samples")}
        with self._lock:
            self.decisions.append(decision)
        self.driver.note("adapt_batch", f"batch {batch} -> {to}", **decision)
        self.driver.set_batch(to, pin=False)

    def choose(self, model: GoodputModel, world_size: int, hosts: int,
               batch: int) -> Optional[Tuple[int, float, float, bool]]:
        """The batch to change to at this size, or None to keep ``batch``:
        ``(batch, its goodput, the current batch's measured goodput, whether the first was
        measured)`` (goodput: samples/s at B0; see the class for the rule).  ``batch`` must
        have been measured at this size (:meth:`tick` adds its look first)."""
        with self._lock:
            seen = {b: s / n for (w, h, b), (s, n) in self._measured.items()
                    if (w, h) == (world_size, hosts) and n}

        def measured(b: int) -> float:
            return model.base_batch * _goodput.gain(model.sqr, model.var / model.base_batch,
                                                    b / model.base_batch) / seen[b]

        current = measured(batch)
        cands = {int(c[0]) for c in _goodput.batch_candidates(
            world_size, model.min_batch, model.max_batch, 1, model.max_local_batch)}
        best = None
        for b in cands | set(seen):
            if b == batch:
                continue
            g = measured(b) if b in seen else model.goodput(world_size, hosts, b)
            if best is None or g > best[1]:
                best = (b, g, b in seen)
        if best is None or best[1] <= current * (1.0 + _goodput.SWITCH_GAIN):
            return None
        return best[0], best[1], current, best[2]

    def status(self) -> dict:
        """``{"model", "best", "decisions"}``: the fitted coefficients, the best batch and its
        goodput at each size up to ``--max-np`` (one host), and the changes asked for."""
        with self._lock:
            model, decisions = self.model, list(self.decisions[-10:])
        if model is None:
            return {"model": None, "best": {}, "decisions": decisions}
        best = {}
        for n in range(1, self.driver.spec.max_np + 1):
            got = model.best(n)
            if got is not None:
                best[str(n)] = {"batch": got[0], "goodput": round(got[1], 2)}
        return {"model": vars(model.perf), "best": best, "decisions": decisions}
