"""A worker process as the launcher sees it: what it is started with (:class:`WorkerSpec`),
its output prefixed with its rank, its exit reported to a callback (:class:`WorkerProcess`),
local or over ssh (for a remote worker the local process is the ssh client, and its exit code
comes back from the remote supervisor, ``remote_worker.py``); and stopping them all."""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from launcher.observe.timestamps import stamp
from launcher.spawn.remote_worker import MARKER

log = logging.getLogger(__name__)

SSH_FAILED = 255   # ssh's exit code for its own errors (and for a session lost midway)


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker is started with: the user's command, the extra environment, the
    working directory, and for remote hosts how ssh reaches them (horovodrun's ``-p`` and
    ``-i``: None leaves it to ssh's configuration); ``engine``: an engine that starts workers
    itself (``--ray``: a :class:`launcher.ray.engine.RayEngine`), None for local / ssh."""
    command: List[str]
    env: Dict[str, str]
    cwd: str
    ssh_port: Optional[int] = None
    ssh_identity_file: Optional[str] = None
    engine: Optional[object] = None
    timestamps: bool = False  # --prefix-output-with-timestamp: lines start with the local time
    zygote: Optional[bool] = None  # --zygote / --no-zygote; None: HVD_EDL_ZYGOTE, default yes
    keep_zygote: Optional[float] = None  # --keep-zygote=S (0: off); None: HVD_EDL_ZYGOTE_KEEP
    zygote_dir: Optional[str] = None     # --zygote-dir; None: HVD_EDL_ZYGOTE_DIR, else default


class WorkerProcess:
    """A running worker.  ``label()`` gives the current output prefix (its rank once known).

    For a remote worker (``host`` given) ``popen`` is the local ssh client: signals go to the
    remote supervisor over its stdin, the worker's exit code comes back in a marker line."""

    def __init__(self, popen: subprocess.Popen, label: Callable[[], str],
                 on_exit: Callable[[int], None], out=sys.stdout,
                 files: Optional[Dict[str, object]] = None, host: Optional[str] = None,
                 timestamps: bool = False):
        self.popen = popen
        self.timestamps = timestamps  # horovodrun's --prefix-output-with-timestamp format
        self.host = host
        self.last_error_line = ""  # the worker's last non-empty stderr line
        self._label = label
        self._on_exit = on_exit
        self._out = out
        self._files = files or {}  # --output-filename: "stdout"/"stderr" -> a file, unprefixed
        self._out_lock = _OUT_LOCK
        self._stdin_lock = threading.Lock()
        self.remote_pid: Optional[int] = None    # the worker's pid on its host, once started
        self._remote_code: Optional[int] = None
        self._ssh_lines: List[str] = []          # ssh's messages before the worker started
        self._last_line = ""                     # the last stderr line after it started
        self._threads = [threading.Thread(target=self._pump, args=(popen.stdout, "stdout"),
                                          daemon=True),
                         threading.Thread(target=self._pump, args=(popen.stderr, "stderr"),
                                          daemon=True)]
        for t in self._threads:
            t.start()
        threading.Thread(target=self._wait, daemon=True).start()

    def _pump(self, stream, name: str) -> None:
        """Copy the stream line by line with the rank prefix; a progress bar's "\r" redraws
        count as line ends, so they show up as they happen."""
        pending = b""
        while True:
            chunk = stream.read1(65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = re.split(rb"[\r\n]", pending)
            self._write(name, lines)
        self._write(name, [pending])
        stream.close()
        if name in self._files:
            self._files[name].close()

    def _write(self, name: str, lines) -> None:
        lines = [line.decode(errors="replace") for line in lines if line]
        if self.host is not None and name == "stderr":
            lines = self._take_markers(lines)
        if not lines:
            return
        if name == "stderr":  # what a failure message quotes: the script's last error line
            self.last_error_line = next((x for x in reversed(lines) if x.strip()),
                                        self.last_error_line)
        with self._out_lock:
            when = stamp() if self.timestamps else ""  # horovodrun's: "{time}[{rank}]<...>:"
            for line in lines:
                self._out.write(f"{when}[{self._label()}]<{name}>:{line}\n")
            self._out.flush()
        f = self._files.get(name)
        if f is not None:
            f.write("".join(line + "\n" for line in lines))
            f.flush()

    def _take_markers(self, lines: List[str]) -> List[str]:
        """Remote stderr: take the supervisor's marker lines out; keep ssh's own messages
        (everything before ``started``) for the failure line."""
        out = []
        for line in lines:
            if MARKER in line:
                before, _, marker = line.partition(MARKER)
                if before:
                    out.append(before)
                what, _, value = marker.partition(" ")
                if what == "started" and value.isdigit():
                    self.remote_pid = int(value)
                    out.extend(self._ssh_lines)  # ssh's warnings, if any: shown after all
                    self._ssh_lines = []
                elif what == "exit" and re.fullmatch(r"-?\d+", value):
                    self._remote_code = int(value)
            elif self.remote_pid is None and self._remote_code is None:
                self._ssh_lines = (self._ssh_lines + [line])[-20:]
            else:
                out.append(line)
                self._last_line = line
        return out

    def _wait(self) -> None:
        code = self.popen.wait()
        for t in self._threads:
            t.join(timeout=5)
        if self.host is not None:
            code = self._remote_exit(code)
        self._on_exit(code)

    def _remote_exit(self, ssh_code: int) -> int:
        said = next((s for s in reversed(self._ssh_lines) if s.strip()), "no message")
        if self._remote_code is not None:
            if self.remote_pid is None:  # the supervisor ran but could not start the command
                say(f"worker on host {self.host} did not start (exit {self._remote_code}): "
                     f"{said.strip()}")
            return self._remote_code
        if ssh_code == SSH_FAILED and self.remote_pid is None:
            say(f"ssh to host {self.host} failed (exit {ssh_code}): {said.strip()}")
        elif ssh_code == SSH_FAILED:
            say(f"ssh session to host {self.host} lost (exit {ssh_code}) while "
                 f"{self._label()} ran; its last line: {self._last_line.strip() or '-'}")
        elif self.remote_pid is None and ssh_code != 0:  # e.g. 127: no python3 on that host
            say(f"worker on host {self.host} did not start (exit {ssh_code}): {said.strip()}")
        return ssh_code

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the worker's process group (it and anything it started); for a
        remote worker through its supervisor, and SIGKILL also ends the ssh session (the
        supervisor then kills the group even if the line never arrives)."""
        if self.host is None:
            try:
                os.killpg(self.popen.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            return
        self.send(f"signal {int(sig)}\n")
        if sig == signal.SIGKILL:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def send(self, text: str) -> None:
        """Write ``text`` to the supervisor's stdin (its command channel: a signal to forward,
        or over ssh the supervisor's source and the job); a session already gone is ignored."""
        with self._stdin_lock:
            try:
                self.popen.stdin.write(text.encode())
                self.popen.stdin.flush()
            except (OSError, ValueError):  # the session is gone already
                pass

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for the local process (the ssh client for a remote worker).

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        return self.popen.wait(timeout=timeout)

    @property
    def running(self) -> bool:
        return self.popen.poll() is None


class _NotStarted:
    """A worker that could not even be started (no ``ssh`` here): exits at once with
    :data:`SSH_FAILED`, reported from a thread like any exit."""

    def __init__(self, on_exit: Callable[[int], None]):
        self.remote_pid = None
        threading.Thread(target=on_exit, args=(SSH_FAILED,), daemon=True).start()

    def signal(self, sig: int) -> None:
        pass

    def wait(self, timeout: Optional[float] = None) -> int:
        return SSH_FAILED

    running = False


_OUT_LOCK = threading.Lock()


def say(line: str) -> None:
    with _OUT_LOCK:
        print(f"hvd-edl-run: {line}", file=sys.stderr, flush=True)


def die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the launcher dies (Linux ``PR_SET_PDEATHSIG``),
    so a ``kill -9`` of ``hvd-edl-run`` leaves no orphaned workers training.  The signal fires
    when the *thread* that forked exits: the driver spawns from its main thread only."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the remote supervisor ends the worker when the ssh session closes


def worker_output_files(output_dir: str, worker_id: str) -> Dict[str, object]:
    """``--output-filename DIR``: open ``DIR/worker.<worker_id>/stdout`` and ``.../stderr``
    (horovodrun's ``DIR/rank.<rank>/stdout`` layout, per worker since ranks change).

    Raises:
        OSError: the folder or the files cannot be created.
    """
    folder = os.path.join(output_dir, f"worker.{worker_id}")
    os.makedirs(folder, exist_ok=True)
    return {name: open(os.path.join(folder, name), "w") for name in ("stdout", "stderr")}


def terminate_all(procs: List, grace_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to every running worker; SIGKILL those still running after ``grace_s``."""
    for p in procs:
        if p.running:
            p.signal(sig)
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.signal(signal.SIGKILL)
