"""The cluster service's telemetry thread: it asks each running job for its control API's
``/ctl/telemetry`` (:class:`launcher.serve.control.ControlClient`), every
:data:`TELEMETRY_IDLE_S` seconds, every :data:`TELEMETRY_BUSY_S` while the job releases slots.
The answers give

* the job's live workers per host, from which the loop sees slots taken back actually freed
  (``svc.telemetry``, read by :func:`launcher.cluster.apply.check_release`; the loop is woken at
  once for a releasing job);
* its speed at its current world size once it has trained steadily for ``speed.STEADY_S`` at
  one generation (:mod:`launcher.cluster.speed`), recorded in the job's ``speed`` (the
  throughput the policies see) by the loop's thread (the store has one writer);
* its ring's size (what ``status`` shows as its ``world_size``): each change is a ``ring``
  event (:func:`ring_change`), with what the service held at that moment (the job's allocation
  file, the resting hosts), so the order of what the service saw is in its own log.

Its functions take the service explicitly (``svc``, :class:`launcher.cluster.service.Service`):
they read ``svc.runs`` and ``svc.releasing`` (the loop's), and write only ``svc.telemetry``.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Dict, Tuple

from launcher.cluster import speed as speed_
from launcher.cluster.job_goodput import JobGoodput

log = logging.getLogger(__name__)

TELEMETRY_BUSY_S = 0.05  # a job releasing slots is asked this often whether they are free
TELEMETRY_IDLE_S = 1.0   # ... the others this often (speed points, world size)


def poll(svc) -> None:
    """The thread's body until ``svc.stopping``: ask each running job for ``/ctl/telemetry``
    (every 1 s; every 0.05 s while it releases slots): its world size, live workers per host,
    and speed points."""
    from launcher.serve.control import ControlClient, ControlError
    last: Dict[str, float] = {}
    clients: Dict[Tuple[str, int], ControlClient] = {}
    steady: Dict[str, Tuple[int, float]] = {}  # job id -> (generation, since)
    rings: Dict[Tuple[str, int], int] = {}      # (job id, run) -> ring size last noted
    refused: Dict[Tuple[str, int], str] = {}    # (job id, run) -> the non-finite value last logged
    while not svc.stopping:
        now = time.monotonic()
        for job_id, run in list(svc.runs.items()):
            period = TELEMETRY_BUSY_S if job_id in svc.releasing else TELEMETRY_IDLE_S
            if now - last.get(job_id, 0.0) < period:
                continue
            last[job_id] = now
            key = (job_id, run.number)
            asked = time.monotonic()
            try:
                if key not in clients:
                    clients[key] = ControlClient(run.files.job_file, timeout_s=2.0,
                                                 owners=run.files.uids())
                answer = clients[key].call("telemetry")
            except ControlError:
                clients.pop(key, None)
                continue
            take(svc, steady, rings, refused, key, answer, asked)
            if job_id in svc.releasing:
                svc.wake.set()
        time.sleep(TELEMETRY_BUSY_S if svc.releasing else 0.2)


def take(svc, steady: Dict[str, Tuple[int, float]], rings: Dict[Tuple[str, int], int],
         refused: Dict[Tuple[str, int], str], key: Tuple[str, int], answer: dict,
         asked: float) -> None:
    """Take one ``/ctl/telemetry`` ``answer`` of run ``key`` ((job id, run number)) fetched at
    ``asked`` (monotonic seconds): kept in ``svc.telemetry`` (live workers, ring size), a
    ``ring`` event on a change (:func:`ring_change`), a speed point (:func:`speed_point`) and
    the job's goodput (its adaptive batch).  An answer holding a number that is not finite (an
    infinite or NaN speed, step time or noise: JSON's ``Infinity``/``NaN``) is refused as a
    measurement: its numbers are kept as None, no speed point or goodput is taken from it, and
    one warning line is logged per run and value (``refused``: what was last logged); the job
    runs on with its last measured speed."""
    job_id = key[0]
    answer, bad = finite(answer)
    if bad is not None and refused.get(key) != bad:
        log.warning("job %s: telemetry refused: %s is not a finite number", job_id, bad)
    if bad is not None:
        refused[key] = bad
    svc.telemetry[job_id] = (asked, answer)
    ring_change(svc, rings, key, answer, time.time())
    if bad is not None:
        return
    speed_point(svc, steady, job_id, answer.get("job", {}))
    if answer.get("adaptive_batch"):  # the script opted in: learn its goodput
        svc.goodput.setdefault(job_id, JobGoodput()).observe(answer, asked)


def finite(value, path: str = "answer"):
    """``(value with every float that is not finite replaced by None, the path of the first
    such float, e.g. ``answer.job.samples_per_s``, or None)``: ``value`` as JSON decodes it
    (dicts, lists, numbers, strings)."""
    if isinstance(value, float):
        return (value, None) if math.isfinite(value) else (None, path)
    first = None
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out[k], bad = finite(v, f"{path}.{k}")
            first = first or bad
        return out, first
    if isinstance(value, list):
        items = []
        for i, v in enumerate(value):
            item, bad = finite(v, f"{path}[{i}]")
            items.append(item)
            first = first or bad
        return items, first
    return value, None


def ring_change(svc, rings: Dict[Tuple[str, int], int], key: Tuple[str, int], answer: dict,
                at: float) -> None:
    """Note a ``ring`` event when a run's ring size in its telemetry ``answer`` (fetched at
    wall-clock ``at``, seconds) differs from the last one noted for it (``rings``: (job id, run
    number) -> size, kept by :func:`poll`; 0 before a run's first ring).  Its detail:
    ``world_size``, ``previous``, ``generation``, ``at`` (the answer's time, not the write's),
    ``allocation`` (host -> slots of the job's allocation file) and ``resting`` (hosts resting)
    as the service held them when the answer came: the ring of 2 of a job whose launcher
    fenced a vanished host is recorded with that host still allocated, before it rests
    (:mod:`launcher.cluster.reach`).  The event is written on the loop's thread (one writer)."""
    tel_job = answer.get("job") or {}
    size = tel_job.get("world_size", 0)
    if not isinstance(size, int) or isinstance(size, bool) or size == rings.get(key, 0):
        return
    previous, rings[key] = rings.get(key, 0), size
    job_id = key[0]
    detail = {"world_size": size, "previous": previous,
              "generation": tel_job.get("generation", 0), "at": at,
              "allocation": dict(svc.written.get(job_id, {})),
              "resting": sorted(svc.reach.rest_left())}
    svc.post(lambda: svc.events.note(
        job_id, "ring", f"its ring is {size} workers (was {previous}), from its telemetry",
        **detail))


def speed_point(svc, steady: Dict[str, Tuple[int, float]], job_id: str,
                tel_job: dict) -> None:
    """Record the job's speed at its world size (``tel_job``: the telemetry answer's ``job``)
    once it has been at one generation for ``speed.STEADY_S`` (``steady``: job id ->
    (generation, since), kept by :func:`poll`); the store is written on the loop's thread."""
    gen = tel_job.get("generation", 0)
    since = steady.get(job_id)
    if since is None or since[0] != gen:
        steady[job_id] = (gen, time.monotonic())
        return
    if time.monotonic() - since[1] < speed_.STEADY_S:
        return
    hosts = svc.written.get(job_id, {})
    gpu_type = svc.type_of(hosts)
    if gpu_type is None and any(getattr(svc.host_terms.get(h), "gpu_type", None)
                                for h in hosts):
        return  # a ring over GPU types (mixed_types.py) runs at its slowest: not a type's speed
    p = speed_.point(tel_job, gpu_type)
    if p is None:
        return

    def record():
        job = svc.store.job(job_id)
        if job is not None and not job.ended:
            sp = dict(job.speed)
            sp[speed_.key(p)] = p
            svc.store.update(job_id, speed=sp)
    svc.post(record)
