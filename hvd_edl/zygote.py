"""The worker fork server ("zygote", as Android's zygote and Python's ``multiprocessing``
forkserver): one process of the worker's own Python interpreter that has imported
``hvd_edl.torch`` (and with it torch and ``horovod.torch``, about 1.8 CPU-s) once, and forks a
worker per request, so a worker starts in milliseconds instead of paying that import again.

It initialises nothing that cannot cross a fork: no CUDA, no Horovod, no thread pool of its own
(OpenBLAS's one pool thread, started by numpy, quiesces itself at fork: its ``pthread_atfork``
handler).  Started as ``PYTHON -c "import sys; del sys.path[0]; import hvd_edl.zygote as z;
z.main()" SOCKET IDLE_S|- PARENT_FD|-`` with the job's environment (``launcher/spawn/zygote_client.py``
starts it and keys it by interpreter and the variables read at import); it binds ``SOCKET``
only once the import is done (a ``SOCKET.failed`` file says why it never will).

Protocol, one Unix stream connection per worker, from its stub (``zygote_client.py``):

* stub -> zygote: one byte carrying the stub's stdin/stdout/stderr (``SCM_RIGHTS``), then one
  JSON line ``{"command", "env", "cwd", "kill_group_on_exit", "ignored"}`` (the
  signals the stub inherited as ignored); later lines ``signal N``.
* zygote -> stub: ``started PID`` or ``refused REASON`` (the stub then runs the command itself,
  the exec path), and ``exit CODE`` when the worker ends (``subprocess``'s convention: -N for
  a death by signal N).
* The stub's connection closing before the worker's exit (the stub died, even of SIGKILL) kills
  the worker's process group; the zygote's death kills every worker (``PR_SET_PDEATHSIG``).
* Only processes of the zygote's own user are served (``SO_PEERCRED``; a kept zygote's socket
  also lies in a 0700 folder of that user): root's or another user's stub is refused.

A zygote without a parent pipe (a *kept* one: per user and key, shared by launchers, see
``docs/zygote.md``) stops taking stubs on SIGTERM or once its modules went stale (its socket is
removed, so the next launcher starts a fresh one) and exits when its last worker has.

The child becomes what ``exec`` of the command would have made: the environment (the C
``environ`` too), ``sys.argv``, ``sys.path[0]``, the working directory, standard streams built
from the handed fds as the interpreter builds them, signal dispositions and mask, fresh
``random``/numpy seeds, and ``/proc/PID/environ`` and ``/proc/PID/cmdline`` showing its own
(``prctl(PR_SET_MM_MAP)``, unprivileged; a kernel without it makes the zygote refuse to start,
so the launcher uses the exec path).  What stays different is in ``docs/zygote.md``.
"""
from __future__ import annotations

import atexit
import ctypes
import io
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
import zipfile
from importlib.util import MAGIC_NUMBER
from typing import Dict, List, Optional, Set

from hvd_edl import forked_exit, module_shadows

MAX_REQUEST_BYTES = 4 << 20
REQUEST_TIMEOUT_S = 10.0
_PR_SET_PDEATHSIG = 1
_PR_SET_MM = 35
_PR_SET_MM_MAP = 14
_STARTED = time.time()   # a module file changed after this was imported by an older version
_SHADOWS_AT_START: Set[str] = set()   # module_shadows.shadows() once the import was done


class _MmMap(ctypes.Structure):
    """``struct prctl_mm_map`` (linux/prctl.h)."""
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "start_code", "end_code", "start_data", "end_data", "start_brk", "brk", "start_stack",
        "arg_start", "arg_end", "env_start", "env_end", "auxv")] + \
        [("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]


def show_in_proc(argv: List[str], env: Dict[str, str]) -> None:
    """Make ``/proc/self/cmdline`` and ``/proc/self/environ`` (what ``ps``, psutil and our own
    tools read from outside) show ``argv`` and ``env``, as after an ``exec``: Linux's
    ``prctl(PR_SET_MM, PR_SET_MM_MAP)`` (CRIU's unprivileged call, ``CONFIG_CHECKPOINT_RESTORE``).

    Raises:
        OSError: the kernel refused (no such call, or a seccomp filter).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()

    def field(n: int) -> int:  # proc(5) numbering; fields[0] is field 3
        return int(fields[n - 3])
    args = b"".join(os.fsencode(a) + b"\0" for a in argv)
    envs = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in env.items())
    # the kernel reads these areas for as long as the process lives, and Python's finalisation
    # frees its own objects while a worker exits (a sampler then read freed memory as its
    # environment): malloc'd copies, never freed, outlive the interpreter
    libc.malloc.restype = ctypes.c_void_p
    abuf, ebuf = libc.malloc(len(args) or 1), libc.malloc(len(envs) or 1)
    if not abuf or not ebuf:
        raise OSError(12, "show_in_proc: malloc failed")
    ctypes.memmove(abuf, args, len(args))
    ctypes.memmove(ebuf, envs, len(envs))
    libc.sbrk.restype = ctypes.c_void_p
    m = _MmMap(start_code=field(26), end_code=field(27), start_stack=field(28),
               start_data=field(45), end_data=field(46), start_brk=field(47),
               brk=libc.sbrk(0), arg_start=abuf,
               arg_end=abuf + len(args), env_start=ebuf,
               env_end=ebuf + len(envs), exe_fd=0xFFFFFFFF)
    if libc.prctl(_PR_SET_MM, _PR_SET_MM_MAP, ctypes.byref(m), ctypes.sizeof(m), 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_MM_MAP): {os.strerror(err)}")


def refusal(request: dict) -> Optional[str]:
    """Why this zygote leaves ``request`` to the exec path (None: it can run it): only
    ``PYTHON [-u] SCRIPT ARGS`` with a source file, or ``PYTHON [-u] -m MODULE ARGS``, in an
    existing directory, by the interpreter this zygote runs."""
    command, cwd = request.get("command"), request.get("cwd")
    if not isinstance(command, list) or len(command) < 2 or \
            not all(isinstance(a, str) for a in command) or not isinstance(cwd, str):
        return "malformed request"
    if not os.path.isdir(cwd):
        return "no such directory"
    rest = command[1:]
    while rest and rest[0] == "-u":
        rest = rest[1:]
    why = stale() or _state_refusal(request)
    if why is not None:
        return why
    if len(rest) >= 2 and rest[0] == "-m":
        return shadowed(cwd)
    if not rest or rest[0].startswith("-"):
        return "not a script"
    script = os.path.join(cwd, rest[0])
    try:
        with open(script, "rb") as f:
            head = f.read(4)
        if head == MAGIC_NUMBER or zipfile.is_zipfile(script):
            return "compiled or zipped script"
    except OSError:
        return "script not readable"
    return shadowed(os.path.dirname(os.path.realpath(script)))


def _state_refusal(request: dict) -> Optional[str]:
    """Why the worker cannot be given its stub's process state (None: it can): a resource
    limit above this zygote's hard one, or a nice value below its own, which only a privileged
    process may set (an exec'd worker would have them: the exec path)."""
    import resource

    def above(a: int, b: int) -> bool:   # a > b, RLIM_INFINITY the largest
        inf = resource.RLIM_INFINITY
        return a != b and (a == inf or (b != inf and a > b))
    try:
        for res, _soft, hard in request.get("rlimits") or ():
            if above(int(hard), resource.getrlimit(int(res))[1]) and not _capable(24):
                return "a resource limit above the zygote's"
        nice = request.get("nice")
        if nice is not None and int(nice) < os.getpriority(os.PRIO_PROCESS, 0) and \
                not _capable(23):
            return "a nice value below the zygote's"
    except (OSError, ValueError, TypeError):
        return "malformed process state"
    return None


def _capable(cap: int) -> bool:
    """Whether this process has capability ``cap`` (23: CAP_SYS_NICE, 24: CAP_SYS_RESOURCE)
    in effect: root in a container may lack them."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> cap & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _take_state(request: dict) -> None:
    """In the forked child: the stub's umask, resource limits, nice value and CPU affinity
    (``zygote_client.process_state``), as an exec from the stub would have kept them; the
    zygote's own are its starter's (a kept zygote's: an earlier job's launcher)."""
    import resource
    if request.get("umask") is not None:
        os.umask(int(request["umask"]))
    for res, soft, hard in request.get("rlimits") or ():
        resource.setrlimit(int(res), (int(soft), int(hard)))
    if request.get("nice") is not None:
        os.setpriority(os.PRIO_PROCESS, 0, int(request["nice"]))
    if request.get("affinity"):
        try:
            os.sched_setaffinity(0, [int(c) for c in request["affinity"]])
        except OSError:   # a CPU the zygote's cpuset lacks: the worker keeps the zygote's
            pass


def stale() -> Optional[str]:
    """Why this zygote's modules are no longer what an exec'd worker would import (None: they
    are): a loaded module's file changed or was removed since the zygote started (hvd_edl
    edited, a package upgraded during a job or within a remote zygote's idle minute), or a new
    file in a ``sys.path`` entry before the one a loaded module came from shadows it
    (:mod:`hvd_edl.module_shadows`; those there at the start, which it did not import anyway,
    do not count).  A few ms: one ``stat`` per loaded module and per ``sys.path`` entry."""
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str):
            continue
        try:
            st = os.stat(path)   # ctime too: a file put in place with an older mtime (cp -p,
            if max(st.st_mtime, st.st_ctime) > _STARTED:   # tar x, rsync -a) is new code too
                return f"stale: {path} changed since the zygote imported it"
        except OSError:
            if os.path.isdir(os.path.dirname(path)):   # not a file in an archive: removed
                return f"stale: {path} removed since the zygote imported it"
    new = module_shadows.shadows() - _SHADOWS_AT_START
    if new:
        return f"stale: {min(new)} shadows a module the zygote imported"
    return None


def shadowed(path0: str) -> Optional[str]:
    """Why a worker whose ``sys.path[0]`` is ``path0`` cannot be forked (None: it can): that
    directory holds its own copy of a package this zygote has imported (a checkout of hvd_edl,
    a local ``tqdm.py``), which an exec'd worker would import instead of ours.  A module a bare
    interpreter loads before the script (``json``) is checked too: that only costs an exec."""
    from importlib.machinery import PathFinder
    for name in sorted({m.partition(".")[0] for m in sys.modules}):
        if name.startswith("__"):
            continue
        try:
            spec = PathFinder.find_spec(name, [path0])
        except (ImportError, ValueError, OSError):
            continue
        if spec is None or spec.origin in (None, "namespace"):
            continue   # nothing there, or a namespace portion (a regular package wins over it)
        loaded = getattr(sys.modules.get(name), "__file__", None)
        if loaded is None:
            continue   # built in or frozen: found before sys.path, a local file never shadows it
        if os.path.realpath(loaded) != os.path.realpath(spec.origin):
            return f"{path0} has its own {name}"
    return None


def _std_stream(fd: int, write: bool, unbuffered: bool, encoding: str, errors: str):
    """A standard stream over ``fd`` built the way CPython's ``create_stdio`` builds one."""
    raw = io.FileIO(fd, "wb" if write else "rb", closefd=False)
    if write and unbuffered:
        buf = raw
    else:
        buf = io.BufferedWriter(raw) if write else io.BufferedReader(raw)
    line = write and not unbuffered and (raw.isatty() or fd == 2)
    return io.TextIOWrapper(buf, encoding=encoding, errors=errors, newline="\n",
                            line_buffering=line, write_through=write and unbuffered)


def _rebase_dynamo_debug_dir() -> None:
    """``torch._dynamo.config.debug_dir_root`` defaults to ``$PWD/torch_compile_debug``, read when
    the config module is imported: preloaded (:func:`preload_dynamo`), that was the zygote's
    working directory (``/``), so ``TORCH_COMPILE_DEBUG=1`` wrote there.  Recomputed here, in the
    worker's own, as its default (not a user override: a thread's fresh context sees it too).
    ``TORCH_COMPILE_DEBUG=1`` also has ``import torch`` put the trace log's folder (opened at
    its first record) at ``debug_dir_root/tlparse``: moved along."""
    if "torch._dynamo.config" not in sys.modules:
        return
    import torch._dynamo.config as config   # imported already (the zygote's)
    try:
        entry = config._config["debug_dir_root"]
        old, new = entry.default, config.default_debug_dir_root()
        entry.default = new
        config._mark_get_dict_dirty("debug_dir_root")
    except Exception:  # noqa: BLE001 - another torch's config: set it as a user would
        try:
            config.debug_dir_root = config.default_debug_dir_root()
        except Exception:  # noqa: BLE001
            pass
        return
    handler = getattr(sys.modules.get("torch._logging._internal"), "LOG_TRACE_HANDLER", None)
    if isinstance(old, str) and getattr(handler, "stream", 0) is None \
            and getattr(handler, "root_dir", None) == os.path.join(old, "tlparse"):
        handler.root_dir = os.path.join(new, "tlparse")


def _become(request: dict) -> dict:
    """In the forked child: turn this process into what ``exec`` of the request's command would
    have made (see the module doc).  Returns the main module's namespace and what to run."""
    env: Dict[str, str] = request["env"]
    command: List[str] = request["command"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    _rebase_dynamo_debug_dir()
    rest = command[1:]
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    while rest[0] == "-u":
        unbuffered, rest = True, rest[1:]
    enc, errs = sys.__stdout__.encoding, sys.__stdout__.errors
    sys.stdin = sys.__stdin__ = _std_stream(0, False, unbuffered, enc, "strict")
    sys.stdout = sys.__stdout__ = _std_stream(1, True, unbuffered, enc, errs)
    sys.stderr = sys.__stderr__ = _std_stream(2, True, unbuffered, enc, "backslashreplace")
    sys.orig_argv = list(command)
    if rest[0] == "-m":
        sys.argv = ["-m"] + rest[2:]   # runpy puts the module's file in argv[0]
        sys.path.insert(0, os.getcwd())
        what = ("module", rest[1])
    else:
        sys.argv = list(rest)
        sys.path.insert(0, os.path.dirname(os.path.realpath(rest[0])))  # as CPython: links resolved
        what = ("script", os.path.abspath(rest[0]))   # CPython 3.9+: __main__.__file__ absolute
    show_in_proc(command, env)
    import random
    random.seed()
    if "numpy.random" in sys.modules:  # an exec'd worker seeds numpy's global state afresh
        sys.modules["numpy.random"].seed()
    return {"what": what}


_unhandled_interrupt = []


def _die_of_sigint() -> None:
    """Registered before the script runs, so it runs last at exit: CPython ends a program that
    an uncaught KeyboardInterrupt stopped by SIGINT on itself (exit status -2)."""
    if _unhandled_interrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


def _run(what) -> None:
    """Run the script (compiled into ``__main__``'s own namespace, as ``python FILE`` does) or
    the module (``runpy``, as ``python -m`` does); an uncaught exception is printed with the
    script's frames only and ends the process with status 1 (KeyboardInterrupt: SIGINT)."""
    kind, target = what
    space = sys.modules["__main__"].__dict__
    builtins = space["__builtins__"]
    space.clear()   # the zygote's own ``-c`` globals: a script sees only its own names
    space.update(__name__="__main__", __doc__=None, __package__=None, __spec__=None,
                 __builtins__=builtins, __annotations__={})   # CPython's main module has one
    atexit.register(_die_of_sigint)
    try:
        if kind == "module":
            import runpy
            runpy._run_module_as_main(target, alter_argv=True)   # what ``python -m`` calls
        else:
            with open(target, "rb") as f:
                source = f.read()
            code = compile(source, target, "exec", dont_inherit=True)
            from importlib.machinery import SourceFileLoader
            space.update(__file__=target, __cached__=None,
                         __loader__=SourceFileLoader("__main__", target))
            exec(code, space)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: B902 - printed as the interpreter prints it
        import runpy
        ours = {__file__, runpy.__file__, "<string>"}
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in ours:
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)   # the printer reads __traceback__
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, tb   # as PyErr_Print
        if isinstance(e, KeyboardInterrupt):
            _unhandled_interrupt.append(True)
        raise SystemExit(1)
    raise SystemExit(0)


class _Worker:
    def __init__(self, pid: int, conn: socket.socket, kill_group: bool):
        self.pid, self.conn, self.kill_group = pid, conn, kill_group
        self.exited = False


def _read_request(conn: socket.socket):
    """The stub's fds and JSON line; raises OSError / ValueError on anything else."""
    conn.settimeout(REQUEST_TIMEOUT_S)
    msg, fds, _flags, _addr = socket.recv_fds(conn, 1, 3)
    if len(fds) != 3 or msg != b"\0":
        for fd in fds:
            os.close(fd)
        raise ValueError("expected one byte and three fds")
    data = b""
    try:
        while not data.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk or len(data) > MAX_REQUEST_BYTES:
                raise ValueError("request cut short")
            data += chunk
        request = json.loads(data)
        if not isinstance(request, dict) or not isinstance(request.get("env"), dict):
            raise ValueError("malformed request")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    conn.settimeout(None)
    return fds, request


class Zygote:
    """The fork server's loop: accept a stub, fork its worker, forward its signals, report the
    worker's exit; exit itself after ``idle_s`` with no worker and no stub (None: never)."""

    def __init__(self, listener: socket.socket, idle_s: Optional[float],
                 parent_fd: Optional[int] = None, path: Optional[str] = None,
                 path_ino: Optional[int] = None):
        self.listener = listener
        self.idle_s = idle_s
        self.parent_fd = parent_fd
        self.launcher_gone = False   # the parent pipe closed: its folder is left to us
        self.path, self.path_ino = path, path_ino   # the socket's name and its inode, once bound
        self.draining = False   # no new stubs: exit when the last worker has
        self.drain_asked = False   # SIGTERM came
        self.sel = selectors.DefaultSelector()
        self.workers: Dict[int, _Worker] = {}
        self.by_conn: Dict[socket.socket, _Worker] = {}
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    def serve(self) -> None:
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "drain_asked", True))
        signal.set_wakeup_fd(self.wake_w)
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "reap")
        if self.parent_fd is not None:
            self.sel.register(self.parent_fd, selectors.EVENT_READ, "parent")
        idle_since = time.monotonic()
        while True:
            for key, _ in self.sel.select(timeout=1.0):
                if key.data == "accept":
                    self._accept()
                elif key.data == "reap":
                    self._reap()
                elif key.data == "parent":   # the launcher is gone: so are its workers
                    for w in self.workers.values():
                        _killpg(w.pid, signal.SIGKILL)
                    self.launcher_gone = True
                    return
                else:
                    self._from_stub(key.fileobj)
            self._reap()
            if self.drain_asked:
                self._drain()
            if self.draining and not (self.workers or self.by_conn):
                return
            if self.workers or self.by_conn:
                idle_since = time.monotonic()
            elif self.idle_s is not None and time.monotonic() - idle_since > self.idle_s:
                return

    def _accept(self) -> None:
        if self.draining:
            return
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        if peer_uid(conn) != os.getuid():   # not this user's stub: its fds die with conn
            _send(conn, "refused not this user's zygote\n")
            conn.close()
            return
        try:
            fds, request = _read_request(conn)
        except (OSError, ValueError) as e:
            _send(conn, f"refused {type(e).__name__}\n")
            conn.close()
            return
        why = refusal(request)
        if why is not None and why.startswith("stale") and self.parent_fd is None:
            self._drain()   # a kept zygote: the next launcher starts one with the code on disk
        if why is not None:
            _send(conn, f"refused {why}\n")
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            conn.close()   # the worker holds no fd of the zygote's (an exec'd one has none)
            self._child(fds, request, parent)   # never returns
        for fd in fds:
            os.close(fd)
        w = _Worker(pid, conn, bool(request.get("kill_group_on_exit")))
        self.workers[pid] = w
        self.by_conn[conn] = w
        self.sel.register(conn, selectors.EVENT_READ, "stub")
        _send(conn, f"started {pid}\n")

    def _child(self, fds: List[int], request: dict, parent: int) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:   # the zygote died before the line above
                os._exit(137)
            os.setsid()
            signal.set_wakeup_fd(-1)
            for sig in signal.valid_signals():
                if sig in (signal.SIGKILL, signal.SIGSTOP):
                    continue
                try:
                    signal.signal(sig, signal.SIG_DFL)
                except (OSError, ValueError):
                    pass
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGPIPE, signal.SIG_IGN)   # as CPython sets them at start
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            for sig in request.get("ignored") or ():   # inherited as ignored: kept so by exec
                signal.signal(int(sig), signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_SETMASK, [])
            for i, fd in enumerate(fds):
                os.dup2(fd, i)
            for fd in fds + [self.wake_r, self.wake_w] + \
                    ([] if self.parent_fd is None else [self.parent_fd]):
                if fd > 2:
                    os.close(fd)
            self.sel.close()
            self.listener.close()
            for conn in list(self.by_conn):
                conn.close()
            _take_state(request)
            state = _become(request)
        except BaseException as e:  # noqa: B902 - nothing of the zygote's may run on
            try:
                os.write(2, f"hvd_edl zygote: cannot start the worker: {e}\n".encode())
            finally:
                os._exit(127)
        code = None
        try:
            _run(state["what"])
        except SystemExit as e:   # the script's end: exit without the inherited modules' teardown
            code = e.code
        # out of the handler: the exception, its traceback and the frames it held (a function's
        # locals where it called sys.exit) are dropped first, as CPython does before its exit
        forked_exit.finish(code)

    def _drain(self) -> None:
        """Take no more stubs (the socket closed and, when it is still this zygote's, removed);
        :meth:`serve` returns once the last worker has exited."""
        if self.draining:
            return
        self.draining = True
        try:
            self.sel.unregister(self.listener)
        except (KeyError, ValueError):
            pass
        self.listener.close()
        unlink_own(self.path, self.path_ino)

    def _from_stub(self, conn: socket.socket) -> None:
        w = self.by_conn[conn]
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        if not data:   # the stub is gone: nothing it started may outlive it
            if not w.exited:
                _killpg(w.pid, signal.SIGKILL)
            self._forget(w)
            return
        for line in data.decode(errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == "signal" and parts[1].isdigit() and not w.exited:
                _killpg(w.pid, int(parts[1]))

    def _reap(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        while self.workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            w = self.workers.pop(pid, None)
            if w is None:
                continue
            w.exited = True
            if w.kill_group:
                _killpg(pid, signal.SIGKILL)   # what the worker left behind in its group
            code = os.waitstatus_to_exitcode(status)
            _send(w.conn, f"exit {code}\n")
            self._forget(w)

    def _forget(self, w: _Worker) -> None:
        if w.conn in self.by_conn:
            del self.by_conn[w.conn]
            self.sel.unregister(w.conn)
            w.conn.close()


def peer_uid(conn: socket.socket) -> Optional[int]:
    """The uid of the process at the other end of a Unix socket (``SO_PEERCRED``: the kernel's
    word, fixed at ``connect``); None if it cannot be read."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", creds)[1]
    except OSError:
        return None


def unlink_own(path: Optional[str], ino: Optional[int]) -> None:
    """Remove the socket ``path`` if it is still the one this zygote bound (inode ``ino``):
    a newer zygote of the same key may have taken the name since; and a kept zygote's pid file
    (``KEY.pid`` beside ``KEY.sock``) if it names this process, so that the next launcher
    starts a fresh zygote instead of waiting for this one's socket.  Issue 38: its log
    (``KEY.sock.log``) too if empty, and its ``KEY.lock`` if no one holds it (taken without
    waiting, removed while held: a starter that waited on it retries on the new file,
    ``launcher.spawn.zygote_client._locked``); if someone holds it, a starter is at work and
    the lock file stays."""
    if path is None:
        return
    lock_fd = None
    if path.endswith(".sock"):
        import fcntl
        try:
            lock_fd = os.open(path[:-len(".sock")] + ".lock",
                              os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            if lock_fd is not None:
                os.close(lock_fd)
            lock_fd = None
    try:
        _unlink_files(path, ino, lock_fd)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


def _unlink_files(path: str, ino: Optional[int], lock_fd: Optional[int]) -> None:
    try:
        if ino is None or os.stat(path).st_ino == ino:
            os.unlink(path)
    except OSError:
        pass
    base = path[:-len(".sock")] if path.endswith(".sock") else path
    try:   # a kept zygote's log only under its lock: a starter may have just opened it
        if os.stat(path + ".log").st_size == 0 and (
                lock_fd is not None or not os.path.exists(base + ".lock")):
            os.unlink(path + ".log")
    except OSError:
        pass
    if not path.endswith(".sock"):
        return
    try:
        with open(base + ".pid") as f:
            if f.read(32).strip() == str(os.getpid()):
                os.unlink(base + ".pid")
    except (OSError, ValueError):
        pass
    if lock_fd is not None:
        try:
            if os.stat(base + ".lock").st_ino == os.fstat(lock_fd).st_ino and \
                    not os.path.exists(base + ".pid") and not os.path.exists(path):
                os.unlink(base + ".lock")
        except OSError:
            pass


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except OSError:
        pass


def _send(conn: socket.socket, text: str) -> None:
    try:
        conn.sendall(text.encode())
    except OSError:
        pass


SCRATCH_PREFIX = "dynamo-cache."   # preload_dynamo's scratch folder: PREFIX + the zygote's pid


def sweep_dead_scratch(parent: str) -> List[str]:
    """Remove the scratch folders (:func:`preload_dynamo`) in ``parent`` of zygotes that are no
    longer alive: a zygote killed during its import (a kept zygote's folder outlives it; the
    kept zygotes' sweep removes only their key's files).  A live pid's is kept (its own, or
    another zygote's import under way, or a reused pid: left for a later sweep).  Returns the
    names removed."""
    import shutil
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        pid = name[len(SCRATCH_PREFIX):]
        if not name.startswith(SCRATCH_PREFIX) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue           # alive (or not ours to signal: not ours to remove)
        except ProcessLookupError:
            pass
        except OSError:
            continue
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        removed.append(name)
    return removed


def preload_dynamo(scratch_parent: str) -> None:
    """Import ``torch._dynamo`` here, once, leaving no trace of the import in what a worker
    inherits.  ``torch.optim``'s first optimizer imports it lazily (``_disable_dynamo``): about
    1 CPU-second per worker, half of a small Horovod worker's CPU (py-spy on Horovod's elastic
    script, 4 workers), and at exit the finalisers of the ``torch.library`` objects it made
    took another fifth.  The import writes ``TORCHINDUCTOR_CACHE_DIR`` into ``os.environ``,
    makes ``$TMPDIR/torchinductor_$USER`` and caches ``tempfile.tempdir``: here the cache
    folder is a scratch folder under ``scratch_parent`` (removed after; a worker's own cache
    folder is found when it is used, ``DiskDynamoCache.path_prefix``), and the environment and
    ``tempfile.tempdir`` are put back.  The variables it reads at import are part of the key
    (``zygote_client.IMPORT_ENV``; tests/test_zygote.py fails on one that is not).  The
    ``torch.library`` finalisers inherited by a worker are not run at its exit (deregistering
    operators in a process that ends).  Any failure: nothing preloaded (a worker imports it
    itself, as before)."""
    import shutil
    import tempfile
    saved_env, saved_tempdir = dict(os.environ), tempfile.tempdir
    sweep_dead_scratch(scratch_parent)   # an earlier zygote's, killed during this import
    scratch = os.path.join(scratch_parent, f"{SCRATCH_PREFIX}{os.getpid()}")
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = scratch
    try:
        import torch._dynamo  # noqa: F401
        import torch.library
        import weakref
        for f in list(weakref.finalize._registry):
            info = f.peek()
            if info is not None and info[1] is torch.library._del_library:
                f.atexit = False
    except Exception:  # noqa: BLE001 - an optimisation only: the worker imports it as before
        pass
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        tempfile.tempdir = saved_tempdir
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: Optional[List[str]] = None) -> None:
    """``SOCKET IDLE_S|- PARENT_FD|-``: import ``hvd_edl.torch``, check that ``/proc`` can be made to show a
    worker's own command line and environment, then serve on ``SOCKET`` (bound under a temporary
    name and renamed into place, so a stub that finds it finds it ready).  On any failure before
    that, ``SOCKET.failed`` holds the reason and the process exits 1: stubs then exec."""
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0]
    idle_s = float(argv[1]) if len(argv) > 1 and argv[1] != "-" else None
    parent_fd = int(argv[2]) if len(argv) > 2 and argv[2] != "-" else None
    try:
        import hvd_edl.torch  # noqa: F401 - the import every worker would pay
        preload_dynamo(os.path.dirname(os.path.abspath(path)))
        show_in_proc(sys.orig_argv, dict(os.environ))  # the worker's /proc view must be possible
        _SHADOWS_AT_START.update(module_shadows.shadows())   # not what it imported: not new
        import gc
        gc.collect()
        gc.freeze()   # CPython's advice before fork: a worker's collections never touch (and
        # so never copy) the pages of the objects imported here
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = f"{path}.{os.getpid()}"
        listener.bind(tmp)
        listener.listen(64)
        os.rename(tmp, path)
        ino = os.stat(path).st_ino
    except BaseException as e:  # noqa: B902 - any failure means: use the exec path
        try:
            fd = os.open(f"{path}.failed", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                         0o600)   # never through a link another user put there
            with os.fdopen(fd, "w") as f:
                f.write(f"{type(e).__name__}: {e}\n")
        finally:
            os._exit(1)
    zygote_pid = os.getpid()
    zygote = Zygote(listener, idle_s, parent_fd, path, ino)
    try:
        zygote.serve()   # a worker leaves by SystemExit
    finally:
        if os.getpid() == zygote_pid:
            unlink_own(path, ino)
            if zygote.launcher_gone:   # a launcher that died (SIGKILL) left its mkdtemp folder:
                try:                   # the last of its zygotes removes it, once empty
                    os.rmdir(os.path.dirname(path))
                except OSError:
                    pass
            os._exit(0)   # nothing to flush; finalising torch's modules takes seconds
