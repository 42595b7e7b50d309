"""A host's announced end (``host ends=T`` in a discovery line: a spot VM's notice, AWS 120 s,
GCE 30 s) under ``hvd-edl-run``: no new worker goes there, rank 0 writes a durable checkpoint at
its next commit and the workers there leave stop-free before the deadline (nothing rolled back,
no failure), the others train on."""
from __future__ import annotations

import time

import psutil

from conftest import long_digits, summary
from hvd_edl import checkpoint


def test_an_announced_end_checkpoints_and_leaves_before_the_deadline(tmp_path, job_factory):
    ck = tmp_path / "ck"
    job = job_factory(["-np", "2", "--min-np", "1", "--max-np", "2", "--discovery-interval",
                       "0.2", "--checkpoint-dir", str(ck), "--checkpoint-every", "3600"],
                      long_digits(tmp_path), hosts="localhost:1\n127.0.0.1:1")
    ev1 = job.wait_generation(1)
    assert sorted(m.split("@")[1] for m in ev1["members"]) == ["127.0.0.1:0", "localhost:0"]
    job.wait_for("a progress line", lambda: "sample/s]" in job.output(), 60)
    leaver = next(m.split("@")[0] for m in ev1["members"] if "127.0.0.1" in m)
    worker = psutil.Process(job.wait_for("its pid", lambda: job.worker_pid(leaver), 30))
    deadline = time.time() + 30  # GCE's notice
    noticed = time.monotonic()
    job.set_hosts(f"localhost:1\n127.0.0.1:1 ends={deadline:.3f}")
    worker.wait(timeout=60)
    exit_s = time.monotonic() - noticed
    ev2 = job.wait_generation(2)
    assert ev2["kind"] == "scale_in" and ev2["rolled_back_steps"] == 0, ev2
    assert all("127.0.0.1" not in m for m in ev2["members"]), ev2
    notes = job.notes("notice")
    assert notes and notes[0]["host"] == "127.0.0.1" and notes[0]["checkpoint_request"], notes
    written = job.wait_for("the notice's checkpoint", lambda: [
        p for p in ck.glob("*.pt") if checkpoint.read_sidecar(p).get("request", 0) >= 1], 60)
    assert written
    print(f"\nnotice at {deadline - 30:.1f}, deadline {deadline:.1f}: checkpoint "
          f"{written[0].name}, the leaver out of the ring after "
          f"{ev2['time'] - (deadline - 30):.2f} s, its process gone after {exit_s:.2f} s "
          f"(30 s allowed)")
    assert exit_s < 30
    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]
    assert "ends in" in job.output()
    assert summary(tmp_path)["world_size"] == 1
