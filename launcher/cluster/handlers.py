"""The requests of the cluster service's HTTP API (:func:`launcher.cluster.server.routes`):
``submit`` and ``cancel`` change the store, so the server runs them on the service's loop thread
(:meth:`launcher.cluster.service.Service.call`: the store has one writer); ``status`` only reads
(the store, and the pool and the slots in use: ``Service.slots_in_use``), so any thread may call
it (the server's, ``/metrics``'s collector); so does ``logs`` (the store and a run's log).  A bad request raises :class:`RequestError`
(HTTP 400; 404 for an unknown job).

Each function takes the service explicitly (:class:`launcher.cluster.service.Service`, whose
``submit``/``cancel``/``status`` methods call them): ``submit`` reads ``pool``, ``fixed_pool``
and ``state_dir``, adds the job to ``store``, makes its folder and sets ``decide_now``;
``cancel`` stops the job's run in ``runs`` or ends the job (:func:`launcher.cluster.ends.end`).

Each request has a caller (:class:`launcher.cluster.users.User`, the kernel's word): a job is
its submitter's (``user``, ``uid``) and runs with the environment it was submitted from;
``cancel`` and ``logs`` of another user's job are refused (:func:`.users.may_manage`, 403).
"""
from __future__ import annotations

import os
import signal
import time
from typing import Optional

from launcher.arg_types import MAX_PRIORITY, MAX_WORKERS
from launcher.cluster import drains as drains_
from launcher.cluster import ends, exec_input, reasons, runnable, users
from launcher.cluster.runs import JobFiles, open_in_folder, takes_part
from launcher.cluster.store import JobRecord, Store


class RequestError(ValueError):
    """A client request refused (bad input: 400; ``status`` 404 for an unknown job)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def submit(svc, req: dict, caller: Optional[users.User] = None) -> dict:
    """A ``submit`` request of ``caller`` (default: the service's user; validated here; the
    loop's thread only): the job is queued as ``caller``'s, in the store with its folder (that
    user's), and a round is asked for.  ``req["environ"]``, the environment ``submit`` ran in,
    is the job's (``req["env"]``, its ``--env`` pairs, on top); without it, the service's.

    Returns:
        ``{"id": ..., "state": "queued"}``.
    Raises:
        RequestError: a bad size, (a fixed pool) a ``min_np`` that can never fit, a bad goal
            (:func:`check_goal`).
        launcher.cluster.exec_input.BadExecInput: what ``execve`` could not take: no
            command, an argument, a path or an environment variable with a NUL, a name not
            POSIX's, a string too long (:mod:`.exec_input`).
        launcher.cluster.runnable.NotRunnable: the job could not start as its user (its
            folder, interpreter, training script: the first argument after the interpreter
            ending in ``.py``, or the service's interpreter: :func:`.runnable.check`).
    """
    caller = caller or users.service_user()
    argv = exec_input.check_argv(req.get("argv"))
    nums = {}
    for key in ("np", "min_np", "max_np", "priority"):
        v = req.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise RequestError(f"{key} must be an integer, got {v!r}")
        nums[key] = v
    for key, bound in (("np", MAX_WORKERS), ("min_np", MAX_WORKERS), ("max_np", MAX_WORKERS),
                       ("priority", MAX_PRIORITY)):
        if nums[key] is not None and abs(nums[key]) > bound:
            raise RequestError(f"{key} {nums[key]} is out of range (at most {bound} either "
                               f"side of 0)")
    np_, lo, hi = nums["np"], nums["min_np"], nums["max_np"]
    np_ = np_ or lo or 1
    lo = lo or np_
    hi = hi or max(np_, lo)
    if min(np_, lo, hi) < 1:
        raise RequestError("--np, --min-np and --max-np must be at least 1")
    if lo > hi:
        raise RequestError(f"--min-np {lo} is larger than --max-np {hi}")
    if not lo <= np_ <= hi:
        raise RequestError(f"--np {np_} must lie within [--min-np {lo}, --max-np {hi}]")
    capacity = sum(svc.pool.values())
    if svc.fixed_pool and lo > capacity:
        raise RequestError(f"--min-np {lo} can never fit: the pool has {capacity} slots")
    cwd = exec_input.check_path(req.get("cwd") or os.getcwd(), "cwd")
    env = exec_input.check_environ(req.get("env"), "env")
    environ = exec_input.check_environ(req.get("environ"), "environ")
    runnable.check(argv, cwd, dict(environ or os.environ, **env), caller.uid)
    goal, speed = check_goal(svc, req.get("goal"), req.get("speed_profile"))
    script = next((a for a in argv if a.endswith(".py")), argv[0])
    name = exec_input.check_name(req.get("name") or os.path.basename(script)[:64])
    ckpt = exec_input.check_path(req.get("checkpoint_dir") or "", "checkpoint_dir")
    job = JobRecord(id="", name=str(name)[:64], argv=argv, cwd=cwd, env=env, np=np_,
                    min_np=lo, max_np=hi, priority=nums["priority"] or 0,
                    checkpoint_dir=str(ckpt), state="queued", submitted_at=time.time(),
                    goal=goal, speed=speed, user=caller.name, uid=caller.uid,
                    environ=environ)
    job = svc.store.add_job(job, event={"kind": "submit", "reason": "submitted",
                                        "np": np_, "min_np": lo, "max_np": hi,
                                        "user": caller.name})
    files = JobFiles(svc.state_dir, job.id).make(job.uid)
    if not ckpt:
        svc.store.update(job.id, checkpoint_dir=str(files.checkpoints))
    svc.events.write({"at": job.submitted_at, "job": job.id, "kind": "submit",
                      "reason": "submitted", "np": np_, "min_np": lo, "max_np": hi,
                      "user": caller.name})
    svc.decide_now = True
    return {"id": job.id, "state": "queued"}


def check_goal(svc, goal, profile) -> tuple:
    """A submit's ``goal`` (``{"objective", "samples", "deadline_at", "budget_usd",
    "types"}``, :class:`launcher.cluster.choice.Goal`) and ``speed_profile`` checked: returns
    (the goal's dict or {}, the job's first speed points).

    Raises:
        RequestError: an unknown objective, samples not positive, a deadline not finite or
            already past, a budget not positive, types neither a list nor a comma string (or an
            empty name in them), a GPU type neither the pool nor the price table knows, or a
            malformed speed profile."""
    import math
    from launcher.cluster import speed as speed_
    from launcher.cluster.choice import OBJECTIVES, Goal
    if not goal:
        if profile:
            raise RequestError("a speed profile goes with an objective (--objective)")
        return {}, {}
    if not isinstance(goal, dict) or goal.get("objective") not in OBJECTIVES:
        raise RequestError(f"objective must be one of {', '.join(OBJECTIVES)}")
    types = goal.get("types")
    if isinstance(types, str):  # "t4,a100", as --types says it
        goal = dict(goal, types=types.split(","))
    elif types is not None and not (isinstance(types, (list, tuple))
                                    and all(isinstance(t, str) for t in types)):
        raise RequestError(f"types must be a list of GPU type names or a comma-separated "
                           f"string, got {types!r}")
    if any(not t.strip() for t in goal.get("types") or ()):  # "a100,,t4": not a shorter list
        raise RequestError(f"types {types!r}: an empty GPU type name")
    goal = dict(goal, types=[t.strip().lower() for t in goal.get("types") or ()])
    try:
        g = Goal.from_dict(goal)
    except (KeyError, TypeError, ValueError):
        raise RequestError("a goal needs objective and samples (a number)") from None
    if not (math.isfinite(g.samples) and g.samples > 0):
        raise RequestError(f"--samples must be positive, got {g.samples:g}")
    if g.deadline_at is not None and not (isinstance(g.deadline_at, (int, float))
                                          and math.isfinite(g.deadline_at)):
        raise RequestError(f"the deadline must be a finite number of unix seconds, got "
                           f"{g.deadline_at!r}")
    if g.deadline_at is not None and not g.deadline_at > time.time():
        raise RequestError(f"the deadline {g.deadline_at!r} is already past")
    if g.budget_usd is not None and not (isinstance(g.budget_usd, (int, float))
                                         and math.isfinite(g.budget_usd) and g.budget_usd > 0):
        raise RequestError(f"the budget must be a positive number of dollars, got "
                           f"{g.budget_usd!r}")
    known_types = svc.known_types()
    for t in list(g.types) + list((profile or {}).keys()):
        if t not in known_types:
            raise RequestError(f"unknown GPU type {t!r} (the pool and the price table know: "
                               f"{', '.join(sorted(known_types)) or 'none'})")
    try:
        points = speed_.profile_points(profile) if profile else {}
    except ValueError as e:
        raise RequestError(f"--speed-profile: {e}") from None
    out = g.as_dict()
    out["done_samples"] = 0.0
    if profile and speed_.start_costs(profile):
        out["start_s"] = speed_.start_costs(profile)
    return out, points


def cancel(svc, job_id: str, caller: Optional[users.User] = None) -> dict:
    """A ``cancel`` request of ``caller`` (default: the service's user; the loop's thread
    only): a running job's run gets SIGTERM (it ends ``cancelled`` when the run exits), any
    other job ends ``cancelled`` now.

    Raises:
        RequestError: an unknown job (404) or one already ended.
        launcher.cluster.users.Refusal: another user's job (403).
    """
    job = known(svc.store, job_id)
    users.may_manage(caller or users.service_user(), job_id, job.user, job.uid, "cancel")
    if job.ended:
        raise RequestError(f"job {job_id} already ended ({job.state})")
    if job_id in svc.runs:
        svc.store.update(job_id, stopping="cancel",
                         event={"kind": "cancel", "reason": "cancel requested: SIGTERM"})
        svc.events.write({"job": job_id, "kind": "cancel", "reason": "cancel requested"})
        svc.runs[job_id].stop(signal.SIGTERM)
        return {"id": job_id, "state": "running", "cancelling": True}
    ends.end(svc, job, "cancelled", None, "cancelled before it ran again")
    return {"id": job_id, "state": "cancelled"}


LOG_CHUNK_BYTES = 256 * 1024  # the most of a run's log one ``logs`` answer carries


def logs(svc, job_id: str, run: Optional[int] = None, offset: int = 0,
         limit: int = LOG_CHUNK_BYTES, caller: Optional[users.User] = None) -> dict:
    """A ``logs`` request (any thread: reads only): up to ``limit`` bytes of run ``run``'s
    output (default the latest run), its launcher's and its workers' (``run<N>.log`` in the
    job's folder), from byte ``offset`` on.  A chunk that stops short of the end stops after
    its last whole line.

    Returns:
        ``{"id", "run", "runs", "state", "offset", "next", "size", "data", "ended"}``:
        ``data`` the text (UTF-8, undecodable bytes replaced), ``next`` the offset to ask from
        next, ``size`` the log's size when read, ``ended`` whether the run had ended before
        it was read (then ``next == size`` means every line is in).
    Raises:
        RequestError: an unknown job, a job that has not run yet, or no such run (404).
        launcher.cluster.users.Refusal: another user's job (403).
    """
    job = known(svc.store, job_id)
    users.may_manage(caller or users.service_user(), job_id, job.user, job.uid,
                     "read the logs of")
    if job.run == 0:
        raise RequestError(f"job {job_id} has not run yet ({job.state}): no output",
                           status=404)
    number = job.run if run is None else run
    if not 1 <= number <= job.run:
        raise RequestError(f"job {job_id} has no run {number} (its runs: "
                           + (f"1 to {job.run})" if job.run > 1 else "1)"), status=404)
    ended = number < job.run or job.state != "running"  # before reading: then all is written
    files = JobFiles(svc.state_dir, job_id)
    path = files.run_file(number, "log")
    try:
        with os.fdopen(open_in_folder(path, os.O_RDONLY, files.owner(), create=False),
                       "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(min(max(0, offset), size))
            data = f.read(max(1, min(limit, LOG_CHUNK_BYTES)))
    except FileNotFoundError:
        size, data = 0, b""
    except OSError as e:  # a link or a FIFO planted in the job's folder (runs.open_in_folder)
        raise RequestError(f"job {job_id}: its log cannot be read: {e}", status=409)
    start = min(max(0, offset), size)
    if start + len(data) < size and b"\n" in data:
        data = data[:data.rindex(b"\n") + 1]
    return {"id": job_id, "run": number, "runs": job.run, "state": job.state, "offset": start,
            "next": start + len(data), "size": size, "ended": ended,
            "data": data.decode("utf-8", "replace")}


def known(store: Store, job_id) -> JobRecord:
    """The record of ``job_id``.

    Raises:
        RequestError: no such job (404).
    """
    job = store.job(job_id) if isinstance(job_id, str) else None
    if job is None:
        raise RequestError(f"no job {job_id!r} in this cluster (hvd-edl-cluster status "
                           f"lists them)", status=404)
    return job


def workers_of(telemetry) -> list:
    """A running job's workers from its last ``/ctl/telemetry`` answer (``(fetched, answer)``
    or None): ``{"worker", "host", "slot", "gpu", "state", "rank"}`` each, as its launcher
    placed them (``gpu``: None on a CPU host); only those whose process may still live
    (:func:`launcher.cluster.runs.takes_part`: a worker its launcher fenced is not shown)."""
    answer = telemetry[1] if telemetry else None
    return [{"worker": w.get("worker_id"), "host": w.get("host"), "slot": w.get("slot"),
             "gpu": w.get("gpu"), "state": w.get("state"), "rank": w.get("rank")}
            for w in (answer or {}).get("workers", []) if takes_part(w)]


def ring_size(telemetry) -> int:
    """The workers in a running job's ring from its last ``(fetched, answer)`` of
    ``/ctl/telemetry`` (0 before its first answer): what ``status``/``top`` show as its
    ``world_size`` (its slots are ``allocated``)."""
    size = (((telemetry or (0, None))[1] or {}).get("job") or {}).get("world_size", 0)
    return size if isinstance(size, int) and not isinstance(size, bool) else 0


def status(svc, job_id: Optional[str] = None) -> dict:
    """What ``status``/``queue``/``top`` show (any thread: reads only): every job (or only
    ``job_id``) with its ``reason`` (a waiting job's: why it waits, :func:`.reasons.shown`),
    the pool, the policy, slots total/used/free/lent, the queue and which jobs hold each
    host's slots.

    Raises:
        RequestError: an unknown ``job_id`` (404).
    """
    store = svc.store
    allocs = store.allocations()
    jobs = [known(svc.store, job_id)] if job_id else store.jobs()
    pool, occupied = svc.slots_in_use()
    used = sum(sum(v.values()) for v in occupied.values())
    running = [j for j in jobs if j.state == "running"]
    out = [j.public(allocs.get(j.id)) for j in jobs]
    waiting = svc.waiting_reasons   # the last round's (replaced whole: a consistent read)
    host_gpus, job_gpus = svc.gpu_view()
    for row in out:
        row["reason"] = reasons.shown(row["state"], row["reason"], row["allocation"],
                                      waiting.get(row["id"]))
        row["gpus"] = {h: list(g) for h, g in job_gpus.get(row["id"], {}).items()}
        row["allocated"] = row["world_size"]  # the slots it holds (its allocation file)
        if row["state"] == "running":  # its real membership: its telemetry, not the allocation
            tel = svc.telemetry.get(row["id"])
            row["world_size"] = ring_size(tel)
            row["workers"] = workers_of(tel)
        else:
            row["workers"] = []
    return {"jobs": out, "pool": pool, "pool_gpus": {h: list(g) for h, g in host_gpus.items()},
            "resting": svc.reach.rest_left(),  # hosts no job reaches: seconds of rest left
            "kept_out": drains_.kept_out(svc),  # host -> why it is not scheduled, the undo
            "policy": getattr(svc.policy, "name", "?"),
            "slots": {"total": sum(pool.values()), "used": used,
                      "free": max(0, sum(pool.values()) - used),
                      "lent": sum(max(0, j.world_size - j.np) for j in running)},
            "queue": [j.id for j in jobs if j.state in ("queued", "suspended")],
            "holders": {h: [[jid, n] for jid, hosts in occupied.items()
                            for hh, n in hosts.items() if hh == h] for h in pool}}
