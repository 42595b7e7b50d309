"""Make-before-break without a free host (issue 42, section 3): a job whose host is revoked
(a notice: a drain with a deadline) gets its replacement on slots taken stop-free from another
job above its minimum (:mod:`launcher.cluster.make_before_break`, the ``typed`` policy), the
revoked host's worker leaves only once the replacement is in the ring: nothing rolled back, no
checkpoint, every sample once, no GPU used twice.  Pure tests of the rule, then one real
service with two real jobs (ledger over Gloo, audited) on a full pool."""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from launcher.cluster.make_before_break import donor_order, make_room
from launcher.cluster.policies.typed import TypedPolicy
from launcher.cluster.policy import JobView, Snapshot, check_allocation
from test_cluster_service import assert_exactly_once, ledger, service, wait_for  # noqa: F401

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks.common.gpu_sampler import GpuSampler  # noqa: E402


def _job(id, n=1, lo=1, hi=1, at=0.0, hosts=None, displaced=0, priority=0, goal=None):
    return JobView(id=id, submitted_at=at, np=n, min_np=lo, max_np=hi, started=True,
                   allocation=hosts or {}, displaced=displaced, priority=priority, goal=goal)


# ---- the rule, pure ----------------------------------------------------------------------------

def test_free_slots_first_then_the_lowest_donor_down_to_its_minimum():
    a = _job("a", displaced=2, lo=1, hi=2)
    b = _job("b", n=3, lo=1, hi=3, at=1, hosts={"x": 3})          # 2 spare
    c = _job("c", n=2, lo=1, hi=2, at=2, hosts={"y": 2}, priority=1)  # higher priority
    alloc = {"b": {"x": 3}, "c": {"y": 2}}
    free = {"z": 1}
    order = donor_order([a, b, c], alloc)
    assert [d.id for d in order] == ["b", "c"]
    hosts, taken = make_room(a, alloc, free, order)
    assert hosts == {"z": 1, "x": 1} and taken == {"b": {"x": 1}}
    assert alloc == {"b": {"x": 2}, "c": {"y": 2}, "a": {"z": 1, "x": 1}} and free == {"z": 0}


def test_no_donor_is_shrunk_below_its_minimum_nor_for_too_few_slots():
    a = _job("a", displaced=2, lo=2, hi=2)
    b = _job("b", n=2, lo=1, hi=2, hosts={"x": 2})      # 1 spare: fewer than a's min of 2
    s = _job("s", n=2, lo=2, hi=2, hosts={"y": 2})      # static: spares nothing
    alloc = {"b": {"x": 2}, "s": {"y": 2}}
    free = {"x": 0, "y": 0}
    assert make_room(a, alloc, free, donor_order([a, b, s], alloc)) is None
    assert alloc == {"b": {"x": 2}, "s": {"y": 2}} and free == {"x": 0, "y": 0}  # unchanged


def test_a_host_over_held_does_not_hide_the_free_slots_of_another():
    a = _job("a", displaced=1, lo=1, hi=1)
    b = _job("b", n=2, lo=1, hi=2, hosts={"x": 2})  # 1 spare: not needed, z is free
    alloc = {"b": {"x": 2}}
    free = {"x": -1, "z": 1}  # x held over its slots (a host that shrank under b)
    hosts, taken = make_room(a, alloc, free, donor_order([a, b], alloc))
    assert hosts == {"z": 1} and taken == {} and free == {"x": -1, "z": 0}, (hosts, taken)


def test_typed_moves_a_revoked_job_onto_a_slot_another_job_lends():
    """The round of the real test below: j2 holds both slots of the host left, j1's host is
    revoked: j2 lends one (a shrink, with its reason), j1 moves there, never preempted; with
    j2 at its minimum, j1 is left out (today's checkpoint path) and j2 keeps its slots."""
    j2 = _job("j2", n=2, lo=1, hi=2, at=1, hosts={"b": 2})
    j1 = _job("j1", at=2, displaced=1)
    snap = Snapshot(now=100.0, pool={"b": 2}, jobs=(j2, j1))
    p = TypedPolicy()
    alloc = p.allocate(snap)
    check_allocation(snap, alloc)
    assert alloc == {"j2": {"b": 1}, "j1": {"b": 1}}
    assert "lends 1 slot on b to j1" in p.explain("j2") and "taken from j2" in p.explain("j1")
    j2 = _job("j2", n=2, lo=2, hi=2, at=1, hosts={"b": 2})
    snap = Snapshot(now=100.0, pool={"b": 2}, jobs=(j2, j1))
    alloc = p.allocate(snap)
    assert alloc == {"j2": {"b": 2}} and "checkpointed" in p.explain("j1")


# ---- a real service, two real jobs -------------------------------------------------------------

def _gens(svc, job):
    path = svc.state / "jobs" / job / "run1.events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if '"generation"' in x] \
        if path.exists() else []


def test_a_notice_on_a_full_pool_moves_the_job_onto_a_slot_taken_from_another(service,
                                                                            tmp_path):
    """Pool localhost:1 + 127.0.0.1:2, full: j1 (1-2 workers) on 127.0.0.1's two GPUs, j2 (one
    worker) on localhost.  localhost gets a notice (its pool line's ``ends=``; 240 s: AWS gives
    120, but a worker's start here took 75 s and more at load 40):
    j1 lends one slot stop-free, j2's replacement starts there once j1's leaver is gone, joins,
    and only then does j2's worker on localhost leave: before the deadline, 0 steps rolled
    back, one run each, exactly-once audits 0/0, and no GPU selected by two live workers at
    any sample."""
    marker = f"mbb-{os.getpid()}-{time.monotonic_ns()}"
    os.environ["HVD_EDL_TEST_MARKER"] = marker
    pool = tmp_path / "pool"
    pool.write_text("localhost:1\n127.0.0.1:2\n")
    sampler = None
    try:
        svc = service("--policy", "typed", "--assume-gpus", "--host-discovery-script",
                      f"cat {pool}", "--discovery-interval", "0.2", "--round", "1")
        sampler = GpuSampler(marker, period_s=0.05)
        a1, a2 = tmp_path / "a1", tmp_path / "a2"
        env = ("--env", f"HVD_EDL_TEST_MARKER={marker}")
        j1 = svc.submit(*env, "--np", "2", "--min-np", "1", "--max-np", "2",
                        *ledger(tmp_path, "j1", 256, 1000, delay=0.03), "--stop-file",
                        str(tmp_path / "stop1"), audit_dir=a1)
        j2 = svc.submit(*env, "--np", "1", *ledger(tmp_path, "j2", 256, 1000, delay=0.03),
                        "--stop-file", str(tmp_path / "stop2"), audit_dir=a2)
        jobs = svc.wait_jobs(lambda j: all(x["state"] == "running" for x in j.values()),
                             "both running")
        assert jobs[j1]["allocation"] == {"127.0.0.1": 2}, jobs
        assert jobs[j2]["allocation"] == {"localhost": 1}, jobs
        wait_for("both rings formed", lambda: (_gens(svc, j1) or [{}])[-1].get("world_size")
                 == 2 and _gens(svc, j2), 150, svc.job_logs)
        new = tmp_path / "pool.new"
        new.write_text(f"localhost:1 ends={time.time() + 240:.1f}\n127.0.0.1:2\n")
        os.replace(new, pool)  # atomic: discovery never reads half a file
        drained = wait_for("localhost drained", lambda: [e for e in svc.events()
                                                         if e["kind"] == "drained"], 270,
                           lambda: svc.output() + json.dumps(svc.events())[-3000:])
        assert drained[0]["host"] == "localhost" and drained[0]["spare_s"] > 0, drained
        lent = svc.events(j1, "shrink")
        assert lent and f"lends 1 slot on 127.0.0.1 to {j2}" in lent[0]["reason"], lent
        assert not svc.events(j2, "drain_preempt"), \
            "the replacement had not joined 10 s before the deadline: checkpointed instead"
        log = (svc.state / "jobs" / j2 / "run1.log").read_text()
        joined = re.search(r"\(joined: w\d+@127\.0\.0\.1", log)
        left = re.search(r"\(left: w\d+@localhost", log)
        assert joined and left and joined.start() < left.start(), log[-3000:]
        (tmp_path / "stop1").touch()
        (tmp_path / "stop2").touch()
        jobs = svc.wait_jobs(lambda j: all(x["state"] == "done" for x in j.values()),
                             "both done", timeout_s=120)
    finally:
        os.environ.pop("HVD_EDL_TEST_MARKER", None)
        if sampler is not None:
            sampler.stop()
    assert jobs[j1]["runs"] == 1 and jobs[j2]["runs"] == 1, jobs  # moved, never restarted
    assert not svc.events(j2, "suspend") and not svc.events(j2, "drain_preempt")
    for job in (j1, j2):
        assert all(g.get("rolled_back_steps", 0) == 0 for g in _gens(svc, job)), _gens(svc, job)
    assert sampler.shared_gpus() == [], sampler.shared_gpus()[:5]
    assert_exactly_once(a1, 256)
    assert_exactly_once(a2, 256)
