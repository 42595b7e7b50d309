"""``kill -9`` of one worker of a 16-worker ring, again and again: every failure costs exactly
the killed worker, no survivor aborts, nothing waits for Gloo's 30 s timeout.

Before our patch 0008 (``cmake/patches/0008-gloo-pair-errors-not-aborts.patch``) a survivor whose
collective the kill aborted could receive a peer's next message into a receive it had posted
for the aborted one, and Gloo's loop thread ended the process (SIGABRT, "op.preamble.length <=
op.nbytes. 4188 vs 8"): one kill took the ring from 16 to 13 workers (1 in 2 kills with
``benchmarks/job/scale.py``'s walk); and a message for a receive whose operation had been
abandoned left Gloo's loop thread spinning on it, so one survivor waited for Gloo's 30 s timeout
and the whole ring with it (2 kills in 10).  Real launcher, real Horovod over Gloo, real kills; marked
``long`` (about 3 minutes: 16 processes on 2 cores).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
from benchmarks.common import jobs  # noqa: E402  (the Job harness of make bench and make scale)

N = 16
KILLS = 6


@pytest.mark.long
def test_each_kill_of_one_of_16_workers_costs_that_worker_only(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONSAFEPATH", "1")
    job = jobs.Job("hvd_edl", tmp_path, N, step_delay=0.1, max_np=N,
                   launcher_args=("--blacklist-cooldown-range", "1", "1"))
    try:
        assert job.wait_settled(N, 12, 0, 300), job.output_tail()
        for k in range(KILLS):
            t = job.kill_highest_rank()
            assert t is not None
            assert job.wait_settled(N, 12, t, 120), (k, job.output_tail())
            after = [e for e in job.events() if e["time"] >= t]
            failures = [e for e in after if e["kind"] == "failure"]
            assert failures, (k, after)
            for e in failures:
                # only the killed worker left, and the ring did not wait for Gloo's timeout
                assert e["previous_world_size"] - len(e.get("left", [])) + \
                    len(e.get("joined", [])) == e["world_size"], e
                assert len(e.get("left", [])) == 1, (k, e)
                assert e["stall_s"] < 10, (k, e)
        out = job.out_path.read_text(errors="replace")
        assert "terminate called" not in out
        assert "code -6" not in out
    finally:
        job.finish()
