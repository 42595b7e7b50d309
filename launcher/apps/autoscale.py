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

``--autoscale-profile FILE`` starts from an earlier run's ``profile.json`` instead of profiling.

Margins (a hysteresis band).  A decision acts only when the predicted figure clears the
threshold by more than its own uncertainty: the relative error ``eps`` of a throughput is the
largest of the model's leave-one-size-out error (:func:`launcher.apps.speed_model.loso_mape`,
three sizes or more), the measured spread of repeated measurements at one size (their relative
standard deviation; ``NOISE_DEFAULT`` until a size was measured twice) and ``NOISE_FLOOR``.  A
marginal efficiency m(n) = (T(n+1) - T(n)) / T(1) of the model is uncertain by ``band = eps T(n+1) /
T(1)`` (its errors at neighbouring sizes go together); one of two independent measurements
(the check below) by ``eps sqrt(T(n)^2 + T(n+1)^2) / T(1)``.  The job grows from n while
m(n) >= E + band and shrinks from n while m(n - 1) < E - band, else it stays; ``cost`` moves
only to a size whose predicted cost per sample is lower by more than ``eps sqrt 2``.  Every
decision prints the figures it compared (``one more worker would add 0.483 of a lone worker's
throughput (model 4,043 -> 6,001 samples/s ± 3.1 %); threshold 0.5 + band 0.056: stay``).

Decisions are bounded by [--min-np, --max-np] and the usable slots discovery offers, and held
for ``hold_s`` seconds; a change in the usable slots is decided on at once.  A decision is taken
only once the current size was measured in this stint (so that it can be checked), and it is
checked: once the new size was measured (``measure_s`` seconds of steady training, its point
refreshed), the measured throughputs before and after are judged against the same threshold and
band; a decision that made things worse by more than the noise (for ``efficiency``: the workers
removed added at least E + band, or the workers added added less than E - band; for ``cost``: a
higher measured cost per sample) is undone at once and the size it returned to is held for
``REVERT_HOLDS`` x ``hold_s`` (Horovod has no autoscaler; CM-DARE's models are fitted offline and
their error is reported, not acted upon).  Each decision and check goes to the event log
(``autoscale``, phase "decision" / "check" / "revert", with the predicted samples/s and the
figures) and ``Driver.telemetry.count("autoscale")`` (moves only); ``hvd-edl-ctl status`` shows
the prediction and the last decision.
"""
from __future__ import annotations

import json
import logging
import math
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from launcher.apps.speed_model import ProfilePoint, SpeedModel, loso_mape

log = logging.getLogger(__name__)

HOLD_S = 30.0              # seconds a decision holds before the next one (hysteresis)
PROFILE_S = 5.0            # seconds of measurement per size in the start-up profile
MAX_PROFILE_SIZES = 6      # sizes the start-up profile measures at most (spread evenly)
LOOP_S = 1.0               # seconds between the autoscaler's looks at the job
COMMIT_STEPS = 10          # steps between commits assumed for the work a revocation loses
DEFAULT_STALL_S = 1.0      # a failure switch's stall before one was measured (seconds)
MEASURE_MIN_S = 3.0        # shortest measurement of a held size (seconds; else profile_s)
SETTLE_S = 2.0             # seconds of training at a new size before it is measured
STINT_POINTS = 5           # a size's point is the mean of its last measurements in one stint
NOISE_FLOOR = 0.01         # the least relative error a throughput is given (1 %)
NOISE_DEFAULT = 0.03       # a throughput's relative spread before a size was measured twice
REVERT_HOLDS = 3           # an undone decision's size is held this many hold_s


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
    profile_path: Optional[str] = None

    @property
    def measure_s(self) -> float:
        """Seconds of one measurement of a held size (``profile_s``, at least 3 s)."""
        return max(self.profile_s, MEASURE_MIN_S)


def load_profile(path: str) -> List[ProfilePoint]:
    """The points of a ``profile.json`` (``hvd-edl-ctl profile``, ``--autoscale``).

    Raises:
        ValueError: unreadable, not a profile, or fewer than two sizes (message for people)."""
    try:
        with open(path) as f:
            doc = json.load(f)
        points = [ProfilePoint.from_dict(p) for p in doc["points"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--autoscale-profile {path}: not a readable profile.json "
                         f"({type(e).__name__}: {e})") from None
    if len({p.world_size for p in points}) < 2:
        raise ValueError(f"--autoscale-profile {path}: needs points of two sizes or more, has "
                         f"{sorted({p.world_size for p in points})}")
    return points


def parse_policy(text: str, price_on_demand: Optional[float] = None,
                 price_spot: Optional[float] = None, revocation_rate: Optional[float] = None,
                 hold_s: float = HOLD_S, profile_s: float = PROFILE_S,
                 profile_path: Optional[str] = None) -> Policy:
    """``"efficiency:0.7"`` or ``"cost"`` (with the price flags) as a :class:`Policy`;
    ``profile_path``: a ``profile.json`` to start from instead of a start-up profile.

    Raises:
        ValueError: an unknown objective, E outside (0, 1], cost without a price, a negative
            price or rate, a price / rate flag without ``cost``, or a profile that cannot be
            used (message for people)."""
    if profile_path is not None:
        load_profile(profile_path)
        profile_path = os.path.abspath(profile_path)
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
        return Policy("efficiency", efficiency=e, hold_s=hold_s, profile_s=profile_s,
                      profile_path=profile_path)
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
                      profile_s=profile_s, profile_path=profile_path)
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


# ---- decisions with a margin (pure functions of the model, the sizes and the error) -----------

def _n(x: float) -> str:
    """Samples/s for people: ``4043.2`` -> ``"4,043"``."""
    return f"{x:,.0f}"


def marginal_band(model: SpeedModel, n: int, eps: float) -> Tuple[float, float]:
    """``(m, band)``: the marginal efficiency m(n) of the (n + 1)-th worker and its uncertainty
    when each predicted throughput is uncertain by the relative error ``eps``: ``eps T(n+1) /
    T(1)`` (a fitted model's errors at neighbouring sizes go together, so their difference is
    about as uncertain as one of them; see the module docstring)."""
    t1 = model.samples_per_s(1)
    tn, tn1 = model.samples_per_s(n), model.samples_per_s(n + 1)
    return (tn1 - tn) / t1, eps * max(tn, tn1) / t1


def _next_worker(model: SpeedModel, n: int, e: float, eps: float) -> Tuple[bool, str]:
    """Whether a worker beyond ``n`` clears E + band, and the comparison for people."""
    m, band = marginal_band(model, n, eps)
    grow = m >= e + band
    return grow, (f"one more worker would add {m:.3f} of a lone worker's throughput (model "
                  f"{_n(model.samples_per_s(n))} -> {_n(model.samples_per_s(n + 1))} samples/s "
                  f"± {eps * 100:.1f} %); threshold {e:g} + band {band:.3f}: "
                  + ("add it" if grow else "stay"))


def _last_worker(model: SpeedModel, n: int, e: float, eps: float) -> Tuple[bool, str]:
    """Whether the ``n``-th worker falls below E - band, and the comparison for people."""
    m, band = marginal_band(model, n - 1, eps)
    drop = m < e - band
    return drop, (f"the last of {n} workers adds {m:.3f} of a lone worker's throughput (model "
                  f"{_n(model.samples_per_s(n - 1))} -> {_n(model.samples_per_s(n))} samples/s "
                  f"± {eps * 100:.1f} %); threshold {e:g} - band {band:.3f}: "
                  + ("remove it" if drop else "keep it"))


def efficiency_decision(model: SpeedModel, e: float, lo: int, hi: int, current: int,
                        eps: float) -> Tuple[int, str]:
    """``(size, why)``: from ``current`` workers (moved into [lo, hi] first), grow while the
    next worker adds at least ``e`` + band of a lone worker's throughput, else shrink while the
    last one adds less than ``e`` - band, else stay; ``eps``: the throughputs' relative error.
    ``why`` holds the comparisons that decided, with their figures."""
    start = min(max(current, lo), hi)
    why: List[str] = []
    if start != current:
        why.append(f"{current} workers is outside [{lo}, {hi}]")
    n = start
    while n < hi:
        grow, text = _next_worker(model, n, e, eps)
        if not grow:
            if n > start:
                why.append(text)
            break
        if n == start:
            why.append(text)
        n += 1
    if n > start:
        if n == hi:
            why.append(f"the usable slots and --max-np end at {hi}")
        return n, "; ".join(why)
    while n > lo:
        drop, text = _last_worker(model, n, e, eps)
        if not drop:
            why.append(text)
            break
        if n == start:
            why.append(text)
        n -= 1
    if n == start and start < hi:
        why.insert(len(why) - (1 if start > lo else 0), _next_worker(model, start, e, eps)[1])
    if n < start and n == lo:
        why.append(f"--min-np and the bounds end at {lo}")
    return n, "; ".join(why)


def cost_decision(model: SpeedModel, policy: Policy, lo: int, hi: int, current: int,
                  eps: float, stall_s: float = DEFAULT_STALL_S) -> Tuple[int, str]:
    """``(size, why)``: the size of lowest predicted cost per sample when it is lower than the
    current size's by more than the band ``eps sqrt 2`` (two throughputs, each uncertain by
    ``eps``), else the current size (moved into [lo, hi])."""
    start = min(max(current, lo), hi)
    best = cost_target(model, policy, lo, hi, stall_s)
    c_best, lost = cost_per_sample(model, best, policy, stall_s)
    c_now, _ = cost_per_sample(model, start, policy, stall_s)
    band = eps * math.sqrt(2)
    move = best != start and c_best < c_now * (1 - band)
    want = best if move else start
    why = (f"predicted cost {c_best * 1e6:.6g} per million samples at {best} workers "
           f"({_n(model.samples_per_s(best))} samples/s, {lost:.1f} s/h lost to revocations) "
           f"against {c_now * 1e6:.6g} at {start} ({_n(model.samples_per_s(start))} samples/s) "
           f"± {eps * 100:.1f} %; move when lower by more than band {band * 100:.1f} %: "
           + (f"move to {best}" if move else "stay"))
    if start != current:
        why = f"{current} workers is outside [{lo}, {hi}]; " + why
    return want, why


def measured_cost(policy: Policy, n: int, samples_per_s: float, step_s: float,
                  stall_s: float) -> float:
    """:func:`cost_per_sample` at ``n`` workers with a measured throughput and step time."""
    class _Measured:
        def samples_per_s(self, k):
            return samples_per_s

        def step_s(self, k):
            return step_s
    return cost_per_sample(_Measured(), n, policy, stall_s)[0]


# ---- the running autoscaler ----------------------------------------------------------------------

class Autoscaler:
    """Sizes the job run by ``driver`` (a :class:`launcher.job.driver.Driver`) for ``policy`` in
    a thread of the launcher (:meth:`start`); :meth:`status` is its part of ``hvd-edl-ctl
    status``."""

    def __init__(self, driver, policy: Policy):
        self.driver = driver
        self.policy = policy
        self.model: Optional[SpeedModel] = None
        self.loso: Optional[float] = None     # the model's mean LOSO error (fraction)
        self.points: Dict[int, ProfilePoint] = {}
        self.spreads: Dict[int, float] = {}   # size -> relative std of repeated measurements
        self.decisions: List[dict] = []
        self.target: Optional[int] = None
        self.evaluation: Optional[str] = None  # the last decision's comparisons
        self.phase = "waiting"       # waiting -> profiling -> running (or "off: <why>")
        self._hold_until = -math.inf
        self._decided_cap: Optional[int] = None
        self._check: Optional[dict] = None     # the last move, until it was measured
        # the stint: the current generation, its size, when its next measurement began
        # (monotonic; None: not settled yet) and its measurements (samples/s)
        self._stint_gen = 0
        self._stint_n = 0
        self._mark: Optional[float] = None
        self._stint: List[float] = []
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
        measured = self._learn(now)
        lo, hi = self._bounds()
        if measured and self._check is not None:
            self._verify(now)
            return
        if self.model is None:
            self._explore(now, lo, hi)
            return
        if now < self._hold_until and hi == self._decided_cap:
            return
        if d.profiler.status()["state"] == "running":
            return  # a profile asked for through hvd-edl-ctl moves the job: wait for it
        current = d.ring().world_size
        if not self._stint and lo <= current <= hi:
            return  # decide on a measured size only: the decision is checked against it
        self._decide(now, lo, hi)

    def _profile(self) -> None:
        if self.policy.profile_path:
            self.points = {p.world_size: p for p in load_profile(self.policy.profile_path)}
            self._refit()
            self.phase = "running"
            self._note(f"speed model from {self.policy.profile_path} (sizes "
                       f"{', '.join(map(str, sorted(self.points)))}): no start-up profile",
                       phase="profile", sizes=sorted(self.points))
            return
        lo, hi = self._bounds()
        sizes = list(range(lo, hi + 1))
        if len(sizes) > MAX_PROFILE_SIZES:
            step = (len(sizes) - 1) / (MAX_PROFILE_SIZES - 1)
            sizes = sorted({lo + round(i * step) for i in range(MAX_PROFILE_SIZES)})
        if len(sizes) < 2:  # one usable size: nothing to choose yet
            sizes = [lo]
        try:
            self.driver.profiler.start(sizes, self.policy.profile_s, out_dir=self.out_dir())
            self.phase = "profiling"
            self._note(f"profiling sizes {', '.join(map(str, sizes))} to fit the speed model",
                       phase="profile", sizes=sizes)
        except ValueError as e:
            self.phase = f"off: {e}"
            self._note(f"cannot profile ({e}): autoscaling off", phase="off")

    def out_dir(self) -> str:
        """Where the start-up profile goes: beside the ``--event-log``, else a folder of this
        launcher in the temporary folder (the profiler never overwrites a profile there)."""
        log_path = self.driver.spec.event_log
        if log_path:
            return os.path.dirname(os.path.abspath(log_path))
        return os.path.join(tempfile.gettempdir(), f"hvd-edl-{os.getpid()}")

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

    def _learn(self, now: float) -> bool:
        """Measure the size held now: every ``measure_s`` seconds of settled training (after
        ``SETTLE_S``) the job's throughput over that span refreshes its point (the mean of the
        stint's last ``STINT_POINTS`` measurements) and its spread.  True when it measured."""
        d = self.driver
        ring = d.ring()
        if ring.generation != self._stint_gen:  # a new stint: nothing measured in it yet
            self._stint_gen, self._stint_n, self._stint = ring.generation, ring.world_size, []
            self._mark = None
        if not ring.settled or not ring.world_size:
            self._mark = None
            return False
        if self._mark is None:
            self._mark = now + SETTLE_S
            return False
        if now - self._mark < self.policy.measure_s:
            return False
        try:
            thr = d.telemetry.throughput(self._mark, now)
        except ValueError:
            self._mark = now
            return False
        self._mark = now
        n = self._stint_n
        self._stint.append(thr)
        recent = self._stint[-STINT_POINTS:]
        mean = statistics.fmean(recent)
        if len(recent) >= 2:
            self.spreads[n] = statistics.stdev(recent) / mean
        job = d.telemetry.job()

        def num(key):
            v = job.get(key)
            return math.nan if v is None else float(v)
        self.points[n] = ProfilePoint(n, mean, num("step_s"), num("compute_s"), num("wait_s"))
        self._refit()
        return True

    def _explore(self, now: float, lo: int, hi: int) -> None:
        """No model yet (a profile aborted, or one usable size): once the current size is
        measured, move to the nearest size not measured yet (larger first), held like a
        decision."""
        d = self.driver
        current = d.ring().world_size
        if current not in self.points or now < self._hold_until:
            return
        todo = [n for n in range(lo, hi + 1) if n not in self.points]
        if not todo:
            return
        want = min(todo, key=lambda n: (abs(n - current), -n))
        self._hold_until, self._decided_cap = now + self.policy.hold_s, hi
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
            errs = loso_mape(pts)
        except ValueError as e:
            log.info("autoscale: cannot fit the model: %s", e)
            return
        with self._lock:
            self.model = model
            self.loso = statistics.fmean(errs.values()) / 100.0 if errs else None

    def eps(self) -> float:
        """The relative error given to a throughput (see the module docstring): the largest of
        the model's LOSO error, the measured spread (mean over the sizes measured twice or
        more; ``NOISE_DEFAULT`` before) and ``NOISE_FLOOR``."""
        spread = statistics.fmean(self.spreads.values()) if self.spreads else NOISE_DEFAULT
        return max(NOISE_FLOOR, spread, self.loso or 0.0)

    def _stall_s(self) -> float:
        stalls = [s for _, kind, s in self.driver.telemetry.stalls() if kind == "failure"]
        return sum(stalls) / len(stalls) if stalls else DEFAULT_STALL_S

    def _decide(self, now: float, lo: int, hi: int) -> None:
        d = self.driver
        with self._lock:
            model = self.model
        stall, eps = self._stall_s(), self.eps()
        current = d.ring().world_size
        if self.policy.objective == "efficiency":
            want, why = efficiency_decision(model, self.policy.efficiency, lo, hi, current, eps)
        else:
            want, why = cost_decision(model, self.policy, lo, hi, current, eps, stall)
        self._hold_until, self._decided_cap = now + self.policy.hold_s, hi
        first = self.evaluation is None
        self.evaluation = why
        if want == self.target and not first:
            return
        pred = prediction(model, self.policy, want, stall)
        self.target = want
        d.set_target(want)
        before = statistics.fmean(self._stint[-STINT_POINTS:]) if self._stint else None
        rec = {"time": time.time(), "from": current, "to": want, "bounds": [lo, hi],
               "predicted_samples_per_s": pred["samples_per_s"], "prediction": pred,
               "eps": round(eps, 4), "measured_samples_per_s": before, "reason": why}
        with self._lock:
            self.decisions.append(rec)
        if want != current:
            d.telemetry.count("autoscale")
            step = job_step_s(d)
            self._check = {"from": current, "to": want, "before": before,
                           "before_step_s": step, "predicted": pred["samples_per_s"]}
        move = f"stays at {want} workers" if want == current else \
            f"{current} -> {want} workers"
        self._note(f"{move}, predicted {_n(pred['samples_per_s'])} samples/s: {why}",
                   phase="decision", **{k: rec[k] for k in (
                       "from", "to", "bounds", "predicted_samples_per_s", "prediction", "eps",
                       "measured_samples_per_s")})

    def _verify(self, now: float) -> None:
        """The last move's new size was just measured: judge the throughputs measured before
        and after it against the policy's threshold and band; undo it if it made things worse
        by more than the noise, and hold the size it returns to."""
        d = self.driver
        c, self._check = self._check, None
        a, b, m_a = c["from"], c["to"], c["before"]
        if self._stint_n != b or m_a is None:
            return  # the job moved elsewhere meanwhile (a failure, discovery): not this check
        m_b = statistics.fmean(self._stint[-STINT_POINTS:])
        eps = self.eps()
        head = (f"check of {a} -> {b} workers: measured {_n(m_a)} samples/s at {a}, "
                f"{_n(m_b)} at {b} (predicted {_n(c['predicted'])}, ± {eps * 100:.1f} %)")
        if self.policy.objective == "efficiency":
            e, k = self.policy.efficiency, abs(a - b)
            with self._lock:
                model = self.model
            t1 = m_b if b == 1 else m_a if a == 1 else model.samples_per_s(1)
            mm = (m_a - m_b) / (k * t1) if b < a else (m_b - m_a) / (k * t1)
            band = eps * math.hypot(m_a, m_b) / (k * t1)
            worse = mm >= e + band if b < a else mm < e - band
            what = (f"the {k} worker(s) removed added {mm:.3f} of a lone worker's throughput "
                    f"each; threshold {e:g} + band {band:.3f}") if b < a else \
                (f"the {k} worker(s) added add {mm:.3f} of a lone worker's throughput each; "
                 f"threshold {e:g} - band {band:.3f}")
        else:
            stall = self._stall_s()
            step_b = job_step_s(d)
            c_a = measured_cost(self.policy, a, m_a, c["before_step_s"] or 0.0, stall)
            c_b = measured_cost(self.policy, b, m_b, step_b or 0.0, stall)
            band = eps * math.sqrt(2)
            worse = c_b > c_a * (1 + band)
            what = (f"measured cost {c_b * 1e6:.6g} per million samples at {b} against "
                    f"{c_a * 1e6:.6g} at {a}; band {band * 100:.1f} %")
        if not worse:
            self._note(f"{head}: {what}: kept", phase="check", **{
                "from": a, "to": b, "measured": [m_a, m_b], "eps": round(eps, 4)})
            return
        hold_s = REVERT_HOLDS * self.policy.hold_s
        self.target = a
        d.set_target(a)
        d.telemetry.count("autoscale")
        lo, hi = self._bounds()
        self._hold_until, self._decided_cap = now + hold_s, hi
        why = f"{head}: {what}: the decision made things worse; back to {a}, held {hold_s:g} s"
        self.evaluation = why
        rec = {"time": time.time(), "from": b, "to": a, "bounds": [lo, hi],
               "predicted_samples_per_s": m_a, "measured": [m_a, m_b], "eps": round(eps, 4),
               "reason": why, "revert": True}
        with self._lock:
            self.decisions.append(rec)
        self._note(f"{b} -> {a} workers, undone: {why}", phase="revert", **{
            k: rec[k] for k in ("from", "to", "bounds", "predicted_samples_per_s", "measured",
                                "eps")})

    def _note(self, text: str, **fields) -> None:
        self.driver.note("autoscale", text, objective=self.policy.objective, **fields)

    # ---- status --------------------------------------------------------------------------------

    def status(self) -> dict:
        """``{"objective", "phase", "target", "prediction" (at the current size), "decisions"
        (the last five), "evaluation" (the last decision's comparisons), "eps"}`` for
        ``hvd-edl-ctl status``."""
        with self._lock:
            model, decisions = self.model, list(self.decisions[-5:])
        out = {"objective": self.policy.objective, "phase": self.phase, "target": self.target,
               "efficiency": self.policy.efficiency or None, "decisions": decisions,
               "prediction": None, "evaluation": self.evaluation, "eps": round(self.eps(), 4)}
        if model is not None:
            n = self.driver.ring().world_size or (self.target or 1)
            out["prediction"] = prediction(model, self.policy, n, self._stall_s())
        return out


def job_step_s(driver) -> Optional[float]:
    """The members' mean seconds per step now (telemetry), None when unknown."""
    v = driver.telemetry.job().get("step_s")
    return None if v is None else float(v)
