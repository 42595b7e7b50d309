"""A worker on a Ray node as the driver sees it: the same interface as a local or ssh worker
(:class:`launcher.spawn.process.WorkerProcess`: ``signal``, ``wait``, ``running``,
``remote_pid``, ``last_error_line``), its output prefixed with its rank, its exit reported once.

Its life: the agent places a :class:`launcher.ray.actor.WorkerPlace` actor on the node (the
reservation), the actor starts the link bootstrap, the bootstrap dials back
(:mod:`launcher.ray.link`), and from then on it is an ssh worker in all but the transport: the
same remote supervisor, the same environment (the launcher's, less what only makes sense here,
plus the job's), the same markers.  When it ends, its actor is killed and the reservation
released.  A signal before the link is up cancels the start.
"""
from __future__ import annotations

import json
import signal as signal_
import socket
import subprocess
import threading
from typing import Callable, Dict, Optional

from hvd_edl.messages import ENV_SLOT, ENV_WORKER_ID
from launcher.ray.link import ENV_LINK_TOKEN, NODE_BOOTSTRAP
from launcher.spawn.process import WorkerProcess, WorkerSpec, say
from launcher.spawn.ssh import SUPERVISOR_SOURCE, BOOTSTRAP, remote_environment

LINK_LOST = 255          # the exit code of a worker whose link ended without its exit code
LINK_TIMEOUT_S = 30.0    # a started bootstrap must dial back within this


class _Stream:
    """One direction of a link socket as a pipe's reader: ``read1`` returns b"" at the end
    (also for a reset), and ``eof`` is set then."""

    def __init__(self, sock: socket.socket):
        self._f = sock.makefile("rb", buffering=65536)
        self.eof = threading.Event()

    def read1(self, n: int = 65536) -> bytes:
        try:
            chunk = self._f.read1(n)
        except (OSError, ValueError):
            chunk = b""
        if not chunk:
            self.eof.set()
        return chunk

    def close(self) -> None:
        self.eof.set()
        try:
            self._f.close()
        except OSError:
            pass


class _LinkPopen:
    """What :class:`WorkerProcess` needs of a ``Popen`` (``stdout``, ``stderr``, ``stdin``,
    ``wait``, ``poll``), over a link's two sockets; it "exits" with :data:`LINK_LOST` when
    both streams ended (the real exit code comes in the supervisor's marker)."""

    pid = None

    def __init__(self, io: socket.socket, err: socket.socket):
        self._socks = (io, err)
        self.stdout = _Stream(io)
        self.stderr = _Stream(err)
        self.stdin = io.makefile("wb")

    def poll(self) -> Optional[int]:
        return LINK_LOST if self.stdout.eof.is_set() and self.stderr.eof.is_set() else None

    def wait(self, timeout: Optional[float] = None) -> int:
        for stream in (self.stdout, self.stderr):
            if not stream.eof.wait(timeout):
                raise subprocess.TimeoutExpired("ray link", timeout)
        return LINK_LOST

    def shutdown(self) -> None:
        """End both connections now (the remote supervisor then kills the worker's group, and
        our readers see their end even when the node is silent)."""
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.shutdown()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


class _LinkedProcess(WorkerProcess):
    """A :class:`WorkerProcess` over a link: SIGKILL also ends the link, and a link lost
    without the supervisor's exit code is named as such."""

    def signal(self, sig: int) -> None:
        self.send(f"signal {int(sig)}\n")
        if sig == signal_.SIGKILL:
            self.popen.shutdown()

    def _remote_exit(self, link_code: int) -> int:
        if self._remote_code is not None:
            if self.remote_pid is None:
                said = next((s for s in reversed(self._ssh_lines) if s.strip()), "no message")
                say(f"worker on ray node {self.host} did not start (exit {self._remote_code}): "
                     f"{said.strip()}")
            return self._remote_code
        say(f"link to {self._label()} on ray node {self.host} lost (the node died, was cut off "
             f"or was stopped); its last line: {self._last_line.strip() or '-'}")
        return link_code


class RayWorker:
    """One worker placed on Ray node ``host`` by ``engine`` (a :class:`RayEngine`); see the
    module docstring.  ``placed``: its actor holds the reservation."""

    def __init__(self, engine, spec: WorkerSpec, host: str, extra_env: Dict[str, str],
                 label: Callable[[], str], on_exit: Callable[[int], None],
                 files: Optional[Dict[str, object]] = None):
        self.engine = engine
        self.spec = spec
        self.host = host
        self.worker_id = extra_env.get(ENV_WORKER_ID, "?")
        self.slot = int(extra_env.get(ENV_SLOT, "0"))
        self.placed = False
        self._env = extra_env
        self._label = label
        self._on_exit = on_exit
        self._files = files
        self._lock = threading.Lock()
        self._proc: Optional[_LinkedProcess] = None
        self._cancel: Optional[int] = None     # a signal that came before the link
        self._cancelled = threading.Event()
        self._ended = threading.Event()
        self._last_error = ""

    # ---- the WorkerProcess interface -------------------------------------------------------------

    @property
    def remote_pid(self) -> Optional[int]:
        return self._proc.remote_pid if self._proc is not None else None

    @property
    def last_error_line(self) -> str:
        return self._proc.last_error_line if self._proc is not None else self._last_error

    @property
    def running(self) -> bool:
        return not self._ended.is_set()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the worker's process group through its supervisor; before the link
        is up, SIGTERM / SIGKILL cancel the start (the worker then exits with -sig)."""
        with self._lock:
            proc = self._proc
            if proc is None and sig in (signal_.SIGTERM, signal_.SIGKILL, signal_.SIGINT):
                self._cancel = sig
                self._cancelled.set()
        if proc is not None:
            proc.signal(sig)

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for the worker's end.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"ray worker {self.worker_id}", timeout)
        return self._code

    # ---- its life --------------------------------------------------------------------------------

    def launch(self) -> None:
        threading.Thread(target=self._launch, name=f"ray-{self.worker_id}", daemon=True).start()

    def _launch(self) -> None:
        engine = self.engine
        link = engine.links.expect()
        argv = ["{python}", "-c", NODE_BOOTSTRAP, engine.links.addr, str(engine.links.port),
                self.worker_id, BOOTSTRAP]
        try:
            answer = engine.agent.request(
                "start", engine.start_timeout_s + 10.0, worker=self.worker_id, node=self.host,
                cpus=engine.cpus, gpus=engine.gpus, argv=argv, env={ENV_LINK_TOKEN: link.token},
                cwd=self.spec.cwd, node_ip=engine.node_ip_of(self.host) or "",
                auto_iface=engine.auto_iface, place_timeout_s=engine.start_timeout_s,
                slot=self.slot, node_gpus=engine.node_gpus(self.host))
        except Exception as e:  # noqa: BLE001 - RayError, the agent gone: a failed start
            answer = {"ok": False, "error": str(e)}
        if not answer.get("ok"):
            engine.links.forget(link)
            if self._cancel is None:
                self._last_error = f"ray: node {self.host} refused worker {self.worker_id}'s " \
                                   f"actor: {answer.get('error')}"
                say(self._last_error)
            return self._finish(LINK_LOST if self._cancel is None else -self._cancel)
        self.placed = True
        waited = 0.0
        while not link.ready.is_set() and not self._cancelled.is_set() \
                and waited < LINK_TIMEOUT_S:
            link.ready.wait(0.1)
            waited += 0.1
        with self._lock:
            if not link.ready.is_set() or self._cancel is not None:
                engine.links.forget(link)
                for s in link.streams.values():
                    s.close()
                if self._cancel is None:
                    self._last_error = (f"ray: worker {self.worker_id} on node {self.host} did "
                                        f"not dial back to {engine.links.addr}:{engine.links.port}"
                                        f" within {LINK_TIMEOUT_S:g} s (can the node reach "
                                        f"this address? see --bind-address)")
                    say(self._last_error)
                code = LINK_LOST if self._cancel is None else -self._cancel
                self._proc = None
                threading.Thread(target=self._finish, args=(code,), daemon=True).start()
                return
            popen = _LinkPopen(link.streams["io"], link.streams["err"])
            self._proc = _LinkedProcess(popen, self._label, self._finish, files=self._files,
                                        host=self.host)
        env = remote_environment(self.spec, self._env)
        if engine.auto_iface:
            env.pop("HOROVOD_GLOO_IFACE", None)  # the actor set the node's own interface
        job = {"cwd": self.spec.cwd, "env": env, "command": list(self.spec.command),
               "label": f"{self.worker_id}@{self.host}"}
        self._proc.send(json.dumps(SUPERVISOR_SOURCE) + "\n" + json.dumps(job) + "\n")

    def _finish(self, code: int) -> None:
        if self._ended.is_set():
            return
        self._code = code
        if self._proc is not None:
            self._proc.popen.close()
        self.engine.forget(self)
        self._ended.set()
        self._on_exit(code)
