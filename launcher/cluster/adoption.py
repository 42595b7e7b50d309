"""Re-adoption, in the cluster service: a service started on a state directory an earlier one
used (after a stop, a crash, a ``kill -9``) takes over the runs that one started.  Its jobs run
in sessions of their own and outlive it, and every state change was in the store before it was
acted on, so the store's ``running`` jobs and their files (:meth:`launcher.cluster.runs.Run.probe`)
say what became of each run:

* ``alive``: the run is the service's again, with the slots its allocation file gives it; a
  cancel or a preemption the earlier service asked for is asked again (SIGTERM; a preempted run
  is stopped without a new checkpoint request);
* ``never`` (the earlier service died between recording the run and starting it): it is
  started now on its recorded allocation, so a run is never started twice; without one the job
  goes back to the queue (``queued``, or ``suspended`` after an earlier run);
* ``ended`` or ``lost``: the run ended while no service watched; the job ends or is suspended
  as for any run's end (:func:`launcher.cluster.ends.run_ended`).

:func:`adopt` runs once, from :meth:`launcher.cluster.service.Service.open` (the service given
explicitly), before the loop starts.
"""
from __future__ import annotations

import signal
import threading
import time

from launcher.cluster import apply, ends
from launcher.cluster import gpus as gpus_
from launcher.cluster.runs import JobFiles, Run


def adopt(svc) -> None:
    """Re-adopt the runs an earlier service started on ``svc.state_dir`` (module docstring):
    fills ``svc.runs``, ``written`` and ``occupied`` for the live ones, starts the ones recorded
    but never started, ends the others; an ``adopt`` event for each of the first two."""
    for job in svc.store.jobs(("running",)):
        files = JobFiles(svc.state_dir, job.id).make()
        run = Run(files, job.run)
        what, code = run.probe()
        hosts = files.read_hosts()
        if what == "alive":
            svc.runs[job.id] = run
            svc.written[job.id] = hosts
            # its GPUs: its file's lists, plus what its leavers still held when the earlier
            # service stopped (held until its telemetry shows them gone)
            gpus_.load_held(svc, job.id, files.read_gpus())
            occupied = gpus_.occupied_counts(svc, job.id, hosts)
            svc.set_occupied(job.id, occupied)
            if occupied != hosts:
                svc.releasing[job.id] = time.monotonic()
            svc.events.note(job.id, "adopt", f"run {job.run} re-adopted (wrapper pid "
                            f"{run.pid()}, launcher pid {run.launcher_pid()})", hosts=hosts)
            if job.stopping == "cancel":
                run.stop(signal.SIGTERM)
            elif job.stopping == "preempt":
                threading.Thread(target=run.stop, daemon=True).start()
        elif what == "never":
            allocs = svc.store.allocations().get(job.id) or hosts
            svc.events.note(job.id, "adopt", f"run {job.run} was recorded but never started: "
                            f"starting it now", hosts=allocs)
            if allocs:
                apply.launch(svc, job, allocs, job.run)
            else:
                svc.store.update(job.id, state="queued" if job.run <= 1 else "suspended")
        else:
            ends.run_ended(svc, job, what, code)
