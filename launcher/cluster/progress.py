"""Pollux's progress model for a simulated job whose global batch may change: how far an
optimizer step at batch B takes it, and when it ends.

As Pollux's simulator measures it (Qiao et al., OSDI 2021; ``simulator/simulator.py`` of
petuum/adaptdl's ``osdi21-artifact``): a job of application A progresses, per optimizer step at
global batch B in epoch e, by AdaScale's gain ``(var + sqr) / (var / S + sqr)``, ``S = B / B_min``
(``B_min`` A's smallest validated batch, the progress unit), with ``grad_sqr`` and ``grad_var``
of validation-B.csv at epoch e, linearly interpolated between the validated batches around B;
epoch e ends at the least progress any validated batch reached by its end, and the job ends at
the progress of its epoch count (:data:`launcher.cluster.workload.EPOCHS`).

At a fixed batch that is a fixed number of optimizer steps per epoch, so the simulator keeps
counting steps: :meth:`ProgressModel.steps` maps progress to steps at a batch (piecewise linear,
exact), :meth:`ProgressModel.progress` back; a batch change converts the steps done.

:class:`BatchModel` is one trace job that adapts its batch (``launcher.cluster.simulator.SimJob``'s
``batch``): its initial batch B0 (the trace's ``batch_size``), Pollux's bounds for A (global batch
between ``B_min`` and A's largest validated batch, the local batch within the profiled range,
accumulating above the largest micro-batch, 8 for yolov3), its step time at a placement and batch
(the profiles, as for fixed-batch jobs), and the :class:`launcher.cluster.goodput.GoodputView` a
policy sees each round (the gradient statistics at its current batch and epoch, as a live job
measures them).
"""
from __future__ import annotations

import bisect
import functools
from typing import Dict, List, Optional, Tuple

import numpy as np

from launcher.cluster import goodput as gp
from launcher.cluster.policy import Placement


class ProgressModel:
    """Progress against steps for one application (the module's docstring).

    Args:
        app: a :class:`launcher.cluster.workload.Application`.
    Attributes:
        bounds: progress at the end of each epoch, ``bounds[0] == 0``, ``bounds[-1]`` the end.
        base_batch: the progress unit's batch (A's smallest validated batch).
    """

    def __init__(self, app):
        self.app = app
        self.base_batch = app.init_batch_size
        self.bounds: List[float] = [0.0] + [
            min(rows[e]["progress"] for rows in app.validation.values())
            for e in range(app.epochs)]
        self.end = self.bounds[-1]

    def grad_stats(self, batch: float, epoch: int) -> Tuple[float, float]:
        """(grad_sqr, grad_var) at global ``batch`` in ``epoch`` (0-based), interpolated."""
        return self.app.grad_stats(batch, min(epoch, self.app.epochs - 1))

    def gain(self, batch: float, epoch: int) -> float:
        """Progress of one optimizer step at ``batch`` in ``epoch``."""
        sqr, var = self.grad_stats(batch, epoch)
        return gp.gain(sqr, var, batch / self.base_batch)

    def epoch(self, progress: float) -> int:
        """The epoch (0-based) ``progress`` is in (the last one at or past the end)."""
        return min(bisect.bisect_right(self.bounds, progress) - 1, self.app.epochs - 1)

    @functools.lru_cache(maxsize=4096)
    def _cum(self, batch: int) -> Tuple[np.ndarray, np.ndarray]:
        """(steps at each epoch bound, gain per epoch) at ``batch``."""
        gains = np.array([self.gain(batch, e) for e in range(self.app.epochs)])
        steps = np.concatenate([[0.0], np.cumsum(np.diff(self.bounds) / gains)])
        return steps, gains

    def steps(self, batch: int, progress: float) -> float:
        """Optimizer steps at ``batch`` from 0 to ``progress``."""
        cum, gains = self._cum(int(batch))
        e = self.epoch(progress)
        return float(cum[e] + (progress - self.bounds[e]) / gains[e])

    def total_steps(self, batch: int) -> float:
        """Optimizer steps at ``batch`` for the whole job."""
        return float(self._cum(int(batch))[0][-1])

    def progress(self, batch: int, steps: float) -> float:
        """Progress after ``steps`` optimizer steps at ``batch`` from 0 (the inverse of
        :meth:`steps`)."""
        cum, gains = self._cum(int(batch))
        e = min(int(np.searchsorted(cum, steps, side="right")) - 1, self.app.epochs - 1)
        e = max(e, 0)
        return float(min(self.end, self.bounds[e] + (steps - cum[e]) * gains[e]))


@functools.lru_cache(maxsize=16)
def _model(app) -> ProgressModel:
    return ProgressModel(app)


class BatchModel:
    """A trace job that adapts its global batch (the module's docstring).

    Args:
        app: its :class:`launcher.cluster.workload.Application`.
        b0: the batch it starts at (the trace's ``batch_size``).
        min_batch, max_batch: its global batch bounds (default: Pollux's, A's smallest and
            largest validated batch).
        adapts: False: it keeps ``b0`` (the bounds then only bound the candidates a policy
            may judge it at).
    """

    def __init__(self, app, b0: int, min_batch: Optional[int] = None,
                 max_batch: Optional[int] = None, adapts: bool = True):
        self.app = app
        self.model = _model(app)
        self.b0 = int(b0)
        self.min_batch = int(min_batch or app.init_batch_size)
        self.max_batch = int(max_batch or max(app.validation))
        self.adapts = adapts
        self.min_local, self.max_local = app.min_local_bsz, app.max_local_bsz
        self._view = None     # ((epoch, batch), GoodputView) last given

    @property
    def max_replicas(self) -> int:
        """The most replicas a batch within the bounds keeps at the smallest local batch."""
        return max(1, max(self.max_batch, self.b0) // self.min_local)

    def run_batch(self, replicas: int, batch: int) -> Tuple[int, int, int]:
        """(global batch run, micro-batch, accumulation steps) of ``batch`` over ``replicas``."""
        micro, accum = gp.split_batch(int(batch), replicas, self.max_local)
        micro = max(micro, self.min_local)
        return replicas * micro * (accum + 1), micro, accum

    def step_time(self, placement: Placement, batch: int) -> float:
        """Seconds of one optimizer step at global ``batch`` over ``placement``."""
        _, micro, accum = self.run_batch(sum(placement), batch)
        st, sy = self.app.step_time(tuple(placement), micro)
        return gp.step_seconds(st, sy, accum)

    def view(self, progress: float, batch: int) -> gp.GoodputView:
        """What a policy sees of this job now: its statistics at ``batch`` in the current epoch
        (the same object while the epoch and the batch stay: its memo of the best batch per
        placement carries over rounds)."""
        key = (self.model.epoch(progress), batch)
        if self._view is not None and self._view[0] == key:
            return self._view[1]
        sqr, var = self.model.grad_stats(batch, key[0])
        v = self._make_view(sqr, var, batch)
        self._view = (key, v)
        return v

    def _make_view(self, sqr: float, var: float, batch: int) -> gp.GoodputView:
        return gp.GoodputView(sqr, var, self.model.base_batch, batch,
                              functools.partial(_configs, self.app, self.min_batch, self.max_batch,
                                                self.b0 if not self.adapts else None),
                              adapts=self.adapts)


@functools.lru_cache(maxsize=None)
def _configs(app, min_batch: int, max_batch: int, fixed: Optional[int],
             placement: Placement) -> Tuple[np.ndarray, np.ndarray]:
    """(candidate global batches, optimizer step seconds) at ``placement``; a job that keeps
    ``fixed`` has that one candidate (accumulating where it must)."""
    n = sum(placement)
    if fixed is not None:
        micro, accum = gp.split_batch(fixed, n, app.max_local_bsz)
        if micro < app.min_local_bsz and n > 1:
            return np.empty(0), np.empty(0)
        cands = [(fixed, max(micro, app.min_local_bsz), accum)]
    else:
        cands = gp.batch_candidates(n, min_batch, max_batch, app.min_local_bsz,
                                    app.max_local_bsz)
    b = np.array([c[0] for c in cands], float)
    st, sy = app.step_times(tuple(placement), [c[1] for c in cands])
    return b, gp.step_seconds(st, sy, np.array([c[2] for c in cands], float))


def batch_models(trace, adapts: bool = True, path: Optional[str] = None) -> Dict[str, BatchModel]:
    """A :class:`BatchModel` per trace job (``TraceJob``) by name.  ncf keeps its trace batch
    (32,768), as in Pollux's simulator."""
    from launcher.cluster.workload import applications
    apps = applications(path)
    return {tj.name: BatchModel(apps[tj.application], tj.batch_size,
                                adapts=adapts and tj.application != "ncf") for tj in trace}


def adaptive_sim_jobs(trace, adapts: bool = True, path: Optional[str] = None):
    """Elastic :class:`launcher.cluster.simulator.SimJob` objects for a workload whose jobs
    carry a :class:`BatchModel` (:func:`batch_models`): ``np`` the trace's GPU count, ``min_np``
    1, ``max_np`` the most GPUs a batch within the bounds keeps at the smallest profiled local
    batch (at most 64, at least the trace's).  ``adapts=False``: every job keeps its trace batch
    (the same work as ``workload.sim_jobs(elastic=True)``)."""
    from launcher.cluster.simulator import SimJob
    models = batch_models(trace, adapts, path)
    out = []
    for tj in trace:
        m = models[tj.name]
        hi = max(tj.num_replicas, min(64, m.max_replicas))
        out.append(SimJob(tj.name, tj.time, functools.partial(m.step_time, batch=m.b0),
                          m.model.total_steps(m.b0), tj.num_replicas, 1, hi,
                          samples_per_step=m.b0, elastic=True, batch=m))
    return out


def warm_profiles(host_slots: int = 4, max_gpus: int = 64, path: Optional[str] = None) -> None:
    """Tabulate every application's candidate batches and step times at every compact placement
    up to ``max_gpus`` (the profiles' interpolation, the simulator's stand-in for each job's own
    throughput model, is slow per call: ~10 ms a placement).  Timing a policy's round after this
    measures the policy, not the trace's interpolation."""
    from launcher.cluster.policies.edl import compact_placement
    from launcher.cluster.workload import applications
    for app in applications(path).values():
        for n in range(1, max_gpus + 1):
            _configs(app, app.init_batch_size, max(app.validation), None,
                     compact_placement(n, host_slots))
