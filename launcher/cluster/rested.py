"""Slots a job's own launcher rests, in the cluster service: when a worker fails (a joiner
whose host cannot run the command, a GPU that faults), the job's launcher rests its slot for the
rest of the run (:meth:`launcher.job.slot_book.SlotBook.record_failure`; a host failing again
and again is blacklisted), and would never start a worker there again; the service's allocation
still gave the job that slot (that GPU), so the pool lost it until the job ended.

The service learns it from the job's telemetry (``/ctl/telemetry``'s ``resting``: host -> slots
resting for the rest of the run, beside its worker rows), as :mod:`launcher.cluster.reach`
learns of unreached hosts, and gives those slots back: the job's allocation file and its
allocation in the store lose them (a ``rested`` event), and the slot (its GPU) counts free once
no process of the job uses it (:func:`launcher.cluster.runs.takes_part`: the failed worker's
process has exited), by the same release as any shrink (:func:`launcher.cluster.apply.write`,
:func:`launcher.cluster.apply.check_release`).  For the rest of that run the job is never
allocated more slots on that host than it kept there (:func:`clamp`: its launcher would not use
them).

A worker *fenced* by its launcher (no heartbeat while its peers beat: its host frozen, gone or cut
off the network) is not among them: its process may live on and hold its GPU, so its slot, and its
host, stay the job's until the host rests as no job reaches it (:mod:`launcher.cluster.reach`,
its cooldown covering the time the remote side needs to end the process).

A host's slots are numbered from 0 in its allocation file, and a worker keeps its slot (its
local rank, its GPU) for life, so only rested slots at the end of a host's range can leave the
file without moving a live worker: a rested slot below a live one stays counted as the job's
until the slots above it go (the joiners of a growth take the highest slots, so a failing
joiner's slot is almost always last).

:func:`given_back` is the decision, a pure function of the job's allocation file and a
telemetry answer; :func:`check` applies it on the service's loop thread each pass.
"""
from __future__ import annotations

import time
from typing import Dict

from launcher.cluster import apply
from launcher.cluster.runs import takes_part


def given_back(written: Dict[str, int], answer: dict) -> Dict[str, int]:
    """host -> the slots the job keeps there, for each host of ``written`` (its allocation
    file: host -> slots) whose last slots rest for good in ``answer`` (a ``/ctl/telemetry``
    answer: ``resting``, host -> resting slots; ``workers``, rows with ``host``, ``slot`` and
    ``state``) and run no live process (:func:`takes_part`); hosts that keep all their slots are
    left out.  ``{"h": 3}`` and slot 2 resting, its process gone -> ``{"h": 2}``."""
    resting = answer.get("resting") or {}
    live = {(w.get("host"), w.get("slot")) for w in answer.get("workers", []) if takes_part(w)}
    out: Dict[str, int] = {}
    for host, k in written.items():
        rest = set(resting.get(host, ()))
        keep = k
        while keep > 0 and keep - 1 in rest and (host, keep - 1) not in live:
            keep -= 1
        if keep < k:
            out[host] = keep
    return out


def clamp(svc, alloc: Dict[str, Dict[str, int]]) -> Dict[str, Dict[str, int]]:
    """The policy's allocation with each job held to the slots its current run can use on a
    host where slots were given back (``svc.caps``); hosts left with 0 dropped."""
    out = {}
    for job_id, hosts in alloc.items():
        number, caps = svc.caps.get(job_id, (None, {}))
        run = svc.runs.get(job_id)
        if not caps or run is None or getattr(run, "number", None) != number:
            out[job_id] = hosts
            continue
        out[job_id] = {h: min(k, caps.get(h, k)) for h, k in hosts.items()
                       if min(k, caps.get(h, k)) > 0}
    return out


def check(svc) -> None:
    """Each pass of the loop: for every running job (not being stopped) whose telemetry,
    fetched after its allocation file was last written, shows slots resting for good at the
    end of a host's range with their processes gone, write the smaller allocation (a
    ``rested`` event) and ask for a round; a job left with no slot is not touched (its launcher
    ends the run, which frees them)."""
    for job_id, run in list(svc.runs.items()):
        written = svc.written.get(job_id)
        fetched, answer = svc.telemetry.get(job_id, (0.0, None))
        if not written or answer is None or fetched < svc.written_at.get(job_id, 0.0):
            continue
        cut = given_back(written, answer)
        if not cut:
            continue
        job = svc.store.job(job_id)
        if job is None or job.stopping:
            continue
        kept = {h: cut.get(h, k) for h, k in written.items() if cut.get(h, k) > 0}
        if not kept:
            continue
        number, caps = svc.caps.get(job_id, (run.number, {}))
        caps = dict(caps) if number == run.number else {}
        caps.update(cut)
        svc.caps[job_id] = (run.number, caps)
        allocs = svc.store.allocations().get(job_id, {})
        alloc = {h: min(k, cut.get(h, k)) for h, k in allocs.items() if min(k, cut.get(h, k))}
        slots = {h: list(range(cut[h], written[h])) for h in cut}
        reason = ("its launcher rests " + ", ".join(
            f"{h} slot{'s' if len(s) > 1 else ''} {','.join(map(str, s))}"
            for h, s in sorted(slots.items())) + " for the rest of its run (a worker failed "
            f"there): given back, {sum(written.values())} -> {sum(kept.values())} slots")
        svc.store.update(job_id, allocation=alloc, last_change_at=time.time(), reason=reason,
                         event={"kind": "rested", "reason": reason, "hosts": kept,
                                "from": written, "slots": slots})
        svc.events.write({"job": job_id, "kind": "rested", "reason": reason, "hosts": kept,
                          "from": written, "slots": slots})
        svc.events.count("rested")
        apply.write(svc, job_id, kept)
        svc.decide_now = True
