"""The cluster service's telemetry thread: it asks each running job for its control API's
``/ctl/telemetry`` (:class:`launcher.serve.control.ControlClient`), every
:data:`TELEMETRY_IDLE_S` seconds, every :data:`TELEMETRY_BUSY_S` while the job releases slots.
The answers give

* the job's live workers per host, from which the loop sees slots taken back actually freed
  (``svc.telemetry``, read by :func:`launcher.cluster.apply.check_release`; the loop is woken at
  once for a releasing job);
* its speed at its current world size once it has trained steadily for ``speed.STEADY_S`` at
  one generation (:mod:`launcher.cluster.speed`), recorded in the job's ``speed`` (the
  throughput the policies see) by the loop's thread (the store has one writer).

Its functions take the service explicitly (``svc``, :class:`launcher.cluster.service.Service`):
they read ``svc.runs`` and ``svc.releasing`` (the loop's), and write only ``svc.telemetry``.
"""
from __future__ import annotations

import time
from typing import Dict, Tuple

from launcher.cluster import speed as speed_
from launcher.cluster.job_goodput import JobGoodput

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
            svc.telemetry[job_id] = (asked, answer)
            speed_point(svc, steady, job_id, answer.get("job", {}))
            if answer.get("adaptive_batch"):  # the script opted in: learn its goodput
                svc.goodput.setdefault(job_id, JobGoodput()).observe(answer, asked)
            if job_id in svc.releasing:
                svc.wake.set()
        time.sleep(TELEMETRY_BUSY_S if svc.releasing else 0.2)


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
