"""The cluster service's pool: the hosts and slots its jobs share, as its discovery gives them
(``-H`` / ``--hostfile``: fixed; ``--discovery-script``: asked again every
``--discovery-interval`` seconds on a thread of its own, :func:`watch`).

A change is applied on the loop's thread (:func:`changed`): the new pool (``Service.set_pool``,
under the service's lock: ``status`` reads it from other threads), a ``pool`` event, and the
hosts that left take their slots from the jobs that held them at once (:func:`hosts_left`),
before the policy's next round (asked for now) redistributes.  A discovery that fails keeps the
last good pool and says so once on stderr.

Each function takes the service explicitly (:class:`launcher.cluster.service.Service`).
"""
from __future__ import annotations

import sys
import time
from typing import Dict, List, Optional


def watch(svc) -> None:
    """The discovery thread's body until ``svc.stopping``: every ``svc.discovery_interval_s``
    ask ``svc.discovery`` for the pool; a different one goes to the loop (:func:`changed`)."""
    problem: Optional[str] = None
    while not svc.stopping:
        time.sleep(svc.discovery_interval_s)
        try:
            hosts = dict(svc.discovery.find_available_hosts_and_slots())
        except Exception as e:  # noqa: BLE001 - keep the last good pool, say it once
            if str(e) != problem:
                problem = str(e)
                print(f"hvd-edl-cluster: pool discovery failed, keeping the last pool: "
                      f"{e}", file=sys.stderr)
            continue
        problem = None
        if hosts != svc.discovered:
            svc.post(lambda hosts=hosts: changed(svc, hosts))
            svc.wake.set()


def changed(svc, hosts: Dict[str, int]) -> None:
    """The pool is now ``hosts`` (the loop's thread): a ``pool`` event, the hosts that left
    taken from their jobs (:func:`hosts_left`), a round asked for."""
    before = svc.pool
    svc.set_pool(hosts)
    gone = sorted(set(before) - set(svc.pool))  # left discovery, or drained (drains.py)
    svc.events.note(None, "pool", "the pool changed" + (
        f": {', '.join(gone)} left" if gone else ""), pool=hosts,
        before=before)
    hosts_left(svc, gone)
    svc.decide_now = True


def hosts_left(svc, gone: List[str]) -> None:
    """Hosts that left the pool take their slots from the jobs that held them: each such
    job's allocation loses them at once (its workers there leave stop-free; a job left with
    none is preempted), before the policy's next round redistributes."""
    if not gone:
        return
    for job_id, hosts in svc.store.allocations().items():
        lost = {h: k for h, k in hosts.items() if h in gone}
        if not lost:
            continue
        new = {h: k for h, k in hosts.items() if h not in gone}
        kind = "shrink" if new else "preempt"
        reason = (f"{', '.join(sorted(lost))} left the pool: "
                  f"{sum(hosts.values())} -> {sum(new.values())} slots"
                  + ("" if new else " (preempted unless this round places it elsewhere: a "
                     "'move' event then)"))
        svc.store.update(job_id, allocation=new, last_change_at=time.time(),
                         reason=reason, event={"kind": kind, "reason": reason,
                                               "hosts": new, "from": hosts})
        svc.events.write({"job": job_id, "kind": kind, "reason": reason, "hosts": new,
                          "from": hosts})
        svc.events.count(kind)
