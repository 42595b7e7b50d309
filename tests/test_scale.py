"""Horovod's Gloo set-up with our patches 0004 and 0007 (``cmake/patches/0004-gloo-fast-init.patch``,
``0007-gloo-one-request-rendezvous.patch``):
real processes, real Horovod over Gloo, our rendezvous server; no launcher (unit level).

With ``HVD_EDL_GLOO_FAST_INIT=1`` (what hvd_edl's runtime sets) four ranks on one host form
their rings from one full mesh instead of four, the rendezvous sees 3 requests a rank and
rendezvous instead of one per key and peer, and collectives on the global ring and on a registered process set (whose contexts
are built from the shared local one) still give the right answers, across a re-init.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
from benchmarks.common.ring_env import CountingRendezvous, kill_leftovers, rank_env  # noqa: E402

N = 4

RANK_SCRIPT = r"""
import json, os, sys
import torch
import horovod.torch as hvd
for line in sys.stdin:   # one generation a line: {"port", "token"}; an empty line ends
    if not line.strip():
        break
    g = json.loads(line)
    os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"] = str(g["port"])
    os.environ["HOROVOD_GLOO_RENDEZVOUS_TOKEN"] = g["token"]
    pair = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[pair])
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="g")
    sub = None
    if hvd.rank() < 2:
        sub = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="p",
                            process_set=pair).item()
    hvd.allreduce(torch.zeros(1), name="done")  # ranks 2, 3 must not shut down before the pair
    ids = [hvd.rank(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()]
    hvd.shutdown()
    print(json.dumps({"rank": int(os.environ["HOROVOD_RANK"]),
                      "total": total.item(), "pair": sub, "ids": ids}), flush=True)
"""


def _run_ring(fast: bool, rdv: CountingRendezvous, generation: int, hosts: int = 1):
    """N ranks initialise twice (two generations, each its own rendezvous); returns each
    init's per-rank results and the requests each generation's rendezvous answered.  With
    ``hosts`` > 1 the ranks say they run on that many hosts (N / hosts each, host-major, as
    Horovod's launcher numbers them), so Horovod also forms local and cross rings."""
    procs = []
    for rank in range(N):
        env = rank_env(rank, N, hosts=hosts, gloo_timeout_s=20, fast_init=fast)
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], env=env, cwd=ROOT,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True))
    inits, requests = [], []
    try:
        for g in (generation, generation + 1):
            port = rdv.open(g, ["localhost"])   # seals the one before: open it once it is done
            line = json.dumps({"port": port, "token": rdv.token(g)}) + "\n"
            for p in procs:
                p.stdin.write(line)
                p.stdin.flush()
            answers = []
            for p in procs:
                out = p.stdout.readline()
                while out and not out.startswith("{"):  # Horovod's log lines, if any
                    sys.stderr.write(out)
                    out = p.stdout.readline()
                assert out, f"a rank ended with code {p.wait(timeout=30)}"
                answers.append(json.loads(out))
            inits.append(answers)
            requests.append(rdv.requests.get(port, 0))
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
            assert p.wait(timeout=30) == 0
    finally:
        kill_leftovers(procs)
    return inits, requests


# marker long (make test's 15 minutes): the two-host test below forms local and cross rings through the same path
@pytest.mark.long
def test_fast_gloo_init_forms_the_same_rings_from_far_fewer_rendezvous_requests():
    rdv = CountingRendezvous("127.0.0.1")
    try:
        upstream, upstream_requests = _run_ring(False, rdv, 1)
        fast, fast_requests = _run_ring(True, rdv, 3)
    finally:
        rdv.close()
    for inits in (upstream, fast):
        assert len(inits) == 2  # both generations formed
        for answers in inits:
            assert sorted(r["rank"] for r in answers) == list(range(N))
            for r in answers:
                assert r["total"] == sum(range(N))
                assert r["pair"] == (3.0 if r["rank"] < 2 else None)
    for answers in fast:
        assert [r["ids"] for r in sorted(answers, key=lambda r: r["rank"])] == \
            [[r, r, N, 0, 1] for r in range(N)]
    # upstream: four full meshes of 4 ranks, a request per key and peer (220); patches 0004 +
    # 0007: one mesh, 3 requests a rank (two PUTs, one multi_get), nothing for the cross ring
    # of one rank, plus the pair's own three rendezvous (3, 3 and 2 requests for each of its
    # two ranks: the last is a ring of one, with nothing to read)
    for before, after in zip(upstream_requests, fast_requests):
        assert after == 3 * N + 2 * (3 + 3 + 2) < 0.15 * before, \
            (upstream_requests, fast_requests)


def test_fast_gloo_init_on_two_hosts_forms_local_and_cross_rings_from_one_request_each():
    """Patch 0007 off the one-host path: 2 hosts x 2 ranks (as Horovod's launcher numbers
    them), so every rendezvous (global, local, cross) and the Gloo controller's allgathers run;
    each rendezvous reads its keys in one multi_get, and the rings say the right ranks."""
    rdv = CountingRendezvous("127.0.0.1")
    try:
        inits, requests = _run_ring(True, rdv, 1, hosts=2)
    finally:
        rdv.close()
    assert len(inits) == 2
    for answers in inits:
        answers = sorted(answers, key=lambda r: r["rank"])
        assert [r["ids"] for r in answers] == [[r, r % 2, 2, r // 2, 2] for r in range(N)]
        for r in answers:
            assert r["total"] == sum(range(N))
            assert r["pair"] == (3.0 if r["rank"] < 2 else None)
    # 3 requests a rank and rendezvous: global, local and cross (each rank in one of each),
    # and the pair [0, 1] (one host): its global, local, and cross rings of one (2 requests)
    assert requests == [3 * N * 3 + 2 * (3 + 3 + 2)] * 2, requests
