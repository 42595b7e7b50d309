"""The processes of a cluster job: each run is ``python -m launcher.cluster.wrapper ...
hvd-edl-run ...`` started in a session of its own (it outlives the service), as the job's user
(under a root service: :func:`launcher.cluster.users.popen_user`) and with the environment it
was submitted from, with its files in the job's 0700 folder ``STATE_DIR/jobs/<id>/`` (that
user's, and so every file in it):

==========================  ==============================================================
``hosts``                   the allocation file its host discovery prints (:mod:`.allocation`)
``job.json``                its ``--job-file`` (URL and control secret; the control API's
                            client)
``checkpoints/``            its ``--checkpoint-dir`` when the user gave none
``run<N>.log``              the launcher's output
``run<N>.events.jsonl``     its ``--event-log`` (one per run: a launcher starts its log afresh)
``run<N>.pid``              the wrapper's pid: the run started
``run<N>.lock``             ``flock``-ed by the wrapper for its life
``run<N>.exit``             its exit code, written once at its end (:mod:`.wrapper`)
==========================  ==============================================================

:meth:`Run.probe` answers what became of a run from these files alone, so a restarted service
re-adopts what an earlier one started: ``ended`` (with the code), ``alive``, ``never`` (the
service died before the wrapper started: start it now) or ``lost`` (the wrapper died without an
exit code).
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from hvd_edl.private_file import MISSING
from launcher.cluster import allocation, user_files, users
from launcher.cluster.exec_input import NAME
from launcher.spawn import zygote_client

log = logging.getLogger(__name__)

KEPT_DIR_ENV = zygote_client.KEEP_DIR_ENV
MARKER_ENV = "HVD_EDL_CLUSTER_RUN"  # a run's marker (Run.marker), inherited by its processes
DISCOVERY_INTERVAL_S = 0.2  # the jobs' --discovery-interval: a shrink is seen this fast


def folder_owner(folder: Path) -> Optional[Tuple[int, int]]:
    """``(uid, gid)`` of a job's folder when it is not the service's user's (a user's job under
    a root service), else None (also when it does not exist)."""
    try:
        st = os.stat(folder)
    except OSError:
        return None
    return None if st.st_uid == os.geteuid() else (st.st_uid, st.st_gid)


class JobFiles:
    """The paths of one job's folder (see the module docstring); :meth:`make` creates it."""

    def __init__(self, state_dir: Path, job_id: str):
        self.dir = Path(state_dir) / "jobs" / job_id
        self.hosts = self.dir / "hosts"
        self.job_file = self.dir / "job.json"
        self.checkpoints = self.dir / "checkpoints"

    def make(self, uid: Optional[int] = None) -> "JobFiles":
        """Create the folder (0700); a new one is ``uid``'s under a root service
        (:func:`launcher.cluster.users.give`)."""
        if not self.dir.exists():
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            users.give(self.dir, uid)
        return self

    def owner(self) -> Optional[Tuple[int, int]]:
        """``(uid, gid)`` of the folder when it is not the service's user's (a user's job
        under a root service), else None: its files are made theirs."""
        return folder_owner(self.dir)

    def uids(self) -> frozenset:
        """The uids whose files the service accepts in the folder: its own and the folder's
        owner's (the job's user under a root service; :mod:`launcher.cluster.user_files`)."""
        owner = self.owner()
        return user_files.job_uids(owner[0] if owner else None)

    def run_file(self, run: int, kind: str) -> Path:
        return self.dir / f"run{run}.{kind}"

    def read_hosts(self) -> Dict[str, int]:
        """The allocation the job sees now ({} when there is no file)."""
        try:
            return allocation.parse(allocation.read(str(self.hosts), self.uids()))
        except (OSError, ValueError):
            return {}

    def read_gpus(self) -> Dict[str, tuple]:
        """The GPUs the allocation file names per host ({} when none or no file)."""
        try:
            return allocation.parse_gpus(allocation.read(str(self.hosts), self.uids()))
        except (OSError, ValueError):
            return {}

    def write_hosts(self, hosts: Dict[str, int], gpus: Optional[Dict[str, tuple]] = None) -> None:
        """Rewrite the allocation file: ``hosts`` ({host: slots}) and the GPUs of each slot."""
        allocation.write(str(self.hosts), hosts, gpus, self.owner())


def launcher_command() -> List[str]:
    """How to start ``hvd-edl-run`` with this interpreter."""
    script = Path(sys.executable).parent / "hvd-edl-run"
    return [str(script)] if script.exists() else [sys.executable, "-m", "launcher.cli"]


@dataclass(frozen=True)
class RunSpec:
    """What one run of a job is started with.  ``np``, ``min_np``, ``max_np``: the job's
    bounds (``np`` the size it starts at: its allocation's); ``argv``: the training command;
    ``checkpoint_dir``: its ``--checkpoint-dir``; ``checkpoint_every_s``: its interval;
    ``launcher_args``: the pool's own ``hvd-edl-run`` flags (``serve``'s ``-p``, ``-i``,
    ``--network-interface``: how to reach its hosts), the same for every job, except that a job
    run as another user than the service's reaches them with its own ssh keys (no ``-i``);
    ``environ``: the environment it was submitted from (empty: the service's); ``uid``: its
    user (None: the service's); ``kept_zygote``: the ``hvd-edl-run`` flags that say where
    its launcher finds the service's kept zygote for its user (:mod:`.kept_zygotes`), given
    unless the submitter named its own folder (``HVD_EDL_ZYGOTE_DIR``)."""
    argv: Tuple[str, ...]
    cwd: str
    env: Tuple[Tuple[str, str], ...]
    np: int
    min_np: int
    max_np: int
    checkpoint_dir: str
    checkpoint_every_s: float = 30.0
    launcher_args: Tuple[str, ...] = ()
    environ: Tuple[Tuple[str, str], ...] = ()
    uid: Optional[int] = None
    kept_zygote: Tuple[str, ...] = ()

    def own_launcher_args(self) -> List[str]:
        """``launcher_args`` as this job uses them: ``-i KEY`` (the service user's key) left
        out when it runs as another user (docs/cluster.md: each user's key on every host)."""
        args, out = list(self.launcher_args), []
        i = 0
        while i < len(args):
            if args[i] == "-i" and users.runs_as_other(self.uid) and i + 1 < len(args):
                i += 2
                continue
            out.append(args[i])
            i += 1
        return out

    def environment(self, marker: str) -> Dict[str, str]:
        """The run's environment: the submitter's (else the service's), its ``--env`` pairs,
        ``MARKER_ENV`` = ``marker``; under a root service the user's ``HOME``, ``USER`` and
        ``LOGNAME`` when the submitter's environment did not name them."""
        env = dict(self.environ) if self.environ else dict(os.environ)
        if users.runs_as_other(self.uid):
            u = users.User.of_uid(self.uid)
            for k, v in (("HOME", u.home), ("USER", u.name), ("LOGNAME", u.name)):
                env.setdefault(k, v)
        env.update(dict(self.env))
        env[MARKER_ENV] = marker  # its processes inherit it
        return env

    def launcher_argv(self, files: JobFiles, number: int) -> List[str]:
        """``hvd-edl-run``'s command line for run ``number``."""
        discovery = f"{sys.executable} -I -S {allocation.__file__} {files.hosts}"
        return launcher_command() + [
            "-np", str(self.np), "--min-np", str(self.min_np), "--max-np", str(self.max_np),
            "--host-discovery-script", discovery,
            "--discovery-interval", str(DISCOVERY_INTERVAL_S),
            "--job-file", str(files.job_file), "--event-log",
            str(files.run_file(number, "events.jsonl")),
            "--checkpoint-dir", self.checkpoint_dir,
            "--checkpoint-every", f"{self.checkpoint_every_s:g}"] + self.own_launcher_args() \
            + self.kept_zygote_args() + ["--"] + list(self.argv)

    def kept_zygote_args(self) -> List[str]:
        """``kept_zygote``, unless the submitter's environment or the job's ``--env`` named
        its own kept zygotes' folder (flags, not variables: a worker's environment stays the
        submitter's)."""
        env = dict(self.environ) if self.environ else dict(os.environ)
        env.update(dict(self.env))
        return [] if KEPT_DIR_ENV in env else list(self.kept_zygote)


class Run:
    """One run (number ``number``) of a job, started here (``proc``) or adopted."""

    def __init__(self, files: JobFiles, number: int, proc: Optional[subprocess.Popen] = None):
        self.files = files
        self.number = number
        self.proc = proc

    @classmethod
    def start(cls, files: JobFiles, number: int, spec: RunSpec) -> "Run":
        """Start run ``number`` (its wrapper, in a new session, output to ``run<N>.log``), as
        ``spec.uid`` under a root service, with :meth:`RunSpec.environment`; its lock and log
        files are the job's user's.

        Raises:
            OSError: it cannot be started.
            ValueError, TypeError: ``spec`` holds what ``execve`` cannot take (a NUL, a ``=``
                in an environment name, a string not encodable, a non-string): ``submit``
                refuses those (:mod:`.exec_input`), a job stored before it did may hold them.
        """
        owner = files.owner()
        lock_fd = open_in_folder(files.run_file(number, "lock"), os.O_RDWR, owner)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            log_fd = open_in_folder(files.run_file(number, "log"), os.O_WRONLY | os.O_APPEND, owner)
            with os.fdopen(log_fd, "ab") as out:
                if owner is not None:
                    os.fchown(lock_fd, *owner)
                    os.fchown(out.fileno(), *owner)
                env = spec.environment(cls(files, number).marker())
                proc = subprocess.Popen(
                    [sys.executable, "-m", "launcher.cluster.wrapper",
                     "--pid-file", str(files.run_file(number, "pid")),
                     "--exit-file", str(files.run_file(number, "exit")), "--"]
                    + spec.launcher_argv(files, number),
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    cwd=spec.cwd, env=env, start_new_session=True, pass_fds=(lock_fd,),
                    **users.popen_user(spec.uid))
        finally:
            os.close(lock_fd)  # the wrapper holds the lock now (its copy of the descriptor)
        return cls(files, number, proc)

    def marker(self) -> str:
        """The value of :data:`MARKER_ENV` in the environment of this run and of every local
        process it starts (its files' common prefix: unique per state directory and run), by
        which the service finds the run's processes left after its end (:mod:`.orphans`)."""
        return str(self.files.dir / f"run{self.number}")

    def exit_code(self) -> Optional[int]:
        """The run's exit code once written, else None."""
        try:
            return int(json.loads(self._read("exit"))["exit_code"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _lock_held(self) -> bool:
        try:
            fd = open_in_folder(self.files.run_file(self.number, "lock"), os.O_RDWR,
                                self.files.owner(), create=False)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except OSError:
            return True
        finally:
            os.close(fd)

    def probe(self) -> Tuple[str, Optional[int]]:
        """``("ended", code)``, ``("alive", None)``, ``("never", None)`` or ``("lost",
        None)`` (module docstring)."""
        if self.proc is not None:
            self.proc.poll()  # reap our own child
        code = self.exit_code()
        if code is not None:
            return "ended", code
        if self._lock_held():
            return "alive", None
        code = self.exit_code()  # written just before the lock was let go
        if code is not None:
            return "ended", code
        if self.files.run_file(self.number, "pid").exists():
            return "lost", None
        return "never", None

    def error_excerpt(self) -> str:
        """The first lines of the run's error, from the end of ``run<N>.log``: the launcher's
        ``hvd-edl-run: error:`` lines (they quote the failed worker's last error line) and the
        failed script's innermost ``File ..., line N`` of the first traceback; "" when the log
        says nothing of the kind (:func:`error_excerpt`)."""
        return error_excerpt(self.files.run_file(self.number, "log"))

    def _read(self, kind: str, limit: int = 4096) -> str:
        """The text of the run's small file ``run<N>.<kind>`` (:func:`open_in_folder`).

        Raises: OSError (missing, or not a plain file of the job's user)."""
        fd = open_in_folder(self.files.run_file(self.number, kind), os.O_RDONLY,
                            self.files.owner(), create=False)
        with os.fdopen(fd, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")

    def pid(self) -> Optional[int]:
        try:
            return int(self._read("pid"))
        except (OSError, ValueError):
            return None

    def launcher_pid(self) -> Optional[int]:
        """The ``hvd-edl-run`` pid its job file names (None before it is written)."""
        try:
            fd = open_in_folder(self.files.job_file, os.O_RDONLY, self.files.owner(),
                                create=False)
            with os.fdopen(fd, "rb") as f:
                return int(json.loads(f.read(1 << 16))["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def is_wrapper(self, pid: int) -> bool:
        """Whether process ``pid`` is this run's wrapper: its environment carries the run's
        :meth:`marker` (set by :meth:`start`) and it runs as the job's user or the service's.
        ``run<N>.pid`` lies in the job's folder, which is its user's under a root service: a pid
        written there by hand names any process, and root would signal it."""
        import psutil
        owner = self.files.owner()
        uids = {os.geteuid()} | ({owner[0]} if owner is not None else set())
        try:
            proc = psutil.Process(pid)
            return (proc.uids().real in uids
                    and proc.environ().get(MARKER_ENV) == self.marker())
        except (psutil.Error, OSError):
            return False

    def stop(self, sig: int = signal.SIGTERM) -> bool:
        """Send ``sig`` to the run's wrapper (it passes it to the launcher); False when the run
        is not alive, or its pid file names another process (:meth:`is_wrapper`)."""
        pid = self.proc.pid if self.proc is not None else self.pid()
        if pid is None or not self._lock_held():
            return False
        if not self.is_wrapper(pid):
            log.warning("run %s: its pid file names process %d, not its wrapper: not signalled",
                        self.marker(), pid)
            return False
        try:
            os.kill(pid, sig)
            return True
        except OSError:
            return False


def open_in_folder(path: Path, flags: int, owner: Optional[Tuple[int, int]],
                   create: bool = True) -> int:
    """Open (with ``create``, creating it 0600 when missing) a file of a job's folder, which is
    its user's under a root service (:func:`launcher.cluster.user_files.open_owned`: never
    through a link the user planted, never blocking on a FIFO, only a regular file of the
    job's user, ``owner`` ``(uid, gid)``, or the service's own), and not a hard link either:
    else root would write, chown or read a file of anyone's.  Returns a blocking descriptor.

    Raises:
        OSError: it cannot be opened (missing and not ``create``), or it is not such a file
            (:class:`hvd_edl.private_file.PrivateFileError`, one line).
    """
    try:
        fd = user_files.open_owned(path, user_files.job_uids(owner[0] if owner else None),
                                   flags | (os.O_CREAT if create else 0) | os.O_CLOEXEC)
    except user_files.PrivateFileError as e:
        if e.reason == MISSING:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path)) \
                from None
        raise
    try:
        if os.fstat(fd).st_nlink != 1:
            raise OSError(f"{path} is a hard link: not used")
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


LOG_TAIL_BYTES = 64 * 1024   # what :func:`error_excerpt` reads of a run's log
EXCERPT_CHARS = 600           # ... and the longest excerpt it returns


def error_excerpt(log_path: Path) -> str:
    """What a failed run's log (``log_path``, its last :data:`LOG_TAIL_BYTES`) says of the
    error, in one line of at most :data:`EXCERPT_CHARS` characters: its launcher's error lines
    (``hvd-edl-run: error: ...``, the prefix dropped), joined by "; ", then where the first
    traceback of a worker ended (``at "train.py", line 3``); "" when it has none."""
    try:
        with os.fdopen(open_in_folder(log_path, os.O_RDONLY, folder_owner(log_path.parent),
                                      create=False), "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    said = [x.split("hvd-edl-run: error: ", 1)[1].strip() for x in lines
            if x.startswith("hvd-edl-run: error: ")]
    where = ""
    start = next((i for i, x in enumerate(lines) if x.endswith("Traceback (most recent call "
                                                              "last):")), None)
    if start is not None:
        prefix = lines[start][:-len("Traceback (most recent call last):")]
        for x in lines[start + 1:]:
            if not x.startswith(prefix):
                continue
            text = x[len(prefix):]
            if not text.startswith(" "):
                break  # the exception's own line ends the traceback
            if text.strip().startswith("File "):
                where = text.strip()[len("File "):].split(", in ")[0]
    if where:
        said.append(f"at {where}")
    out = "; ".join(said)
    return out if len(out) <= EXCERPT_CHARS else out[:EXCERPT_CHARS - 3] + "..."


def live_slots(telemetry: Optional[dict]) -> Dict[str, int]:
    """host -> worker processes of the job still alive in a ``/ctl/telemetry`` answer
    (:func:`takes_part`): pending, ready, members and leavers until their process exits, so a
    slot (a GPU) is free for the next job only once its leaver is gone."""
    out: Dict[str, int] = {}
    for w in (telemetry or {}).get("workers", []):
        if takes_part(w):
            out[w["host"]] = out.get(w["host"], 0) + 1
    return out


def takes_part(worker: dict) -> bool:
    """Whether a ``/ctl/telemetry`` worker row's process may still use its slot (its GPU): any
    row of a live process, a leaver in its interpreter's teardown included (the launcher drops
    a row when its process has exited).  Counting a leaver out of the ring as gone let the next
    job start on its GPU while it still held its memory (about 8 s in one run)."""
    return worker.get("state") in ("pending", "ready", "member", "leaving")


def environment(pairs: Sequence[str]) -> Dict[str, str]:
    """``["K=V", ...]`` -> ``{K: V}``.

    Raises:
        ValueError: an item without ``=``, or whose name is not a variable name
            (:data:`launcher.cluster.exec_input.NAME`: POSIX's)."""
    out = {}
    for item in pairs:
        k, sep, v = item.partition("=")
        if not sep or not NAME.fullmatch(k):
            raise ValueError(f"--env {item!r}: expected NAME=VALUE (NAME: letters, digits "
                             f"and _, not starting with a digit)")
        out[k] = v
    return out
