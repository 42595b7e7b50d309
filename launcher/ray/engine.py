"""``hvd-edl-run --ray ADDRESS``: the launcher's handle on a Ray cluster.  One object answers
both questions the driver asks of an engine:

* *which hosts, how many slots* (:meth:`RayEngine.find_available_hosts_and_slots`, Horovod's
  discovery interface): every alive node that is not being drained is a host, named by its
  node id (several nodes may share an address); its slots are the workers its free resources
  fit (``--cpus-per-worker`` / ``--gpus-per-worker``) plus the workers of this job it already
  holds.  A node added (by hand or by Ray's autoscaler) is a host added; a node drained
  (a spot notice, the autoscaler's idle termination, ``ray drain-node``) or removed is a host
  gone, and its workers leave gracefully; a node that dies is found by the heartbeats
  (seconds), long before Ray's health checks declare it dead.
* *start a worker there* (:meth:`RayEngine.start`): an actor reserves the worker's resources
  on that node and starts its supervisor, which dials back (:mod:`launcher.ray.link`).  The
  job uses only what its actors reserved; another Ray workload keeps its own.

Ray itself runs in a child process (:mod:`launcher.ray.agent`): every question to it is
answered within a bound, and when Ray's head is lost the job goes on with the workers it has
(their links are the launcher's own), says so once, and asks again every
:data:`RECONNECT_EVERY_S` seconds.
"""
from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from launcher.discovery import DiscoveryError
from launcher.job.rendezvous import know_host
from launcher.network_interface import interface_address
from launcher.ray.link import LinkServer

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0    # the agent's ray.init must answer within this
NODES_TIMEOUT_S = 5.0       # a membership question (one discovery call) within this
RECONNECT_EVERY_S = 15.0    # after the agent ended: a new one at most this often
_ROOT = str(Path(__file__).resolve().parents[2])


class RayError(RuntimeError):
    """Ray could not be used: not installed, the address unreachable, no node that fits a
    worker, the agent gone.  The message is one line for the user."""


def fits(resources: Dict[str, float], cpus: float, gpus: float) -> int:
    """How many workers of ``cpus`` CPUs and ``gpus`` GPUs ``resources`` (Ray's ``{"CPU": 2.0,
    "GPU": 1.0, ...}``) hold: ``fits({"CPU": 5}, 2, 0) == 2``; 0 when a needed resource is
    missing.  At least one of ``cpus``, ``gpus`` is > 0."""
    counts = [math.floor(resources.get(name, 0.0) / need + 1e-9)
              for name, need in (("CPU", cpus), ("GPU", gpus)) if need > 0]
    return max(0, min(counts)) if counts else 0


class _Agent:
    """The :mod:`launcher.ray.agent` process and its JSON-lines protocol; requests are answered
    within their timeout or fail with :class:`RayError`."""

    def __init__(self, address: str, timeout_s: float = CONNECT_TIMEOUT_S):
        from launcher.spawn.process import die_with_parent
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        self.address = address
        self.proc = subprocess.Popen([sys.executable, "-m", "launcher.ray.agent", address],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env, cwd=_ROOT,
                                     start_new_session=True, preexec_fn=die_with_parent)
        self._lock = threading.Lock()
        self._answers: Dict[int, dict] = {}
        self._waiting: Dict[int, threading.Event] = {}
        self._seq = 0
        self._stderr: List[str] = []
        self.hello: Optional[dict] = None
        self._hello = threading.Event()
        threading.Thread(target=self._read_err, daemon=True).start()
        threading.Thread(target=self._read_out, daemon=True).start()
        if not self._hello.wait(timeout_s):
            self.close()
            raise RayError(f"no answer from the Ray cluster at {address} within {timeout_s:g} s"
                           f"{self._said()}")
        if self.hello is None or "error" in self.hello:
            self.close()
            said = (self.hello or {}).get("error") or f"the Ray agent ended{self._said()}"
            raise RayError(said)

    def _said(self) -> str:
        lines = [s for s in self._stderr if s.strip()]
        return f" (it said: {lines[-1].strip()[:200]})" if lines else ""

    def _read_err(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            log.debug("ray agent: %s", line)
            self._stderr = (self._stderr + [line])[-20:]

    def _read_out(self) -> None:
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if self.hello is None:
                self.hello = msg
                self._hello.set()
                continue
            with self._lock:
                event = self._waiting.pop(msg.get("id"), None)
                if event is not None:
                    self._answers[msg["id"]] = msg
            if event is not None:
                event.set()
        self._hello.set()
        with self._lock:  # the agent ended: nobody waits in vain
            waiting, self._waiting = self._waiting, {}
        for event in waiting.values():
            event.set()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def request(self, op: str, timeout_s: float, wait: bool = True, **fields) -> dict:
        """Send one request; with ``wait`` its answer within ``timeout_s`` seconds.

        Raises:
            RayError: the agent ended, or no answer in time.
        """
        event = threading.Event()
        with self._lock:
            self._seq += 1
            rid = self._seq
            if wait:
                self._waiting[rid] = event
            try:
                self.proc.stdin.write((json.dumps({"id": rid, "op": op, **fields}) + "\n")
                                      .encode())
                self.proc.stdin.flush()
            except (OSError, ValueError):
                self._waiting.pop(rid, None)
                raise RayError(f"the Ray agent ended{self._said()}") from None
        if not wait:
            return {}
        if not event.wait(timeout_s):
            with self._lock:
                self._waiting.pop(rid, None)
            raise RayError(f"Ray did not answer '{op}' within {timeout_s:g} s")
        with self._lock:
            answer = self._answers.pop(rid, None)
        if answer is None:
            raise RayError(f"the Ray agent ended (exit code {self.proc.poll()}){self._said()}")
        return answer

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


def connect(address: str, cpus_per_worker: float, gpus_per_worker: float,
            start_timeout_s: float, nic: Optional[str],
            bind_address: Optional[str]) -> Tuple["RayEngine", str]:
    """The engine for ``--ray ADDRESS`` and the address the job's servers listen on:
    ``--bind-address``, else ``--network-interface``'s, else this node's address in the Ray
    cluster (the one its nodes reach it at).  Without ``--network-interface`` each worker's ring
    uses the interface that carries its node's Ray address.

    Raises:
        RayError: see :class:`RayEngine`; or the address cannot be bound.
    """
    engine = RayEngine(address, cpus_per_worker, gpus_per_worker, start_timeout_s,
                       auto_iface=nic is None)
    bind = bind_address
    if bind is None and nic is not None:
        bind = interface_address(nic)
        if bind is None:
            engine.close()
            raise RayError(f"--network-interface {nic}: no such interface with an IPv4 address")
    bind = bind or engine.node_ip
    try:
        engine.listen(bind)
    except OSError as e:
        engine.close()
        raise RayError(f"cannot listen on {bind} for the workers' links: {e.strerror or e}") \
            from None
    return engine, bind


class RayEngine:
    """The Ray cluster at ``address`` (``auto``: the one this machine belongs to) as the
    engine of one job; see the module docstring.

    Args:
        address: what ``ray.init(address=...)`` takes (``auto``, ``HOST:PORT``).
        cpus_per_worker, gpus_per_worker: what each worker's actor reserves (>= 0, not both 0).
        start_timeout_s: how long an actor may take to be placed and start (``--start-timeout``).

    Raises:
        RayError: ray is not installed, the cluster does not answer, or no alive node could
            ever hold one worker.
    """

    def __init__(self, address: str, cpus_per_worker: float = 1.0, gpus_per_worker: float = 0.0,
                 start_timeout_s: float = 120.0, auto_iface: bool = True):
        self.address = address
        self.cpus = cpus_per_worker
        self.gpus = gpus_per_worker
        self.start_timeout_s = start_timeout_s
        self.auto_iface = auto_iface
        self.reasons: Dict[str, str] = {}       # node id -> why it left (drain, death)
        self._lock = threading.Lock()
        self._workers: Dict[str, object] = {}  # worker id -> RayWorker (live ones)
        self._shown: Dict[str, int] = {}       # node id -> slots last printed
        self._ips: Dict[str, str] = {}
        self._gpus: Dict[str, float] = {}
        self._lost_said = False
        self._closed = False
        self._last_hosts: Dict[str, int] = {}
        self._last_connect = time.monotonic()
        self.agent = _Agent(address)
        self.node_id = self.agent.hello["node_id"]
        self.node_ip = self.agent.hello["node_ip"]
        self.version = self.agent.hello.get("ray", "?")
        self.links: Optional[LinkServer] = None
        self._check_fits()

    def _check_fits(self) -> None:
        nodes = self.agent.request("nodes", NODES_TIMEOUT_S)["nodes"]
        alive = [n for n in nodes if n["alive"]]
        if not any(fits(n["total"], self.cpus, self.gpus) for n in alive):
            most = max((n["total"].get("CPU", 0.0) for n in alive), default=0.0)
            gpus = max((n["total"].get("GPU", 0.0) for n in alive), default=0.0)
            self.agent.close()
            raise RayError(f"no node of the Ray cluster at {self.address} can hold one worker "
                           f"(--cpus-per-worker {self.cpus:g}, --gpus-per-worker {self.gpus:g}); "
                           f"its largest node has {most:g} CPUs and {gpus:g} GPUs "
                           f"({len(alive)} alive nodes)")

    def listen(self, bind_addr: str) -> None:
        """Accept the workers' links on ``bind_addr`` (the coordinator's address; for a
        wildcard the nodes dial this node's Ray address).

        Raises:
            OSError: it cannot be bound.
        """
        if self.links is None:
            self.links = LinkServer(bind_addr)
            if bind_addr in ("0.0.0.0", "::"):
                self.links.addr = self.node_ip

    # ---- discovery -----------------------------------------------------------------------------

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        """``{node id: slots}`` of the alive, undrained nodes with room for a worker, in Ray's
        order.  A node's slots are never fewer than its live workers need (its highest slot
        + 1), so a moment's lag of Ray's resource view never evicts anyone.

        Raises:
            DiscoveryError: Ray does not answer (its head lost: the job goes on with the
                workers it has), or no node has room.
        """
        if self._closed:  # the job is ending: nothing changes any more
            return dict(self._last_hosts)
        try:
            nodes = self._nodes()
        except RayError as e:
            with self._lock:
                n = len(self._workers)
            self._lost_said = True
            raise DiscoveryError(f"ray: {e}: the Ray head at {self.address} looks lost; the job "
                                 f"goes on with the {n} worker{'s' if n != 1 else ''} it has "
                                 f"(no node joins until Ray answers again)",
                                 key="ray: head lost") from None
        if self._lost_said:
            self._lost_said = False
            print(f"hvd-edl-run: ray: the Ray cluster at {self.address} answers again",
                  file=sys.stderr, flush=True)
        with self._lock:
            workers = list(self._workers.values())
        hosts: Dict[str, int] = {}
        for n in nodes:
            nid = n["id"]
            self._gpus[nid] = n["total"].get("GPU", 0.0)
            if self._ips.get(nid) != n["ip"]:
                self._ips[nid] = n["ip"]
                know_host(nid, [n["ip"]])  # the rendezvous admits its workers by address
            if not n["alive"]:
                self.reasons[nid] = f"ray: node {n['ip']} is dead"
                continue
            if n["draining"] is not None:
                deadline = n["draining"]
                self.reasons[nid] = (f"ray: node {n['ip']} is being drained"
                                     + (f" (deadline in {max(0.0, deadline / 1000 - time.time()):.0f} s)"
                                        if deadline else ""))
                continue
            mine = [w for w in workers if w.host == nid]
            placed = sum(1 for w in mine if w.placed)
            slots = max(fits(n["available"], self.cpus, self.gpus) + placed,
                        max((w.slot + 1 for w in mine), default=0))
            if slots > 0:
                hosts[nid] = slots
        for nid, slots in hosts.items():
            if self._shown.get(nid) != slots:
                self._shown[nid] = slots
                print(f"hvd-edl-run: ray: node {nid} ({self._ips.get(nid)}) offers {slots} "
                      f"slot{'s' if slots != 1 else ''}", flush=True)
        for nid in [k for k in self._shown if k not in hosts]:
            del self._shown[nid]
        self._last_hosts = dict(hosts)
        if not hosts:
            raise DiscoveryError(f"ray: no alive node of the cluster at {self.address} has room "
                                 f"for a worker now (--cpus-per-worker {self.cpus:g}, "
                                 f"--gpus-per-worker {self.gpus:g})", key="ray: no room")
        return hosts

    def _nodes(self) -> List[dict]:
        if not self.agent.alive and time.monotonic() - self._last_connect > RECONNECT_EVERY_S:
            self._last_connect = time.monotonic()
            try:
                self.agent = _Agent(self.address)
            except RayError as e:
                raise RayError(f"the Ray agent ended; a new one failed: {e}") from None
        return self.agent.request("nodes", NODES_TIMEOUT_S)["nodes"]

    def node_ip_of(self, node_id: str) -> Optional[str]:
        return self._ips.get(node_id)

    def node_gpus(self, node_id: str) -> int:
        """How many GPUs node ``node_id`` has in all (0 when unknown)."""
        return int(self._gpus.get(node_id, 0))

    # ---- spawning ------------------------------------------------------------------------------

    def start(self, spec, host: str, extra_env: Dict[str, str], label: Callable[[], str],
              on_exit: Callable[[int], None], files: Optional[Dict[str, object]] = None):
        """Start one worker on node ``host`` (a node id); returns a
        :class:`launcher.ray.worker.RayWorker` at once (the actor is placed in the
        background; a refusal is one line and an exit code 255)."""
        from launcher.ray.worker import RayWorker
        worker = RayWorker(self, spec, host, extra_env, label, on_exit, files)
        with self._lock:
            self._workers[worker.worker_id] = worker
        worker.launch()
        return worker

    def forget(self, worker) -> None:
        """``worker`` ended: release its actor's reservation (without waiting for Ray)."""
        with self._lock:
            self._workers.pop(worker.worker_id, None)
        try:
            self.agent.request("stop", 0, wait=False, worker=worker.worker_id)
        except RayError:
            pass

    def close(self) -> None:
        """End the agent (Ray then ends this job's actors) and the link server."""
        self._closed = True
        self.agent.close()
        if self.links is not None:
            self.links.close()
