"""The control API of a running ``hvd-edl-run`` job (EDL's ``scale_out`` / ``scale_in``) and how a
client finds it.

The API is served by the coordinator's HTTP server (same port, same bind address, same per-job
secret and signature check as the workers' requests, see :mod:`launcher.serve.control_auth`).  Every
call is ``POST`` with a JSON object and answers a JSON object:

==================  ===============  ==========================================================
path                body             effect
==================  ===============  ==========================================================
``/ctl/status``     ``{}``           generation, world size, workers, step, last stall, target
``/ctl/telemetry``  ``{}``           the heartbeats' figures only (``hvd-edl-ctl top``; cheap)
``/ctl/scale``      ``{"np": N}``    target world size N in [min-np, max-np]
``/ctl/drain``      ``{"host": H}``  workers on H leave at the next commit; none placed there
``/ctl/undrain``    ``{"host": H}``  H may be used again
``/ctl/batch``      ``{"batch": B}`` global batch B from the next switch on, for a script that
                                     opted in (``hvd.elastic.AdaptiveBatchSampler``); answers
                                     ``adaptive`` false when it did not (it keeps its batch);
                                     B pins it (``--adapt-batch`` leaves it);
                                     ``{"batch": "auto"}`` lifts the pin
``/ctl/checkpoint`` ``{"wait": S}``  rank 0 writes a checkpoint at its next commit; answers
                                     ``{"path", "step"}`` once written (``path`` null after S s)
``/ctl/profile``    ``{"sizes": [N],  walk through those world sizes stop-free, measure each
                    "seconds": S,    (``launcher.apps.profiler``); answers at once; ``{"status":
                    "out": DIR}``    true}`` answers the running or last profile instead
``/ctl/migrate``    ``{"from": A,    the workers on A move to B in one stop-free switch (new
                    "to": B,         ones build first); A is drained; answers the migration
                    "wait": S}``     (``phase`` "done", "abandoned", or still running after S s)
==================  ===============  ==========================================================

A refused call answers 400 with ``{"error": "..."}`` and changes nothing.

The job file.  At start ``hvd-edl-run`` writes ``{"url", "secret", "pid", "command",
"started"}`` to a file only its user can read (mode 0600, in a 0700 directory): ``--job-file
PATH``, else ``$XDG_RUNTIME_DIR/hvd-edl/<pid>.json``, else ``~/.hvd_edl/jobs/<pid>.json``; it
prints the path and removes the file when it ends (also when the launch is refused).
With ``--job-file`` a pointer ``<pid>.ref`` in that default directory names it; a reader
(``hvd-edl-ctl list``) removes the pointers of launchers gone (``kill -9``).
``hvd-edl-ctl`` reads ``--job FILE`` (or ``--job PID``: that launcher's file in the default
directory), else ``$HVD_EDL_JOB``, else the only job file of a running launcher in that default
directory.  It refuses a job file that is a symbolic link, is not owned by the user, or that
others can read or write (the secret in it would be someone else's, or no longer secret).
"""
from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence

from hvd_edl import private_file
from hvd_edl.private_file import PrivateFileError, read_private, write_private
from launcher.serve.control_auth import CallRefused, post_signed

ENV_JOB = "HVD_EDL_JOB"
PREFIX = "/ctl/"


class ControlError(RuntimeError):
    """A control call failed: the job refused it (``status`` 400-499) or could not be reached
    (``status`` None).  The message is one line for people."""

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(message)
        self.status = status


# ---- the job file --------------------------------------------------------------------------------

def default_job_dir() -> Path:
    """Where job files go when no path is given (see the module docstring)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "hvd-edl"
    return Path.home() / ".hvd_edl" / "jobs"


def write_job_file(path: Optional[str], url: str, secret: str,
                   command: Sequence[str] = ()) -> Path:
    """Write the job file atomically with mode 0600 (its directory 0700 if created) and return
    its path; ``path`` None means ``default_job_dir()/<pid>.json``.  ``command``: the training
    command (for ``hvd-edl-ctl list``); ``started`` is now (unix seconds).

    Raises:
        OSError: the file cannot be written.
    """
    target = Path(path) if path else default_job_dir() / f"{os.getpid()}.json"
    write_private(target, json.dumps({"url": url, "secret": secret, "pid": os.getpid(),
                                      "command": list(command), "started": time.time()}).encode())
    if path:  # --job-file: a pointer in the default directory, so that list and --job PID see it
        try:
            write_private(_pointer(os.getpid()),
                          json.dumps({"job_file": str(target.resolve())}).encode())
        except OSError:
            pass  # the job runs; only hvd-edl-ctl list will not show it
    return target


def _pointer(pid: int) -> Path:
    """The default directory's pointer to the job file of launcher ``pid`` written elsewhere
    (``--job-file``): ``<pid>.ref``, ``{"job_file": PATH}``."""
    return default_job_dir() / f"{pid}.ref"


def remove_job_file(path: Path) -> None:
    """The launcher's end: remove its job file and its pointer (missing ones are fine)."""
    for p in (path, _pointer(os.getpid())):
        try:
            p.unlink()
        except OSError:
            pass


def _pointed_to(ref: Path) -> Optional[Path]:
    """The job file a ``<pid>.ref`` pointer names, None when unreadable or unsafe."""
    try:
        target = json.loads(read_private(ref)).get("job_file")
    except (PrivateFileError, OSError, ValueError, AttributeError):
        return None
    return Path(target) if isinstance(target, str) else None


def _launcher_running(pid: int, job_file: Path) -> bool:
    """True when process ``pid`` exists and was started before ``job_file`` was written, so it
    is the launcher that wrote it and not a later process that reused the pid of a launcher
    ended by ``kill -9`` (whose job file stays behind)."""
    import psutil  # here: the launcher, which imports this module, never needs it
    try:
        return psutil.Process(pid).create_time() <= job_file.stat().st_mtime + 1.0
    except (psutil.Error, OSError):
        return False


def read_job_file(path: Path, owners: Optional[Iterable[int]] = None) -> dict:
    """The job file's contents, after checking it is safe to use: a regular file (not a
    symbolic link), owned by this user, neither readable nor writable by group or others.
    ``owners``: the uids whose file is accepted (default: this user only; a root cluster service
    also accepts the job's user for a file in that user's job folder,
    :mod:`launcher.cluster.user_files`).

    Raises:
        ControlError: missing, unreadable, unsafe (the message says which check failed and
            what to do) or malformed.
    """
    try:
        data = read_private(path, owners=owners)
    except PrivateFileError as e:
        if e.reason == private_file.SYMLINK:
            raise ControlError(f"job file {path} is a symbolic link: refused (hvd-edl-run writes "
                               f"a plain file; give its real path)") from None
        if e.reason == private_file.NOT_REGULAR:
            raise ControlError(f"job file {path} is not a regular file: refused") from None
        if e.reason == private_file.OTHER_OWNER:
            mine = sorted(set(owners)) if owners is not None else [os.geteuid()]
            raise ControlError(f"job file {path} is owned by uid {e.uid}, not by you (uid "
                               f"{', '.join(map(str, mine))}): refused (its secret is not "
                               f"yours to use)") from None
        if e.reason == private_file.OPEN_TO_OTHERS:
            raise ControlError(f"job file {path} is readable or writable by others (mode "
                               f"{e.mode:04o}): refused, its secret may be "
                               f"known; hvd-edl-run writes it 0600 (restart the job, or "
                               f"chmod 600 {path} if you know no one else read or changed it)") from None
        if e.reason == private_file.MISSING:
            raise ControlError(f"no job file {path}: the job ended (hvd-edl-run removes it at "
                               f"its end) or never ran") from None
        why = e.detail or e.reason
        raise ControlError(f"cannot read job file {path}: {why}") from None
    try:
        job = json.loads(data)
    except ValueError as e:
        raise ControlError(f"cannot read job file {path}: {e}") from None
    if not isinstance(job, dict):
        raise ControlError(f"cannot read job file {path}: not a JSON object")
    return job


MAX_REFS_READ = 1024  # the most <pid>.ref pointers one reader looks at (and prunes)


def live_refs(folder: Path, limit: int = MAX_REFS_READ) -> List[Path]:
    """The ``<pid>.ref`` pointers in ``folder`` whose launcher still runs (at most ``limit``
    looked at); each whose launcher is gone (``kill -9``: it could not remove its own) is
    removed on the way, so they do not pile up."""
    live = []
    for ref in sorted(itertools.islice(folder.glob("*.ref"), limit)):
        stem = ref.stem
        if stem.isdigit() and _launcher_running(int(stem), ref):
            live.append(ref)
        elif stem.isdigit() and ref.exists() and not ref.is_symlink():
            try:
                ref.unlink()
            except OSError:
                pass
    return live


def running_jobs(folder: Optional[Path] = None) -> List[Path]:
    """Job files in ``folder`` (default :func:`default_job_dir`) whose launcher still runs;
    files that are unsafe (see :func:`read_job_file`) or malformed are skipped.  Jobs whose
    file is elsewhere (``--job-file``) are found through their ``<pid>.ref`` pointer there
    (:func:`live_refs`, which removes the pointers of launchers gone)."""
    folder = default_job_dir() if folder is None else folder
    live: List[Path] = []
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    files += [t for t in map(_pointed_to, live_refs(folder) if folder.is_dir()
                             else []) if t is not None]  # --job-file jobs
    for p in files:
        try:
            pid = int(read_job_file(p).get("pid", -1))
        except (ControlError, ValueError, TypeError):
            continue
        if _launcher_running(pid, p):
            live.append(p)
    return live


def find_job_file(explicit: Optional[str] = None) -> Path:
    """The job file ``hvd-edl-ctl`` uses: ``explicit`` (a path, or a launcher's pid: its file
    in :func:`default_job_dir`), else ``$HVD_EDL_JOB``, else the only job file in
    :func:`default_job_dir` whose launcher is still running.

    Raises:
        ControlError: a pid with no job file, or none given and none or several running jobs
            found.
    """
    given = explicit or os.environ.get(ENV_JOB)
    if given and given.isdigit() and not os.path.exists(given):
        path = default_job_dir() / f"{given}.json"
        if not os.path.lexists(path):
            path = _pointed_to(_pointer(int(given))) or path
        if not os.path.lexists(path):
            raise ControlError(f"no job file for pid {given} in {default_job_dir()} (see "
                               f"hvd-edl-ctl list)")
        return path
    if given:
        return Path(given)
    folder = default_job_dir()
    live = running_jobs(folder)
    if not live:
        raise ControlError(f"no running job found in {folder}; give --job FILE or set {ENV_JOB} "
                           f"(hvd-edl-run prints the path at start)")
    if len(live) > 1:
        raise ControlError(f"{len(live)} running jobs in {folder}: "
                           f"{', '.join(str(p) for p in live)}; choose one with --job FILE or "
                           f"--job PID (hvd-edl-ctl list)")
    return live[0]


# ---- client --------------------------------------------------------------------------------------

class ControlClient:
    """Signed calls to a job's control API.

    Args:
        job_file: a file written by :func:`write_job_file`.
        timeout_s: seconds one call may take.
        owners: the uids whose job file is accepted (default: this user only;
            :func:`read_job_file`).

    Raises:
        ControlError: the job file is missing, unreadable, unsafe (:func:`read_job_file`)
            or malformed.
    """

    def __init__(self, job_file: Path, timeout_s: float = 30.0,
                 owners: Optional[Iterable[int]] = None):
        job = read_job_file(Path(job_file), owners)
        try:
            self.url = str(job["url"]).rstrip("/")
            self.secret = str(job["secret"])
        except (KeyError, TypeError) as e:
            raise ControlError(f"cannot read job file {job_file}: missing {e}") from None
        self.job = job
        self.path = Path(job_file)
        self.timeout_s = timeout_s

    def call(self, name: str, **args) -> dict:
        """POST ``args`` to ``/ctl/<name>`` and return the answer.

        Raises:
            ControlError: the job refused the call (its message) or cannot be reached.
        """
        from http.client import HTTPException
        try:
            return post_signed(self.url, PREFIX + name, self.secret, args, self.timeout_s)
        except CallRefused as e:
            raise ControlError(str(e), e.status) from None
        except TimeoutError:
            raise ControlError(f"the job at {self.url} did not answer within "
                               f"{self.timeout_s:g} s (--timeout)") from None
        except ConnectionError:
            raise ControlError(self._unreachable()) from None
        except (OSError, HTTPException) as e:   # no name, an answer that is not HTTP, ...
            said = " ".join(str(e).split())[:200]   # one line
            detail = f"{type(e).__name__}: {said}" if said else type(e).__name__
            raise ControlError(f"cannot reach the job at {self.url}: {detail}") from None


    def _unreachable(self) -> str:
        """One line on a refused connection: the job ended (its file is gone or its launcher
        no longer runs), else nothing answers at its address yet or any more."""
        pid = self.job.get("pid")
        gone = not self.path.exists() or not isinstance(pid, int) or \
            not _launcher_running(pid, self.path)
        if gone:
            return f"the job ended (its launcher, pid {pid}, is gone)"
        return (f"no job answers at {self.url} (connection refused; its launcher, pid {pid}, "
                f"still runs: starting, ending or stopped)")


# ---- server side ---------------------------------------------------------------------------------

def routes(driver) -> Dict[str, Callable[[dict], dict]]:
    """The control API's handlers for ``CoordinatorServer(extra_routes=...)``; ``driver`` is the
    job's :class:`launcher.job.driver.Driver`.  Handlers raise ``ValueError`` for bad requests."""

    def _int(data: dict, key: str) -> int:
        v = data.get(key)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{key!r} must be an integer, got {v!r}")
        return v

    def _host(data: dict) -> str:
        return _named(data, "host")

    def _wait(data: dict, default: float) -> float:
        v = data.get("wait", default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"'wait' must be a number of seconds, got {v!r}")
        return float(v)

    def _named(data: dict, key: str) -> str:
        """The host in ``data[key]``, canonical (``launcher.discovery.hosts.check_host``: as discovery
        spells it), or ValueError (HostSpecError) with one line."""
        from launcher.discovery.hosts import check_host
        v = data.get(key)
        if not isinstance(v, str) or not v:
            raise ValueError(f"{key!r} must be a host name, got {v!r}")
        return check_host(v.strip().removeprefix("[").removesuffix("]"))

    return {
        PREFIX + "migrate": lambda data: driver.migrate(_named(data, "from"), _named(data, "to"),
                                                        _wait(data, 120.0)),
        PREFIX + "status": lambda data: driver.status(),
        PREFIX + "telemetry": lambda data: driver.telemetry_snapshot(),
        PREFIX + "profile": lambda data: driver.profiler.status() if data.get("status") else
        driver.profiler.start(data.get("sizes"), data.get("seconds", 10.0),
                              data.get("out", "."), data.get("settle", 2.0)),
        PREFIX + "scale": lambda data: driver.set_target(_int(data, "np")),
        PREFIX + "batch": lambda data: driver.set_batch(
            "auto" if data.get("batch") == "auto" else _int(data, "batch")),
        PREFIX + "drain": lambda data: driver.drain(_host(data), True),
        PREFIX + "undrain": lambda data: driver.drain(_host(data), False),
        PREFIX + "checkpoint": lambda data: driver.request_checkpoint(
            float(data.get("wait", 60.0)) if isinstance(data.get("wait", 60.0), (int, float))
            else _int(data, "wait")),
    }
