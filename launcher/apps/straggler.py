"""Straggler mitigation (EDL, Wu et al., arXiv 1909.11985, section 5): find a member that computes
much slower than the others, and report, evict or replace it.

In synchronous data-parallel training every member's *step* takes as long as the slowest one's;
what tells a straggler apart is its *compute* time per step (``WorkerStats.compute_s``: the
step minus the time blocked in collectives, :mod:`hvd_edl.step_timer`): the straggler computes
long and waits little, its peers compute briefly and wait for it.

A member is a straggler when its compute time per step (the telemetry's window mean,
``Telemetry.WINDOW_S``) stays above ``ratio`` x the median of the *other* members' for
``window_s`` seconds in a row.  With two members the other one is the faster of them (the only
median there is); a ring of one has no straggler.  Guards against false positives:

* **start-up**: the first ``grace_s`` seconds after each generation formed are ignored (the
  first steps of a new ring are slow on everyone: caches, Gloo's first buffers);
* **tiny steps**: nothing is judged while the others' median is below ``floor_s`` (below
  5 ms a 2x difference is a few milliseconds, the size of one scheduler hiccup on a shared
  core);
* **noise**: the excess must hold for the whole ``window_s``, on top of a 5-second mean; one
  dip below the threshold starts the count over;
* **silence**: a member with no step in the last ``STALE_S`` seconds is liveness's business
  (``launcher/job/liveness.py``), not a straggler.

Defaults (``--straggler-ratio 2 --straggler-window 5``): a worker slowed 3x is found about
8-11 s after it slowed down (its 5 s mean crosses 2x after about 3.75 s of slow steps, then 5 s
in a row; measured 9.9 and 10.9 s by ``benchmarks/apps/straggler.py`` at load 15-34).  Why 2 and not 1.5: on the 2-core test host shared by other jobs (load 20-35),
healthy 2-worker jobs showed one member at 1.8-2.9x the other's compute for 5 s and more
(preemption of its threads counts as compute), while a worker slowed 3x measured 1.6-2.9x:
no threshold separates them at such a load, 2 leaves more room than 1.5 at ordinary ones.
Raise ``--straggler-ratio`` on hosts shared with other tenants' work.

Policies (``--straggler-policy``, default ``report``):

* ``off``: no detection;
* ``report``: an event-log note (kind "straggler") and the launcher line
  ``hvd-edl-run: straggler: worker W on HOST:SLOT compute X ms/step vs median Y ms for W s``;
* ``evict``: also ask it to leave (a scale-in; not below ``--min-np``), its slot rests
  ``rest_s`` seconds (no worker is placed there meanwhile);
* ``replace``: also start a worker on a free slot elsewhere, let it build, and swap it for the
  straggler in one stop-free switch (:mod:`launcher.apps.migration`, kind "replace"); the
  straggler's slot rests ``rest_s`` seconds.  Without a free slot it is only reported.

Counts go to ``coord.telemetry.count("straggler")``, ``count("eviction")`` and, for a
replacement (a migration of one worker), ``count("migration")``.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from launcher.job.registry import WorkerState

log = logging.getLogger(__name__)

POLICIES = ("off", "report", "evict", "replace")
STALE_S = 3.0  # a member with no step reported for this long is not judged (seconds)


@dataclass(frozen=True)
class StragglerPolicy:
    """What ``--straggler-*`` asked for.  Times in seconds.

    ``ratio``: a straggler computes more than ``ratio`` x the others' median per step;
    ``window_s``: for this long in a row; ``grace_s``: ignored after each generation formed;
    ``floor_s``: not judged while the others' median compute per step is below this;
    ``rest_s``: an evicted or replaced straggler's slot takes no worker for this long.
    """
    policy: str = "report"
    ratio: float = 2.0
    window_s: float = 5.0
    grace_s: float = 5.0
    floor_s: float = 0.005
    rest_s: float = 300.0

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"straggler policy {self.policy!r}: choose one of {POLICIES}")
        if not self.ratio > 1.0:
            raise ValueError(f"straggler ratio must be > 1, got {self.ratio}")
        if not self.window_s > 0:
            raise ValueError(f"straggler window must be > 0 s, got {self.window_s}")


@dataclass
class Finding:
    """A straggler: ``compute_s`` its mean compute per step, ``median_s`` the others' median
    (seconds per step), ``for_s`` how long it has been above the threshold (seconds)."""
    worker_id: str
    host: str
    slot: int
    rank: int
    compute_s: float
    median_s: float
    for_s: float

    def describe(self) -> str:
        return (f"worker {self.worker_id} on {self.host}:{self.slot} compute "
                f"{self.compute_s * 1e3:.1f} ms/step vs median {self.median_s * 1e3:.1f} ms "
                f"for {self.for_s:.0f} s")


class StragglerDetector:
    """Judges the members' compute times once per call of :meth:`check` (the driver's loop)."""

    def __init__(self, policy: StragglerPolicy):
        self.policy = policy
        self._above_since: Dict[str, float] = {}  # worker -> when it went above the threshold
        self._flagged: set = set()  # found in this generation (each worker once per ring)
        self._generation = 0

    def check(self, stats: List, generation: int, generation_age_s: float,
              now: float) -> List[Finding]:
        """New stragglers among ``stats`` (``launcher.observe.telemetry.WorkerStats`` of the current
        members, rank >= 0), ``generation_age_s`` seconds after the current generation formed;
        ``now``: ``time.monotonic()``.  Each worker is returned at most once per generation."""
        p = self.policy
        if p.policy == "off":
            return []
        if generation != self._generation:  # a new ring: every count starts over
            self._generation = generation
            self._above_since.clear()
            self._flagged.clear()
        if generation_age_s < p.grace_s:
            return []
        judged = [s for s in stats if s.rank >= 0 and not math.isnan(s.compute_s)
                  and not math.isnan(s.updated_at) and now - s.updated_at <= STALE_S]
        if len(judged) < 2:
            self._above_since.clear()
            return []
        import statistics  # here: a launcher's start need not import it (fractions, decimal)
        found: List[Finding] = []
        for s in judged:
            others = [o.compute_s for o in judged if o is not s]
            median = statistics.median(others)
            if median < p.floor_s or s.compute_s <= p.ratio * median:
                self._above_since.pop(s.worker_id, None)
                continue
            since = self._above_since.setdefault(s.worker_id, now)
            if now - since >= p.window_s and s.worker_id not in self._flagged:
                self._flagged.add(s.worker_id)
                found.append(Finding(s.worker_id, s.host, s.slot, s.rank, s.compute_s, median,
                                     now - since))
        for gone in set(self._above_since) - {s.worker_id for s in judged}:
            del self._above_since[gone]
        return found


def mitigate(driver, detector: StragglerDetector, now: float) -> None:
    """One pass of the driver's loop: find stragglers among the current members and act on
    them as the policy says (report / evict / replace); see the module docstring."""
    from launcher.apps import migration
    ring = driver.ring()
    if ring.generation == 0 or ring.finishing or ring.failure or not ring.logged:
        return
    members = set(ring.members)
    generation, age_s = ring.generation, time.time() - ring.formed_at
    stats = [s for s in driver.telemetry.workers() if s.worker_id in members]
    for f in detector.check(stats, generation, age_s, now):
        policy = detector.policy.policy
        rec = driver.worker(f.worker_id)
        if rec is None or rec.state != WorkerState.MEMBER:
            continue
        driver.telemetry.count("straggler")
        action, fields = "reported", {}
        running = driver.migration is not None and driver.migration.active
        if policy == "evict":
            if len(members) - 1 < driver.spec.min_np:
                action = f"not evicted: the ring would fall below --min-np {driver.spec.min_np}"
            else:
                driver.slots.rest(f.host, f.slot, now + detector.policy.rest_s)
                action = f"evicted; its slot rests {detector.policy.rest_s:g} s"
        elif policy == "replace":
            slot = None if running else _free_slot_elsewhere(driver, f, now)
            if running:
                action = f"not replaced: a {driver.migration.purpose} is running"
            elif slot is None:
                action = "not replaced: no free usable slot elsewhere"
            else:
                driver.slots.rest(f.host, f.slot, now + detector.policy.rest_s)
                m = migration.Migration(source=f.host, target=slot[0], leavers=[f.worker_id],
                                        target_slots=[slot], purpose="straggler",
                                        drain_source=False,
                                        build_timeout_s=driver.spec.start_timeout_s + 10.0)
                driver.migration = m
                driver.telemetry.count("migration")  # one, as hvd-edl-ctl migrate counts
                action = (f"replacing it with a new worker on {slot[0]}:{slot[1]}; its slot "
                          f"rests {detector.policy.rest_s:g} s")
                fields = {"replacement_slot": f"{slot[0]}:{slot[1]}"}
        driver.note("straggler", f"{f.describe()}: {action}", phase="found",
                           worker=f.worker_id, host=f.host, slot=f.slot, rank=f.rank,
                           compute_ms=round(f.compute_s * 1e3, 3),
                           median_ms=round(f.median_s * 1e3, 3), for_s=round(f.for_s, 2),
                           ratio=detector.policy.ratio, policy=policy, action=action,
                           ring=generation, **fields)
        if policy == "evict" and action.startswith("evicted"):
            driver.telemetry.count("eviction")
            driver.ask_to_leave(rec, f"straggler: evicted ({f.describe()})")
        driver.wake.set()


def _free_slot_elsewhere(driver, f: Finding, now: float) -> Optional[tuple]:
    """A free usable slot for a straggler's replacement, not the straggler's own: another
    host's first (a slow machine slows every slot of it), then another slot of its host."""
    from launcher.apps.migration import free_slots
    hosts = sorted(driver.slots.hosts, key=lambda h: h == f.host)
    for host in hosts:
        for slot in free_slots(driver, host, now):
            if (host, slot) != (f.host, f.slot):
                return host, slot
    return None
