"""The namespace test cluster (tests/cluster.py) for the benchmarks that run on it (library, not
a benchmark): ``Cluster`` and ``ClusterUnavailable``, loaded by path (the benchmark
benchmarks/multihost/cluster.py is also named ``cluster``), and :func:`reset_hosts` between
runs.  Used by benchmarks/multihost/cluster.py and benchmarks/multihost/cluster_chaos.py.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_test_cluster():
    """tests/cluster.py, loaded by path (multihost/cluster.py's own name would shadow it)."""
    spec = importlib.util.spec_from_file_location("hvd_edl_tests_cluster",
                                                  ROOT / "tests" / "cluster.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_cluster = _load_test_cluster()
Cluster, ClusterUnavailable = _cluster.Cluster, _cluster.ClusterUnavailable


def reset_hosts(c: Cluster) -> None:
    """Every host back on the bridge, running, with nothing but its sshd."""
    for name, h in c.hosts.items():
        c.thaw(name)
        try:
            c.reconnect(name)
        except RuntimeError:
            pass
        sshd = c._sshd[name].pid
        for pid in c.pids(name):
            if pid != sshd:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
