"""One elastic data-parallel job on transient (spot) hosts that come and go: Bamboo's AWS spot
availability traces (Thorpe et al., "Bamboo: Making Preemptible Instances Resilient for
Affordable Training of Large DNNs", NSDI 2023) replayed as the job's hosts, with spot and
on-demand prices; stop-free changes against checkpoint-restart per change.

Hosts: ``availability`` (``bamboo/traces/{p3,g4dn}-trace.csv``: ``time_ms,add|remove,node``)
gives the spot hosts present over time (events at one instant are one change; the trace repeats
when the job outlives it).  Each host holds one GPU (p3.2xlarge: one V100; g4dn.xlarge: one T4);
the job's throughput on ``n`` hosts comes from Sia's per-type profiles (V100 ``azure``, T4
``aws``) at a fixed local batch, through :class:`launcher.cluster.workload.Application`.

Costs of a change of hosts (:class:`ChangeCost`):

* ``stop_free`` (hvd_edl, notices used: AWS announces a spot reclaim 2 minutes ahead): a leaving
  host's workers leave at the next commit, so no work is lost; a change stalls the ring
  ``switch_s``; a new host's workers build (``join_s``) while the others train.
* ``checkpoint_restart``: every change stops the job, which restarts from the checkpoint written
  in the notice (no work lost either), costing ``restart_s`` of no progress; a change during a
  restart starts it over.

Mixes: ``spot`` (the trace's hosts), ``on_demand`` (a fixed fleet of the trace's time-weighted
mean hosts, never revoked), ``mixed`` (half that fleet on demand plus the spot trace).  Cost is
host-hours times the price while a host is held (spot hosts from add to remove).
"""
from __future__ import annotations

import csv
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple


def availability(path: Path) -> List[Tuple[float, int]]:
    """The spot hosts over time: ``[(t_s, hosts), ...]`` from a Bamboo trace, one entry per
    distinct instant (sorted; the count after every event of that instant).  ValueError when an
    event is neither add nor remove."""
    events = []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            t, ev = float(row[0]) / 1000.0, row[1].strip()
            if ev not in ("add", "remove"):
                raise ValueError(f"{path}: unknown event {ev!r}")
            events.append((t, 1 if ev == "add" else -1))
    events.sort()
    out: List[Tuple[float, int]] = []
    n = 0
    for t, d in events:
        n += d
        if out and out[-1][0] == t:
            out[-1] = (t, n)
        else:
            out.append((t, n))
    return out


def mean_hosts(avail: List[Tuple[float, int]]) -> float:
    """Time-weighted mean of the host count over the trace."""
    tot = 0.0
    for (t0, n), (t1, _) in zip(avail, avail[1:]):
        tot += n * (t1 - t0)
    return tot / (avail[-1][0] - avail[0][0])


@dataclass(frozen=True)
class ChangeCost:
    """Seconds a change of hosts costs (the module's docstring)."""
    mode: str               # "stop_free" or "checkpoint_restart"
    switch_s: float = 0.0
    join_s: float = 0.0
    restart_s: float = 0.0


@dataclass
class Outcome:
    """A run's figures: ``jct_s`` to finish the work (inf if not within ``limit``),
    ``samples_per_s`` over the first trace period, ``cost_usd`` to finish, ``changes``."""
    jct_s: float
    samples_per_s: float
    cost_usd: float
    changes: int


def run(avail: List[Tuple[float, int]], throughput: Callable[[int], float], work: float,
        cost: ChangeCost, spot_price: float, on_demand: int = 0, od_price: float = 0.0,
        use_spot: bool = True, limit_s: float = 14 * 86400.0) -> Outcome:
    """Train ``work`` samples on the trace's spot hosts (``use_spot``) plus ``on_demand`` fixed
    hosts from time 0; ``throughput(n)`` samples/s on n hosts.  The trace repeats past its end.
    ``samples_per_s`` is over the trace's first period (or until the work is done)."""
    base = avail[0][0]
    period = avail[-1][0] - base
    done, usd, changes = 0.0, 0.0, 0
    n_prev: Optional[int] = None
    n_old, slow_until, stall_until = 0, 0.0, 0.0
    at_period: Optional[float] = None
    k = 0
    while True:
        cycle, i = divmod(k, len(avail) - 1)
        k += 1
        t0 = avail[i][0] - base + cycle * period
        t1 = avail[i + 1][0] - base + cycle * period
        if t0 >= limit_s:
            return Outcome(math.inf, (at_period or done) / period, usd, changes)
        spot = avail[i][1] if use_spot else 0
        n = spot + on_demand
        if n != n_prev:
            if n_prev is not None:
                changes += 1
                if cost.mode == "checkpoint_restart":
                    slow_until, stall_until = t0, t0 + cost.restart_s
                elif n > n_prev and n_prev > 0:
                    n_old, slow_until = n_prev, t0 + cost.join_s
                    stall_until = slow_until + cost.switch_s
                else:
                    slow_until, stall_until = t0, t0 + cost.switch_s
            n_prev = n
        pieces = [(t0, min(slow_until, t1), n_old), (max(t0, stall_until), t1, n)]
        price = spot * spot_price + on_demand * od_price
        for s0, s1, m in pieces:
            if s1 <= s0 or m <= 0:
                continue
            thr = throughput(m)
            if at_period is None and s1 >= period:
                at_period = done + thr * max(0.0, period - s0)
            if done + thr * (s1 - s0) >= work:
                t_end = s0 + (work - done) / thr
                usd += price * (t_end - t0) / 3600.0
                rate = at_period / period if at_period is not None else work / t_end
                return Outcome(t_end, rate, usd, changes)
            done += thr * (s1 - s0)
        usd += price * (t1 - t0) / 3600.0
        if at_period is None and t1 >= period:
            at_period = done


@functools.lru_cache(maxsize=None)
def profile_throughput(app_folder: str, profile: str, local_bsz: int, n: int) -> float:
    """Samples/s of ``n`` one-GPU hosts at ``local_bsz`` per GPU from a per-type profile (Sia's
    ``placements<profile>.csv`` / ``scalability<profile>.csv``, one GPU per node)."""
    app = _app(app_folder, profile)
    if n <= 0:
        return 0.0
    st, _ = app.step_time((1,) * n, local_bsz)
    return n * local_bsz / st


@functools.lru_cache(maxsize=None)
def _app(app_folder: str, profile: str):
    from launcher.cluster.workload import Application, traces_dir
    folder = Path(app_folder)
    return Application(folder, 1, profile=profile,
                       validation=traces_dir() / "traces" / folder.name)
