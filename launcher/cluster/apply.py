"""Applying an allocation, in the cluster service: each pass of its loop brings every job's run
towards what the store says the job is to hold (the policy's last word, or a host leaving the
pool), the way the service's module docstring tells:

* a smaller allocation is written to the job's allocation file at once (its workers there
  leave stop-free at their next commit); the slots stay *occupied* until the job's telemetry
  shows those workers gone (:func:`check_release`), so no slot is ever used by two jobs;
* a larger one (or a move) is written, or a job not running is started (:func:`start`), only
  on slots free by that measure (:func:`free_slots`); a growth that must wait still shrinks
  what is to go;
* a running job allocated nothing is preempted (:func:`preempt`: checkpoint, then SIGTERM).

All of it runs on the service's loop thread.  Each function takes the service explicitly
(:class:`launcher.cluster.service.Service`): it reads ``store``, ``pool``, ``state_dir``,
``launcher_args`` and ``telemetry``, and keeps the slot state: ``runs`` (job id -> live run),
``written`` (job id -> its allocation file now), ``occupied`` (through
:meth:`Service.set_occupied`), ``releasing`` and ``waiting_since``.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Dict

from launcher.cluster import ends
from launcher.cluster import gpus as gpus_
from launcher.cluster.runs import JobFiles, Run, RunSpec, live_slots
from launcher.cluster.store import JobRecord

log = logging.getLogger(__name__)

CHECKPOINT_WAIT_S = 30.0  # a preemption waits this long for the checkpoint before SIGTERM


def free_slots(svc) -> Dict[str, int]:
    """host -> slots no job occupies (negative when a host shrank under its jobs)."""
    free = dict(svc.pool)
    for hosts in svc.occupied.values():
        for h, k in hosts.items():
            if h in free:
                free[h] -= k
    return free


def apply_allocations(svc) -> None:
    """Bring every job towards its allocation (the service's module docstring)."""
    allocs = svc.store.allocations()
    jobs = {j.id: j for j in svc.store.jobs(("queued", "running", "suspended"))}
    for job_id in list(svc.releasing):  # what the jobs freed since the last pass
        check_release(svc, job_id)
    free = free_slots(svc)
    for job_id, job in jobs.items():
        target = allocs.get(job_id, {})
        if job.stopping:
            continue
        if job_id not in svc.runs:
            if target and job.state in ("queued", "suspended") \
                    and all(free.get(h, 0) >= k for h, k in target.items()):
                for h, k in target.items():
                    free[h] -= k
                start(svc, job, target)
            continue
        if not target:
            preempt(svc, job, wait_s=checkpoint_wait(svc, job_id))
            continue
        written = svc.written.get(job_id, {})
        if target == written:
            continue
        grow = {h: k - written.get(h, 0) for h, k in target.items()
                if k > written.get(h, 0)}
        if all(free.get(h, 0) >= k for h, k in grow.items()):
            for h, k in grow.items():
                free[h] -= k
            write(svc, job_id, target)  # grows, shrinks or moves in one edit
            svc.waiting_since.pop(job_id, None)
            continue
        # the growth waits for slots another job is releasing; shrink what is to go now
        kept = {h: min(k, target.get(h, 0)) for h, k in written.items()
                if h in svc.pool and min(k, target.get(h, 0)) > 0}
        if kept != written and kept:
            write(svc, job_id, kept)


def check_release(svc, job_id: str) -> None:
    """Slots a job was asked to give back count as free once a telemetry answer asked for
    after the request shows its workers there gone (or its run ended)."""
    asked = svc.releasing[job_id]
    written = svc.written.get(job_id, {})
    if job_id in svc.runs:
        fetched, answer = svc.telemetry.get(job_id, (0.0, None))
        if answer is None or fetched < asked:
            return
        live = live_slots(answer)
        if any(live.get(h, 0) > written.get(h, 0) for h in live):
            return
    if job_id in svc.runs:
        fetched, answer = svc.telemetry.get(job_id, (0.0, None))
        gpus_.released(svc, job_id, gpus_.live_pairs(answer))
        svc.set_occupied(job_id, gpus_.occupied_counts(svc, job_id, dict(written)))
    else:
        svc.set_occupied(job_id, {})
    del svc.releasing[job_id]
    svc.events.note(job_id, "released", "its workers on the slots taken back left",
                    released_s=round(time.monotonic() - asked, 3), hosts=dict(written))
    svc.wake.set()


def write(svc, job_id: str, hosts: Dict[str, int]) -> None:
    """Rewrite a job's allocation file, with its GPUs on GPU hosts (:func:`gpus.choose`: a
    running worker keeps its GPU); what it held beyond ``hosts`` stays occupied until released
    (:func:`check_release`)."""
    lists = gpus_.choose(svc, job_id, hosts)
    JobFiles(svc.state_dir, job_id).write_hosts(hosts, lists)
    gpus_.hold(svc, job_id, lists)
    svc.written[job_id] = dict(hosts)
    svc.written_at[job_id] = time.monotonic()
    svc.store.update(job_id, world_size=sum(hosts.values()))
    before = svc.occupied.get(job_id, {})
    occ = {h: max(before.get(h, 0), hosts.get(h, 0)) for h in set(before) | set(hosts)}
    occ = gpus_.occupied_counts(svc, job_id, occ)
    svc.set_occupied(job_id, occ)
    if any(occ.get(h, 0) > hosts.get(h, 0) for h in occ):
        svc.releasing.setdefault(job_id, time.monotonic())


def start(svc, job: JobRecord, hosts: Dict[str, int]) -> None:
    """Start a new run of ``job`` on ``hosts``: recorded first (run number, state), then
    started, so a service killed in between finds the run recorded but never started and puts
    the job back in the queue (:mod:`.adoption`), never starting it twice; the ``run`` event is
    written once the run has started (the event log says only what was done)."""
    number = job.run + 1
    resumed = job.run > 0
    now = time.time()
    waited = time.monotonic() - svc.waiting_since.pop(job.id, time.monotonic())
    svc.store.update(job.id, state="running", run=number, stopping=None,
                     started_at=job.started_at or now, world_size=sum(hosts.values()))
    launch(svc, svc.store.job(job.id), hosts, number,
           reason=f"run {number} started" + (" from its checkpoint" if resumed else ""),
           waited_s=round(waited, 3), since_submit_s=round(now - job.submitted_at, 3))


def launch(svc, job: JobRecord, hosts: Dict[str, int], number: int,
           reason: str = "", **detail) -> None:
    """Start run ``number`` of ``job`` on ``hosts``, as :func:`start` recorded it: its
    allocation file first, then the run, then its ``run`` event (``reason``, ``detail``:
    ``waited_s``, ``since_submit_s``).  A run that cannot start, for any reason (``OSError``;
    ``ValueError`` or ``TypeError`` from what a stored job holds: a NUL, a bad environment
    name, a job stored before ``submit`` checked them) fails the job (:func:`cannot_start`);
    the service goes on."""
    try:
        files = JobFiles(svc.state_dir, job.id).make(job.uid)
        write(svc, job.id, hosts)
        spec = RunSpec(argv=tuple(job.argv), cwd=job.cwd, env=tuple(sorted(job.env.items())),
                       np=sum(hosts.values()), min_np=job.min_np, max_np=job.max_np,
                       checkpoint_dir=job.checkpoint_dir, launcher_args=svc.launcher_args,
                       environ=tuple(sorted(job.environ.items())), uid=job.uid,
                       kept_zygote=svc.kept_zygotes.launcher_args(
                           job.uid, {**(job.environ or os.environ), **job.env}))
        run = Run.start(files, number, spec)
    except Exception as e:  # noqa: BLE001 - whatever a stored job holds: that job fails
        cannot_start(svc, job, number, e)
        return
    svc.runs[job.id] = run
    svc.store.update(job.id, wrapper_pid=run.proc.pid, job_file=str(files.job_file))
    svc.events.note(job.id, "run", reason or f"run {number} started", hosts=hosts, run=number,
                    wrapper_pid=run.proc.pid, **detail)


def cannot_start(svc, job: JobRecord, number: int, error: Exception) -> None:
    """Run ``number`` of ``job`` could not start (``error``): no process of it exists, so its
    slots are free at once, and the job ends ``failed`` with the error in its reason (one line,
    at most 300 characters)."""
    svc.written.pop(job.id, None)
    svc.written_at.pop(job.id, None)
    svc.releasing.pop(job.id, None)
    svc.set_occupied(job.id, {})
    said = " ".join(f"{type(error).__name__}: {error}".split())[:300]
    log.warning("job %s: run %d cannot start: %s", job.id, number, said)
    ends.end(svc, job, "failed", None, f"cannot start its run {number}: {said}")


def checkpoint_wait(svc, job_id: str) -> float:
    """How long a preemption of ``job_id`` waits for its checkpoint: :data:`CHECKPOINT_WAIT_S`,
    or less when a host it occupies is drained with a deadline (until 5 s before the earliest,
    at least 1 s), so that the run is stopped before the machine goes."""
    held = svc.occupied.get(job_id, {})
    deadlines = [d["deadline"] for h, d in svc.drains.items()
                 if d.get("deadline") and held.get(h)]
    if not deadlines:
        return CHECKPOINT_WAIT_S
    return max(1.0, min(CHECKPOINT_WAIT_S, min(deadlines) - time.time() - 5.0))


def preempt(svc, job: JobRecord, wait_s: float = CHECKPOINT_WAIT_S) -> None:
    """Checkpoint (on a thread: it waits for rank 0's next commit, at most ``wait_s`` seconds)
    and SIGTERM the run."""
    svc.store.update(job.id, stopping="preempt",
                     event={"kind": "suspend", "reason": "preempted: checkpoint, then "
                            "SIGTERM; resumes from its checkpoint"})
    svc.events.write({"job": job.id, "kind": "suspend", "reason": "preempted"})
    run = svc.runs[job.id]
    files = run.files

    def checkpoint_then_stop():
        try:
            from launcher.serve.control import ControlClient, ControlError
            try:
                ControlClient(files.job_file, timeout_s=wait_s + 5, owners=files.uids()).call(
                    "checkpoint", wait=wait_s)
            except ControlError as e:
                log.info("job %s: no checkpoint before the preemption: %s", job.id, e)
        finally:
            run.stop(signal.SIGTERM)
    threading.Thread(target=checkpoint_then_stop, daemon=True).start()
