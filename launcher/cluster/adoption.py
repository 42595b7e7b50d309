"""Re-adoption, in the cluster service: a service started on a state directory an earlier one
used (after a stop, a crash, a ``kill -9``) takes over the runs that one started.  Its jobs run
in sessions of their own and outlive it, and every state change was in the store before it was
acted on, so the store's ``running`` jobs and their files (:meth:`launcher.cluster.runs.Run.probe`)
say what became of each run:

* ``alive``: the run is the service's again, with the slots its allocation file gives it; a
  cancel or a preemption the earlier service asked for is asked again (SIGTERM; a preempted run
  is stopped without a new checkpoint request);
* ``never`` (the earlier service died between recording the run and starting it): the job goes
  back to the queue as it was before (``queued``, or ``suspended`` after an earlier run; its run
  number back, no ``run`` event: that start never happened), and the next round decides anew;
* ``ended`` or ``lost``: the run ended while no service watched; the job ends or is suspended
  as for any run's end (:func:`launcher.cluster.ends.run_ended`).

:func:`adopt` runs once, from :meth:`launcher.cluster.service.Service.open` (the service given
explicitly), before the loop starts.

What the store holds as a job's *allocation* is the policy's last decision, which the earlier
service may not have carried out when it died (a shrink decided but its file not written, a
start decided but not begun).  The event log must say only what was done, and the new service
must not act on a decision it did not take: each adopted run's allocation is set back to what its
file gives it, the allocation of a job with no run is cleared, and a decision dropped that way is
named in the ``adopt`` event (``dropped``: the hosts decided); the first round then decides from
what the jobs really hold.
"""
from __future__ import annotations

import signal
import threading
import time

from launcher.cluster import ends
from launcher.cluster import gpus as gpus_
from launcher.cluster.runs import JobFiles, Run


def adopt(svc) -> None:
    """Re-adopt the runs an earlier service started on ``svc.state_dir`` (module docstring):
    fills ``svc.runs``, ``written`` and ``occupied`` for the live ones, puts the ones recorded
    but never started back in the queue, ends the others; an ``adopt`` event for each of the
    first two; allocations set back to what was done."""
    allocs = svc.store.allocations()
    for job in svc.store.jobs(("running",)):
        files = JobFiles(svc.state_dir, job.id).make()
        run = Run(files, job.run)
        what, code = run.probe()
        hosts = files.read_hosts()
        decided = allocs.get(job.id, {})
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
            dropped = {}
            if not job.stopping and decided != hosts:  # decided, never carried out
                dropped = {"dropped": decided}
                svc.store.update(job.id, allocation=hosts)
            svc.events.note(job.id, "adopt", f"run {job.run} re-adopted (wrapper pid "
                            f"{run.pid()}, launcher pid {run.launcher_pid()})"
                            + (f"; its allocation is what its file gives it, the decision "
                               f"{decided} was not carried out" if dropped else ""),
                            hosts=hosts, **dropped)
            if job.stopping == "cancel":
                run.stop(signal.SIGTERM)
            elif job.stopping == "preempt":
                threading.Thread(target=run.stop, daemon=True).start()
        elif what == "never":
            back = "queued" if job.run <= 1 else "suspended"
            svc.store.update(job.id, state=back, run=job.run - 1, allocation={},
                             started_at=job.started_at if job.run > 1 else None)
            svc.events.note(job.id, "adopt", f"run {job.run} was recorded but never started: "
                            f"{back} again, the next round decides", dropped=decided)
        else:
            ends.run_ended(svc, job, what, code)
    for job in svc.store.jobs(("queued", "suspended")):
        decided = allocs.get(job.id)
        if decided:  # a start decided, not begun
            svc.store.update(job.id, allocation={})
            svc.events.note(job.id, "undone", f"{job.state}: its start on {decided} was decided "
                            f"but not begun: the next round decides", dropped=decided)
