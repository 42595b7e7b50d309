"""Horovod ranks started by hand, without a launcher: the environment each rank gets and a
rendezvous server that counts requests.  The unit-level tests of our Horovod patches
(tests/test_idle_loop.py, test_scale.py, test_blocking_wait.py) and the benchmarks that time
Horovod alone (job/collectives.py, job/scale.py) start their ranks this way.

Part of the benchmarks' library (``benchmarks.common``), imported with the repository root on
``sys.path``: ``from benchmarks.common.ring_env import rank_env``.  Tests append the root at the
end of ``sys.path``, so tests/cluster.py stays the ``cluster`` they import.
"""
from __future__ import annotations

import os
import subprocess
from typing import Dict, Iterable, Optional

from launcher.job.rendezvous import GenerationRendezvous

RENDEZVOUS_ADDR = "127.0.0.1"


def rank_env(rank: int, size: int, *, hosts: int = 1, port: Optional[int] = None,
             token: Optional[str] = None, gloo_timeout_s: Optional[int] = None,
             fast_init: Optional[bool] = None, blocking_wait: Optional[bool] = None,
             idle_wait_ms: Optional[object] = None, **extra: str) -> Dict[str, str]:
    """This process's environment for rank ``rank`` of ``size``, as Horovod's launcher sets it
    (and hvd_edl's runtime at a switch): ``HOROVOD_RANK/SIZE/LOCAL_*/CROSS_*/HOSTNAME``, the Gloo
    controller and CPU operations over loopback, our rendezvous at 127.0.0.1 and
    ``PYTHONSAFEPATH=1``.

    Args:
        hosts: the ranks say they run on that many hosts, ``size // hosts`` each, host-major (as
            Horovod's launcher numbers them): ``localhost`` for one host, else ``host0``,
            ``host1`` ...
        port, token: the generation's rendezvous port and token, when known at start (a rank
            that learns them later sets them before its ``hvd.init()``).
        gloo_timeout_s: ``HOROVOD_GLOO_TIMEOUT_SECONDS``.
        fast_init, blocking_wait, idle_wait_ms: ``HVD_EDL_GLOO_FAST_INIT``,
            ``HVD_EDL_BLOCKING_WAIT`` (True "1", False "0") and ``HVD_EDL_IDLE_WAIT_MS``: our
            patches 0004/0007, 0005 and 0009.
        extra: more variables, set last.

    A parameter left at None sets nothing: the variable passes through from this process.
    """
    per_host = size // hosts
    env = dict(os.environ)
    env.update({"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size),
                "HOROVOD_LOCAL_RANK": str(rank % per_host), "HOROVOD_LOCAL_SIZE": str(per_host),
                "HOROVOD_CROSS_RANK": str(rank // per_host), "HOROVOD_CROSS_SIZE": str(hosts),
                "HOROVOD_HOSTNAME": "localhost" if hosts == 1 else f"host{rank // per_host}",
                "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
                "HOROVOD_GLOO_IFACE": "lo", "HOROVOD_GLOO_RENDEZVOUS_ADDR": RENDEZVOUS_ADDR,
                "PYTHONSAFEPATH": "1"})
    optional = {"HOROVOD_GLOO_RENDEZVOUS_PORT": port, "HOROVOD_GLOO_RENDEZVOUS_TOKEN": token,
                "HOROVOD_GLOO_TIMEOUT_SECONDS": gloo_timeout_s,
                "HVD_EDL_GLOO_FAST_INIT": fast_init, "HVD_EDL_BLOCKING_WAIT": blocking_wait,
                "HVD_EDL_IDLE_WAIT_MS": idle_wait_ms}
    for name, value in optional.items():
        if value is not None:
            env[name] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    env.update(extra)
    return env


def kill_leftovers(procs: Iterable[subprocess.Popen]) -> None:
    """Kill and reap every rank of ``procs`` still running (a ``finally`` after the ranks)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


class CountingRendezvous(GenerationRendezvous):
    """Our rendezvous server (``launcher.job.rendezvous``), counting the requests each generation's
    store answers (by port)."""

    def __init__(self, *args, **kwargs):
        self.requests: Dict[int, int] = {}
        super().__init__(*args, **kwargs)

    async def _answer(self, store, request, body):
        self.requests[store.port] = self.requests.get(store.port, 0) + 1
        return await super()._answer(store, request, body)
