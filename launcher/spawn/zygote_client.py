"""The launcher's side of the worker fork server (``hvd_edl/zygote.py``): which commands may use
one, how a zygote is keyed, started and found, and the stub that stands for one worker.

Standard library only, and no import of this package: the local stub runs this file by path
(``python -I -S zygote_client.py SOCKET WAIT_S -- COMMAND...``, about 30 ms of CPU), and over ssh its
source travels ahead of the remote supervisor's (``remote_worker.py``), which uses
:class:`Session` the same way.

The stub is the launcher's child for one worker, with the worker's environment, working
directory and PR_SET_PDEATHSIG: it hands its stdin/stdout/stderr and the job to the zygote, which
forks the worker; it forwards every signal it gets to the worker's process group and exits with
the worker's exit code (dying of the same signal when the worker did, so ``Popen.returncode`` is
-N as for an exec'd worker).  If it cannot reach a zygote within its bound, or the zygote
refuses the command, it ``exec``s the command itself: the exec path, nothing visible to the user.
"""
import json
import os
import re
import signal
import socket
import sys
import time

# variables that the worker's interpreter, its libraries (libgomp, OpenBLAS, MKL, torch) or
# hvd_edl's own modules read while ``import hvd_edl.torch`` runs: two environments that differ
# in one of them need two zygotes (tests/test_zygote.py checks hvd_edl's module-level reads);
# the second line: what ``import torch._dynamo`` reads (the zygote preloads it:
# hvd_edl.zygote.preload_dynamo; tests/test_zygote.py checks every name it reads is here), less
# TMPDIR/TEMP/TMP, whose traces the preload removes
IMPORT_ENV = re.compile(r"PYTHON.*|LD_.*|OMP_.*|GOMP_.*|KMP_.*|MKL_.*|OPENBLAS_.*|TORCH_.*"
                        r"|PYTORCH_.*|LANG|LANGUAGE|LC_.*|MALLOC_.*|HVD_EDL_IDLE_WAIT_MS"
                        r"|HVD_EDL_STREAM_.*|HVD_EDL_SYNC_.*"
                        r"|TORCHDYNAMO_.*|TORCHINDUCTOR_.*|INDUCTOR_.*|AOTINDUCTOR_.*|AOT_.*"
                        r"|PARTITIONER_.*|SYMPY_.*|MPMATH_.*|TRITON_.*|CUTLASS_.*|CUTEDSL_.*"
                        r"|PT2_.*|LOG_AUTOTUNE.*|LOG_TLPARSE|DUMP_AOTI.*|ENABLE_.*TMA.*"
                        r"|FAKE_ALLOW_META|UNSAFE_SKIP_FSDP_.*|CI|CXX|SAGE_ROOT|_PYTHON_.*"
                        r"|HOME|USER|LOGNAME|LNAME|USERNAME")
PYTHON_NAME = re.compile(r"python(\d+(\.\d+)*)?")
# the zygote's start: nothing from the working directory on sys.path (the worker's own path is
# set per worker)
ZYGOTE_BOOT = "import sys; del sys.path[0]; import hvd_edl.zygote as z; z.main()"
WAIT_S = 120.0        # a stub waits this long for its zygote's import, then execs itself
READY_WAIT_S = 5.0    # ... or this long for a kept zygote that was serving a moment ago
REMOTE_IDLE_S = 60.0  # a per-user zygote on a remote host exits after this long without workers
SWITCH_ENV = "HVD_EDL_ZYGOTE"
KEEP_ENV = "HVD_EDL_ZYGOTE_KEEP"      # seconds a kept zygote lives idle (opt-in: keep_seconds)
KEEP_DIR_ENV = "HVD_EDL_ZYGOTE_DIR"   # the folder of this user's kept zygotes (keep_folder)
KEPT_NAMES = ("PATH", "HOME", "USER", "LOGNAME", "TMPDIR", "SHELL")  # kept_env
# a label of whoever starts kept zygotes (a test run): kept in the zygote's own environment and
# in the cluster service's folder names, so that run finds what it left (mark)
KEPT_MARK_ENV = "HVD_EDL_KEPT_MARK"


def wanted(flag=None, env=None) -> bool:
    """Whether workers start through a zygote: ``flag`` (``--zygote`` / ``--no-zygote``) if
    given, else ``HVD_EDL_ZYGOTE=0|1`` in ``env`` (the launcher's environment), else yes."""
    if flag is not None:
        return bool(flag)
    value = (os.environ if env is None else env).get(SWITCH_ENV, "").strip()
    return value not in ("0", "no", "false", "off")


def eligible(command, env) -> bool:
    """``PYTHON [-u] SCRIPT ...`` or ``PYTHON [-u] -m MODULE ...`` with a Python interpreter found
    on the worker's ``PATH`` (anything else, a shell script or another interpreter, execs)."""
    if len(command) < 2 or not PYTHON_NAME.fullmatch(os.path.basename(command[0])):
        return False
    rest = list(command[1:])
    while rest and rest[0] == "-u":
        rest = rest[1:]
    if not rest or (rest[0].startswith("-") and not (rest[0] == "-m" and len(rest) >= 2)):
        return False
    if any(not p or not os.path.isabs(p) for p in env.get("PYTHONPATH", "").split(os.pathsep)
           if env.get("PYTHONPATH")):
        return False   # a relative entry is resolved against the zygote's cwd, not the worker's
    return executable(command[0], env) is not None


def executable(name, env):
    """Where ``name`` is found as ``exec`` would find it with ``env``'s PATH (None: nowhere)."""
    import shutil
    return shutil.which(name, path=env.get("PATH", os.defpath)) if os.sep not in name else \
        (name if os.access(name, os.X_OK) else None)


def import_env(env) -> dict:
    """The part of ``env`` that ``import hvd_edl.torch`` reads (:data:`IMPORT_ENV`)."""
    return {k: v for k, v in env.items() if IMPORT_ENV.fullmatch(k)}


def zygote_key(python, env) -> str:
    """A zygote's name: the interpreter as the command names it (a venv's ``python`` and the base
    interpreter differ), the import-time environment, the user and the host (its name and
    network namespace: namespace hosts share one /tmp); 16 hex digits."""
    import hashlib
    text = json.dumps([python, sorted(import_env(env).items()), os.getuid(),
                       env.get("PATH", ""), host_identity()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def host_identity() -> str:
    """This host as a worker sees it: host name and network namespace."""
    import socket as _socket
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{_socket.gethostname()}:{netns}"


def zygote_env(env, per_worker) -> dict:
    """What a zygote is started with: ``env`` less the worker's own variables (``per_worker``
    names), but with every import-time one (the key's)."""
    return {k: v for k, v in env.items() if k not in per_worker or IMPORT_ENV.fullmatch(k)}


def remote_session(command, env, cwd, per_worker, fds):
    """On a remote host (the ssh supervisor): run the worker through this user's kept zygote for
    its key (:func:`kept_zygote`, idle for :data:`REMOTE_IDLE_S` it exits; stubs wait at most
    :data:`WAIT_S` for its import).  Returns a started :class:`Session`, or None: exec the
    command instead.  ``per_worker``: unused (a kept zygote's environment is
    :func:`kept_env`'s)."""
    if not eligible(command, env):
        return None
    sock = kept_zygote(command[0], env, private_dir(), REMOTE_IDLE_S)
    session = Session()
    if sock is None or not session.connect(sock, wait_for(sock)):
        return None
    if session.start(command, env, cwd, fds=fds, kill_group_on_exit=True) is None:
        return None
    return session


def keep_seconds(flag=None, env=None):
    """How long a kept zygote lives without workers (seconds), or None: keep none (the
    default).  ``flag``: ``hvd-edl-run --keep-zygote[=SECONDS]`` if given, else
    ``HVD_EDL_ZYGOTE_KEEP=SECONDS`` in ``env`` (the launcher's environment; 0, empty or not a
    number: none)."""
    if flag is not None:
        return float(flag) if flag > 0 else None
    value = (os.environ if env is None else env).get(KEEP_ENV, "").strip()
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if 0 < seconds < float("inf") else None


def keep_folder(env=None) -> str:
    """Where this user's kept zygotes live: ``HVD_EDL_ZYGOTE_DIR`` in ``env`` (a cluster
    service's per-user folder, a test session's), else :func:`private_dir`'s default.

    Raises:
        OSError: that folder is not a private folder of this user (:func:`private_dir`).
    """
    return private_dir((os.environ if env is None else env).get(KEEP_DIR_ENV) or None)


def kept_env(env) -> dict:
    """A kept zygote's own environment: ``env``'s import-time variables (the key's) and
    :data:`KEPT_NAMES`, nothing of the job that started it (its secret, a cluster run's
    marker: the service finds a run's processes by it, and a zygote shared by later jobs is
    none of them).  ``HVD_EDL_KEPT_MARK`` (:func:`mark`) is kept too: a label of the starter
    (a test run), which no worker gets from it (a worker's environment is its stub's)."""
    out = import_env(env)
    out.update({k: env[k] for k in KEPT_NAMES if k in env})
    if mark(env):
        out[KEPT_MARK_ENV] = mark(env)
    return out


def mark(env=None) -> str:
    """``HVD_EDL_KEPT_MARK`` of ``env`` (default: this process's) if it is a short label
    (1-32 letters and digits), else "": what a test run sets so that kept zygotes and the
    cluster service's zygote folders it started can be found after it (tests/leftovers.py)."""
    value = (os.environ if env is None else env).get(KEPT_MARK_ENV, "")
    return value if re.fullmatch(r"[0-9A-Za-z]{1,32}", value) else ""


def kept_zygote(python, env, folder, idle_s):
    """The socket of this user's kept zygote for ``python`` and ``env``'s key in ``folder``
    (``KEY.sock``), started now if none serves or is starting (one starter at a time: the
    ``KEY.lock`` file; its pid in ``KEY.pid``), to exit after ``idle_s`` seconds without
    workers.  None when it failed to start within the last 10 minutes (``KEY.sock.failed``):
    the exec path, without paying the import again.  The socket may not be bound yet (the
    zygote is importing): :meth:`Session.connect` waits for it.

    The folder is opened once and checked (:func:`open_private_dir`); every file in it is
    opened, removed or renamed relative to that descriptor and without following a link, so a
    folder swapped by another user after the check (a parent others can write) cannot make
    this user create or append a file of their choosing (breaker i8).

    Raises:
        OSError: ``folder`` is not a private folder of this user, or a file in it is a link.
    """
    key = zygote_key(python, env)
    sock = os.path.join(folder, f"{key}.sock")
    dir_fd = open_private_dir(folder)
    try:
        if listening(sock):
            return sock
        sweep_dead(dir_fd, folder)
        with os.fdopen(_locked(dir_fd, f"{key}.lock"), "a"):
            if listening(sock) or kept_pid(sock) is not None:
                return sock   # ready, or importing
            failed = f"{key}.sock.failed"
            try:
                if time.time() - os.stat(failed, dir_fd=dir_fd,
                                         follow_symlinks=False).st_mtime < 600:
                    return None
            except FileNotFoundError:
                pass
            for stale in (f"{key}.sock", failed):
                try:
                    os.unlink(stale, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
            log_fd = _open_in(dir_fd, f"{key}.sock.log", os.O_WRONLY | os.O_APPEND)
            try:
                popen = start_zygote(python, sock, kept_env(env), idle_s=idle_s, log_fd=log_fd)
            finally:
                os.close(log_fd)
            tmp = f"{key}.pid.{os.getpid()}"
            with os.fdopen(_open_in(dir_fd, tmp, os.O_WRONLY | os.O_TRUNC), "w") as f:
                f.write(str(popen.pid))
            os.replace(tmp, f"{key}.pid", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return sock
    finally:
        os.close(dir_fd)


def _locked(dir_fd, name, wait=True):
    """A descriptor of the lock file ``name`` in ``dir_fd`` (created if missing), holding its
    ``flock``; the file is still the one named ``name`` when this returns (a sweeper or a
    zygote that exits may remove a lock file while holding it: whoever waited on the removed
    one takes the new one).  ``wait=False``: None at once if another holds it.

    Raises:
        OSError: the file is a link, or it kept being replaced (10 tries).
    """
    import fcntl
    for _ in range(10):
        fd = _open_in(dir_fd, name, os.O_WRONLY | os.O_APPEND)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
    raise OSError(f"lock file {name} keeps being replaced")


SWEEP_AFTER_S = 600.0   # a dead kept zygote's files are swept once all are this old (issue 38)
_KEPT_SUFFIXES = (".sock", ".pid", ".sock.log", ".sock.failed", ".lock")


def sweep_dead(dir_fd, folder, older_than_s=SWEEP_AFTER_S):
    """Remove the files of this user's kept zygotes in ``folder`` (opened as ``dir_fd``) that
    died without removing them (killed: no process listens on ``KEY.sock`` and ``KEY.pid``
    names no live zygote), for keys whose every file is older than ``older_than_s`` seconds,
    each under its ``KEY.lock`` taken without waiting (a key being started is skipped), the lock
    file last.  Returns the keys swept.  Issue 38: 479 such files in one day of tests."""
    try:
        names = os.listdir(dir_fd)
    except OSError:
        return []
    keys = {}
    for name in names:
        for suffix in _KEPT_SUFFIXES:
            if name.endswith(suffix) and re.fullmatch(r"[0-9a-f]{16}", name[:-len(suffix)]):
                keys.setdefault(name[:-len(suffix)], []).append(name)
                break
    now, swept = time.time(), []
    for key, files in sorted(keys.items()):
        try:
            if any(now - os.stat(n, dir_fd=dir_fd, follow_symlinks=False).st_mtime < older_than_s
                   for n in files):
                continue
        except OSError:
            continue
        sock = os.path.join(folder, f"{key}.sock")
        try:
            fd = _locked(dir_fd, f"{key}.lock", wait=False)
        except OSError:
            continue
        if fd is None:
            continue
        try:
            if listening(sock) or kept_pid(sock) is not None:
                continue
            for suffix in _KEPT_SUFFIXES:   # .lock last, while held
                try:
                    os.unlink(f"{key}{suffix}", dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
            swept.append(key)
        finally:
            os.close(fd)
    return swept


def open_private_dir(path) -> int:
    """A descriptor of ``path``, checked once opened to be a directory of this user's, 0700,
    not a link (``O_NOFOLLOW``): what is opened relative to it stays in that directory even if
    ``path`` is swapped afterwards.  The caller closes it.

    Raises:
        OSError: ``path`` is missing, a link, someone else's or open to others.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        os.close(fd)
        raise OSError(f"{path} is not a private directory of uid {os.getuid()}")
    return fd


def _open_in(dir_fd, name, flags) -> int:
    """``name`` in the directory ``dir_fd``, created 0600 if missing, never through a link."""
    return os.open(name, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)


def wait_for(sock_path) -> float:
    """How long a stub waits for a kept zygote's socket: :data:`WAIT_S` while it imports, a few
    seconds when it served a moment ago (it may have just ended: then exec soon)."""
    return READY_WAIT_S if listening(sock_path) else WAIT_S


def listening(sock_path) -> bool:
    """Whether a zygote serves ``sock_path`` now (a connection that is closed at once)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sock_path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def kept_pid(sock_path, uid=None):
    """The pid of the live zygote of user ``uid`` (default: this one) that ``KEY.pid`` beside ``sock_path`` names
    (its command line must name ``sock_path``: a pid file outlives its process, and pids are
    reused), else None."""
    try:
        with open(f"{sock_path[:-5]}.pid") as f:
            pid = int(f.read(32))
        if os.stat(f"/proc/{pid}").st_uid != (os.getuid() if uid is None else uid):
            return None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return None
    except (OSError, ValueError):
        return None
    return pid if ZYGOTE_BOOT.encode() in argv and os.fsencode(sock_path) in argv else None


def end_kept(folder):
    """SIGTERM every kept zygote in ``folder`` (by its pid file, checked as :func:`kept_pid`
    does, as the folder's owner's): each stops taking workers and exits when its last worker
    has.  Returns the pids signalled."""
    ended = []
    try:
        owner = os.lstat(folder).st_uid
        names = os.listdir(folder)
    except OSError:
        return ended
    for name in sorted(names):
        if not name.endswith(".pid"):
            continue
        pid = kept_pid(os.path.join(folder, name[:-4] + ".sock"), owner)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
                ended.append(pid)
            except OSError:
                pass
    return ended


def private_dir(path=None) -> str:
    """A directory only this user can enter (0700, owned by the user, not a link): the given one
    or ``$TMPDIR/hvd-edl-zygote-UID``.

    Raises:
        OSError: it exists but is someone else's, a link, or open to others.
    """
    import stat
    import tempfile
    path = path or os.path.join(tempfile.gettempdir(), f"hvd-edl-zygote-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{path} is not a private directory of uid {os.getuid()}")
    return path


def start_zygote(python, sock_path, env, idle_s=None, parent_fd=None, log_fd=None):
    """Start a zygote for ``python`` serving on ``sock_path`` (it binds once its import is done);
    its stderr goes to ``log_fd`` if given (a kept zygote's, opened by :func:`kept_zygote`),
    else to ``sock_path + '.log'`` (a launcher's own, in its ``mkdtemp`` folder).  ``idle_s``: exit after that long without
    workers; ``parent_fd``: the read end of a pipe whose writer is the launcher (EOF: the
    launcher died, every worker is killed).  Returns the ``Popen``.

    Raises:
        OSError: the interpreter cannot be started.
    """
    import subprocess
    argv = [python, "-c", ZYGOTE_BOOT, sock_path, "-" if idle_s is None else str(idle_s),
            "-" if parent_fd is None else str(parent_fd)]

    def start(log):
        return subprocess.Popen(argv, env=env, cwd="/", stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log, start_new_session=True,
                                pass_fds=() if parent_fd is None else (parent_fd,))
    if log_fd is not None:
        return start(log_fd)
    with open(sock_path + ".log", "ab") as log:
        return start(log)


def process_state() -> dict:
    """What an exec'd worker inherits from its stub besides environment, working directory and
    signals: the umask, the resource limits, the nice value and the CPU affinity.  A zygote's
    own are its starter's (a kept one's: an earlier job's launcher), so the stub hands its own
    and the forked worker takes them (``hvd_edl.zygote``)."""
    import resource
    mask = os.umask(0o022)
    os.umask(mask)
    limits = []
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            try:
                limits.append([getattr(resource, name), *resource.getrlimit(getattr(resource, name))])
            except (OSError, ValueError):
                pass
    state = {"umask": mask, "rlimits": limits}
    try:
        state["nice"] = os.getpriority(os.PRIO_PROCESS, 0)
    except OSError:
        pass
    try:
        state["affinity"] = sorted(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        pass
    return state


def server_uid(conn):
    """The uid of the process at the other end of a Unix socket (``SO_PEERCRED``), or None."""
    import struct
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", creds)[1]
    except OSError:
        return None


class Session:
    """One worker run by a zygote, seen from its stub: :meth:`connect` (bounded wait for the
    zygote to be ready), :meth:`start` (the worker runs: its pid; None: refused, exec instead),
    :meth:`signal`, :meth:`wait` (its exit code, -N for a signal; -9 if the zygote vanished)."""

    def __init__(self):
        self.sock = None
        self.pid = None
        self._buf = b""

    def connect(self, sock_path, wait_s) -> bool:
        deadline = time.monotonic() + wait_s
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(sock_path)
                if server_uid(s) != os.getuid():   # not this user's zygote (a folder swapped
                    s.close()                      # by another user): it gets nothing of ours
                    return False
                self.sock = s
                return True
            except ConnectionRefusedError:   # a socket nobody serves: that zygote is gone
                s.close()
                return False
            except OSError:
                s.close()
            if os.path.exists(sock_path + ".failed") or time.monotonic() > deadline:
                return False
            time.sleep(0.02)   # the zygote is importing torch: poll its socket, bounded

    def start(self, command, env, cwd, fds=(0, 1, 2), kill_group_on_exit=False, ignored=()):
        try:
            socket.send_fds(self.sock, [b"\0"], list(fds))
            self.sock.sendall(json.dumps({"command": list(command), "env": dict(env),
                                          "cwd": cwd, "kill_group_on_exit": kill_group_on_exit,
                                          "ignored": [int(s) for s in ignored],
                                          **process_state()}).encode()
                              + b"\n")
            line = self._line()
        except OSError:
            line = None
        if line and line.startswith("started ") and line[8:].isdigit():
            self.pid = int(line[8:])
            return self.pid
        self.sock.close()
        return None

    def signal(self, sig) -> None:
        try:
            self.sock.sendall(f"signal {int(sig)}\n".encode())
        except OSError:
            pass

    def wait(self) -> int:
        while True:
            try:
                line = self._line()
            except OSError:
                line = None
            if line is None:   # the zygote is gone, and its workers with it (PDEATHSIG);
                try:           # what the worker started is in its group: gone too, as the
                    os.killpg(self.pid, signal.SIGKILL)   # stub's death would make it
                except OSError:
                    pass
                return -signal.SIGKILL
            if line.startswith("exit ") and re.fullmatch(r"-?\d+", line[5:]):
                self.sock.close()
                return int(line[5:])

    def _line(self):
        while b"\n" not in self._buf:
            chunk = self.sock.recv(4096)
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode(errors="replace")


def exit_like(code) -> None:
    """End this process as the worker ended: its exit status, or death by the same signal
    (no core file)."""
    if code >= 0:
        os._exit(code)
    sig = -code
    import resource
    for step in (lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)),
                 lambda: signal.signal(sig, signal.SIG_DFL),   # not for SIGKILL: it needs none
                 lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig]),
                 lambda: os.kill(os.getpid(), sig)):
        try:
            step()
        except (OSError, ValueError):
            pass
    os._exit(128 + sig)


def stub_main(argv) -> None:
    """The local stub: ``SOCKET WAIT_S -- COMMAND...`` (environment and cwd: the worker's).
    Never returns: exits as the worker did, or becomes the command (exec path)."""
    sock_path, wait_s, command = argv[0], float(argv[1]), argv[3:]
    pending = []
    session = Session()

    def forward(sig, _frame):
        if session.pid is None:
            pending.append(sig)
        else:
            session.signal(sig)
    catchable = [s for s in signal.valid_signals()
                 if s not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD)]
    # what the launcher's child inherited as ignored (``nohup``: SIGHUP; ``cmd &`` in a script:
    # SIGINT, SIGQUIT) an exec'd worker keeps ignored: so do the stub and the forked worker
    # (SIGPIPE and SIGXFSZ: every Python interpreter ignores them itself)
    ignored = [s for s in catchable if s not in (signal.SIGPIPE, signal.SIGXFSZ)
               and signal.getsignal(s) == signal.SIG_IGN]
    catchable = [s for s in catchable if s not in ignored]
    for sig in catchable:
        try:
            signal.signal(sig, forward)
        except (OSError, ValueError):
            pass
    if session.connect(sock_path, wait_s) and \
            session.start(command, os.environ, os.getcwd(), ignored=ignored) is not None:
        for sig in pending:
            session.signal(sig)
        pending = None
        exit_like(session.wait())
    for sig in catchable:   # the exec path: the command becomes this process
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    for sig in pending or ():
        os.kill(os.getpid(), sig)
    try:
        os.execvp(command[0], command)
    except OSError as e:
        sys.stderr.write(f"hvd-edl-run: cannot start {command[0]!r}: {e}\n")
        os._exit(127)


if __name__ == "__main__":
    stub_main(sys.argv[1:])
