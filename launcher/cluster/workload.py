"""Pollux's published workloads and application profiles, loaded for the simulator.

The data (measured step times, validation runs, the 8 workloads at four loads, the published
per-job completion times) are those of Qiao et al., "Pollux: Co-adaptive Cluster Scheduling for
Goodput-Optimized Deep Learning" (OSDI 2021), from the ``simulator/`` folder of the
``osdi21-artifact`` branch of petuum/adaptdl.  They are read at run time from
``$HVD_EDL_POLLUX_TRACES`` or ``../shared/traces/pollux-osdi21`` beside the repository (never
copied into it); see that folder's README.md for the setting and the columns.

How a trace job becomes simulated work (the published setting, as Pollux's simulator models it):

* **Work.** A job of application A at global batch B runs A's number of epochs (:data:`EPOCHS`).
  Pollux's simulator advances a job by *progress* (the validation runs' ``progress`` column: the
  statistically efficient samples, in units of A's smallest validated batch); one optimizer step at
  batch B makes ``gain = (var + sqr) / (var / scale + sqr)`` of progress, ``scale = B / B_0``, from
  that epoch's gradient statistics (``grad_sqr``, ``grad_var`` of validation-B.csv), and epoch e
  ends at the least progress any validated batch reached by then.  With a fixed batch that is a
  fixed number of optimizer steps per epoch, which :meth:`Application.total_steps` sums
  (``model="progress"``, the default, what the published figures assume).  ``model="iteration"``
  takes the ``iteration`` column of validation-B.csv instead (the steps the validation run did).
* **Step time.** The local batch is ``ceil(B / GPUs)``; above A's largest profiled local batch
  (8 for yolov3) the step accumulates gradients over ``k`` micro-batches: a step costs
  ``step + (k - 1) (step - sync)`` (Pollux's model).  ``step`` and ``sync`` come from
  placements.csv when the placement (GPUs per node) was measured, linearly interpolated in the
  local batch (clamped to the measured range); otherwise from a linear interpolation over
  (nodes, GPUs, local batch) of placements.csv (averaged per key) and scalability.csv
  (scipy's ``LinearNDInterpolator``, nearest measured point outside their hull).

Raises FileNotFoundError (one line) when the data folder is absent.
"""
from __future__ import annotations

import csv
import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from launcher.cluster.policy import Placement

EPOCHS: Dict[str, int] = {"bert": 2, "cifar10": 100, "ncf": 10, "imagenet": 90,
                          "deepspeech2": 80, "yolov3": 50}
"""Epochs each application trains for in the published setting."""

MAX_LOCAL_BSZ: Dict[str, int] = {"yolov3": 8}
"""Largest local batch that fits a GPU where it is below the profiles' largest (else accumulate)."""

LOADS = ("0.5", "1.0", "1.5", "2.0")
"""The published job loads (x the base load of 160 jobs in 8 hours)."""

_ENV = "HVD_EDL_POLLUX_TRACES"


def traces_dir(path: Optional[str] = None) -> Path:
    """The folder of Pollux's data: ``path``, else ``$HVD_EDL_POLLUX_TRACES``, else
    ``../shared/traces/pollux-osdi21`` beside the repository.  FileNotFoundError if absent."""
    if path is None:
        path = os.environ.get(_ENV) or str(
            Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "pollux-osdi21")
    p = Path(path)
    if not (p / "traces").is_dir():
        raise FileNotFoundError(f"no Pollux traces at {p} (set {_ENV} to the pollux-osdi21 folder)")
    return p


def _read_csv(path: Path) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


class Application:
    """One of the six profiled applications: step times and work at a global batch.

    Args:
        folder: ``traces/<application>`` of the data folder.
        epochs: epochs a job trains for (:data:`EPOCHS`).
        max_local_bsz: largest local batch per GPU (default: the largest profiled).
        profile: a suffix of the profile files, ``placements<profile>.csv`` (Sia's per-type
            profiles: ``-aws``, ``-rtx``, ``-dgx-ext``).
        validation: the folder of the validation runs (default ``folder``).
    """

    def __init__(self, folder: Path, epochs: int, max_local_bsz: Optional[int] = None,
                 profile: str = "", validation: Optional[Path] = None):
        self.name = folder.name
        self.profile = profile
        self.epochs = epochs
        self.validation: Dict[int, List[Dict[str, float]]] = {}
        for p in sorted((validation or folder).glob("validation-*.csv")):
            b = int(p.stem.split("-")[-1])
            self.validation[b] = [{k: float(v) for k, v in r.items()} for r in _read_csv(p)]
        self.validation = dict(sorted(self.validation.items()))
        self._placements: Dict[str, List[Tuple[float, float, float]]] = {}
        self._points: Dict[Tuple[int, int, float], List[Tuple[float, float]]] = {}
        for r in _read_csv(folder / f"placements{profile}.csv"):
            key = r["placement"]
            bsz, st, sy = float(r["local_bsz"]), float(r["step_time"]), float(r["sync_time"])
            self._placements.setdefault(key, []).append((bsz, st, sy))
            digits = [int(c) for c in key]
            self._points.setdefault((len(digits), sum(digits), bsz), []).append((st, sy))
        for rows in self._placements.values():
            rows.sort()
        for r in _read_csv(folder / f"scalability{profile}.csv"):
            self._points.setdefault((int(r["num_nodes"]), int(r["num_replicas"]),
                                     float(r["local_bsz"])), []).append(
                (float(r["step_time"]), float(r["sync_time"])))
        bszs = sorted({b for rows in self._placements.values() for b, _, _ in rows})
        self.min_local_bsz = int(bszs[0])
        self.max_local_bsz = int(max_local_bsz or bszs[-1])
        self.init_batch_size = min(self.validation)
        self._interp = None

    # -- step time ---------------------------------------------------------------------------
    @functools.lru_cache(maxsize=None)
    def step_time(self, placement: Placement, local_bsz: float) -> Tuple[float, float]:
        """(step seconds, of which sync seconds) of one micro-batch of ``local_bsz`` per GPU at
        ``placement`` (GPUs per node), measured or interpolated (the module's docstring)."""
        pl = tuple(p for p in placement if p > 0)
        key = "".join(map(str, min(pl[i:] + pl[:i] for i in range(len(pl)))))
        rows = self._placements.get(key)
        if rows is not None:
            import numpy as np
            xs = [b for b, _, _ in rows]
            return (float(np.interp(local_bsz, xs, [s for _, s, _ in rows])),
                    float(np.interp(local_bsz, xs, [s for _, _, s in rows])))
        lin, near = self._interpolators()
        q = (min(len(pl), 16), sum(pl), float(local_bsz))
        st, sy = lin([q])[0]
        if not (st == st and sy == sy):     # NaN: outside the measured hull
            st, sy = near([q])[0]
        return float(st), float(sy)

    def step_times(self, placement: Placement, local_bszs) -> Tuple["np.ndarray", "np.ndarray"]:
        """:meth:`step_time` for many local batches at once (one interpolator query): arrays of
        (step seconds, sync seconds), shape ``(len(local_bszs),)``."""
        import numpy as np
        bs = np.asarray(local_bszs, float)
        pl = tuple(p for p in placement if p > 0)
        key = "".join(map(str, min(pl[i:] + pl[:i] for i in range(len(pl)))))
        rows = self._placements.get(key)
        if rows is not None:
            xs = [b for b, _, _ in rows]
            return (np.interp(bs, xs, [s for _, s, _ in rows]),
                    np.interp(bs, xs, [s for _, _, s in rows]))
        lin, near = self._interpolators()
        q = np.column_stack([np.full(len(bs), min(len(pl), 16)), np.full(len(bs), sum(pl)), bs])
        out = lin(q)
        bad = np.isnan(out).any(axis=1)
        if bad.any():
            out[bad] = near(q[bad])
        return out[:, 0], out[:, 1]

    def _interpolators(self):
        if self._interp is None:
            import numpy as np
            from scipy.interpolate import LinearNDInterpolator, NearestNDInterpolator
            keys = list(self._points)
            xs = np.array(keys, dtype=float)
            ys = np.array([np.mean(self._points[k], axis=0) for k in keys])
            self._interp = (LinearNDInterpolator(xs, ys), NearestNDInterpolator(xs, ys))
        return self._interp

    def optimizer_step_s(self, placement: Placement, batch_size: int) -> float:
        """Seconds of one optimizer step at global ``batch_size`` over ``placement``, with
        gradient accumulation where the local batch exceeds :attr:`max_local_bsz`."""
        n = sum(placement)
        local = math.ceil(batch_size / n - 1e-8)
        micro = max(1, math.ceil(local / self.max_local_bsz - 1e-8))
        atomic = math.ceil(local / micro - 1e-8)
        st, sy = self.step_time(tuple(placement), atomic)
        return st + (micro - 1) * (st - sy)

    # -- work --------------------------------------------------------------------------------
    def grad_stats(self, batch_size: float, epoch: int) -> Tuple[float, float]:
        """(grad_sqr, grad_var) of validation-B.csv at ``epoch`` (0-based) for global
        ``batch_size``, linearly interpolated between the validated batches around it (clamped
        to the validated range), as Pollux's simulator."""
        bs = list(self.validation)
        lo = max((b for b in bs if b <= batch_size), default=bs[0])
        hi = min((b for b in bs if b >= batch_size), default=bs[-1])
        a, b = self.validation[lo][epoch], self.validation[hi][epoch]
        if lo == hi:
            return a["grad_sqr"], a["grad_var"]
        w = (batch_size - lo) / (hi - lo)
        return (a["grad_sqr"] * (1 - w) + b["grad_sqr"] * w,
                a["grad_var"] * (1 - w) + b["grad_var"] * w)

    @functools.lru_cache(maxsize=None)
    def total_steps(self, batch_size: int, model: str = "progress") -> float:
        """Optimizer steps a job at global ``batch_size`` takes to train :attr:`epochs` epochs
        (``model``: ``progress`` or ``iteration``, the module's docstring).  ValueError for an
        unknown model."""
        if model == "iteration":
            bs = list(self.validation)
            near = min(bs, key=lambda b: abs(math.log(b / batch_size)))
            return self.validation[near][self.epochs - 1]["iteration"]
        if model != "progress":
            raise ValueError(f"unknown work model {model!r} (progress or iteration)")
        steps = 0.0
        prev = 0.0
        scale = batch_size / self.init_batch_size
        for e in range(self.epochs):
            nxt = min(rows[e]["progress"] for rows in self.validation.values())
            sqr, var = self.grad_stats(batch_size, e)
            gain = (var + sqr) / (var / scale + sqr)
            steps += (nxt - prev) / gain
            prev = nxt
        return steps


@functools.lru_cache(maxsize=4)
def applications(path: Optional[str] = None) -> Dict[str, Application]:
    """The six applications of the data folder, by name (FileNotFoundError if absent)."""
    root = traces_dir(path) / "traces"
    return {name: Application(root / name, e, MAX_LOCAL_BSZ.get(name))
            for name, e in EPOCHS.items()}


@dataclass(frozen=True)
class TraceJob:
    """One row of a workload: submitted at ``time`` (s), ``num_replicas`` GPUs asked for at global
    batch ``batch_size`` (samples)."""
    name: str
    time: float
    application: str
    num_replicas: int
    batch_size: int


def workload_path(load: str, index: int, path: Optional[str] = None) -> Path:
    """The csv of workload ``index`` (1-8) at ``load`` (one of :data:`LOADS`)."""
    if load not in LOADS:
        raise ValueError(f"unknown load {load!r} (one of {', '.join(LOADS)})")
    sub = "workloads" if load == "1.0" else f"workloads-{load}"
    return traces_dir(path) / sub / f"workload-{index}.csv"


def load_workload(load: str = "1.0", index: int = 1, path: Optional[str] = None) -> List[TraceJob]:
    """The jobs of one published workload, in submission order."""
    rows = _read_csv(workload_path(load, index, path))
    jobs = [TraceJob(r["name"], float(r["time"]), r["application"], int(r["num_replicas"]),
                     int(r["batch_size"])) for r in rows]
    return sorted(jobs, key=lambda j: (j.time, j.name))


def published(policy: str, load: str = "1.0", path: Optional[str] = None) -> Dict:
    """Pollux's published results of ``policy`` (pollux, tiresias, optimus) at ``load``:
    ``{"jcts": {workload: {job: s}}, "avgs": {workload: s}, "mean": s}``."""
    p = traces_dir(path) / "results-jobload" / f"{policy}-{load}" / "summary.json"
    with open(p) as f:
        return json.load(f)


def sim_jobs(trace: List[TraceJob], elastic: bool = False, path: Optional[str] = None,
             model: str = "progress"):
    """:class:`launcher.cluster.simulator.SimJob` objects for a workload.

    Static (``elastic=False``, what Tiresias and FIFO get): ``np = min_np = max_np`` = the
    trace's GPU count.  Elastic: ``np`` the trace's, ``min_np = 1`` (a fixed global batch runs on
    one GPU, accumulating), ``max_np`` = the most GPUs whose local batch stays at least the
    smallest profiled one (at most 64).  The global batch is the trace's in both.
    """
    from launcher.cluster.simulator import SimJob
    apps = applications(path)
    out = []
    for tj in trace:
        app = apps[tj.application]
        b = tj.batch_size
        step = functools.partial(app.optimizer_step_s, batch_size=b)
        if elastic:
            hi = max(tj.num_replicas, min(64, b // app.min_local_bsz))
            out.append(SimJob(tj.name, tj.time, step, app.total_steps(b, model), tj.num_replicas,
                              1, hi, samples_per_step=b, elastic=True))
        else:
            out.append(SimJob(tj.name, tj.time, step, app.total_steps(b, model), tj.num_replicas,
                              samples_per_step=b, elastic=False))
    return out


USER_SHARES = (0.5, 0.25, 0.15, 0.1)
"""Default skewed split of a workload's jobs among 4 users (fractions of the jobs)."""


def assign_users(jobs, shares=USER_SHARES, seed: int = 0, prefix: str = "user"):
    """The same :class:`launcher.cluster.simulator.SimJob` objects' copies, each given a user:
    ``round(share x len(jobs))`` jobs to each of ``prefix1``, ``prefix2``, ... (the last takes
    what rounding leaves), chosen by a shuffle seeded with ``seed`` (the same split every run).
    ValueError (one line) for shares that are not positive or do not sum to 1 (within 1e-6)."""
    import dataclasses
    import random
    shares = [float(s) for s in shares]
    if not shares or any(s <= 0 for s in shares) or abs(sum(shares) - 1.0) > 1e-6:
        raise ValueError(f"user shares must be positive and sum to 1, got {shares}")
    jobs = list(jobs)
    idx = list(range(len(jobs)))
    random.Random(seed).shuffle(idx)
    user_of = {}
    at = 0
    for k, s in enumerate(shares):
        n = len(jobs) - at if k == len(shares) - 1 else round(s * len(jobs))
        for i in idx[at:at + n]:
            user_of[i] = f"{prefix}{k + 1}"
        at += n
    return [dataclasses.replace(j, user=user_of[i]) for i, j in enumerate(jobs)]
