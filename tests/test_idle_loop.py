"""Horovod's background loop with our patch 0009
(``cmake/patches/0009-idle-loop-waits-for-work.patch``, ``HVD_EDL_IDLE_WAIT_MS``, which hvd_edl's
runtime sets where a host has a core per local rank): real processes, real Horovod over Gloo, our
rendezvous server; no launcher (unit level).

An idle loop (every tensor queue empty) sleeps until a tensor is enqueued, shutdown is asked for,
or the wait ends, instead of running the response cache's collective every 1 ms cycle.  What a
script can observe must not change: collectives whose ranks arrive far apart (longer than the
wait) give the exact results, ``hvd.join()`` waits for the ranks still training, a rank that
never calls ``hvd.shutdown()`` learns of a peer's within the bound, and the idle ranks use a
fraction of upstream's CPU (the loop really sleeps; the same ranks with the variable unset are
the reference, in the same test).
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_edl.runtime import IDLE_WAIT_MS, idle_wait_ms

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
from benchmarks.common.ring_env import kill_leftovers, rank_env  # noqa: E402

WAIT_MS = 150

RANK_SCRIPT = r"""
import json, os, sys, time
import torch
import horovod.torch as hvd
torch.set_num_threads(1)
hvd.init()
r, n = hvd.rank(), hvd.size()
out = {"rank": r}
# ranks arrive far apart (up to 2.5x the idle wait): every result exact
sums = []
for step in range(4):
    time.sleep(0.375 * ((r + step) % n) / max(n - 1, 1))
    h = {k: hvd.allreduce_async(torch.tensor([float(r + step)] * (i + 1)), op=hvd.Sum, name=k)
         for i, k in enumerate(["a", "b"])}
    sums.append({k: hvd.synchronize(x).tolist() for k, x in h.items()})
out["sums"] = sums
out["gathered"] = hvd.allgather(torch.tensor([[r]]), name="g").tolist()
# idle: only the background loops run
hvd.allreduce(torch.zeros(1), name="before_idle")
c0 = time.process_time()
time.sleep(1.0)
out["idle_cpu_s"] = time.process_time() - c0
# uneven data: rank 0 joins first, the others go on with two more allreduces
if r == 0:
    out["last_joined"] = hvd.join()
else:
    for i in range(2):
        time.sleep(0.3)
        hvd.allreduce(torch.ones(1), name=f"uneven{i}")
    out["last_joined"] = hvd.join()
# the last rank shuts down; the others never call hvd.shutdown() and must learn of it
hvd.allreduce(torch.zeros(1), name="before_shutdown")
if r == n - 1:
    hvd.shutdown()
else:
    time.sleep(0.5)  # idle (nothing queued) while the peer shuts down
    t0 = time.monotonic()
    while True:
        try:
            hvd.allreduce(torch.zeros(1), name=f"after{int((time.monotonic() - t0) * 1000)}")
        except Exception as e:  # Horovod raises once its loop has shut down
            out["shutdown_seen_s"] = time.monotonic() - t0
            out["shutdown_error"] = type(e).__name__
            break
        time.sleep(0.05)
        if time.monotonic() - t0 > 20:
            out["shutdown_seen_s"] = None
            break
print("RESULT " + json.dumps(out), flush=True)
"""


def _ring(n, rdv, generation, wait_ms):
    port = rdv.open(generation, ["localhost"], n)
    procs = []
    for rank in range(n):
        env = rank_env(rank, n, port=port, token=rdv.token(generation), gloo_timeout_s=20,
                       fast_init=True, blocking_wait=True, idle_wait_ms=wait_ms)
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            assert lines, f"a rank failed ({p.returncode}): {err[-3000:]}"
            results.append(json.loads(lines[0][len("RESULT "):]))
    finally:
        kill_leftovers(procs)
    return sorted(results, key=lambda x: x["rank"])


def _check(results, n):
    base = n * (n - 1) / 2
    # hvd.join() returns the same last rank to join everywhere: not rank 0, which joined first
    assert len({x["last_joined"] for x in results}) == 1 and results[0]["last_joined"] != 0
    for x in results:
        for step, got in enumerate(x["sums"]):
            want = base + n * step
            assert got == {"a": [want], "b": [want] * 2}, (x["rank"], step, got)
        assert x["gathered"] == [[r] for r in range(n)]
        if x["rank"] != n - 1:
            assert x["shutdown_seen_s"] is not None, f"rank {x['rank']} never saw the shutdown"


# marker long (make test's 15 minutes): test_blocking_wait.py checks the same sleep instead of spinning
@pytest.mark.long
def test_idle_loop_sleeps_and_collectives_keep_horovods_results(rdv):
    n = 3
    patched = _ring(n, rdv, 2, WAIT_MS)
    _check(patched, n)
    upstream = _ring(n, rdv, 3, 0)
    _check(upstream, n)
    # every rank that stayed up found Horovod shut down at its next collective
    assert max(x["shutdown_seen_s"] for x in patched[:-1]) < 5.0
    # the idle ranks' CPU: upstream cycles a collective every 1 ms, the patched loop sleeps
    idle_patched = sum(x["idle_cpu_s"] for x in patched)
    idle_upstream = sum(x["idle_cpu_s"] for x in upstream)
    assert idle_patched < 0.5 * idle_upstream, (idle_patched, idle_upstream)


def test_the_idle_wait_is_on_only_with_a_core_per_local_rank():
    assert idle_wait_ms(1, cores=2) == IDLE_WAIT_MS
    assert idle_wait_ms(2, cores=2) == IDLE_WAIT_MS
    assert idle_wait_ms(3, cores=2) == "0"
    assert idle_wait_ms(16, cores=2) == "0"
    assert idle_wait_ms(8, cores=64) == IDLE_WAIT_MS
