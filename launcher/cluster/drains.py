"""Draining a pool host, in the cluster service: ``hvd-edl-cluster drain HOST [--deadline S]``
(an operator taking a server out, or a spot VM's preemption notice relayed by hand), or a pool
line that announces the host's end (``host ends=UNIX_S``, :mod:`launcher.discovery.hosts`: what
the GCE / AWS discovery scripts can print on a notice).

A draining host leaves the pool the service schedules (:func:`effective`): the jobs holding
slots there lose them at once (:func:`launcher.cluster.pool.hosts_left`): a job that keeps
other hosts shrinks stop-free (its workers there leave at their next commit), a job left with
none is preempted (a checkpoint, then SIGTERM; it resumes elsewhere later).  A shrink or a
preemption is never a job failure.  Each pass of the loop (:func:`check`) notes, once, when the
host holds no job's process any more (``drained``, with the seconds to spare before the
deadline) or that the deadline passed first (``drain_late``).  Drains survive a restart (the
store's ``drains`` meta).

Each function takes the service explicitly (:class:`launcher.cluster.service.Service`).
"""
from __future__ import annotations

import json
import time
from typing import Dict, Optional

from launcher.cluster import pool as pool_


def load(svc) -> Dict[str, dict]:
    """The drains the store keeps (host -> ``{"at", "deadline", "noted"}``, unix seconds)."""
    try:
        data = json.loads(svc.store.meta("drains") or "{}")
        return {h: dict(d) for h, d in data.items() if isinstance(d, dict)}
    except (ValueError, AttributeError):
        return {}


def effective(svc, hosts: Dict[str, int]) -> Dict[str, int]:
    """The pool to schedule on: ``hosts`` less the drained ones and those whose pool line
    announces their end (``ends=``)."""
    ending = getattr(svc.discovery, "ends", {}) or {}
    return {h: k for h, k in hosts.items() if h not in svc.drains and h not in ending}


def drain(svc, host: str, deadline_s: Optional[float] = None, undo: bool = False) -> dict:
    """A ``drain`` request (the loop's thread): ``host`` leaves the pool now, its jobs leave it
    before ``deadline_s`` seconds (None: no deadline); ``undo``: it is schedulable again.

    Returns ``{"host", "draining", "deadline", "jobs"}`` (the jobs that held slots there).

    Raises:
        ValueError: a host the pool does not know, a deadline not positive, or an undo of a
            host not drained (a typo must not pass for done)."""
    if host not in svc.discovered and host not in svc.drains:
        raise ValueError(f"unknown host {host!r}: the pool has {sorted(svc.discovered)}")
    if deadline_s is not None and not deadline_s > 0:
        raise ValueError(f"--deadline must be positive seconds, got {deadline_s}")
    holders = sorted(j for j, hosts in svc.occupied.items() if hosts.get(host))
    if undo:
        if host not in svc.drains:
            raise ValueError(f"host {host} is not drained")
        del svc.drains[host]
        svc.events.note(None, "undrain", f"host {host} is schedulable again", host=host)
    else:
        now = time.time()
        svc.drains[host] = {"at": now, "deadline": None if deadline_s is None
                            else now + deadline_s, "noted": False}
        svc.events.note(None, "drain", f"host {host} drained" + (
            f", deadline in {deadline_s:g} s" if deadline_s else ""), host=host,
            deadline_s=deadline_s, jobs=holders)
    _save(svc)
    pool_.changed(svc, dict(svc.discovered))
    return {"host": host, "draining": not undo, "jobs": holders,
            "deadline": svc.drains.get(host, {}).get("deadline")}


def check(svc) -> None:
    """Each pass: a pool line's new end notice (``ends=``) becomes a drain with that deadline;
    note, once per drain, the host emptied (``drained``: seconds it took and to spare before the
    deadline) or its deadline passed with processes still there (``drain_late``); a drained
    host gone from the pool's discovery is forgotten."""
    changed = False
    for host, t in (getattr(svc.discovery, "ends", {}) or {}).items():
        if host not in svc.drains:
            svc.drains[host] = {"at": time.time(), "deadline": t, "noted": False}
            svc.events.note(None, "drain", f"host {host} announced its end in "
                            f"{t - time.time():.1f} s", host=host, deadline=t)
            changed = True
    now = time.time()
    for host, d in list(svc.drains.items()):
        if d.get("noted") and host not in svc.discovered:
            del svc.drains[host]
            changed = True
            continue
        if d.get("noted"):
            continue
        held = [j for j, hosts in svc.occupied.items() if hosts.get(host)]
        deadline = d.get("deadline")
        if not held:
            d["noted"] = changed = True
            spare = None if deadline is None else round(deadline - now, 2)
            svc.events.note(None, "drained", f"host {host} holds no job's process"
                            + (f", {spare} s before its deadline" if spare is not None else ""),
                            host=host, took_s=round(now - d["at"], 2), spare_s=spare)
        elif deadline is not None and now > deadline and not d.get("late"):
            d["late"] = changed = True
            svc.events.note(None, "drain_late", f"host {host}'s deadline passed with "
                            f"{', '.join(held)} still there", host=host, jobs=held)
    if changed:
        _save(svc)
        if set(svc.pool) & set(svc.drains):
            pool_.changed(svc, dict(svc.discovered))


def _save(svc) -> None:
    svc.store.set_meta("drains", json.dumps(svc.drains))
