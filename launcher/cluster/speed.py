"""A cluster job's speed as its policy sees it: samples/s against the slots it holds, learned
from the job's own telemetry (``/ctl/telemetry``, the heartbeats' figures ``hvd-edl-ctl top``
shows) while it runs under the service.

Each world size the job trained at, steadily for a whole telemetry window, leaves one point
(its samples/s, step, compute and wait seconds).  With points at two sizes or more the job's
throughput is its speed model's (:class:`launcher.apps.speed_model.SpeedModel`, the one
``--autoscale`` fits; CM-DARE's regression), else linear in the slots from the one point, else
unknown (None: the policies then assume linear scaling).  Placement (how the slots spread over
hosts) is not modelled: the telemetry of one run does not separate it.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, Optional

from launcher.cluster.policy import Placement

STEADY_S = 6.0   # a world size held this long (> the telemetry's 5 s window) leaves a point


def point(telemetry_job: dict) -> Optional[dict]:
    """A speed point from a ``/ctl/telemetry`` answer's ``job`` part, or None when it holds no
    throughput."""
    n, thr = telemetry_job.get("world_size") or 0, telemetry_job.get("samples_per_s") or 0.0
    if n < 1 or not thr > 0:
        return None
    return {"world_size": n, "samples_per_s": float(thr), "step_s": telemetry_job.get("step_s"),
            "compute_s": telemetry_job.get("compute_s"),
            "wait_s": telemetry_job.get("wait_s"), "at": time.time()}


def throughput(speed: Dict[str, dict]) -> Optional[Callable[[Placement], float]]:
    """samples/s at a placement, from a job's points (``{str(world_size): point}``); None when
    there are none."""
    points = [p for p in speed.values() if p.get("samples_per_s")]
    if not points:
        return None
    if len({p["world_size"] for p in points}) >= 2:
        from launcher.apps.speed_model import ProfilePoint, SpeedModel
        try:
            model = SpeedModel().fit([ProfilePoint.from_dict(p) for p in points])
            return lambda placement: model.samples_per_s(sum(placement)) if sum(placement) \
                else 0.0
        except (ValueError, RuntimeError):
            pass
    best = max(points, key=lambda p: p["at"])
    per_slot = best["samples_per_s"] / best["world_size"]
    return lambda placement: per_slot * sum(placement)

