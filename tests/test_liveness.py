"""Silent members (launcher/job/liveness.py, hvd_edl/heartbeat.py): a frozen process is declared
dead from its missing heartbeats and fenced, the others are released and train on from the last
commit; the same while a new ring is being set up (Horovod's set-up would otherwise wait for
Gloo's 30 s timeout, then end every survivor with std::terminate).  Timings are printed, not
asserted (benchmarks/multihost/cluster.py measures them: its vanish and freeze faults)."""
from __future__ import annotations

import os
import signal
import time

import psutil

from conftest import long_digits


def _stalls(ev):
    return ev.get("stall_s", 0.0)


def test_frozen_member_is_fenced_and_the_others_train_on(tmp_path, job_factory):
    job = job_factory(["-np", "3", "--min-np", "1", "--max-np", "3", "--discovery-interval",
                       "0.2"], long_digits(tmp_path), hosts="localhost:3")
    job.wait_generation(1)
    job.wait_for("a progress line", lambda: "sample/s]" in job.output(), 90)
    pid = job.wait_for("pid of w2", lambda: job.worker_pid("w2"), 30)
    frozen_at = time.time()
    os.kill(pid, signal.SIGSTOP)
    ev = job.wait_generation(2, timeout_s=60)
    assert ev["kind"] == "failure" and not ev["state_lost"], ev
    assert all(not m.startswith("w2@") for m in ev["members"]), ev
    assert "w2@localhost:1 fell silent" in job.output()
    job.wait_for("the frozen worker killed", lambda: not psutil.pid_exists(pid)
                 or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 30)
    print(f"frozen member: new ring formed {ev['time'] - frozen_at:.2f} s after the freeze; "
          f"survivors' stall {_stalls(ev):.2f} s")
    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]
    kinds = [e["kind"] for e in job.events()]
    assert kinds[:2] == ["start", "failure"], kinds


def test_member_frozen_while_the_ring_forms_costs_seconds_not_the_state(tmp_path, job_factory,
                                                                       monkeypatch):
    """A joiner stops (SIGSTOP) right before its ``hvd.init()`` (fault injection,
    ``HVD_EDL_TEST_STOP_BEFORE_INIT``): the ring forms with it and the members' ``hvd.init()``
    waits for its rendezvous keys.  The coordinator fences it, seals that generation's
    rendezvous and releases the others; their (patched) Horovod fails the set-up instead of
    aborting (std::terminate), and they form the next ring without the joiner, from their
    committed state."""
    monkeypatch.setenv("HVD_EDL_TEST_STOP_BEFORE_INIT", "w3")
    job = job_factory(["-np", "2", "--min-np", "1", "--max-np", "3", "--discovery-interval",
                       "0.2"], long_digits(tmp_path), hosts="localhost:2")
    job.wait_generation(1)
    job.set_hosts("localhost:3")
    job.wait_for("w3 fenced", lambda: "w3@localhost:2 fell silent" in job.output(), 120)
    fenced_at = time.time()
    deadline = time.monotonic() + 60
    ev = None
    while time.monotonic() < deadline and ev is None:  # the ring that trains without w3
        ev = next((e for e in job.events() if e["generation"] >= 3
                   and all(not m.startswith("w3@") for m in e["members"])), None)
        time.sleep(0.05)
    assert ev is not None, job.output()[-4000:]
    assert ev["kind"] == "failure" and not ev["state_lost"] and ev["world_size"] == 2, ev
    out = job.output()
    assert "hvd.init() for generation 2 failed" in out, out[-4000:]
    assert "STATE LOST" not in out
    print(f"joiner frozen in set-up: the ring without it formed {ev['time'] - fenced_at:+.2f} s "
          f"after the fence line; survivors' stall {ev['stall_s']:.2f} s")
    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]
