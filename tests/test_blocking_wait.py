"""Our patch 0005 (``cmake/patches/0005-torch-blocking-wait.patch``): with
``HVD_EDL_BLOCKING_WAIT=1`` (what hvd_edl's runtime sets) a rank waiting in ``synchronize()`` for
a late peer sleeps instead of spinning on ``sched_yield``, and still gets the right answer.
Real processes, real Horovod over Gloo, our rendezvous server; no launcher (unit level).

Two ranks; rank 1 sleeps ``LATE_S`` before its allreduce, rank 0 measures its own thread's CPU
time across its allreduce (``time.thread_time``: the waiting thread only, not Horovod's
background thread), once upstream (``HVD_EDL_BLOCKING_WAIT=0``) and once patched.
"""
import json
import subprocess
import sys
from pathlib import Path

from launcher.job.rendezvous import GenerationRendezvous

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
from benchmarks.common.ring_env import kill_leftovers, rank_env  # noqa: E402

LATE_S = 1.5

RANK_SCRIPT = r"""
import json, os, sys, time
import torch
import horovod.torch as hvd
hvd.init()
hvd.allreduce(torch.zeros(1), name="warm")
if hvd.rank() == 1:
    time.sleep(float(sys.argv[1]))
c0, t0 = time.thread_time(), time.monotonic()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="late").item()
print(json.dumps({"rank": hvd.rank(), "total": total, "cpu_s": time.thread_time() - c0,
                  "wall_s": time.monotonic() - t0}), flush=True)
hvd.shutdown()
"""


def _wait_cpu(blocking: bool, rdv: GenerationRendezvous, generation: int) -> dict:
    """Rank 0's answer (total, cpu_s, wall_s of its allreduce) with rank 1 late."""
    port = rdv.open(generation, ["localhost"])
    procs = []
    for rank in range(2):
        env = rank_env(rank, 2, port=port, token=rdv.token(generation), gloo_timeout_s=20,
                       blocking_wait=blocking, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(LATE_S)],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True))
    try:
        answers = {}
        for p in procs:
            out, _ = p.communicate(timeout=60)
            assert p.returncode == 0, f"a rank ended with code {p.returncode}"
            for line in out.splitlines():
                if line.startswith("{"):
                    r = json.loads(line)
                    answers[r["rank"]] = r
    finally:
        kill_leftovers(procs)
    assert sorted(answers) == [0, 1] and all(r["total"] == 3.0 for r in answers.values())
    return answers[0]


def test_a_rank_waiting_for_a_late_peer_sleeps_instead_of_spinning():
    rdv = GenerationRendezvous("127.0.0.1")
    try:
        upstream = _wait_cpu(False, rdv, 1)
        patched = _wait_cpu(True, rdv, 2)
    finally:
        rdv.close()
    for r in (upstream, patched):  # rank 0 really waited for rank 1
        assert r["wall_s"] > 0.5 * LATE_S, (upstream, patched)
    # upstream spins: about a core for the whole wait (less when the cores are shared); patched:
    # a wake-up every 10 ms at most
    assert patched["cpu_s"] < 0.2 * LATE_S, (upstream, patched)
    assert upstream["cpu_s"] > 2 * patched["cpu_s"], (upstream, patched)
