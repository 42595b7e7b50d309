"""Hosts no job can reach, in the cluster service: a host of the pool that vanishes (its network
cut, powered off) is fenced by each job's launcher within seconds (its workers there are dropped
from the ring and the host rests in the job's own slot book), but the pool's list (``-H``, a
hostfile) still names it.  The service learns a job's real membership from its telemetry
(``/ctl/telemetry``'s worker rows: :func:`launcher.cluster.runs.takes_part`), and a host where
every running job that is allocated slots there has had no live worker for ``unreached_s``
(``serve --unreachable-after S``, default :data:`UNREACHED_S`; each job with a fresh telemetry
answer, training elsewhere, not finishing) *rests*: it leaves the
pool the policy sees for a cooldown (:data:`COOLDOWN_S`, doubled per repeat up to
:data:`MAX_COOLDOWN_S`, as a launcher's ``--blacklist-cooldown-range`` does), its slots are
taken from the jobs that held them at once (:func:`launcher.cluster.pool.hosts_left`), and when
the cooldown ends it is offered again (a host still unreachable rests again, longer).

:class:`Reach` keeps the state (owned by the service, ``svc.reach``); :func:`check` applies it
on the loop's thread.  The decision (:meth:`Reach.observe`) is a pure function of the written
allocations, the telemetry answers and the time, tested alone.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

UNREACHED_S = 10.0     # default: no live worker of any job allocated there this long: it rests
COOLDOWN_S = 60.0      # ... this long the first time
MAX_COOLDOWN_S = 600.0 # ... doubled per repeat up to this
FRESH_S = 5.0          # a telemetry answer older than this says nothing


def live_hosts(answer: Optional[dict]) -> Dict[str, int]:
    """host -> the job's workers there whose process may still live (``/ctl/telemetry``)."""
    from launcher.cluster.runs import live_slots
    return live_slots(answer)


class Reach:
    """Which hosts rest, until when, and since when each host has looked unreached.

    Args:
        unreached_s: seconds a host must look unreached (no live worker of any job allocated
            there, each with a fresh answer) before it rests (``serve --unreachable-after``);
            above 0.

    Raises:
        ValueError: ``unreached_s`` not a finite number above 0.
    """

    def __init__(self, unreached_s: float = UNREACHED_S):
        if not (0 < unreached_s < float("inf")):
            raise ValueError(f"unreached_s must be a number of seconds above 0, got "
                             f"{unreached_s!r}")
        self.unreached_s = float(unreached_s)
        self.since: Dict[str, float] = {}        # host -> first seen unreached (monotonic)
        self.resting: Dict[str, float] = {}      # host -> rests until (monotonic)
        self.strikes: Dict[str, int] = {}        # host -> times it rested

    def resting_hosts(self, now: Optional[float] = None) -> List[str]:
        now = time.monotonic() if now is None else now
        return sorted(h for h, until in self.resting.items() if until > now)

    def rest_left(self, now: Optional[float] = None) -> Dict[str, float]:
        """host -> seconds of rest left (what ``status`` shows)."""
        now = time.monotonic() if now is None else now
        return {h: round(until - now, 1) for h, until in dict(self.resting).items()
                if until > now}

    def observe(self, written: Dict[str, Dict[str, int]],
                telemetry: Dict[str, Tuple[float, dict]],
                now: float) -> Tuple[List[str], List[str]]:
        """One look (``written``: job -> host -> slots its allocation file gives it;
        ``telemetry``: job -> (fetched, answer)); returns (hosts that rest from now, hosts whose
        rest ended)."""
        ended = [h for h, until in self.resting.items() if until <= now]
        for h in ended:
            del self.resting[h]
        verdict: Dict[str, bool] = {}  # host -> unreached by every job that could tell
        for job_id, hosts in written.items():
            fetched, answer = telemetry.get(job_id, (0.0, None))
            if answer is None or now - fetched > FRESH_S \
                    or (answer.get("job") or {}).get("finishing"):
                for h in hosts:
                    verdict[h] = False  # this job cannot tell: the host is not judged
                continue
            live = live_hosts(answer)
            if not live and not (answer.get("job") or {}).get("generation"):
                for h in hosts:  # starting (no ring yet): says nothing of a host
                    verdict[h] = False
                continue
            for h, k in hosts.items():
                if k <= 0:
                    continue
                unreached = live.get(h, 0) == 0
                verdict[h] = unreached if h not in verdict else (verdict[h] and unreached)
        rest = []
        for h in list(self.since):
            if not verdict.get(h):
                del self.since[h]
        for h, unreached in verdict.items():
            if not unreached or h in self.resting:
                continue
            first = self.since.setdefault(h, now)
            if now - first >= self.unreached_s:
                n = self.strikes.get(h, 0)
                self.strikes[h] = n + 1
                self.resting[h] = now + min(COOLDOWN_S * 2 ** n, MAX_COOLDOWN_S)
                del self.since[h]
                rest.append(h)
        return rest, ended


def check(svc) -> None:
    """Each pass of the loop: rest the hosts no job reaches (their slots taken from the jobs at
    once, a ``rest`` event), offer again those whose cooldown ended (a round asked for)."""
    from launcher.cluster import pool as pool_
    now = time.monotonic()
    rest, ended = svc.reach.observe({j: dict(h) for j, h in svc.written.items()
                                     if j in svc.runs}, dict(svc.telemetry), now)
    for h in rest:
        svc.events.note(None, "rest", f"{h}: no job reaches it (no live worker there for "
                        f"{svc.reach.unreached_s:g} s): it rests {svc.reach.rest_left(now)[h]:g} s",
                        host=h)
    pool_.hosts_left(svc, rest)
    for h in ended:
        svc.events.note(None, "rest", f"{h}: its rest ended: offered again", host=h)
    if rest or ended:
        svc.decide_now = True
