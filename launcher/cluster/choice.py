"""Choosing a job's GPU type and number for an objective (CM-DARE, Li, Walls, Guo, arXiv
2004.03072: predict training speed per server type and cluster size, then choose the servers
that train fastest within a budget or cheapest within a deadline, revocations counted).

``hvd-edl-cluster submit --objective time|cost [--deadline S] [--budget DOLLARS] --samples N``:
the job has ``N`` samples of work (epochs x the dataset).  For each GPU type the pool offers
and each size ``n`` in the job's bounds, :func:`predict` gives the time and cost to finish:

* ``T0 = remaining / speed(type, n)`` from the job's speed on that type and size (measured as
  it runs, :mod:`launcher.cluster.speed`; before that its ``--speed-profile``, or another
  type's measurements scaled by the types' TFLOPS);
* on transient (``spot``) hosts, revocations arrive at ``lambda = rate x n`` per hour
  (:mod:`launcher.discovery.prices`: the operator's table, GCE's lifetimes by default), each
  costing ``loss = lost work + switch + stall x (1 - speed(n-1)/speed(n))``: the work since
  the last commit (none with a notice: the workers leave at a commit; on one GPU, where the one
  worker held the committed state in its memory, all the work so far: ``T0 / 2`` on average,
  as Horovod's in-memory commits survive only in a surviving worker), a stop-free switch, and
  the replacement's stall, during which the job trains one host short: the replacement host's
  start-up (a VM's boot: CM-DARE 69-92 s; the offer's ``startup_s``) plus the job's own worker
  start on it (its imports and joining the ring: the job's start on that type), less the
  notice (the replacement starts while the revoked host still trains); so
  ``T = start + T0 / (1 - lambda x loss / 3600)``;
* ``cost = price x n x T / 3600`` (price per GPU-hour), plus what the job spent so far.

``time``: the shortest ``T`` whose cost stays within the budget (any cost without one);
``cost``: the lowest cost whose ``T`` meets the deadline (the shortest ``T`` without one is
not asked: the cheapest).  When nothing fits, the closest (least over budget, or soonest past
the deadline) with ``fits = False`` and why.  Pure functions: the cluster policy
(:mod:`launcher.cluster.policies.typed`) and the benchmark call the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional, Tuple

OBJECTIVES = ("time", "cost")
MAX_REVOCATION_SHARE = 0.9  # a size whose revocations eat more of its time than this: refused


@dataclass(frozen=True)
class Goal:
    """What a job asked for: ``objective`` ("time" or "cost"), ``samples`` of work in all,
    ``deadline_at`` (unix seconds; None: none), ``budget_usd`` (None: none), ``types``
    (allowed GPU types; empty: any)."""
    objective: str
    samples: float
    deadline_at: Optional[float] = None
    budget_usd: Optional[float] = None
    types: Tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {"objective": self.objective, "samples": self.samples,
                "deadline_at": self.deadline_at, "budget_usd": self.budget_usd,
                "types": list(self.types)}

    @classmethod
    def from_dict(cls, d: dict) -> "Goal":
        return cls(d["objective"], float(d["samples"]), d.get("deadline_at"),
                   d.get("budget_usd"), tuple(d.get("types") or ()))


@dataclass(frozen=True)
class Offer:
    """One GPU type as a job may use it now: ``slots`` it could hold, ``price`` dollars per
    GPU-hour, ``revocations_per_h`` per GPU (0: on demand), ``startup_s`` of a replacement
    host."""
    gpu_type: str
    slots: int
    price: float
    revocations_per_h: float = 0.0
    startup_s: float = 0.0
    spot: bool = False


@dataclass(frozen=True)
class Prediction:
    """A choice and what it predicts: ``gpu_type``, ``n`` workers, ``time_s`` to finish,
    ``cost_usd`` in all (spent so far included), ``revocations`` expected, ``fits`` (within the
    budget / deadline) and ``why`` (one line for ``status``); ``parts`` for a ring over
    several classes, ((type, spot, workers), ...) (``gpu_type`` then joins the types with
    ``+``); ``wait_s`` when the choice is to wait that long for busy slots of its type (part of
    ``time_s``: :mod:`launcher.cluster.goal_program`)."""
    gpu_type: str
    n: int
    time_s: float
    cost_usd: float
    revocations: float
    fits: bool = True
    why: str = ""
    spot: bool = False
    parts: Tuple[Tuple[str, bool, int], ...] = ()
    wait_s: float = 0.0

    def as_dict(self) -> dict:
        d = {"type": self.gpu_type, "spot": self.spot, "n": self.n,
             "time_s": round(self.time_s, 3), "cost_usd": round(self.cost_usd, 6),
             "revocations": round(self.revocations, 4), "fits": self.fits, "why": self.why}
        if self.parts:
            d["parts"] = [{"type": t, "spot": s, "n": k} for t, s, k in self.parts]
        if self.wait_s:
            d["wait_s"] = round(self.wait_s, 2)
        return d

    @property
    def label(self) -> str:
        """``2 x t4 spot``; ``1 x a100 + 1 x t4 spot`` for a mixed ring."""
        if self.parts:
            return " + ".join(f"{k} x {t}{' spot' if s else ''}" for t, s, k in self.parts)
        return f"{self.n} x {self.gpu_type}{' spot' if self.spot else ''}"


def predict(remaining: float, speed: Callable[[int], Optional[float]], n: int, offer: Offer,
            commit_s: float = 1.0, switch_s: float = 0.5, start_s: float = 0.0,
            notice: bool = False, spent_usd: float = 0.0, join_s: Optional[float] = None,
            notice_s: float = 0.0) -> Optional[Prediction]:
    """Time and cost to finish ``remaining`` samples on ``n`` GPUs of ``offer`` (module
    docstring); ``speed(n)``: samples/s at ``n`` (None: unknown); ``commit_s``: the job's
    commit period (the work a revocation without notice loses); ``switch_s``: a stop-free
    switch; ``start_s``: the job's own start (0 for a running job); ``join_s``: a replacement
    worker's start on this type, seconds (None: ``start_s``); ``notice``: revocations come with
    a notice (no work lost); ``notice_s``: its length, seconds (the replacement starts within
    it; > 0 implies ``notice``).  None when the speed is unknown or revocations would eat
    more than :data:`MAX_REVOCATION_SHARE` of the time."""
    thr = speed(n)
    if not thr or thr <= 0:
        return None
    t0 = max(0.0, remaining) / thr
    lam = offer.revocations_per_h * n
    revs = 0.0
    t = t0
    if lam > 0:
        short = speed(n - 1) if n > 1 else 0.0
        stall = max(0.0, offer.startup_s + (start_s if join_s is None else join_s) - notice_s)
        if notice or notice_s > 0:
            lost = 0.0
        elif n == 1:  # its one worker held the committed state: all its work, half on average
            lost = t0 / 2.0
        else:
            lost = commit_s
        loss = lost + switch_s + stall * (1.0 - min(1.0, (short or 0.0) / thr))
        share = lam * loss / 3600.0
        if share >= MAX_REVOCATION_SHARE:
            return None
        t = t0 / (1.0 - share)
        revs = lam * t / 3600.0
    t += start_s
    cost = spent_usd + offer.price * n * t / 3600.0
    return Prediction(offer.gpu_type, n, t, cost, revs, spot=offer.spot)


def start_of(start, gpu_type: str, n: int) -> float:
    """A job's start in seconds on ``n`` GPUs of ``gpu_type``: ``start`` is seconds, or a
    mapping type -> seconds or type -> {size: seconds} (JSON: sizes as strings; a size not
    given takes the nearest given one's, the smaller on a tie) with ``"*"`` for the others."""
    if not isinstance(start, dict):
        return float(start)
    s = start.get(gpu_type, start.get("*", 0.0))
    if not isinstance(s, dict):
        return float(s)
    if not s:
        return float(start.get("*", 0.0))
    sizes = sorted(int(k) for k in s)
    near = min(sizes, key=lambda k: (abs(k - n), k))
    return float(s[str(near)] if str(near) in s else s[near])


def choose(goal: Goal, remaining: float, speed: Callable[[str, int], Optional[float]],
           offers: Iterable[Offer], now: float, min_np: int, max_np: int,
           spent_usd: float = 0.0, **predict_kw) -> Optional[Prediction]:
    """The type and number for ``goal`` (module docstring) among ``offers``, sizes in
    [``min_np``, ``max_np``] and each offer's slots; ``speed(type, n)``: samples/s (None:
    unknown); ``now``: unix seconds (the deadline's clock); ``predict_kw``: :func:`predict`'s
    ``commit_s``, ``switch_s``, ``start_s`` (seconds, or per type, or per type and size:
    :func:`start_of`; one worker's start on a type is also a replacement's there unless
    ``join_s`` is given), ``notice``, ``notice_s``.  None when no offer has a known speed
    at a size that fits the bounds."""
    cands = []
    start = predict_kw.pop("start_s", 0.0)
    for offer in offers:
        if goal.types and offer.gpu_type not in goal.types:
            continue
        kw = dict(predict_kw)
        kw.setdefault("join_s", start_of(start, offer.gpu_type, 1))
        for n in range(max(1, min_np), min(max_np, offer.slots) + 1):
            p = predict(remaining, lambda k, t=offer.gpu_type: speed(t, k), n, offer,
                        spent_usd=spent_usd, start_s=start_of(start, offer.gpu_type, n), **kw)
            if p is not None:
                cands.append(p)
    return pick(goal, cands, now)


def rank_key(goal: Goal, p: Prediction, now: float) -> tuple:
    """How good ``p`` is for ``goal``, lower better (``now``: unix seconds, the deadline's
    clock): the ones that fit first (``time``: cost within the budget; ``cost``: time within
    the deadline), among them the soonest (``time``) or cheapest (``cost``); among those that
    do not fit, the least over budget (``time``) or the soonest (``cost``).  :func:`choose`
    picks the least; the round's program (:mod:`launcher.cluster.goal_program`) compares
    running now with waiting by it."""
    if goal.objective == "time":
        fits = goal.budget_usd is None or p.cost_usd <= goal.budget_usd
        return (0, p.time_s, p.cost_usd, p.gpu_type, p.n) if fits else \
            (1, p.cost_usd, p.time_s, p.gpu_type, p.n)
    fits = goal.deadline_at is None or p.time_s <= goal.deadline_at - now
    return (0, p.cost_usd, p.time_s, p.gpu_type, p.n) if fits else \
        (1, p.time_s, p.cost_usd, p.gpu_type, p.n)


def pick(goal: Goal, cands: Iterable[Prediction], now: float) -> Optional[Prediction]:
    """The best of ``cands`` for ``goal`` (:func:`rank_key`), with ``fits`` and ``why`` set;
    None for no candidates."""
    cands = list(cands)
    if not cands:
        return None
    best = min(cands, key=lambda p: rank_key(goal, p, now))
    fits = rank_key(goal, best, now)[0] == 0
    if goal.objective == "time":
        budget = math.inf if goal.budget_usd is None else goal.budget_usd
        if fits:
            return _with(best, True, f"soonest: {_fig(best)}" + (
                f" within the ${budget:g} budget" if goal.budget_usd is not None else ""))
        return _with(best, False, f"no choice fits the ${budget:g} budget; the cheapest: "
                     f"{_fig(best)}")
    left = math.inf if goal.deadline_at is None else goal.deadline_at - now
    if fits:
        return _with(best, True, f"cheapest: {_fig(best)}" + (
            f" within the deadline ({left:.0f} s left)" if goal.deadline_at is not None
            else ""))
    return _with(best, False, f"no choice meets the deadline ({left:.0f} s left); the "
                 f"soonest: {_fig(best)}")


def _fig(p: Prediction) -> str:
    return ((f"waits {p.wait_s:.0f} s for " if p.wait_s else "")
            + f"{p.label}, {p.time_s:.0f} s, ${p.cost_usd:.4f}"
            + (f", {p.revocations:.2f} revocations expected" if p.revocations else ""))


def _with(p: Prediction, fits: bool, why: str) -> Prediction:
    return replace(p, fits=fits, why=why)


def better(objective: str, a: Prediction, b: Prediction) -> float:
    """How much better ``a`` is than ``b`` for ``objective``: the relative saving of time
    ("time") or cost ("cost"), 1 - a / b (negative: worse)."""
    x, y = (a.time_s, b.time_s) if objective == "time" else (a.cost_usd, b.cost_usd)
    return 1.0 - x / y if y > 0 else 0.0
