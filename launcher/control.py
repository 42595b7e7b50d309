"""The control API of a running ``hvd-edl-run`` job (EDL's ``scale_out`` / ``scale_in``) and how a
client finds it.

The API is served by the coordinator's HTTP server (same port, same bind address, same per-job
secret and signature check as the workers' requests, see :mod:`launcher.control_auth`).  Every
call is ``POST`` with a JSON object and answers a JSON object:

==================  ===============  ==========================================================
path                body             effect
==================  ===============  ==========================================================
``/ctl/status``     ``{}``           generation, world size, workers, step, last stall, target
``/ctl/scale``      ``{"np": N}``    target world size N in [min-np, max-np]
``/ctl/drain``      ``{"host": H}``  workers on H leave at the next commit; none placed there
``/ctl/undrain``    ``{"host": H}``  H may be used again
==================  ===============  ==========================================================

A refused call answers 400 with ``{"error": "..."}`` and changes nothing.

The job file.  At start ``hvd-edl-run`` writes ``{"url", "secret", "pid"}`` to a file only its
user can read (mode 0600, in a 0700 directory): ``--job-file PATH``, else
``$XDG_RUNTIME_DIR/hvd-edl/<pid>.json``, else ``~/.hvd_edl/jobs/<pid>.json``; it prints the path
and removes the file when it ends.  ``hvd-edl-ctl`` reads ``--job FILE``, else ``$HVD_EDL_JOB``,
else the only job file of a running launcher in that default directory.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional

import psutil
import requests

from hvd_edl import messages

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


def write_job_file(path: Optional[str], url: str, secret: str) -> Path:
    """Write the job file atomically with mode 0600 (its directory 0700 if created) and return
    its path; ``path`` None means ``default_job_dir()/<pid>.json``.

    Raises:
        OSError: the file cannot be written.
    """
    target = Path(path) if path else default_job_dir() / f"{os.getpid()}.json"
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=str(target.parent), prefix=".job-", suffix=".tmp")  # 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"url": url, "secret": secret, "pid": os.getpid()}, f)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    return target


def _launcher_running(pid: int, job_file: Path) -> bool:
    """True when process ``pid`` exists and was started before ``job_file`` was written, so it
    is the launcher that wrote it and not a later process that reused the pid of a launcher
    ended by ``kill -9`` (whose job file stays behind)."""
    try:
        return psutil.Process(pid).create_time() <= job_file.stat().st_mtime + 1.0
    except (psutil.Error, OSError):
        return False


def find_job_file(explicit: Optional[str] = None) -> Path:
    """The job file ``hvd-edl-ctl`` uses: ``explicit``, else ``$HVD_EDL_JOB``, else the only job
    file in :func:`default_job_dir` whose launcher is still running.

    Raises:
        ControlError: none given and none or several running jobs found.
    """
    given = explicit or os.environ.get(ENV_JOB)
    if given:
        return Path(given)
    folder = default_job_dir()
    live: List[Path] = []
    for p in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            pid = int(json.loads(p.read_text()).get("pid", -1))
        except (OSError, ValueError, AttributeError):
            continue
        if _launcher_running(pid, p):
            live.append(p)
    if not live:
        raise ControlError(f"no running job found in {folder}; give --job FILE or set {ENV_JOB} "
                           f"(hvd-edl-run prints the path at start)")
    if len(live) > 1:
        raise ControlError(f"{len(live)} running jobs in {folder}: "
                           f"{', '.join(str(p) for p in live)}; choose one with --job FILE")
    return live[0]


# ---- client --------------------------------------------------------------------------------------

class ControlClient:
    """Signed calls to a job's control API.

    Args:
        job_file: a file written by :func:`write_job_file`.
        timeout_s: seconds one call may take.

    Raises:
        ControlError: the job file is missing, unreadable or malformed.
    """

    def __init__(self, job_file: Path, timeout_s: float = 30.0):
        try:
            job = json.loads(Path(job_file).read_text())
            self.url = str(job["url"]).rstrip("/")
            self.secret = str(job["secret"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ControlError(f"cannot read job file {job_file}: {e}") from None
        self.timeout_s = timeout_s

    def call(self, name: str, **args) -> dict:
        """POST ``args`` to ``/ctl/<name>`` and return the answer.

        Raises:
            ControlError: the job refused the call (its message) or cannot be reached.
        """
        path = PREFIX + name
        body = json.dumps(args).encode()
        headers = {messages.AUTH_HEADER: messages.sign(self.secret, "POST", path, body),
                   "Content-Type": "application/json"}
        try:
            r = requests.post(self.url + path, data=body, headers=headers, timeout=self.timeout_s)
        except requests.RequestException as e:
            raise ControlError(f"cannot reach the job at {self.url}: {e}") from None
        try:
            data = r.json()
        except ValueError:
            data = {}
        if r.status_code != 200 or not isinstance(data, dict):
            why = data.get("error") if isinstance(data, dict) else None
            raise ControlError(why or f"HTTP {r.status_code}", r.status_code)
        return data


# ---- server side ---------------------------------------------------------------------------------

def routes(driver) -> Dict[str, Callable[[dict], dict]]:
    """The control API's handlers for ``CoordinatorServer(extra_routes=...)``; ``driver`` is the
    job's :class:`launcher.driver.Driver`.  Handlers raise ``ValueError`` for bad requests."""

    def _int(data: dict, key: str) -> int:
        v = data.get(key)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{key!r} must be an integer, got {v!r}")
        return v

    def _host(data: dict) -> str:
        v = data.get("host")
        if not isinstance(v, str) or not v:
            raise ValueError(f"'host' must be a host name, got {v!r}")
        return v

    return {
        PREFIX + "status": lambda data: driver.status(),
        PREFIX + "scale": lambda data: driver.set_target_np(_int(data, "np")),
        PREFIX + "drain": lambda data: driver.drain(_host(data), True),
        PREFIX + "undrain": lambda data: driver.drain(_host(data), False),
    }
