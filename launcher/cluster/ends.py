"""What becomes of a job when its run ends, in the cluster service: the run's files say how it
ended (:meth:`launcher.cluster.runs.Run.probe`: an exit code, or ``lost`` when its wrapper died
without one), the job's record says what the service had asked of it (``stopping``: a cancel, a
preemption); together they give the job's next state and its reason:

=================================  ==========================================================
the run                            the job
=================================  ==========================================================
lost (no exit code)                ``failed``
exited 0                           ``done``
exited after a cancel              ``cancelled``
exited after a preemption          ``suspended`` (resumes later from its checkpoint)
exited otherwise                   ``failed`` (``run N exited CODE: ERROR``, the first lines
                                   of its error from its log: :meth:`Run.error_excerpt`)
=================================  ==========================================================

:func:`end` is the one place a job ends (also a cancel before it ran again, or a run that could
not start).  All of it runs on the service's loop thread.  Each function takes the service
explicitly (:class:`launcher.cluster.service.Service`): it reads ``store`` and ``runs``, clears
the ended run's slot state (``written``, ``releasing``, ``occupied``, ``telemetry``,
``waiting_since``), adds to ``jct_s``, writes events (``events``) and sets ``decide_now``.
"""
from __future__ import annotations

import time
from typing import Optional

from launcher.cluster import gpus as gpus_
from launcher.cluster import orphans
from launcher.cluster.runs import JobFiles, Run
from launcher.cluster.store import JobRecord


def check_runs(svc) -> None:
    """Probe every live run; each that ended leaves ``svc.runs`` and goes to
    :func:`run_ended`."""
    for job_id, run in list(svc.runs.items()):
        what, code = run.probe()
        if what == "alive":
            continue
        job = svc.store.job(job_id)
        del svc.runs[job_id]
        run_ended(svc, job, what, code)


def run_ended(svc, job: JobRecord, what: str, code: Optional[int]) -> None:
    """The run of ``job`` ended (``what``, ``code``: :meth:`Run.probe`'s answer): free its
    slots (once no local process of the run is left: :mod:`.orphans`), then end the job or
    suspend it (module docstring) and ask for a round."""
    files = JobFiles(svc.state_dir, job.id)
    held = svc.occupied.get(job.id) or (files.read_hosts() if what != "never" else {})
    if job.id not in svc.held_gpus and held:  # adopted after the end: its GPUs as it left them
        gpus_.load_held(svc, job.id, files.read_gpus())
    svc.written.pop(job.id, None)
    svc.releasing.pop(job.id, None)
    if not orphans.hold(svc, job.id, Run(files, job.run).marker(), dict(held)):
        svc.set_occupied(job.id, {})  # no process of the run is left: its slots are free now
    svc.telemetry.pop(job.id, None)
    if what == "lost":
        end(svc, job, "failed", None, f"run {job.run} ended without an exit code (its "
            f"wrapper was killed)")
    elif code == 0:
        end(svc, job, "done", 0, f"run {job.run} exited 0")
    elif job.stopping == "cancel":
        end(svc, job, "cancelled", code, f"cancelled: run {job.run} exited {code}")
    elif job.stopping == "preempt":
        svc.store.update(job.id, state="suspended", stopping=None, world_size=0,
                         allocation={}, reason="suspended to its checkpoint",
                         event={"kind": "suspended", "reason": f"run {job.run} stopped "
                                f"(exit {code}) after its checkpoint", "exit_code": code})
        svc.events.write({"job": job.id, "kind": "suspended", "exit_code": code,
                          "reason": "suspended to its checkpoint"})
    else:
        said = Run(JobFiles(svc.state_dir, job.id), job.run).error_excerpt()
        end(svc, job, "failed", code, f"run {job.run} exited {code}" + (f": {said}" if said
                                                                        else ""))
    svc.decide_now = True


def end(svc, job: JobRecord, state: str, code: Optional[int], reason: str) -> None:
    """The one place a job ends (``state`` one of ``done``, ``failed``, ``cancelled``): state,
    exit code and time in one transaction, with ``reason``; its allocation goes."""
    now = time.time()
    svc.store.update(job.id, state=state, exit_code=code, finished_at=now, world_size=0,
                     stopping=None, allocation={}, reason=reason,
                     event={"kind": "end", "reason": reason, "state": state,
                            "exit_code": code})
    svc.events.write({"at": now, "job": job.id, "kind": "end", "state": state,
                      "exit_code": code, "reason": reason})
    svc.waiting_since.pop(job.id, None)
    if state == "done":
        svc.jct_s.append(now - job.submitted_at)
    svc.decide_now = True
