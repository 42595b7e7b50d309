"""A run's processes after its end, in the cluster service: a run ends when its wrapper reports the
launcher's exit, but the run's worker processes may outlive it (a ``kill -9`` of ``hvd-edl-run``:
its workers get SIGKILL through ``PR_SET_PDEATHSIG``, but a process a worker started, a data
loader's worker or a CUDA helper, does not, and a SIGKILLed process with a GPU context still
takes a moment to release it).  Its slots (GPUs) must not go to another job while they live.

Every run is started with :data:`ENV` = its marker (:meth:`launcher.cluster.runs.Run.marker`:
the run's own path prefix in the state directory, unique per service and run) in its
environment; the launcher's local workers and whatever they start inherit it.  When a run ends
(:func:`launcher.cluster.ends.run_ended`) its slots and GPUs stay occupied while any local
process carries the marker
(:func:`carriers`, ``/proc/PID/environ``), checked at each pass of the loop without blocking
it (:func:`check`), and are freed once none does.  Bounded: after :data:`GRACE_S` the carriers
left get SIGKILL (they belong to a run that has ended; Slurm ends a job's cgroup alike), and
after :data:`WAIT_S` in all the slots are freed whatever is left (an event says so), so a
process that never dies cannot hold the pool.

Remote hosts: the service cannot see their processes.  A remote worker is started through a
local ``ssh`` client, a child of the launcher carrying the marker, so the wait covers it while
that client lives; when the ssh session breaks, the remote supervisor
(:mod:`launcher.spawn.remote_worker`) SIGKILLs the worker's process group on that host.  What
is not covered: the seconds between the ssh client's end and the remote group's exit.

Each function takes the service explicitly (:class:`launcher.cluster.service.Service`) on its
loop's thread: it keeps ``svc.leftovers`` (job id -> :class:`Drain`).
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Dict, List

from launcher.cluster.runs import MARKER_ENV as ENV  # every process of a run carries it
GRACE_S = 10.0   # a run's leftover processes may end on their own this long, then SIGKILL
WAIT_S = 15.0    # the slots of an ended run are freed after this long whatever is left
SCAN_S = 0.1     # at most one scan of /proc per this many seconds


def carriers(value: str) -> List[int]:
    """The pids of this machine's processes whose environment carries ``ENV=value`` (those of
    other users cannot be read: never ours)."""
    needle = f"{ENV}={value}".encode()
    out = []
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            out.append(int(name))
    return out


@dataclass
class Drain:
    """An ended run whose processes may still live: since when (monotonic), the pids seen last,
    whether the leftovers were killed, the last scan."""
    marker: str
    since: float
    pids: tuple = ()
    killed: bool = False
    scanned: float = 0.0


def hold(svc, job_id: str, value: str, hosts: Dict[str, int]) -> bool:
    """A run of ``job_id`` (marker ``value``) ended: when local processes still carry its
    marker, keep ``hosts`` (its slots; its GPUs stay held) occupied until they are gone
    (:func:`check`) and return True; else False (the caller frees them now)."""
    pids = carriers(value)
    if not pids or not hosts:
        return False
    now = time.monotonic()
    svc.set_occupied(job_id, hosts)
    svc.leftovers[job_id] = Drain(value, now, tuple(pids), scanned=now)
    svc.events.note(job_id, "orphans", f"its run ended with {len(pids)} of its processes "
                    f"still alive: its slots are held until they are gone (at most "
                    f"{WAIT_S:g} s)", pids=sorted(pids), hosts=hosts)
    return True


def check(svc) -> None:
    """Each pass of the loop: free the slots of every ended run none of whose processes is left
    (SIGKILL to the leftovers after :data:`GRACE_S`; freed anyway after :data:`WAIT_S`)."""
    now = time.monotonic()
    for job_id, d in list(svc.leftovers.items()):
        if now - d.scanned < SCAN_S:
            continue
        d.scanned = now
        pids = carriers(d.marker)
        waited = now - d.since
        if pids and waited < WAIT_S:
            if waited >= GRACE_S and not d.killed:
                d.killed = True
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                svc.events.note(job_id, "orphans", f"{len(pids)} processes of its ended run "
                                f"still alive after {GRACE_S:g} s: SIGKILL", pids=sorted(pids))
            d.pids = tuple(pids)
            continue
        del svc.leftovers[job_id]
        svc.set_occupied(job_id, {})
        svc.events.note(job_id, "orphans", "its ended run's processes are gone: its slots are "
                        "free" if not pids else f"{len(pids)} processes of its ended run still "
                        f"alive after {WAIT_S:g} s: its slots are freed anyway",
                        waited_s=round(waited, 3), pids=sorted(pids))
        svc.decide_now = True
        svc.wake.set()
