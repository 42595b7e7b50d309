"""A job's speed on a GPU type and cluster size it has not run on, predicted from its measurements
on other types and each type's published capability (after CM-DARE, Li, Walls and Guo, arXiv
2004.03072: training speed regressed on GPU TFLOPS, the model's FLOPs and parameters and the
cluster size; 3.4 % MAPE at best).

The one-type speed model (:mod:`launcher.apps.speed_model`, used by :mod:`launcher.cluster.speed`)
fits step time against world size from a job's own points on one type; this module carries a job
across types.  It is a log-linear fixed-effects regression::

    log t(job, type, n, b) = u_job + sum_k beta_k x_k(type, job, n, b)

``t`` seconds per step, ``n`` GPUs, ``b`` local batch (samples per GPU per step), ``u_job`` the
job's own offset (everything about it the features do not see), and ``x`` the capability features
(:func:`features`): log TFLOPS of the type, its products with the model's log FLOPs and log
parameters (a compute-bound model gains the full TFLOPS ratio, a small or memory-bound one less),
log n and its products with log TFLOPS and log parameters (a faster type spends a larger share of
its step in the allreduce), log b and its product with log TFLOPS.  ``beta`` is fitted on the
training jobs with their offsets as fixed effects (within-job demeaning, a small ridge); a new
job's offset is the mean residual of its own measured rows, so one measurement on one type is
enough to predict the others.  Features without variation in the training rows are dropped.

    from launcher.cluster.speed_types import Row, TypeSpeedModel, GPU_TFLOPS
    model = TypeSpeedModel().fit(training_rows)
    model.predict(job_rows_measured, "p100", n=4, local_bsz=128, flops=..., params=...)  # seconds
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np

GPU_TFLOPS: Dict[str, float] = {
    "k80": 4.113,     # CM-DARE's table (one K80 die, FP32)
    "p100": 9.526,    # CM-DARE's table
    "v100": 15.7,     # NVIDIA V100 SXM2 FP32 (GCE)
    "t4": 8.1,        # NVIDIA T4 FP32 (AWS g4dn)
    "rtx": 13.45,     # RTX 2080 Ti FP32 (boost)
    "quad": 16.3,     # Quadro RTX 6000 FP32
    "a100": 19.5,     # A100 40 GB FP32 (without TF32)
}
"""Peak FP32 TFLOPS per GPU type (vendor data sheets; k80/p100 as CM-DARE's table gives them)."""

FEATURES = ("tflops", "tflops_x_flops", "tflops_x_params", "n", "n_x_tflops", "n_x_params",
            "bsz", "bsz_x_tflops")
"""Names of the capability features, in :func:`features`'s order."""


@dataclass(frozen=True)
class Row:
    """One steady measurement of a job.

    ``job``: the job (or model) it belongs to; ``gpu_type``: a key of the type table;
    ``step_s``: seconds per step (> 0); ``n``: GPUs (>= 1); ``local_bsz``: samples per GPU per step
    (1 when unknown); ``flops``: the model's FLOPs per sample (forward); ``params``: its
    parameters."""
    job: str
    gpu_type: str
    step_s: float
    flops: float
    params: float
    n: int = 1
    local_bsz: float = 1.0


def features(tflops: float, flops: float, params: float, n: int = 1,
             local_bsz: float = 1.0) -> np.ndarray:
    """The capability features of one row (shape ``(len(FEATURES),)``, logs of the inputs and their
    products, see the module's docstring).  ValueError for a non-positive input."""
    if min(tflops, flops, params, n, local_bsz) <= 0:
        raise ValueError(f"features need positive inputs: tflops={tflops} flops={flops} "
                         f"params={params} n={n} local_bsz={local_bsz}")
    lt, lf, lp, ln, lb = (math.log(tflops), math.log(flops), math.log(params), math.log(n),
                          math.log(local_bsz))
    return np.array([lt, lt * lf, lt * lp, ln, ln * lt, ln * lp, lb, lb * lt])


class TypeSpeedModel:
    """The fixed-effects regression of the module's docstring.

    Args:
        tflops: GPU type -> peak TFLOPS (default :data:`GPU_TFLOPS`).
        ridge: L2 weight on ``beta`` (in demeaned log units), keeps collinear features bounded.
        type_effects: add, per GPU type, an indicator and its products with log n and log b,
            learned from the other jobs measured on that type: what TFLOPS does not say about a
            type (its memory, its network: t4 nodes on 50 Gb/s Ethernet scale worse than a100
            nodes on InfiniBand).
        cells: the fixed effects are per (job, n, local batch) instead of per job: ``beta`` then
            learns only what changes across types, and a prediction starts from the job's own
            rows at the same size and batch on other types where it has any (else from all its
            rows): the job's own scaling curve carries over, the type's features adjust it.
    """

    def __init__(self, tflops: Optional[Dict[str, float]] = None, ridge: float = 1e-3,
                 type_effects: bool = True, cells: bool = True):
        self.tflops = dict(GPU_TFLOPS if tflops is None else tflops)
        self.ridge = ridge
        self.type_effects = type_effects
        self.cells = cells
        self.beta: Optional[np.ndarray] = None
        self.used: Optional[np.ndarray] = None     # mask of features with variation

    def _x(self, r: Row) -> np.ndarray:
        if r.gpu_type not in self.tflops:
            raise ValueError(f"unknown GPU type {r.gpu_type!r} (known: {', '.join(self.tflops)})")
        x = features(self.tflops[r.gpu_type], r.flops, r.params, r.n, r.local_bsz)
        if not self.type_effects:
            return x
        ln, lb = math.log(r.n), math.log(r.local_bsz)
        extra = np.zeros(3 * len(self.tflops))
        i = 3 * list(self.tflops).index(r.gpu_type)
        extra[i:i + 3] = (1.0, ln, lb)
        return np.concatenate([x, extra])

    def fit(self, rows: Iterable[Row]) -> "TypeSpeedModel":
        """Fit ``beta`` on measured rows of several jobs (each job's offset a fixed effect).

        Raises:
            ValueError: no rows, a non-positive step time, or an unknown GPU type."""
        rows = list(rows)
        if not rows:
            raise ValueError("TypeSpeedModel.fit needs rows")
        if any(not r.step_s > 0 for r in rows):
            raise ValueError("every row needs step_s > 0")
        x = np.array([self._x(r) for r in rows])
        y = np.log([r.step_s for r in rows])
        jobs = np.array(["|".join(map(str, self._cell(r))) for r in rows])
        xd, yd = x.copy(), y.copy()
        for j in set(jobs.tolist()):
            m = jobs == j
            xd[m] -= x[m].mean(axis=0)
            yd[m] -= y[m].mean()
        self.used = xd.std(axis=0) > 1e-9
        a = xd[:, self.used]
        k = a.shape[1]
        beta = np.zeros(x.shape[1])
        if k:
            scale = a.std(axis=0)
            an = a / scale
            coef = np.linalg.solve(an.T @ an + self.ridge * len(y) * np.eye(k), an.T @ yd)
            beta[self.used] = coef / scale
        self.beta = beta
        return self

    def _cell(self, r: Row) -> tuple:
        return (r.job, r.n, r.local_bsz) if self.cells else (r.job,)

    def offset(self, measured: Sequence[Row], like: Optional[Row] = None) -> float:
        """A job's offset ``u`` (log seconds) from its measured rows (at least one): with
        ``cells``, from those at ``like``'s size and local batch where there are any.
        RuntimeError before :meth:`fit`, ValueError without rows."""
        if self.beta is None:
            raise RuntimeError("TypeSpeedModel used before fit")
        if not measured:
            raise ValueError("a job's offset needs at least one measured row")
        if like is not None and self.cells:
            same = [r for r in measured if self._cell(r) == self._cell(like)]
            measured = same or measured
        return float(np.mean([math.log(r.step_s) - self._x(r) @ self.beta for r in measured]))

    def predict(self, measured: Sequence[Row], gpu_type: str, n: int = 1,
                local_bsz: float = 1.0) -> float:
        """Seconds per step of the job of ``measured`` (its rows on other types or sizes; the
        model's ``flops``/``params`` are read from them) on ``n`` GPUs of ``gpu_type`` at
        ``local_bsz``.  Errors as :meth:`offset`; ValueError for an unknown type."""
        r0 = measured[0] if measured else None
        if r0 is None:
            raise ValueError("predict needs the job's measured rows")
        q = Row(r0.job, gpu_type, 1.0, r0.flops, r0.params, n, local_bsz)
        return float(math.exp(self.offset(measured, q) + self._x(q) @ self.beta))

    def samples_per_s(self, measured: Sequence[Row], gpu_type: str, n: int = 1,
                      local_bsz: float = 1.0) -> float:
        """The job's throughput (samples/s, all GPUs) there: ``n * local_bsz / step_s``."""
        return n * local_bsz / self.predict(measured, gpu_type, n, local_bsz)


def mape(actual: Sequence[float], predicted: Sequence[float]) -> float:
    """Mean absolute percentage error as a fraction (0.034 = 3.4 %).  ValueError when empty."""
    if not len(actual):
        raise ValueError("mape of no values")
    a, p = np.asarray(actual, float), np.asarray(predicted, float)
    return float(np.mean(np.abs(p - a) / np.abs(a)))


def leave_one_job_out(rows: Sequence[Row], known: "callable", model_kw: Optional[dict] = None
                      ) -> List[tuple]:
    """Held-out evaluation: for each job, fit on every other job's rows, take the job's rows for
    which ``known(row)`` is true as its measurements and predict the rest.

    Returns ``[(row, predicted_step_s), ...]`` for every predicted (held-out) row.  Jobs with no
    known or no held-out row are skipped."""
    out = []
    jobs = sorted({r.job for r in rows})
    for j in jobs:
        train = [r for r in rows if r.job != j]
        mine = [r for r in rows if r.job == j]
        seen = [r for r in mine if known(r)]
        held = [r for r in mine if not known(r)]
        if not seen or not held:
            continue
        m = TypeSpeedModel(**(model_kw or {})).fit(train)
        for r in held:
            out.append((r, m.predict(seen, r.gpu_type, r.n, r.local_bsz)))
    return out
