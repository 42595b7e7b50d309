"""A running job's goodput as the cluster service sees it, learned from the job's telemetry: what
the ``goodput`` policy (:mod:`launcher.cluster.policies.goodput`) judges a job that opted in to an
adaptive batch by.

From each ``/ctl/telemetry`` answer (``launcher/cluster/telemetry.py`` polls it): the job's
gradient noise (``gradient_noise``: ``sqr`` and the per-sample ``var``, ``hvd_edl.gradient_noise``)
and its adaptive batch (``adaptive_batch``: the batch in force, its layout and the script's
bounds; absent when the script did not opt in).  A configuration (world size, hosts, local batch,
accumulation) held steadily for :data:`launcher.apps.batch_goodput.SETTLE_S` leaves one step
point (compute and wait seconds per step, the mean of every look at it:
:class:`launcher.apps.batch_goodput.StepPoints`), and the step-time model is the job's own
(:func:`launcher.apps.batch_goodput.fit`, Pollux's ``PerfParams``), fitted again at each look.  :meth:`JobGoodput.view` is then a :class:`launcher.cluster.goodput.GoodputView`: the
candidate batches at any placement and their step seconds.  A job that did not opt in has no
view (None): it is scheduled by its throughput alone and keeps its batch.
"""
from __future__ import annotations

import threading
from typing import Optional, Tuple

import numpy as np

from launcher.apps.batch_goodput import SETTLE_S, PerfParams, StepPoint, StepPoints, fit
from launcher.cluster import goodput as gp


class JobGoodput:
    """One job's goodput model in the service (the module's docstring).  Thread-safe: the
    telemetry thread calls :meth:`observe`, the round :meth:`view`."""

    def __init__(self):
        self._lock = threading.Lock()
        self._points = StepPoints()
        self._perf: Optional[PerfParams] = None
        self._noise: Optional[dict] = None
        self._plan: Optional[dict] = None
        self._gen = (-1, 0.0)

    def observe(self, answer: dict, now: float) -> None:
        """Take one ``/ctl/telemetry`` answer seen at ``now`` (monotonic seconds)."""
        job, plan, noise = answer.get("job") or {}, answer.get("adaptive_batch"), \
            answer.get("gradient_noise")
        with self._lock:
            self._plan = plan if plan and plan.get("base_batch") else None
            if noise and noise.get("sqr") is not None and noise.get("var") is not None:
                self._noise = noise
            gen = job.get("generation", 0)
            if gen != self._gen[0]:
                self._gen = (gen, now)
                return
            if self._plan is None or now - self._gen[1] < SETTLE_S \
                    or job.get("compute_s") is None \
                    or job.get("world_size") != self._plan.get("world_size"):
                return
            hosts = max(len({w.get("host") for w in answer.get("workers", [])
                             if w.get("rank", -1) >= 0}), 1)
            p = StepPoint(int(self._plan["world_size"]), hosts, int(self._plan["local_batch"]),
                          int(self._plan["accumulation"]), float(job["compute_s"]),
                          float(job.get("wait_s") or 0.0))
            self._points.add(p)   # the mean of every look (StepPoints)
            self._perf = fit(self._points.points())

    def view(self) -> Optional[gp.GoodputView]:
        """The job's goodput now, or None before it reported an adaptive batch, its gradient
        noise and one steady step point."""
        with self._lock:
            plan, noise, perf = self._plan, self._noise, self._perf
        if plan is None or noise is None or perf is None:
            return None
        base = int(plan["base_batch"])
        lo, hi = int(plan["min_batch"]), int(plan["max_batch"])
        max_local = int(plan.get("max_local_batch") or 0) or hi

        def configs(pl: Tuple[int, ...]):
            n = sum(pl)
            cands = gp.batch_candidates(n, lo, hi, 1, max_local)
            b = np.array([c[0] for c in cands], float)
            t = np.array([perf.step_seconds(n, len(pl), c[1], c[2] + 1) for c in cands], float)
            return b, t
        # the job reports var per sample; the gain takes it at the base batch
        return gp.GoodputView(float(noise["sqr"]), float(noise["var"]) / base, base,
                              int(plan["batch"]), configs, adapts=True)
