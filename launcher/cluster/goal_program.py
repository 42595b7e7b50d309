"""Jobs with an objective (``submit --objective time|cost``) in the round's program
(:mod:`launcher.cluster.round_program`), beside the jobs without one (issue 42, section 3).

CM-DARE (Li, Walls, Guo, arXiv 2004.03072) chooses one job's servers on its own: the type and
number that finish soonest within a budget, or cheapest within a deadline
(:func:`launcher.cluster.choice.choose`).  On a shared pool that rule, applied one job at a time
to the slots free now, takes what is free when the chosen type is busy, never weighs waiting,
and never mixes types.  Here each waiting job with an objective is a row of the same program the
other jobs are in:

* its **configurations** are the round's (``n`` workers of one class, type and spot; or of two
  classes where :func:`launcher.cluster.mixed_types.mixed_pays`), each predicted as CM-DARE
  predicts (:func:`config_prediction`: a mixed ring trains at its slowest type's speed, costs
  each worker's price, is revoked at the sum of its spot workers' rates);
* **waiting** is an option too (:func:`wait_options`): ``n`` slots of a class busy now free
  when the running jobs on them are predicted to finish (their remaining samples over their
  speed; a job whose end is not predictable never frees them, as far as the round knows); the
  job then starts there, so its time is the wait plus that configuration's;
* the configurations the program may give it (:func:`goal_values`) are the ones its objective
  ranks at least as well as its best wait (:func:`launcher.cluster.choice.rank_key`: a job whose
  chosen type is busy waits for it when waiting finishes sooner, or costs less within the
  deadline); where some fit its limit, those that do not count :data:`NOT_FIT_WEIGHT` of
  their value (taken only when the round gives the ones that fit to others, and no wait is
  predicted to do better);
* each one's **value** is ``(1 / T_best) x (m_best / m)``: the job's best configuration counts
  ``1 / T`` as any job's in the program (so the program trades the rows off in one unit:
  completions per second), a configuration less good for the objective less, in proportion
  to its metric ``m`` (time for ``time``: the value is then exactly ``1 / T``; cost for
  ``cost``).

A start's time depends on how many workers start at once on the shared machines (their imports
and ring set-ups share the CPUs): a job's start is read at the number of workers starting
together, its own plus others' (:func:`launcher.cluster.choice.start_of` reads the sizes of a
``start_s`` mapping that way; measured for 1 and for k at once by the benchmark that uses it).
Pure functions.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from launcher.cluster.choice import Goal, Offer, Prediction, pick, predict, rank_key, start_of

Klass = Tuple[str, bool]  # (GPU type, spot)
Config = Mapping[Klass, int]
NOT_FIT_WEIGHT = 1e-3
"""A configuration outside the job's limit, where some are within it: this share of its value."""
QUEUE_TIE = 1e-4
"""Between equal rows, the earlier in the queue is preferred by this share of its value."""


def config_prediction(remaining: float, speed_of, parts: Config,
                      offers: Mapping[Klass, Offer], start=0.0, starting: int = 0,
                      spent_usd: float = 0.0, commit_s: float = 2.0, switch_s: float = 0.5,
                      notice: bool = False, stay: bool = False) -> Optional[Prediction]:
    """CM-DARE's time and cost (:func:`launcher.cluster.choice.predict`) of finishing
    ``remaining`` samples on ``parts`` (class -> workers; one class, or several: a mixed ring).

    Args:
        speed_of: samples/s of ``n`` workers of one type, ``(type, n) -> float | None``.
        offers: each class's terms (price per GPU-hour, revocations per hour per GPU, a
            replacement host's start-up, seconds); a class missing: None is returned.
        start: the job's start, seconds or per type and number starting at once
            (:func:`launcher.cluster.choice.start_of`).
        starting: other workers starting at the same time (their starts share the CPUs).
        spent_usd, commit_s, switch_s, notice: as :func:`launcher.cluster.choice.predict`.
        stay: the job runs there already (no start; a replacement's start still counts).

    Returns:
        the prediction (``parts`` set for a mixed ring; ``gpu_type`` its types joined by
        ``+``), or None where a speed is unknown or revocations eat the time.
    """
    parts = {k: n for k, n in parts.items() if n > 0}
    if not parts or any(k not in offers for k in parts):
        return None
    n = sum(parts.values())
    types = sorted({t for t, _ in parts})

    def ring(m: int) -> Optional[float]:  # the ring runs at its slowest type's speed at m
        if m <= 0:
            return 0.0
        speeds = [speed_of(t, m) for t in types]
        return None if any(s is None for s in speeds) else min(speeds)

    start_s = 0.0 if stay else max(start_of(start, t, n + starting) for t in types)
    join_s = max(start_of(start, t, 1 + starting) for t in types)
    if len(parts) == 1:
        (k, _), = parts.items()
        offer = offers[k]
    else:
        spot = [k for k in parts if k[1]]
        offer = Offer("+".join(types), n,
                      sum(offers[k].price * m for k, m in parts.items()) / n,
                      sum(offers[k].revocations_per_h * m for k, m in parts.items()) / n,
                      max((offers[k].startup_s for k in spot or parts), default=0.0),
                      bool(spot))
    p = predict(remaining, ring, n, offer, commit_s, switch_s, start_s, notice, spent_usd,
                join_s=join_s)
    if p is None or len(parts) == 1:
        return p
    label = tuple(sorted(((t, s, m) for (t, s), m in parts.items()),
                         key=lambda x: (-x[2], x[0], x[1])))
    return Prediction(p.gpu_type, p.n, p.time_s, p.cost_usd, p.revocations, spot=p.spot,
                      parts=label)


def free_after(n: int, free_now: int, releases: Sequence[Tuple[float, int]]) -> Optional[float]:
    """Seconds until ``n`` slots of a class are free: ``free_now`` now, then each
    ``(seconds, slots)`` of ``releases`` as it comes; None when they never add up to ``n``."""
    have = free_now
    if have >= n:
        return 0.0
    for at, k in sorted(releases):
        have += k
        if have >= n:
            return max(0.0, at)
    return None


def wait_options(remaining: float, speed_of, sizes: Iterable[int],
                 offers: Mapping[Klass, Offer], free: Mapping[Klass, int],
                 releases: Mapping[Klass, Sequence[Tuple[float, int]]], **kw
                 ) -> List[Prediction]:
    """Waiting for busy slots: for each class with ``releases`` (seconds from now, slots:
    running jobs predicted to end) and each size in ``sizes`` that is not free now, the
    prediction of starting there once enough slots are free (:func:`free_after`): its time is
    the wait plus the configuration's (:func:`config_prediction`, ``kw`` its arguments), its
    ``wait_s`` the wait; nothing is paid while waiting."""
    out = []
    for k, rel in releases.items():
        if k not in offers:
            continue
        for n in sizes:
            w = free_after(n, free.get(k, 0), rel)
            if w is None or w <= 0:
                continue
            p = config_prediction(remaining, speed_of, {k: n}, offers, **kw)
            if p is not None:
                out.append(Prediction(p.gpu_type, p.n, p.time_s + w, p.cost_usd,
                                      p.revocations, spot=p.spot, wait_s=w))
    return out


def goal_values(goal: Goal, now: float, preds: Sequence[Optional[Prediction]],
                waits: Sequence[Prediction]) -> Tuple[List[float], Optional[Prediction]]:
    """One job's row of the program (the module's docstring).

    Args:
        goal: the job's objective and limit.
        now: unix seconds (the deadline's clock).
        preds: per configuration of the round, its prediction if the job runs there from now
            (None: it cannot).
        waits: its options of waiting (:func:`wait_options`).

    Returns:
        (values, best): per configuration its value, 0 where the program may not give it;
        ``best`` the job's best option overall with its ``why`` (a wait, when every value is
        0 because waiting is better; None when it has no option at all).
    """
    best_wait = min(waits, key=lambda p: rank_key(goal, p, now), default=None)
    wait_key = rank_key(goal, best_wait, now) if best_wait is not None else None
    ok = [i for i, p in enumerate(preds) if p is not None
          and (wait_key is None or rank_key(goal, p, now) <= wait_key)]
    some_fit = any(rank_key(goal, preds[i], now)[0] == 0 for i in ok)
    values = [0.0] * len(preds)
    best = pick(goal, [p for p in preds if p is not None] + list(waits), now)
    if not ok:
        return values, best
    order = sorted(ok, key=lambda i: rank_key(goal, preds[i], now))
    for fit in (0, 1):  # the ones within the limit, then the others (their own reference)
        group = [i for i in order if rank_key(goal, preds[i], now)[0] == fit]
        if not group:
            continue
        ref = preds[group[0]]
        m_ref = rank_key(goal, ref, now)[1]
        weight = NOT_FIT_WEIGHT if fit and some_fit else 1.0
        for rank, i in enumerate(group):
            m = rank_key(goal, preds[i], now)[1]
            ratio = 1.0 if m <= 0 or m_ref <= 0 else m_ref / m
            # ties (e.g. free types: every cost 0) go to the better rank, by a hair
            values[i] = weight * ratio / max(ref.time_s, 1e-9) * (1.0 - 1e-6 * rank)
    return values, best


def running_releases(jobs, klass: Mapping[str, Klass], now: float
                     ) -> Dict[Klass, List[Tuple[float, int]]]:
    """When the running jobs' slots free, per class: ``(seconds from now, slots)`` for each
    running job with an objective and a known speed on its classes (its remaining samples over
    its ring's speed); jobs without either never free theirs, as far as a round knows."""
    out: Dict[Klass, List[Tuple[float, int]]] = {}
    for j in jobs:
        if not j.allocation or not j.goal or j.speed_of is None:
            continue
        parts: Dict[Klass, int] = {}
        for h, k in j.allocation.items():
            if h in klass:
                parts[klass[h]] = parts.get(klass[h], 0) + k
        n = sum(parts.values())
        speeds = [j.speed_of(t, n) for t, _ in parts]
        if not n or any(not s for s in speeds):
            continue
        left = max(0.0, float(j.goal.get("samples") or 0.0)
                   - float(j.goal.get("done_samples") or 0.0))
        t = left / min(speeds)
        if not math.isfinite(t):
            continue
        for k, m in parts.items():
            out.setdefault(k, []).append((t, m))
    return out
