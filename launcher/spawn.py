"""Starting worker processes: locally, or over ssh for remote hosts; their output is prefixed with
the worker's rank; their exit is reported to a callback."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from hvd_edl.audit import ENV_AUDIT_DIR
from hvd_edl.messages import ENV_WORKER_ID
from launcher.hosts import is_local


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker is started with: the user's command and the extra environment."""
    command: List[str]
    env: Dict[str, str]
    cwd: str


class WorkerProcess:
    """A running worker.  ``label()`` gives the current output prefix (its rank once known)."""

    def __init__(self, popen: subprocess.Popen, label: Callable[[], str],
                 on_exit: Callable[[int], None], out=sys.stdout,
                 files: Optional[Dict[str, object]] = None):
        self.popen = popen
        self._label = label
        self._on_exit = on_exit
        self._out = out
        self._files = files or {}  # --output-filename: "stdout"/"stderr" -> a file, unprefixed
        self._out_lock = _OUT_LOCK
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
        if not lines:
            return
        with self._out_lock:
            for line in lines:
                self._out.write(f"[{self._label()}]<{name}>:{line}\n")
            self._out.flush()
        f = self._files.get(name)
        if f is not None:
            f.write("".join(line + "\n" for line in lines))
            f.flush()

    def _wait(self) -> None:
        code = self.popen.wait()
        for t in self._threads:
            t.join(timeout=5)
        self._on_exit(code)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the worker's process group (it and anything it started)."""
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    @property
    def running(self) -> bool:
        return self.popen.poll() is None


_OUT_LOCK = threading.Lock()


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the launcher dies (Linux ``PR_SET_PDEATHSIG``),
    so a ``kill -9`` of ``hvd-edl-run`` leaves no orphaned workers training.  The signal fires
    when the *thread* that forked exits: the driver spawns from its main thread only."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: remote-style cleanup (the worker exits when the coordinator is gone)


def worker_output_files(output_dir: str, worker_id: str) -> Dict[str, object]:
    """``--output-filename DIR``: open ``DIR/worker.<worker_id>/stdout`` and ``.../stderr``
    (horovodrun's ``DIR/rank.<rank>/stdout`` layout, per worker since ranks change).

    Raises:
        OSError: the folder or the files cannot be created.
    """
    folder = os.path.join(output_dir, f"worker.{worker_id}")
    os.makedirs(folder, exist_ok=True)
    return {name: open(os.path.join(folder, name), "w") for name in ("stdout", "stderr")}


def spawn(spec: WorkerSpec, host: str, extra_env: Dict[str, str], label: Callable[[], str],
          on_exit: Callable[[int], None], ssh_port: Optional[int] = None,
          output_dir: Optional[str] = None) -> WorkerProcess:
    """Start ``spec.command`` for one worker on ``host`` (local hosts without ssh); with
    ``output_dir`` its output also goes to :func:`worker_output_files`."""
    env = dict(os.environ)
    env.update(spec.env)
    env.update(extra_env)
    if is_local(host):
        cmd = spec.command
    else:
        # the launcher's audit setting travels too (a local worker inherits it with os.environ)
        passed = {k: os.environ[k] for k in (ENV_AUDIT_DIR,) if k in os.environ}
        exports = " ".join(f"{k}={shlex.quote(v)}"
                           for k, v in {**passed, **spec.env, **extra_env}.items())
        remote = f"cd {shlex.quote(spec.cwd)} && env {exports} {shlex.join(spec.command)}"
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no"]
        cmd += (["-p", str(ssh_port)] if ssh_port else []) + [host, remote]
    files = worker_output_files(output_dir, extra_env[ENV_WORKER_ID]) if output_dir else None
    popen = subprocess.Popen(cmd, env=env, cwd=spec.cwd, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                             start_new_session=True, preexec_fn=_die_with_parent)
    return WorkerProcess(popen, label, on_exit, files=files)


def terminate_all(procs: List[WorkerProcess], grace_s: float = 10.0,
                  sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to every running worker; SIGKILL those still running after ``grace_s``."""
    for p in procs:
        if p.running:
            p.signal(sig)
    for p in procs:
        try:
            p.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.signal(signal.SIGKILL)
