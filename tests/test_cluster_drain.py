"""A pool host leaving under the cluster service: gone from the discovery script's answer, drained
(``hvd-edl-cluster drain HOST --deadline S``), or announcing its end in a pool line
(``host ends=T``).  The jobs there leave it stop-free (before the deadline: a scale-in, nothing
rolled back, never a failure), the pool places nothing there meanwhile, the events say how long
it took and what was left to spare; ``--undo`` gives the host back."""
from __future__ import annotations

import json
import os
import sys
import time

from test_cluster_service import CLI, ROOT, assert_exactly_once, ended_once, ledger, service, wait_for  # noqa: F401,E501


def _status(svc) -> dict:
    from launcher.cluster import cluster_file
    from launcher.cluster.server import ClusterClient
    return ClusterClient(cluster_file.read(svc.cluster)).call("status")


def _ring(svc, job):
    path = svc.state / "jobs" / job / "run1.events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if '"generation"' in x] \
        if path.exists() else []


def _set_pool(pool, text: str) -> None:
    new = pool.with_suffix(".new")
    new.write_text(text)
    os.replace(new, pool)  # atomic: discovery never reads half a file


def test_a_host_leaving_a_drain_and_an_announced_end_move_jobs_off_stop_free(service, tmp_path):
    """One job on one slot of each of two hosts (4 worker starts in all): 127.0.0.1 leaves the
    pool (the discovery script stops naming it) and comes back; is drained with a deadline and
    given back (``--undo``); announces its end.  Each time the job leaves it by a stop-free
    scale-in (nothing rolled back, one run in all) and is lent it again when it is back."""
    pool = tmp_path / "pool"
    _set_pool(pool, "localhost:1\n127.0.0.1:1\n")
    svc = service("--policy", "edl", "--hold", "1", "--host-discovery-script", f"cat {pool}",
                  "--discovery-interval", "0.2")
    a1 = tmp_path / "a1"
    j1 = svc.submit("--min-np", "1", "--max-np", "2",
                    *ledger(tmp_path, "j1", 256, 1000, delay=0.03), "--stop-file",
                    str(tmp_path / "stop1"), audit_dir=a1)
    wait_for("j1's ring of 2", lambda: (_ring(svc, j1) or [{}])[-1].get("world_size") == 2,
             90, svc.job_logs)
    # a host leaving the pool takes its slot from the job that used it: a graceful scale-in
    _set_pool(pool, "localhost:1\n")
    wait_for("j1 off 127.0.0.1", lambda: _ring(svc, j1)[-1]["world_size"] == 1, 90,
             svc.job_logs)
    assert any("127.0.0.1 left" in e["reason"] for e in svc.events(kind="pool")), \
        svc.events(kind="pool")
    after = [e for e in svc.events(j1) if e["kind"] in ("shrink", "move")]
    assert after and "127.0.0.1" not in after[-1]["hosts"], svc.events(j1)
    gens = _ring(svc, j1)
    assert gens[-1]["kind"] == "scale_in" and gens[-1]["rolled_back_steps"] == 0, gens[-1]
    _set_pool(pool, "localhost:1\n127.0.0.1:1\n")  # back: lent again
    wait_for("j1 back on 2", lambda: _ring(svc, j1)[-1]["world_size"] == 2, 90, svc.job_logs)
    r = svc.cli("drain", "127.0.0.1", "--deadline", "30")
    assert r.returncode == 0 and "drained, deadline in 30 s; leaving it: " + j1 in r.stdout, \
        r.stdout + r.stderr
    drained = wait_for("127.0.0.1 drained", lambda: [e for e in svc.events() if e["kind"]
                                                     == "drained"], 60, svc.output)
    assert drained[0]["host"] == "127.0.0.1" and drained[0]["spare_s"] > 0, drained
    assert svc.jobs()[j1]["state"] == "running"
    assert "127.0.0.1" not in _status(svc)["pool"]
    gens = _ring(svc, j1)
    assert gens[-1]["kind"] == "scale_in" and gens[-1]["rolled_back_steps"] == 0, gens[-1]
    assert all(m.split("@")[1].startswith("localhost") for m in gens[-1]["members"]), gens[-1]
    # the host given back: j1 is lent it again
    assert svc.cli("drain", "127.0.0.1", "--undo").returncode == 0
    wait_for("j1 back on 2", lambda: _ring(svc, j1)[-1]["world_size"] == 2, 90, svc.job_logs)
    # a pool line announcing 127.0.0.1's end (a spot notice): the same, with that deadline
    _set_pool(pool, f"localhost:1\n127.0.0.1:1 ends={time.time() + 30:.1f}\n")
    wait_for("the announced end drained", lambda: len([e for e in svc.events()
                                                      if e["kind"] == "drained"]) == 2, 60,
             svc.output)
    assert _ring(svc, j1)[-1]["world_size"] == 1 and _ring(svc, j1)[-1]["rolled_back_steps"] == 0
    (tmp_path / "stop1").touch()
    jobs = svc.wait_jobs(lambda j: j[j1]["state"] == "done", "j1 done")
    assert jobs[j1]["runs"] == 1, jobs            # shrunk 3 times, never restarted nor failed
    ended_once(svc, j1)
    r = svc.cli("drain", "nosuchhost")
    assert r.returncode == 2 and "unknown host 'nosuchhost'" in r.stderr, r.stderr
    assert_exactly_once(a1, 256)


def test_a_job_with_no_ring_off_a_draining_host_is_stopped_before_the_deadline(tmp_path):
    """``drain a --deadline 5`` (closer than LAST_RESORT_S): j1, whose only member is on ``a``
    (its new worker on ``b`` still starting), is checkpointed and stopped now rather than lose
    its workers when the machine goes (a ``drain_preempt`` event, its run's wrapper SIGTERMed);
    j2, with a member on ``b``, is left to leave ``a`` at its next commit."""
    from test_cluster_faults import _wrapper_run
    from launcher.cluster import drains
    from launcher.cluster.policies import make_policy
    from launcher.cluster.runs import JobFiles, Run
    from launcher.cluster.service import Service
    from launcher.cluster.store import JobRecord
    from launcher.discovery import FixedHosts
    svc = Service(tmp_path / "state", FixedHosts({"a": 2, "b": 2}), make_policy("edl"),
                  fixed_pool=True, assume_gpus=True)
    svc.open()
    wrappers = []
    try:
        ids = []
        for _ in range(2):
            job = svc.store.add_job(JobRecord(
                id="", name="t", argv=["python", "t.py"], cwd="/", env={}, np=1, min_np=1,
                max_np=2, priority=0, checkpoint_dir="", state="running", run=1,
                submitted_at=time.time()))
            files = JobFiles(svc.state_dir, job.id).make()
            files.write_hosts({"a": 1})
            wrappers.append(_wrapper_run(files, 1))
            wait_for("the wrapper", lambda: Run(files, 1).probe()[0] == "alive", 30)
            svc.store.update(job.id, allocation={"a": 1}, world_size=1)
            svc.runs[job.id] = Run(files, 1)
            svc.written[job.id] = {"a": 1}
            svc.set_occupied(job.id, {"a": 1, "b": 1})
            ids.append(job.id)
        j1, j2 = ids
        now = time.monotonic()
        svc.telemetry[j1] = (now, {"workers": [{"host": "a", "slot": 0, "state": "member"},
                                               {"host": "b", "slot": 0, "state": "pending"}]})
        svc.telemetry[j2] = (now, {"workers": [{"host": "a", "slot": 0, "state": "member"},
                                               {"host": "b", "slot": 0, "state": "member"}]})
        drains.drain(svc, "a", deadline_s=5)
        drains.check(svc)
        assert svc.store.job(j1).stopping == "preempt"
        assert svc.store.job(j2).stopping is None
        assert [e["job"] for e in svc.store.events() if e["kind"] == "drain_preempt"] == [j1]
        assert wrappers[0].wait(90) == 143  # its launcher SIGTERMed (128 + 15)
        assert wrappers[1].poll() is None
    finally:
        svc.close()
        for w in wrappers:
            if w.poll() is None:
                w.terminate()
                w.wait(30)


def test_a_preemption_on_a_drained_host_waits_for_its_checkpoint_until_the_deadline(tmp_path):
    """The checkpoint before a preemption waits 30 s at most, and no longer than 5 s before the
    deadline of a drained host the job occupies."""
    from launcher.cluster import apply
    from launcher.cluster.policies import make_policy
    from launcher.cluster.service import Service
    from launcher.discovery import FixedHosts
    svc = Service(tmp_path / "state", FixedHosts({"a": 2, "b": 2}), make_policy("edl"),
                  fixed_pool=True, assume_gpus=True)
    svc.occupied = {"j1": {"a": 2}, "j2": {"b": 2}}
    svc.drains = {"a": {"at": time.time(), "deadline": time.time() + 20, "noted": False}}
    assert 14 <= apply.checkpoint_wait(svc, "j1") <= 15
    assert apply.checkpoint_wait(svc, "j2") == apply.CHECKPOINT_WAIT_S
    svc.drains["a"]["deadline"] = time.time() + 2
    assert apply.checkpoint_wait(svc, "j1") == 1.0
