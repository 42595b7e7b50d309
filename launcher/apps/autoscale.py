"""Autoscaling on a speed model: the world size a job should have for an objective (EDL,
arXiv 1909.11985: schedulers sizing jobs for throughput and GPU efficiency; CM-DARE, arXiv
2004.03072: the size that trains cheapest on transient servers, revocations counted).

``hvd-edl-run --autoscale efficiency:E`` (0 < E <= 1): the job grows while one more worker
would add at least E of a lone worker's throughput (:meth:`SpeedModel.marginal_efficiency`)
and shrinks to the size where that stops being true.

``hvd-edl-run --autoscale cost --price-spot P [--price-on-demand Q] [--revocation-rate R]``:
the size with the lowest predicted cost per sample (so per epoch: an epoch is a fixed number of
samples), :func:`cost_per_sample`.  Prices are per worker-hour; R revocations per spot
worker-hour.  With both prices, rank 0 (the holder of the state) runs on demand and the other
n - 1 workers on spot servers; with one price, every worker pays it and only spot workers are
revoked.

The model.  At start-up the autoscaler profiles the job (``launcher.apps.profiler``, every size from
--min-np to the usable slots, at most ``MAX_PROFILE_SIZES`` of them, ``profile_s`` seconds each:
a few seconds of stop-free switches instead of a guess; its profile.json and profile.png go
beside the ``--event-log``, else to the temporary folder) and fits a
:class:`launcher.apps.speed_model.SpeedModel`; afterwards each size the job holds for a while
refreshes that size's point from the telemetry (the model learns from the sizes it passes
through, e.g. sizes a discovery timetable forces on it; without a model, e.g. after a profile
aborted by a failure, it moves to the nearest size not measured yet, one at a time).

Decisions are bounded by [--min-np, --max-np] and the usable slots discovery offers, and held
for ``hold_s`` seconds (hysteresis: no flapping); a change in the usable slots is decided on at
once.  Each decision goes to the event log (``autoscale``, with the predicted samples/s) and
``Driver.telemetry.count("autoscale")``; ``hvd-edl-ctl status`` shows the prediction.
"""
from __future__ import annotations

import logging
import math
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from launcher.apps.speed_model import ProfilePoint, SpeedModel

log = logging.getLogger(__name__)

HOLD_S = 30.0              # seconds a decision holds before the next one (hysteresis)
PROFILE_S = 5.0            # seconds of measurement per size in the start-up profile
MAX_PROFILE_SIZES = 6      # sizes the start-up profile measures at most (spread evenly)
LOOP_S = 1.0               # seconds between the autoscaler's looks at the job
COMMIT_STEPS = 10          # steps between commits assumed for the work a revocation loses
DEFAULT_STALL_S = 1.0      # a failure switch's stall before one was measured (seconds)
POINT_AFTER_S = 8.0        # seconds at a size before its telemetry refreshes the model


@dataclass(frozen=True)
class Policy:
    """What ``--autoscale`` asked for.  ``objective``: "efficiency" or "cost"; ``efficiency``:
    E; prices per worker-hour (None: not given); ``revocation_rate``: revocations per spot
    worker-hour; ``hold_s``, ``profile_s``: seconds."""
    objective: str
    efficiency: float = 0.0
    price_on_demand: Optional[float] = None
    price_spot: Optional[float] = None
    revocation_rate: float = 0.0
    hold_s: float = HOLD_S
    profile_s: float = PROFILE_S


def parse_policy(text: str, price_on_demand: Optional[float] = None,
                 price_spot: Optional[float] = None, revocation_rate: Optional[float] = None,
                 hold_s: float = HOLD_S, profile_s: float = PROFILE_S) -> Policy:
    """``"efficiency:0.7"`` or ``"cost"`` (with the price flags) as a :class:`Policy`.

    Raises:
        ValueError: an unknown objective, E outside (0, 1], cost without a price, a negative
            price or rate, or a price / rate flag without ``cost`` (message for people)."""
    kind, _, arg = text.partition(":")
    if kind == "efficiency":
        try:
            e = float(arg)
        except ValueError:
            raise ValueError(f"--autoscale efficiency:E needs a number E in (0, 1], got "
                             f"{text!r}") from None
        if not 0 < e <= 1:
            raise ValueError(f"--autoscale efficiency:E needs 0 < E <= 1, got {e:g}")
        if price_on_demand is not None or price_spot is not None or revocation_rate is not None:
            raise ValueError("--price-on-demand, --price-spot and --revocation-rate go with "
                             "--autoscale cost")
        return Policy("efficiency", efficiency=e, hold_s=hold_s, profile_s=profile_s)
    if kind == "cost" and not arg:
        if price_on_demand is None and price_spot is None:
            raise ValueError("--autoscale cost needs --price-spot and/or --price-on-demand "
                             "(per worker-hour)")
        for name, v in (("--price-on-demand", price_on_demand), ("--price-spot", price_spot),
                        ("--revocation-rate", revocation_rate)):
            if v is not None and not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a number >= 0, got {v}")
        if revocation_rate and price_spot is None:
            raise ValueError("--revocation-rate applies to spot workers: give --price-spot")
        return Policy("cost", price_on_demand=price_on_demand, price_spot=price_spot,
                      revocation_rate=revocation_rate or 0.0, hold_s=hold_s,
                      profile_s=profile_s)
    raise ValueError(f"--autoscale takes efficiency:E (0 < E <= 1) or cost, got {text!r}")


# ---- the objectives (pure functions of the model) ------------------------------------------------

def efficiency_target(model: SpeedModel, e: float, lo: int, hi: int) -> int:
    """The largest size in [lo, hi] reached from ``lo`` by adding workers while each one adds
    at least ``e`` of a lone worker's throughput (EDL's efficiency objective)."""
    n = lo
    while n < hi and model.marginal_efficiency(n) >= e:
        n += 1
    return n


def cost_per_sample(model: SpeedModel, n: int, policy: Policy, stall_s: float,
                    commit_steps: int = COMMIT_STEPS) -> Tuple[float, float]:
    """(predicted cost per sample, expected seconds lost per hour of training) at ``n`` workers.

    Cost per hour: the on-demand price for rank 0 and the spot price for the others when both
    are given, else one price for all.  Revocations: ``revocation_rate`` per spot worker-hour;
    each costs every worker the work since the last commit (half of ``commit_steps`` steps on
    average) plus a failure switch's ``stall_s`` (CM-DARE's revocation overhead); the time
    lost stretches the hour's training, so cost per sample = cost per hour / (samples/s x
    useful seconds per hour)."""
    od, spot = policy.price_on_demand, policy.price_spot
    if od is not None and spot is not None:
        hourly, revocable = od + spot * (n - 1), n - 1
    elif spot is not None:
        hourly, revocable = spot * n, n
    else:
        hourly, revocable = od * n, 0
    loss_s = commit_steps / 2 * model.step_s(n) + stall_s          # per revocation
    lost_per_hour = min(policy.revocation_rate * revocable * loss_s, 3600.0)
    useful_s = 3600.0 - lost_per_hour
    if useful_s <= 0:
        return math.inf, lost_per_hour
    return hourly / (model.samples_per_s(n) * useful_s), lost_per_hour


def cost_target(model: SpeedModel, policy: Policy, lo: int, hi: int,
                stall_s: float = DEFAULT_STALL_S) -> int:
    """The size in [lo, hi] with the lowest :func:`cost_per_sample` (the larger on a tie
    within 0.1 %: it finishes sooner for the same money)."""
    best, best_cost = lo, math.inf
    for n in range(lo, hi + 1):
        c, _ = cost_per_sample(model, n, policy, stall_s)
        if c <= best_cost * 1.001:
            best, best_cost = n, min(c, best_cost)
    return best


def decide(model: SpeedModel, policy: Policy, lo: int, hi: int,
           stall_s: float = DEFAULT_STALL_S) -> int:
    """The size the policy wants within [lo, hi] (see the module docstring)."""
    if policy.objective == "efficiency":
        return efficiency_target(model, policy.efficiency, lo, hi)
    return cost_target(model, policy, lo, hi, stall_s)


def prediction(model: SpeedModel, policy: Policy, n: int, stall_s: float) -> dict:
    """What ``hvd-edl-ctl status`` prints for ``n`` workers: samples/s, scaling efficiency,
    the next worker's marginal efficiency and, for ``cost``, cost per hour and per million
    samples (the prices' unit)."""
    out = {"world_size": n, "samples_per_s": round(model.samples_per_s(n), 3),
           "efficiency": round(model.efficiency(n), 4),
           "marginal_efficiency": round(model.marginal_efficiency(n), 4)}
    if policy.objective == "cost":
        c, lost = cost_per_sample(model, n, policy, stall_s)
        out["cost_per_million_samples"] = None if math.isinf(c) else round(c * 1e6, 6)
        out["lost_s_per_hour"] = round(lost, 2)
    return out


# ---- the running autoscaler ----------------------------------------------------------------------

class Autoscaler:
    """Sizes the job run by ``driver`` (a :class:`launcher.job.driver.Driver`) for ``policy`` in
    a thread of the launcher (:meth:`start`); :meth:`status` is its part of ``hvd-edl-ctl
    status``."""

    def __init__(self, driver, policy: Policy):
        self.driver = driver
        self.policy = policy
        self.model: Optional[SpeedModel] = None
        self.points: Dict[int, ProfilePoint] = {}
        self.decisions: List[dict] = []
        self.target: Optional[int] = None
        self.phase = "waiting"       # waiting -> profiling -> running (or "off: <why>")
        self._decided_at = -math.inf
        self._decided_cap: Optional[int] = None
        self._size_since: Tuple[int, float] = (0, 0.0)   # (generation, monotonic)
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._loop, name="autoscale", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    # ---- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(LOOP_S):
            try:
                if self._job_over():
                    return
                self._tick(time.monotonic())
            except Exception:  # noqa: BLE001 - the autoscaler must never end the job
                log.exception("autoscale pass failed")

    def _job_over(self) -> bool:
        return self.driver.ring().job_over

    def _bounds(self) -> Tuple[int, int]:
        d = self.driver
        cap = min(d.spec.max_np, d.usable_slot_count(d.spec.max_np))
        return d.spec.min_np, max(cap, d.spec.min_np)

    def _tick(self, now: float) -> None:
        d = self.driver
        if self.phase == "waiting":
            if d.ring().settled:
                self._profile()
            return
        if self.phase == "profiling":
            st = d.profiler.status()
            if st["state"] in ("done", "aborted"):
                self._take_profile(st)
            return
        self._learn(now)
        lo, hi = self._bounds()
        if self.model is None:
            self._explore(now, lo, hi)
            return
        if now - self._decided_at < self.policy.hold_s and hi == self._decided_cap:
            return
        if d.profiler.status()["state"] == "running":
            return  # a profile asked for through hvd-edl-ctl moves the job: wait for it
        self._decide(now, lo, hi)

    def _profile(self) -> None:
        lo, hi = self._bounds()
        sizes = list(range(lo, hi + 1))
        if len(sizes) > MAX_PROFILE_SIZES:
            step = (len(sizes) - 1) / (MAX_PROFILE_SIZES - 1)
            sizes = sorted({lo + round(i * step) for i in range(MAX_PROFILE_SIZES)})
        if len(sizes) < 2:  # one usable size: nothing to choose yet
            sizes = [lo]
        try:
            log_path = self.driver.spec.event_log  # profile.json/.png beside the event log
            out_dir = os.path.dirname(os.path.abspath(log_path)) if log_path else \
                tempfile.gettempdir()
            self.driver.profiler.start(sizes, self.policy.profile_s, out_dir=out_dir)
            self.phase = "profiling"
            self._note(f"profiling sizes {', '.join(map(str, sizes))} to fit the speed model",
                       phase="profile", sizes=sizes)
        except ValueError as e:
            self.phase = f"off: {e}"
            self._note(f"cannot profile ({e}): autoscaling off", phase="off")

    def _take_profile(self, st: dict) -> None:
        for p in st.get("points", []):
            try:
                pt = ProfilePoint.from_dict(p)
            except ValueError:
                continue
            self.points[pt.world_size] = pt
        self._refit()
        self.phase = "running"
        if self.model is None:
            self._note(f"the profile gave {len(self.points)} size(s)"
                       + (f" ({st.get('error')})" if st.get("error") else "")
                       + ": no model yet; each size the job holds is measured", phase="learn")

    def _learn(self, now: float) -> None:
        """A size held for ``POINT_AFTER_S`` refreshes its point from the telemetry."""
        d = self.driver
        gen = d.ring().generation
        if self._size_since[0] != gen:
            self._size_since = (gen, now)
            return
        if now - self._size_since[1] < POINT_AFTER_S or not d.ring().settled:
            return
        job = d.telemetry.job()
        n = job["world_size"]
        if not n or not job.get("step_s") or not job.get("samples_per_s"):
            return
        pt = ProfilePoint(n, float(job["samples_per_s"]), float(job["step_s"]),
                          float(job["compute_s"]), float(job["wait_s"]))
        self.points[n] = pt
        self._size_since = (gen, now)
        self._refit()

    def _explore(self, now: float, lo: int, hi: int) -> None:
        """No model yet (a profile aborted, or one usable size): once the current size is
        measured, move to the nearest size not measured yet (larger first), held like a
        decision."""
        d = self.driver
        current = d.ring().world_size
        if current not in self.points or now - self._decided_at < self.policy.hold_s:
            return
        todo = [n for n in range(lo, hi + 1) if n not in self.points]
        if not todo:
            return
        want = min(todo, key=lambda n: (abs(n - current), -n))
        self._decided_at, self._decided_cap = now, hi
        self.target = want
        d.set_target(want)
        d.telemetry.count("autoscale")
        self._note(f"{current} -> {want} workers to measure a second size (no model yet)",
                   phase="explore", **{"from": current, "to": want, "bounds": [lo, hi]})

    def _refit(self) -> None:
        pts = list(self.points.values())
        if len({p.world_size for p in pts}) < 2:
            return
        try:
            model = SpeedModel().fit(pts)
        except ValueError as e:
            log.info("autoscale: cannot fit the model: %s", e)
            return
        with self._lock:
            self.model = model

    def _stall_s(self) -> float:
        stalls = [s for _, kind, s in self.driver.telemetry.stalls() if kind == "failure"]
        return sum(stalls) / len(stalls) if stalls else DEFAULT_STALL_S

    def _decide(self, now: float, lo: int, hi: int) -> None:
        d = self.driver
        with self._lock:
            model = self.model
        stall = self._stall_s()
        want = decide(model, self.policy, lo, hi, stall)
        current = d.ring().world_size
        self._decided_at, self._decided_cap = now, hi
        if want == self.target:
            return
        pred = prediction(model, self.policy, want, stall)
        if self.policy.objective == "cost":
            why = (f"lowest predicted cost per sample in [{lo}, {hi}] "
                   f"({pred.get('cost_per_million_samples')} per million samples, "
                   f"{pred.get('lost_s_per_hour')} s/h lost to revocations)")
        elif want < hi:
            why = (f"one more worker would add {model.marginal_efficiency(want):.2f} of a lone "
                   f"worker's throughput (< {self.policy.efficiency:g})")
        else:
            why = (f"every worker up to {want} adds >= {self.policy.efficiency:g} of a lone "
                   f"worker's throughput; the usable slots end at {hi}")
        self.target = want
        d.set_target(want)
        rec = {"time": time.time(), "from": current, "to": want, "bounds": [lo, hi],
               "predicted_samples_per_s": pred["samples_per_s"], "prediction": pred,
               "reason": why}
        with self._lock:
            self.decisions.append(rec)
        d.telemetry.count("autoscale")
        move = f"holds {want} workers" if want == current else f"{current} -> {want} workers"
        self._note(f"{move}, predicted {pred['samples_per_s']:.1f} "
                   f"samples/s: {why}", phase="decision", **{k: rec[k] for k in (
                       "from", "to", "bounds", "predicted_samples_per_s", "prediction")})

    def _note(self, text: str, **fields) -> None:
        self.driver.note("autoscale", text, objective=self.policy.objective, **fields)

    # ---- status --------------------------------------------------------------------------------

    def status(self) -> dict:
        """``{"objective", "phase", "target", "prediction" (at the current size), "decisions"
        (the last five)}`` for ``hvd-edl-ctl status``."""
        with self._lock:
            model, decisions = self.model, list(self.decisions[-5:])
        out = {"objective": self.policy.objective, "phase": self.phase, "target": self.target,
               "efficiency": self.policy.efficiency or None, "decisions": decisions,
               "prediction": None}
        if model is not None:
            n = self.driver.ring().world_size or (self.target or 1)
            out["prediction"] = prediction(model, self.policy, n, self._stall_s())
        return out
