"""A cluster job's speed as its policy sees it: samples/s against the slots it holds, learned
from the job's own telemetry (``/ctl/telemetry``, the heartbeats' figures ``hvd-edl-ctl top``
shows) while it runs under the service.

Each world size the job trained at, steadily for a whole telemetry window, leaves one point
(its samples/s, step, compute and wait seconds).  With points at two sizes or more the job's
throughput is its speed model's (:class:`launcher.apps.speed_model.SpeedModel`, the one
``--autoscale`` fits; CM-DARE's regression), else linear in the slots from the one point, else
unknown (None: the policies then assume linear scaling).  Placement (how the slots spread over
hosts) is not modelled: the telemetry of one run does not separate it.

Per GPU type (issue 42; CM-DARE measures speed per server type and cluster size): a point taken
while every host of the job is of one type (``type=`` on its pool line) is kept under
``"TYPE:N"`` and carries ``"type"``; :func:`typed_speed` answers samples/s for any type and
size: from that type's own points when it has some, else from the type with the most points
scaled by the two types' TFLOPS (the price table's ``tflops`` column, else the published figures
of :data:`launcher.cluster.speed_types.GPU_TFLOPS`; CM-DARE's first feature), else unknown.
A job's ``--speed-profile`` (``{"TYPE": {"N": samples_per_s}}``) seeds the
points before it runs.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, Mapping, Optional

from launcher.cluster.policy import Placement

STEADY_S = 6.0   # a world size held this long (> the telemetry's 5 s window) leaves a point


def point(telemetry_job: dict, gpu_type: Optional[str] = None) -> Optional[dict]:
    """A speed point from a ``/ctl/telemetry`` answer's ``job`` part, or None when it holds no
    throughput; ``gpu_type``: the one type of every host the job is on (None: untyped or
    mixed)."""
    n, thr = telemetry_job.get("world_size") or 0, telemetry_job.get("samples_per_s") or 0.0
    if n < 1 or not thr > 0:
        return None
    out = {"world_size": n, "samples_per_s": float(thr), "step_s": telemetry_job.get("step_s"),
           "compute_s": telemetry_job.get("compute_s"),
           "wait_s": telemetry_job.get("wait_s"), "at": time.time()}
    if gpu_type:
        out["type"] = gpu_type
    return out


def key(p: dict) -> str:
    """Where a point is kept in a job's ``speed``: ``"N"`` untyped, ``"TYPE:N"`` typed."""
    return f"{p['type']}:{p['world_size']}" if p.get("type") else str(p["world_size"])


def profile_points(profile: Mapping[str, Mapping[str, float]]) -> Dict[str, dict]:
    """A ``--speed-profile`` (``{"t4": {"1": 50.0, "2": 96.0, "start_s": 12}}``, samples/s by
    size; ``start_s``, optional: the job's start on that type, seconds or ``{"1": 8, "2": 16}``
    by size, :func:`start_costs`) as speed points (``at`` 0: any measured point is newer).

    Raises:
        ValueError: not that shape, a size not a positive integer or a speed not positive."""
    out: Dict[str, dict] = {}
    if not isinstance(profile, Mapping):
        raise ValueError("a speed profile maps GPU types to {size: samples/s}")
    for t, sizes in profile.items():
        if not isinstance(sizes, Mapping) or not sizes:
            raise ValueError(f"speed profile of type {t!r}: needs {{size: samples/s}}")
        for n, thr in sizes.items():
            if n == "start_s":
                _check_start(t, thr)
                continue
            try:
                k, v = int(n), float(thr)
            except (TypeError, ValueError):
                k, v = 0, 0.0
            if k < 1 or not v > 0 or v == float("inf"):
                raise ValueError(f"speed profile of type {t!r}: size {n!r} at {thr!r} samples/s "
                                 f"(sizes are positive integers, speeds positive numbers)")
            p = {"world_size": k, "samples_per_s": v, "at": 0.0, "type": str(t)}
            out[key(p)] = p
    return out


def _check_start(t, start) -> None:
    """ValueError unless ``start`` is seconds (0 <= s < 1e5) or {size: seconds}."""
    values = list(start.items()) if isinstance(start, Mapping) else [("1", start)]
    for n, v in values or [("0", None)]:
        try:
            ok = int(n) >= 1 and 0 <= float(v) < 1e5
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"speed profile of type {t!r}: start_s {start!r} is not a number "
                             f"of seconds nor {{size: seconds}}")


def start_costs(profile: Mapping[str, Mapping[str, float]]) -> Dict[str, object]:
    """type -> the job's start on it (launcher, workers' imports, first ring): seconds, or
    {size: seconds} where the profile gives it per size (starting more workers at once can take
    longer: their imports share the hosts' CPUs), from a checked ``--speed-profile``'s
    ``start_s`` entries (:func:`launcher.cluster.choice.start_of` reads either)."""
    out: Dict[str, object] = {}
    for t, sizes in profile.items():
        if isinstance(sizes, Mapping) and "start_s" in sizes:
            v = sizes["start_s"]
            out[str(t)] = ({str(int(n)): float(x) for n, x in v.items()}
                           if isinstance(v, Mapping) else float(v))
    return out


def _size_model(points) -> Optional[Callable[[int], float]]:
    """samples/s by size from one type's points: the speed model when three sizes or more were
    measured with step times (its fit needs them; scikit-learn is imported only then), else the
    newest point at each size, linear between sizes and per worker beyond them."""
    if not points:
        return None
    measured = [p for p in points if p.get("step_s")]
    if len({p["world_size"] for p in measured}) >= 3:
        from launcher.apps.speed_model import ProfilePoint, SpeedModel
        try:
            model = SpeedModel().fit([ProfilePoint.from_dict(p) for p in measured])
            return lambda n: model.samples_per_s(n) if n > 0 else 0.0
        except (ValueError, RuntimeError, KeyError, TypeError):
            pass
    newest: Dict[int, dict] = {}
    for p in points:
        if p["world_size"] not in newest or p["at"] >= newest[p["world_size"]]["at"]:
            newest[p["world_size"]] = p
    sizes = sorted(newest)
    thr = {k: newest[k]["samples_per_s"] for k in sizes}

    def interpolated(n: int) -> float:
        if n in thr:
            return thr[n]
        if n < sizes[0]:
            return thr[sizes[0]] / sizes[0] * n
        if n > sizes[-1]:
            return thr[sizes[-1]] / sizes[-1] * n
        lo = max(k for k in sizes if k < n)
        hi = min(k for k in sizes if k > n)
        return thr[lo] + (thr[hi] - thr[lo]) * (n - lo) / (hi - lo)
    return interpolated


def typed_speed(speed: Dict[str, dict], tflops: Optional[Mapping[str, float]] = None
                ) -> Callable[[str, int], Optional[float]]:
    """samples/s of a job on ``n`` GPUs of a type (module docstring), from its points
    (``{key: point}``) and each type's TFLOPS (``tflops``, for types it has not run on)."""
    by_type: Dict[str, list] = {}
    for p in speed.values():
        if p.get("type") and p.get("samples_per_s"):
            by_type.setdefault(p["type"], []).append(p)
    models = {t: _size_model(ps) for t, ps in by_type.items()}
    tflops = tflops or {}
    ref = max((t for t in models if tflops.get(t)), key=lambda t: (len(by_type[t]), t),
              default=None)

    def answer(gpu_type: str, n: int) -> Optional[float]:
        if n < 1:
            return 0.0
        model = models.get(gpu_type)
        if model is not None:
            return model(n)
        if ref is not None and tflops.get(gpu_type):
            return models[ref](n) * tflops[gpu_type] / tflops[ref]
        return None
    return answer


def throughput(speed: Dict[str, dict]) -> Optional[Callable[[Placement], float]]:
    """samples/s at a placement, from a job's points (``{str(world_size): point}``); None when
    there are none."""
    points = [p for p in speed.values() if p.get("samples_per_s") and p.get("at")]
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

