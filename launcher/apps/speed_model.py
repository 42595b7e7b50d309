"""A speed model of one job: step time and throughput against world size, fitted with
scikit-learn from profile points (after CM-DARE, Li, Walls and Guo, arXiv 2004.03072, whose
regression models of training speed reached 3.4 % mean absolute percentage error).

Data-parallel step time is modelled as the sum of its two parts, each measured per step by the
workers (``compute_s`` and ``wait_s``, see ``launcher/observe/telemetry.py``):

* compute  c(n) = c0 + c1 (n - 1): per-worker forward/backward, constant in n for a fixed
  per-worker batch on dedicated devices; ``c1`` >= 0 takes the contention of workers sharing
  CPU cores or memory bandwidth;
* comm     w(n) = b (n - 1)/n B + d (n - 1): a ring allreduce of B gradient bytes moves
  2 (n - 1)/n B bytes per worker (bandwidth term ``b``, seconds per byte) in 2 (n - 1) latency-
  bound hops (``d``, seconds per hop).  No intercept: a lone worker waits on no peer (what
  Horovod's background cycle still costs at size 1 lands in c0), and with one, points of sizes
  >= 2 would leave comm(1) undetermined.  ``wait_s`` also holds the wait for the slowest peer,
  which grows with n the same way.

Every coefficient but the compute intercept is fitted non-negative (``LinearRegression(positive=
True)``), so step time never falls as workers are added.  With three or more sizes the model
picks, among the sub-models of these terms (c1 or not; ring, hops or both), the one with the
lowest leave-one-size-out error on its own training points (fewer terms first on a tie): a model
with as many coefficients as points fits them exactly and extrapolates badly; CM-DARE chose its
regressions the same way, by held-out error.  Throughput is n s(n) / t(n), s the samples per
worker per step (the mean of the points': a fixed per-worker batch).

When the points have no per-step timings (a job without telemetry) the step time of a point is
derived from its throughput (n s / samples_per_s) and the same terms are fitted to it in one
regression.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
from sklearn.linear_model import LinearRegression


@dataclass(frozen=True)
class ProfilePoint:
    """Steady training at one world size.

    ``world_size``: workers; ``samples_per_s``: the job's throughput (every rank); ``step_s``,
    ``compute_s``, ``wait_s``: mean seconds per optimizer step, its compute and its wait in
    collectives (nan when unknown); ``samples_per_step``: samples per worker per step (nan:
    derived from ``samples_per_s * step_s / world_size``); ``grad_bytes``: bytes allreduced per
    step (0: unknown; only scales the ring term's coefficient)."""
    world_size: int
    samples_per_s: float
    step_s: float = math.nan
    compute_s: float = math.nan
    wait_s: float = math.nan
    samples_per_step: float = math.nan
    grad_bytes: int = 0

    def per_worker_batch(self) -> float:
        """Samples per worker per step (nan when neither given nor derivable)."""
        if not math.isnan(self.samples_per_step):
            return self.samples_per_step
        return self.samples_per_s * self.step_s / self.world_size

    def timed(self) -> bool:
        """True when the point has per-step compute and wait times."""
        return not (math.isnan(self.compute_s) or math.isnan(self.wait_s))

    @classmethod
    def from_dict(cls, d: dict) -> "ProfilePoint":
        """A point from a ``profile.json`` entry (extra keys ignored; None read as nan).

        Raises:
            ValueError: ``world_size`` or ``samples_per_s`` missing or not positive."""
        def num(key):
            v = d.get(key)
            return math.nan if v is None else float(v)
        n, thr = int(d.get("world_size") or 0), num("samples_per_s")
        if n < 1 or not thr > 0:
            raise ValueError(f"profile point needs world_size >= 1 and samples_per_s > 0: {d}")
        return cls(n, thr, num("step_s"), num("compute_s"), num("wait_s"),
                   num("samples_per_step"), int(d.get("grad_bytes") or 0))

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in asdict(self).items()}


# the terms: name -> feature of world size n and gradient bytes B (see the module docstring)
TERMS = {
    "contention": lambda n, b: n - 1.0,              # compute: workers sharing a machine
    "ring": lambda n, b: (n - 1.0) / n * b,          # comm: bandwidth term of ring allreduce
    "hops": lambda n, b: n - 1.0,                    # comm: 2 (n - 1) latency-bound hops
}
COMPUTE_CHOICES: Tuple[Tuple[str, ...], ...] = ((), ("contention",))
COMM_CHOICES: Tuple[Tuple[str, ...], ...] = (("ring",), ("hops",), ("ring", "hops"))


class _Part:
    """One fitted part: intercept + non-negative coefficients on ``terms``."""

    def __init__(self, terms: Sequence[str], scale_bytes: float, intercept: bool = True):
        self.terms = tuple(terms)
        self.intercept = intercept
        self.scale_bytes = scale_bytes
        self.reg: Optional[LinearRegression] = None
        self.const = 0.0

    def _x(self, ns: Iterable[int]) -> np.ndarray:
        return np.array([[TERMS[t](float(n), self.scale_bytes) for t in self.terms] for n in ns])

    def fit(self, ns: Sequence[int], ys: Sequence[float]) -> "_Part":
        if not self.terms or (self.intercept and len(set(ns)) < 2):
            self.const = float(np.mean(ys))
            self.reg = None
            return self
        self.reg = LinearRegression(positive=True, fit_intercept=self.intercept).fit(
            self._x(ns), np.asarray(ys, float))
        return self

    def predict(self, n: float) -> float:
        if self.reg is None:
            return self.const
        return float(self.reg.predict(self._x([n]))[0])

    def describe(self) -> dict:
        if self.reg is None:
            return {"intercept": self.const}
        return {"intercept": float(self.reg.intercept_) if self.intercept else 0.0,
                **{t: float(c) for t, c in zip(self.terms, self.reg.coef_)}}


class SpeedModel:
    """Step time t(n) = compute(n) + comm(n) and throughput n s / t(n) of one job (see the
    module docstring for the terms and how they are chosen).

    Args:
        compute_terms, comm_terms: force these sub-models (None: chosen by leave-one-size-out
            error when the points have three or more sizes; else no contention term, ring).
    """

    def __init__(self, compute_terms: Optional[Sequence[str]] = None,
                 comm_terms: Optional[Sequence[str]] = None):
        self.compute_terms = None if compute_terms is None else tuple(compute_terms)
        self.comm_terms = None if comm_terms is None else tuple(comm_terms)
        self.points: List[ProfilePoint] = []
        self.batch = math.nan
        self.timed = False
        self._compute: Optional[_Part] = None
        self._comm: Optional[_Part] = None

    # ---- fitting -------------------------------------------------------------------------------

    def fit(self, points: Sequence[ProfilePoint]) -> "SpeedModel":
        """Fit to ``points`` (several points of one size are all used).

        Raises:
            ValueError: no point, or no point with a known per-worker batch."""
        points = list(points)
        if not points:
            raise ValueError("a speed model needs at least one profile point")
        batches = [p.per_worker_batch() for p in points]
        batches = [b for b in batches if not math.isnan(b) and b > 0]
        if not batches:
            raise ValueError("profile points need step_s or samples_per_step (samples per "
                             "worker per step) to model the step time")
        self.points = points
        self.batch = float(np.mean(batches))
        self.timed = all(p.timed() for p in points)
        sizes = sorted({p.world_size for p in points})
        compute, comm = self.compute_terms, self.comm_terms
        if compute is None or comm is None:
            choices = [(c, w) for c in (COMPUTE_CHOICES if compute is None else (compute,))
                       for w in (COMM_CHOICES if comm is None else (comm,))]
            if len(sizes) >= 3 and len(choices) > 1:
                scored = []
                for c, w in choices:
                    errs = loso_mape(points, lambda c=c, w=w: SpeedModel(c, w))
                    scored.append((float(np.mean(list(errs.values()))), len(c) + len(w), c, w))
                scored.sort(key=lambda s: (round(s[0], 6), s[1]))
                compute, comm = scored[0][2], scored[0][3]
            else:
                compute, comm = choices[0]
        self._fit_parts(compute, comm)
        return self

    def _fit_parts(self, compute: Sequence[str], comm: Sequence[str]) -> None:
        scale = float(np.mean([p.grad_bytes for p in self.points])) or 1.0
        ns = [p.world_size for p in self.points]
        if self.timed:
            self._compute = _Part(compute, scale).fit(ns, [p.compute_s for p in self.points])
            # no intercept: a lone worker waits on no peer (Horovod's few ms at size 1 go to
            # the compute intercept); with one, sizes >= 2 leave comm(1) undetermined
            self._comm = _Part(comm, scale, intercept=False).fit(
                ns, [p.wait_s for p in self.points])
        else:  # one regression of the whole step time, derived from throughput
            steps = [p.world_size * self.batch / p.samples_per_s for p in self.points]
            self._compute = _Part((), scale).fit(ns, [0.0] * len(ns))
            # contention and hops are the same feature (n - 1) once the parts are one sum
            terms = tuple(dict.fromkeys("hops" if t == "contention" else t
                                        for t in tuple(compute) + tuple(comm)))
            self._comm = _Part(terms, scale).fit(ns, steps)

    # ---- predictions ---------------------------------------------------------------------------

    def _check(self) -> None:
        if self._compute is None:
            raise RuntimeError("the speed model is not fitted yet (SpeedModel.fit)")

    def step_s(self, n: int) -> float:
        """Predicted seconds per optimizer step at ``n`` workers."""
        self._check()
        return max(self._compute.predict(n) + self._comm.predict(n), 1e-9)

    def samples_per_s(self, n: int) -> float:
        """Predicted job throughput (samples per second, every rank) at ``n`` workers."""
        return n * self.batch / self.step_s(n)

    def efficiency(self, n: int) -> float:
        """Predicted scaling efficiency at ``n`` workers: throughput(n) / (n throughput(1))
        (EDL's measure; 1 = linear scaling)."""
        return self.samples_per_s(n) / (n * self.samples_per_s(1))

    def marginal_efficiency(self, n: int) -> float:
        """What one more worker adds at ``n`` workers, as a fraction of a lone worker's
        throughput: (throughput(n + 1) - throughput(n)) / throughput(1).  1 = the new worker
        is as useful as the first; <= 0 = it slows the job down."""
        return (self.samples_per_s(n + 1) - self.samples_per_s(n)) / self.samples_per_s(1)

    def describe(self) -> dict:
        """The fitted coefficients (seconds; ring: seconds per byte when ``grad_bytes`` known)."""
        self._check()
        return {"timed": self.timed, "samples_per_worker_step": self.batch,
                "compute": self._compute.describe(), "comm": self._comm.describe()}


def loso_mape(points: Sequence[ProfilePoint], factory=SpeedModel) -> Dict[int, float]:
    """Leave-one-size-out error: for each world size, fit ``factory()`` to the points of the
    other sizes and return the absolute percentage error of its predicted throughput against
    the held-out size's mean measured throughput, ``{world_size: percent}``.  Sizes that leave
    fewer than two others to fit are skipped.  (CM-DARE reports mean absolute percentage error
    the same way, on held-out configurations.)"""
    sizes = sorted({p.world_size for p in points})
    out: Dict[int, float] = {}
    if len(sizes) < 3:
        return out
    for n in sizes:
        train = [p for p in points if p.world_size != n]
        held = [p.samples_per_s for p in points if p.world_size == n]
        model = factory().fit(train)
        measured = float(np.mean(held))
        out[n] = abs(model.samples_per_s(n) - measured) / measured * 100.0
    return out


def fit_points(records: Iterable[dict]) -> SpeedModel:
    """A model fitted to ``profile.json`` point dicts (see :meth:`ProfilePoint.from_dict`)."""
    return SpeedModel().fit([ProfilePoint.from_dict(r) for r in records])


__all__ = ["ProfilePoint", "SpeedModel", "loso_mape", "fit_points"]
