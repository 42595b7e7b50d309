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
deadline) or that the deadline passed first (``drain_late``).  An operator's drain survives a
restart (the store's ``drains`` meta) until ``drain HOST --undo``; a drain that came from a
pool line (``"line": true``) follows the line: once the line no longer says ``ends=`` (edited,
then a restart or the next discovery), the host is served again.  :func:`kept_out` says, one
line per host, why a host of the pool is not scheduled and how to undo it (``serve`` prints it
at start, ``status`` shows it).

A job left with no host but the draining ones that the policy places elsewhere is *moved*
stop-free: its new workers start there and the old ones leave at the commit after they joined.
That needs the new workers started (ssh, the interpreter, imports: seconds on an idle machine,
tens of seconds on a loaded one); when :data:`LAST_RESORT_S` before the deadline the job still
has no ring member off the draining hosts, it is checkpointed and stopped instead (a
``drain_preempt`` event; the checkpoint waits at most until 3 s before the deadline) and resumes
from that checkpoint later, rather than lose its workers when the machine goes.

Each function takes the service explicitly (:class:`launcher.cluster.service.Service`).
"""
from __future__ import annotations

import json
import time
from typing import Dict, Optional

from launcher.cluster import apply
from launcher.cluster import pool as pool_
from launcher.cluster.runs import takes_part

LAST_RESORT_S = 10.0  # this close to a drain's deadline a job with no ring elsewhere is stopped


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
    return {h: k for h, k in hosts.items() if h not in ending and not (
        h in svc.drains and not svc.drains[h].get("line"))}


def kept_out(svc) -> Dict[str, str]:
    """host -> one line: why a host the pool's discovery gives is not scheduled, and how to
    undo it (an operator's drain: ``drain HOST --undo``; a line's ``ends=``: edit the line).
    Hosts that are scheduled are absent."""
    ending = dict(getattr(svc.discovery, "ends", {}) or {})  # copies: any thread reads it
    drained = dict(svc.drains)
    now = time.time()
    out: Dict[str, str] = {}
    for host in sorted(set(svc.discovered) | set(drained)):
        if host in ending:
            out[host] = (f"not scheduled: its pool line says ends={ending[host]:g} "
                         f"({_when(ending[host] - now)}); to serve it again, remove ends= from "
                         f"its line")
        elif host in drained and not drained[host].get("line"):
            out[host] = (f"not scheduled: drained by the operator; to serve it again: "
                         f"hvd-edl-cluster drain {host} --undo")
    return out


def _when(left_s: float) -> str:
    """``in 12 s`` / ``already past, 12 s ago``: an end's time from now, never negative."""
    return f"in {left_s:.0f} s" if left_s > 0 else f"already past, {-left_s:.0f} s ago"


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
    changed = follow_lines(svc)
    for host, t in (getattr(svc.discovery, "ends", {}) or {}).items():
        if host not in svc.drains:
            svc.drains[host] = {"at": time.time(), "deadline": t, "noted": False, "line": True}
            svc.events.note(None, "drain", f"host {host}'s line announces its end: "
                            f"{_when(t - time.time())}", host=host, deadline=t)
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
                            + ("" if spare is None else f", {spare} s before its deadline"
                               if spare >= 0 else f", {-spare} s after its deadline"),
                            host=host, took_s=round(now - d["at"], 2), spare_s=spare)
        elif deadline is not None and deadline - now <= LAST_RESORT_S and not d.get("late"):
            last_resort(svc, host, held, deadline, now)
        if held and deadline is not None and now > deadline and not d.get("late"):
            d["late"] = changed = True
            svc.events.note(None, "drain_late", f"host {host}'s deadline passed with "
                            f"{', '.join(held)} still there", host=host, jobs=held)
    if changed:
        _save(svc)
        if set(svc.pool) & set(svc.drains):
            pool_.changed(svc, dict(svc.discovered))


def follow_lines(svc) -> bool:
    """Forget each drain that came from a pool line whose line no longer says ``ends=`` (an
    ``undrain`` event each); True when one went (the caller saves)."""
    ending = getattr(svc.discovery, "ends", {}) or {}
    gone = [h for h, d in svc.drains.items() if d.get("line") and h not in ending]
    for host in gone:
        del svc.drains[host]
        svc.events.note(None, "undrain", f"host {host}'s line no longer says ends=: it is "
                        f"schedulable again", host=host)
    return bool(gone)


def last_resort(svc, host: str, held, deadline: float, now: float) -> None:
    """``host``'s deadline is :data:`LAST_RESORT_S` away: each job of ``held`` (job ids with
    processes there) that is running, not being stopped, and has no ring member on a host not
    draining (its telemetry) is checkpointed and stopped (module docstring)."""
    for job_id in held:
        job = svc.store.job(job_id)
        if job is None or job.stopping or job_id not in svc.runs:
            continue
        _, answer = svc.telemetry.get(job_id, (0.0, None))
        elsewhere = [w for w in (answer or {}).get("workers", []) if takes_part(w)
                     and w.get("state") == "member" and w.get("host") not in svc.drains]
        if elsewhere:  # a ring off the host: its workers there leave at their next commit
            continue
        svc.events.note(job_id, "drain_preempt", f"{host}'s deadline is {deadline - now:.1f} s "
                        f"away and the job has no ring member elsewhere yet: checkpointed and "
                        f"stopped, it resumes later", host=host)
        apply.preempt(svc, job, wait_s=max(1.0, deadline - now - 3.0))


def _save(svc) -> None:
    svc.store.set_meta("drains", json.dumps(svc.drains))
