"""What one Horovod collective costs right after a switch at N ranks on this host (issue 17: where
the 16-rank switch's time goes beyond the Gloo set-up).

N ranks (``--ranks``, default 16) start, initialise once (warm-up: imports, first sockets), shut
down, then initialise again against a fresh generation of our rendezvous server, as at a switch
(``HVD_EDL_GLOO_FAST_INIT=1``, ``HVD_EDL_BLOCKING_WAIT=1``, ``HVD_EDL_IDLE_WAIT_MS``: what
hvd_edl's workers set), and run ``--rounds`` rounds of an allgather of two int64s, a
broadcast of 64 KiB (``broadcast_object``'s first broadcast) and an allreduce of one float, each
under a new name (Horovod negotiates it); then all stay idle ``--idle-s`` seconds.  Prints the
slowest rank's ``hvd.init()``, per operation the median over rounds of the slowest rank's time
(seconds), and the CPU cores the idle ranks used (their process CPU time over the window: only
Horovod's background loops run).  ``HOROVOD_CYCLE_TIME`` and the other Horovod variables pass
through from the environment; ``HVD_EDL_IDLE_WAIT_MS=0`` runs upstream's idle loop (patch 0009
off), ``=200`` the patched one (by default the workers' rule: patched with a core per rank).

    .venv/bin/python benchmarks/job/collectives.py [--ranks 16] [--rounds 3] [--idle-s 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from hvd_edl.runtime import idle_wait_ms  # noqa: E402
from launcher.job.rendezvous import GenerationRendezvous  # noqa: E402
from benchmarks.common.ring_env import kill_leftovers, rank_env  # noqa: E402

RANK = r"""
import json, os, sys, time
import torch, horovod.torch as hvd
torch.set_num_threads(1)
hvd.init(); hvd.allreduce(torch.ones(1), name="warm"); hvd.shutdown()
print("READY", flush=True)
port, token = sys.stdin.readline().split()
os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"], os.environ["HOROVOD_GLOO_RENDEZVOUS_TOKEN"] = port, token
t0 = time.monotonic(); hvd.init(); init_s = time.monotonic() - t0
ops = {"allgather": lambda i: hvd.allgather(torch.tensor([[1, 2]]), name=f"ag{i}"),
       "broadcast_64k": lambda i: hvd.broadcast(torch.zeros(65536, dtype=torch.uint8), 0,
                                                name=f"bc{i}"),
       "allreduce": lambda i: hvd.allreduce(torch.ones(1), name=f"ar{i}")}
times = {k: [] for k in ops}
for i in range(int(sys.argv[1])):
    for k, op in ops.items():
        t = time.monotonic(); op(i); times[k].append(time.monotonic() - t)
hvd.allreduce(torch.ones(1), name="idle")  # every rank done with the rounds
c0, w0 = time.process_time(), time.monotonic()
time.sleep(float(sys.argv[2]))  # idle: only Horovod's background loop runs
idle = (time.process_time() - c0) / (time.monotonic() - w0)
print("RESULT " + json.dumps({"init_s": init_s, "times": times, "idle_cores": idle}), flush=True)
hvd.shutdown()
"""


def _line(p: subprocess.Popen, prefix: str) -> str:
    """The next line of ``p``'s output that starts with ``prefix`` (Horovod's log lines skipped).

    Raises:
        RuntimeError: the rank ended first.
    """
    for line in p.stdout:
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    raise RuntimeError(f"a rank ended (code {p.wait()}) before printing {prefix.strip()}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--idle-s", type=float, default=2.0,
                   help="idle window after the rounds: every rank's CPU time over it (seconds)")
    a = p.parse_args()
    if a.ranks < 2 or a.rounds < 1:
        p.error("--ranks must be at least 2, --rounds at least 1")
    n = a.ranks
    rdv = GenerationRendezvous("127.0.0.1")
    procs = []
    try:
        port = rdv.open(2, ["localhost"], n)
        for rank in range(n):
            env = rank_env(rank, n, port=port, token=rdv.token(2), fast_init=True,
                           blocking_wait=True,
                           idle_wait_ms=os.environ.get("HVD_EDL_IDLE_WAIT_MS", idle_wait_ms(n)))
            procs.append(subprocess.Popen([sys.executable, "-c", RANK, str(a.rounds),
                                          str(a.idle_s)], env=env,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True))
        for q in procs:
            _line(q, "READY")
        port = rdv.open(3, ["localhost"], n)  # the first generation is over: a "switch"
        for q in procs:
            q.stdin.write(f"{port} {rdv.token(3)}\n")
            q.stdin.flush()
        results = [json.loads(_line(q, "RESULT ")) for q in procs]
        for q in procs:
            q.wait(timeout=60)
    finally:
        kill_leftovers(procs)
        rdv.close()
    print(f"{n} ranks: hvd.init() {max(r['init_s'] for r in results):.3f} s (slowest rank)")
    idle = sum(r["idle_cores"] for r in results)
    print(f"  idle: {idle:.2f} cores in use by the {n} ranks (Horovod's background loops, "
          f"{a.idle_s:.0f} s window)")
    for op in results[0]["times"]:
        slowest = [max(r["times"][op][i] for r in results) for i in range(a.rounds)]
        print(f"  {op:14s} {statistics.median(slowest) * 1000:6.1f} ms median of {a.rounds} "
              f"(rounds: {', '.join(f'{x * 1000:.1f}' for x in slowest)} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
