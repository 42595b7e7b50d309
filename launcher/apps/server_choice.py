"""``hvd-edl-run --autoscale time|cost --samples N``: the job's GPU type and number chosen at
start among the hosts of a typed ``--hostfile`` (``host:slots type=NAME [price=D] [spot]``),
the same choice the cluster service's ``typed`` policy makes (:mod:`launcher.cluster.choice`,
CM-DARE's): ``time`` the soonest within ``--budget``, ``cost`` the cheapest within
``--deadline``, expected revocations of spot hosts counted (``--revocation-risk``, default
GCE's lifetimes).  The job's speed per type and size comes from ``--speed-profile``
(``{"t4": {"1": 50, "2": 96}}``, samples/s, e.g. measured with ``hvd-edl-ctl profile`` on each
type), other types scaled by the price table's ``tflops``.  The job then runs on the chosen
hosts only, at the chosen size; the choice is printed with its predicted time and cost.

Without ``--samples``, ``--autoscale cost`` is the per-sample cost autoscaler of
:mod:`launcher.apps.autoscale` (one type, sizes only).
"""
from __future__ import annotations

import json
import math
import time
from typing import Dict, List, Optional, Tuple

from launcher.cluster import speed as speed_
from launcher.cluster.choice import Goal, Offer, Prediction, choose
from launcher.cluster.policy import fill_hosts
from launcher.discovery.hosts import HostLine
from launcher.discovery.prices import RiskTable, host_terms, read_prices


def choose_hosts(lines: Dict[str, HostLine], objective: str, samples: float,
                 deadline: Optional[float], budget: Optional[float], min_np: int, max_np: int,
                 prices_path: Optional[str] = None, risk_path: Optional[str] = None,
                 profile_path: Optional[str] = None, types: Tuple[str, ...] = (),
                 commit_s: float = 2.0, start_s: float = 10.0
                 ) -> Tuple[Dict[str, int], Prediction]:
    """The hosts (host -> slots) and the :class:`Prediction` for the job (module docstring);
    ``deadline``: seconds from now, or a unix time when >= 1e9.

    Raises:
        ValueError: one line: no --samples, the other objective's limit (--deadline with
            time, --budget with cost), a deadline not finite or already past, a budget not
            positive,
            an unknown type, an unreadable table or profile, no known speed, nothing fits the
            bounds."""
    from launcher.discovery.prices import TableError
    if not (samples and samples > 0):
        raise ValueError(f"--autoscale {objective} needs --samples N (the job's work in "
                         f"samples) and a typed --hostfile")
    wrong = {"time": ("--deadline", deadline, "cost"),
             "cost": ("--budget", budget, "time")}.get(objective)
    if wrong and wrong[1] is not None:  # the other objective's limit: it would be ignored
        raise ValueError(f"{wrong[0]} goes with --autoscale {wrong[2]}, not {objective} "
                         f"(time: the soonest within --budget; cost: the cheapest by "
                         f"--deadline)")
    deadline_at = None
    if deadline is not None:
        if not math.isfinite(deadline):
            raise ValueError(f"--deadline {deadline:g}: not a finite number of seconds")
        deadline_at = deadline if deadline >= 1e9 else time.time() + deadline
        if not deadline_at > time.time():
            raise ValueError(f"--deadline {deadline:g} is already past")
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"--budget needs a positive number of dollars, got {budget:g}")
    try:
        prices = read_prices(prices_path) if prices_path else {}
        risk = RiskTable.read(risk_path) if risk_path else RiskTable()
    except TableError as e:
        raise ValueError(str(e)) from None
    terms = host_terms(lines, prices, risk)
    known = {t.gpu_type for t in terms.values() if t.gpu_type} | set(prices)
    profile = {}
    if profile_path:
        try:
            with open(profile_path) as f:
                profile = json.load(f)
            points = speed_.profile_points(profile)
        except (OSError, ValueError) as e:
            raise ValueError(f"--speed-profile {profile_path}: {e}") from None
    else:
        points = {}
    for t in list(types) + list(profile):
        if t not in known:
            raise ValueError(f"unknown GPU type {t!r} (the hostfile and the price table know: "
                             f"{', '.join(sorted(known)) or 'none'})")
    klass: Dict[Tuple[str, bool], List[str]] = {}
    for h, t in terms.items():
        klass.setdefault((t.gpu_type or "", t.spot), []).append(h)
    offers = [Offer(t, sum(lines[h].slots or 1 for h in hosts),
                    max(terms[h].price or 0.0 for h in hosts),
                    max(terms[h].revocations_per_h for h in hosts),
                    max(terms[h].startup_s for h in hosts), spot)
              for (t, spot), hosts in sorted(klass.items())]
    from launcher.cluster.speed_types import GPU_TFLOPS  # the published figures
    tflops = dict(GPU_TFLOPS, **{t: p.tflops for t, p in prices.items() if p.tflops})
    start = dict(speed_.start_costs(profile), **{"*": start_s})
    pred = choose(Goal(objective, samples, deadline_at, budget, tuple(types)), samples,
                  speed_.typed_speed(points, tflops), offers, time.time(), min_np, max_np,
                  commit_s=commit_s, start_s=start)
    if pred is None:
        raise ValueError("no GPU type of the hostfile has a known speed for this job within "
                         "its sizes (give --speed-profile, and tflops in --prices)")
    free = {h: lines[h].slots or 1 for h in klass[(pred.gpu_type, pred.spot)]}
    return fill_hosts(free, pred.n) or {}, pred
