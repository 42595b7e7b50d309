"""The switch agreement at ``state.commit()`` (``hvd_edl.switch_agreement.agree``): when commits are
slow, a switch requested between two commits happens at the first commit after the request, on
every rank the same, also when the commit before was fast (the epoch's closing commit, right
after a periodic one, as Horovod's examples commit) and in a generation's first period.  Two real ranks, real Horovod over Gloo, our
rendezvous server; the commit periods are set on the ranks' own runtime record (its
``last_commit_at``), not slept.

The benchmark behind it (benchmarks/cluster/reclaim.py): under the earlier rule (one period
decided "slow") a reclaim at 0.9 s commits took up to 1.7 s, two periods.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.job.rendezvous import GenerationRendezvous

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
from benchmarks.common.ring_env import kill_leftovers, rank_env  # noqa: E402

# commit periods (s) before each commit, and the commit before which the request arrives
SCHEDULE = [0.6, 0.6, 0.6, 0.01, 0.6, 0.6, 0.6]
REQUEST_BEFORE = 4   # after the epoch's closing commit (index 3, 0.01 s after the one before)

RANK_SCRIPT = r"""
import collections, json, sys, time, types
import torch
import horovod.torch as hvd
from hvd_edl import switch_agreement
hvd.init()
schedule, request_before = json.loads(sys.argv[1]), int(sys.argv[2])
rt = types.SimpleNamespace(commit_periods=collections.deque(maxlen=8),
                           training_finished_elsewhere=lambda: False)
switch_agreement.new_ring_agreement(rt)  # what the runtime sets when a ring forms
switched_at = None
for i, period in enumerate(schedule):
    rt.last_commit_at = time.monotonic() - period
    # rank 1 alone sees the request (the coordinator's flag reaches ranks at different times)
    pending = i >= request_before and hvd.rank() == 1
    if switch_agreement.agree(rt, lambda: pending):
        switched_at = i
        break
print(json.dumps({"rank": hvd.rank(), "switched_at": switched_at}), flush=True)
hvd.shutdown()
"""


def _switch_commit(rdv: GenerationRendezvous, generation: int, env_extra: dict,
                   schedule=SCHEDULE, request_before=REQUEST_BEFORE) -> dict:
    port = rdv.open(generation, ["localhost"])
    procs = []
    for rank in range(2):
        env = rank_env(rank, 2, port=port, token=rdv.token(generation), gloo_timeout_s=20,
                       OMP_NUM_THREADS="1", **env_extra)
        procs.append(subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, json.dumps(schedule), str(request_before)],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True))
    answers = {}
    try:
        for p in procs:
            out, _ = p.communicate(timeout=60)
            assert p.returncode == 0, f"a rank ended with code {p.returncode}"
            for line in out.splitlines():
                if line.startswith("{"):
                    r = json.loads(line)
                    answers[r["rank"]] = r["switched_at"]
    finally:
        kill_leftovers(procs)
    return answers


@pytest.fixture
def rdv():
    r = GenerationRendezvous("127.0.0.1")
    yield r
    r.close()


def test_a_switch_between_slow_commits_happens_at_the_first_commit_after_the_request(rdv):
    answers = _switch_commit(rdv, 1, {})
    assert answers == {0: REQUEST_BEFORE, 1: REQUEST_BEFORE}, answers


def test_the_earlier_one_period_rule_paid_a_second_period_after_a_closing_commit(rdv):
    """The same schedule under the earlier rule (``HVD_EDL_SYNC_AGREE_WINDOW=1``, and 0: that
    rule whole): the fast closing commit put the next, slow one in the pipelined mode, so the
    switch came one commit late (still the same commit on both ranks)."""
    for window in ("1", "0"):
        answers = _switch_commit(rdv, int(window) + 1, {"HVD_EDL_SYNC_AGREE_WINDOW": window})
        assert answers == {0: REQUEST_BEFORE + 1, 1: REQUEST_BEFORE + 1}, (window, answers)


def test_the_earlier_rule_whole_pipelined_a_generations_first_commit(rdv):
    answers = _switch_commit(rdv, 1, {"HVD_EDL_SYNC_AGREE_WINDOW": "0"},
                             schedule=[0.6, 0.6, 0.6], request_before=0)
    assert answers == {0: 1, 1: 1}, answers


def test_a_switch_requested_in_a_generations_first_period_happens_at_its_first_commit(rdv):
    """A ring just formed (a job just grown) and a request before its first commit: that commit
    waits for its own agreement, so the switch is there, not one slow period later."""
    answers = _switch_commit(rdv, 1, {}, schedule=[0.6, 0.6, 0.6], request_before=0)
    assert answers == {0: 0, 1: 0}, answers
