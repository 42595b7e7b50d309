"""A multi-node Ray cluster on the namespace cluster (:mod:`cluster`): a Ray head in one host's
namespace, a Ray node per other host, each bound to its namespace's address only (never the
machine's own interfaces).  Shared by tests/test_ray.py and benchmarks/ray/ray_vs_raytrain.py.

    with Cluster(hosts=3) as c:
        ray = RayCluster(c)                       # nothing started yet
        ray.start("h1", head=True, cpus=1)        # ray start --head --block in h1's namespace
        ray.start("h2", cpus=1)                   # ray start --address <h1>:6379 --block
        ray.drain("h2"); ray.kill("h2")           # ray drain-node; SIGKILL of h2's processes
        ray.close()                               # every Ray process stopped by its pid

Every node runs ``ray start --block`` in its namespace with its own ``--temp-dir`` (under the
cluster's folder: Ray's session files and sockets never meet another node's, nor a Ray of the
machine), a 100 MB object store, no dashboard, no usage stats.  Ray's
processes are stopped by their pids: those in the node's namespace that descend from its
``ray start`` (or all of the namespace's but the test's own, for a node that "dies"); never
``ray stop``, which ends every Ray process of the machine by name.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import psutil

from cluster import Cluster

RAY = str(Path(sys.executable).parent / "ray")
HEAD_PORT = 6379
OBJECT_STORE_BYTES = 100 * 2 ** 20
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}


def _signal_all(pids, sig: int) -> None:
    """``sig`` to each of ``pids`` (those already gone are skipped)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


class RayUnavailable(RuntimeError):
    """ray is not installed here; the message says so, for ``pytest.skip``."""


class RayCluster:
    """Ray nodes on the hosts of ``cluster``; see the module docstring."""

    def __init__(self, cluster: Cluster):
        if not os.path.exists(RAY):
            raise RayUnavailable(f"no {RAY} (pip install ray)")
        self.c = cluster
        self.head: Optional[str] = None
        self.procs: Dict[str, subprocess.Popen] = {}
        self.logs: Dict[str, Path] = {}
        self._starts: Dict[str, int] = {}

    @property
    def address(self) -> str:
        """The head's ``HOST:PORT`` (what ``--ray`` takes)."""
        return f"{self.c.hosts[self.head].addr}:{HEAD_PORT}"

    def start(self, host: str, head: bool = False, cpus: int = 1, timeout_s: float = 90.0,
              env: Optional[dict] = None, wait: bool = True) -> None:
        """``ray start --block`` on ``host``, bound to its namespace's address; with ``wait``
        returns once the node runs (see :meth:`wait_started`).  A node may start before its
        head is up (it waits for the head)."""
        h = self.c.hosts[host]
        self._starts[host] = self._starts.get(host, 0) + 1
        temp = self.c.dir / f"ray-{host}-{self._starts[host]}"
        log = self.c.dir / f"ray-{host}-{self._starts[host]}.log"
        argv = [RAY, "start", "--block", "--node-ip-address", h.addr, "--num-cpus", str(cpus),
                "--object-store-memory", str(OBJECT_STORE_BYTES), "--temp-dir", str(temp),
                "--disable-usage-stats"]
        if head:
            argv += ["--head", "--port", str(HEAD_PORT), "--include-dashboard=false"]
            self.head = host
        else:
            argv += ["--address", self.address]
        out = open(log, "w")
        self.procs[host] = self.c.popen(host, argv, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        env=dict(os.environ, **RAY_ENV, **(env or {})))
        self.logs[host] = log
        if wait:
            self.wait_started(host, timeout_s)

    def wait_started(self, host: str, timeout_s: float = 90.0) -> None:
        """Wait until ``host``'s ``ray start`` says "Ray runtime started".

        Raises:
            RuntimeError: it exited or did not start in time (its log's tail in the message).
        """
        log = self.logs[host]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            if "Ray runtime started" in text:
                return
            if self.procs[host].poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"ray start on {host} failed or was late: "
                           f"{log.read_text(errors='replace')[-1500:]}")

    def ray_pids(self, host: str) -> List[int]:
        """The processes of ``host``'s Ray node: its ``ray start`` and what descends from it,
        plus whatever else of Ray runs in its namespace (Ray daemonises some of its agents)."""
        proc = self.procs.get(host)
        pids = set()
        if proc is not None:
            try:
                root = psutil.Process(proc.pid)
                pids = {root.pid} | {p.pid for p in root.children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
        for pid in self.c.pids(host):
            try:
                if any("ray" in part for part in psutil.Process(pid).cmdline()[:3]):
                    pids.add(pid)
            except psutil.Error:
                continue
        return sorted(pids)

    def pid_of(self, host: str, name: str) -> Optional[int]:
        """The pid of the process of ``host``'s node whose name is ``name`` (``gcs_server``,
        ``raylet``)."""
        for pid in self.ray_pids(host):
            try:
                if psutil.Process(pid).name() == name:
                    return pid
            except psutil.Error:
                continue
        return None

    def kill_all(self, host: str, keep: List[int] = ()) -> int:
        """SIGKILL every process of ``host``'s namespace but ``keep`` (a machine that dies:
        its Ray node, the workers' actors, supervisors and training processes); returns how
        many."""
        pids = [p for p in self.c.pids(host) if p not in keep and p != os.getpid()]
        _signal_all(pids, signal.SIGKILL)
        self._reap(host)
        return len(pids)

    def drain(self, host: str, node_id: str, deadline_s: int = 60) -> subprocess.CompletedProcess:
        """``ray drain-node`` of ``node_id`` (the node on ``host``), reason preemption, run on
        the head's namespace (what Ray's autoscaler does for a spot notice)."""
        return subprocess.run(self.c.exec_argv(self.head, [
            RAY, "drain-node", "--address", self.address, "--node-id", node_id,
            "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "test: spot notice",
            "--deadline-remaining-seconds", str(deadline_s)]),
            capture_output=True, text=True, timeout=60, env=dict(os.environ, **RAY_ENV))

    def stop(self, host: str, sig: int = signal.SIGKILL) -> None:
        """Stop ``host``'s Ray node: ``sig`` to each of its processes (:meth:`ray_pids`)."""
        _signal_all(self.ray_pids(host), sig)
        self._reap(host)

    def _reap(self, host: str) -> None:
        """Wait (at most 10 s) for the ``ray start --block`` of ``host`` once its node is ended."""
        proc = self.procs.pop(host, None)
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """Stop every node (also on a test's failure; the cluster's own close kills whatever
        is left in its namespaces)."""
        for host in list(self.procs):
            self.stop(host)
