"""Finish-time fairness of a simulated schedule (Mahajan et al., "Themis: Fair and Efficient GPU
Cluster Scheduling", NSDI 2020).

A job's finish-time fairness is ``rho = JCT shared / JCT alone on 1/N of the cluster``, ``N`` the
number of jobs contending while it was in the system (here the time average, over the rounds
from its submission to its end, of the jobs submitted and not ended: running, queued or
suspended).  ``rho <= 1``: it did at least as well as with its own equal share; a scheduler that
wins on average by starving the big jobs shows a large worst ``rho``.

"Alone on 1/N" is the job at ``max(1, floor(slots / N))`` GPUs (at most its ``max_np``), compact
placement, its reference step time and steps (the trace's batch: the same reference whatever the
policy decided), plus its start cost.
"""
from __future__ import annotations

import statistics
from typing import Dict, Iterable, List, Tuple


def contention(timeline: List[Tuple[float, Dict[str, int], int]], submitted_at: float,
               finished_at: float) -> float:
    """Time-average number of jobs in the system over ``[submitted_at, finished_at]`` from a
    simulation's ``timeline`` (per round: time, slots per running job, jobs queued); at least 1."""
    pts = [(t, len(a) + q) for t, a, q in timeline if submitted_at <= t <= finished_at]
    if not pts:
        return 1.0
    if len(pts) == 1:
        return max(1.0, float(pts[0][1]))
    area = sum((t1 - t0) * n for (t0, n), (t1, _) in zip(pts, pts[1:]))
    return max(1.0, area / (pts[-1][0] - pts[0][0]))


def finish_time_fairness(result, reference: Iterable, slots: int, host_slots: int,
                         start_cost_s: float) -> Dict:
    """Per-job ``rho`` and its worst and median for a :class:`launcher.cluster.simulator.SimResult`
    simulated with ``timeline=True``.  ``reference``: the jobs' fixed-batch
    :class:`~launcher.cluster.simulator.SimJob` objects (their ``step_time``, ``total_steps``,
    ``max_np``: the job alone); ``slots`` the pool's, ``host_slots`` per host, ``start_cost_s``
    what a start costs.  Returns ``{"rho": {job: rho}, "worst": rho, "median": rho}``;
    ValueError (one line) without a timeline."""
    from launcher.cluster.policies.edl import compact_placement
    if not result.timeline:
        raise ValueError("finish-time fairness needs a simulation run with timeline=True")
    ref = {j.id: j for j in reference}
    rho = {}
    for jid, r in result.jobs.items():
        if r.finished_at is None or jid not in ref:
            continue
        j = ref[jid]
        n = contention(result.timeline, r.submitted_at, r.finished_at)
        g = max(1, min(j.max_np, int(slots // n)))
        alone = start_cost_s + j.total_steps * j.step_time(compact_placement(g, host_slots))
        rho[jid] = r.jct_s / alone
    vals = list(rho.values())
    return {"rho": rho, "worst": max(vals) if vals else 0.0,
            "median": statistics.median(vals) if vals else 0.0}
