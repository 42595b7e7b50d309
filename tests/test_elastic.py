"""The elastic core through hvd-edl-run: stop-free scale-out, graceful scale-in, failures, and
host discovery changes.  Membership and step continuity are asserted, not timings (the stall
figures live in benchmarks/job/bench.py and benchmarks/job/scale.py)."""
import pytest
import signal
import sys

from conftest import digits, long_digits, summary

ELASTIC = ["-np", "2", "--min-np", "1", "--max-np", "4", "--discovery-interval", "0.2"]


def _members(ev):
    return [m.split("@")[0] for m in ev["members"]]


def _assert_continuity(events):
    numbers = [e["generation"] for e in events]
    assert numbers == list(range(1, len(events) + 1)), numbers
    steps = [e["step"] for e in events]
    assert steps == sorted(steps), f"step boundaries must not go backwards: {steps}"
    assert events[0]["kind"] == "start"


def test_scale_out_is_stop_free_and_joiner_builds_first_then_sigterm_makes_a_member_leave(
        tmp_path, job_factory):
    """A joiner builds its model (4 s) while the ring trains on, then joins stop-free (old
    members keep ranks 0 and 1, nothing rolled back); then a member gets SIGTERM (e.g.
    Kubernetes evicting the pod) and leaves gracefully: a scale-in that rolls back nothing and
    blames nobody.  One job walks both (before: two jobs, 5 worker starts)."""
    job = job_factory(ELASTIC, long_digits(tmp_path, "--build-delay", "4"), hosts="localhost:2")
    job.wait_generation(1)
    job.set_hosts("localhost:3")
    ev = job.wait_generation(2)
    assert ev["kind"] == "scale_out" and ev["world_size"] == 3
    assert _members(ev) == ["w1", "w2", "w3"]  # old members keep ranks 0 and 1
    assert ev["step"] > 0 and ev["rolled_back_steps"] == 0
    job.kill_worker("w2", signal.SIGTERM)
    ev = job.wait_generation(3)
    assert ev["kind"] == "scale_in" and ev["rolled_back_steps"] == 0
    assert _members(ev) == ["w1", "w3"]
    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]
    assert "w2@localhost:1 failed" not in job.output()  # it left, it did not fail
    _assert_continuity(job.events())
    assert summary(tmp_path)["world_size"] == 2  # the joiner trained to the end as a member


# marker long (make test's 15 minutes): test_control.py's ctl scale and the cluster service's edl test assert a scale-in rolls back nothing
@pytest.mark.long
def test_scale_in_rolls_back_nothing(tmp_path, job_factory):
    job = job_factory(["-np", "3", "--min-np", "1", "--max-np", "4", "--discovery-interval", "0.2"],
                      long_digits(tmp_path), hosts="localhost:3")
    job.wait_generation(1)
    job.set_hosts("localhost:2")
    ev = job.wait_generation(2)
    assert ev["kind"] == "scale_in" and ev["world_size"] == 2
    assert ev["rolled_back_steps"] == 0
    assert _members(ev) == ["w1", "w2"]  # the worker in slot 2 left
    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]
    assert "w3@localhost:2 failed" not in job.output()  # it left, it did not fail
    _assert_continuity(job.events())


def _kill_one_of_three(tmp_path, job_factory, victim):
    job = job_factory(["-np", "3", "--min-np", "1", "--max-np", "3", "--discovery-interval", "0.2"],
                      digits(tmp_path, "--epochs", "15", "--step-delay", "0.01"),
                      hosts="localhost:3")
    ev1 = job.wait_generation(1)
    assert _members(ev1) == ["w1", "w2", "w3"]
    victim_id = _members(ev1)[victim]
    job.wait_for("a progress line", lambda: "sample/s]" in job.output(), 60)
    job.kill_worker(victim_id, signal.SIGKILL)
    ev = job.wait_generation(2)
    assert ev["kind"] == "failure" and not ev["state_lost"]
    assert job.finish() == 0, job.output()[-3000:]
    events = job.events()
    assert all(victim_id not in _members(e) for e in events[1:])
    assert events[-1]["world_size"] == 2
    s = summary(tmp_path)
    assert s["world_size"] == 2 and s["epochs"] == 15
    assert s["test_accuracy"] >= 0.95
    _assert_continuity(events)


@pytest.mark.long
def test_when_every_state_holder_dies_the_restart_is_reported(tmp_path, job_factory):
    """Both members of a ring that started at step s > 0 are killed: the replacements start from
    their initial state, and the event log says so (state_lost, at least s steps rolled back)
    instead of reporting a failure that rolled back nothing."""
    job = job_factory(["-np", "1", "--min-np", "1", "--max-np", "2", "--discovery-interval", "0.2"],
                      long_digits(tmp_path), hosts="localhost:1")
    job.wait_generation(1)
    job.wait_for("a progress line", lambda: "sample/s]" in job.output(), 60)
    job.set_hosts("localhost:4")  # w2 joins; two more slots for the replacements
    ev2 = job.wait_generation(2)
    assert _members(ev2) == ["w1", "w2"] and ev2["step"] > 0
    job.kill_worker("w1", signal.SIGKILL)
    job.kill_worker("w2", signal.SIGKILL)
    lost = job.wait_for("a generation without w1 and w2", lambda: next(
        (e for e in job.events() if e["generation"] > 2
         and not {"w1", "w2"} & set(_members(e))), None), 120)
    assert lost["kind"] == "failure" and lost["state_lost"], lost
    assert lost["rolled_back_steps"] >= ev2["step"], (lost, ev2)
    assert "STATE LOST" in job.output()
    assert not any(e["state_lost"] for e in job.events() if e["generation"] < lost["generation"])
    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]


def test_kill_rank_0_leaves_the_others_training(tmp_path, job_factory):
    _kill_one_of_three(tmp_path, job_factory, victim=0)


# marker long (make test's 15 minutes): test_faults_membership.py loses a joiner right after ready, the harder case
@pytest.mark.long
def test_joiner_that_dies_before_ready_does_not_disturb_the_ring(tmp_path, job_factory):
    job = job_factory(ELASTIC, long_digits(tmp_path, "--build-delay", "3"), hosts="localhost:2")
    job.wait_generation(1)
    job.set_hosts("localhost:3")
    job.kill_worker("w3", signal.SIGKILL)  # still importing / building: never ready
    job.wait_for("the launcher to see w3 die", lambda: "w3@localhost:2 failed" in job.output())
    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]
    events = job.events()
    assert [e["generation"] for e in events] == [1], events
    assert summary(tmp_path)["world_size"] == 2


def test_too_few_workers_for_longer_than_elastic_timeout_fails_clearly(tmp_path, job_factory):
    job = job_factory(["-np", "2", "--min-np", "2", "--max-np", "4", "--elastic-timeout", "3"],
                      digits(tmp_path), hosts="localhost:1")
    rc = job.finish(timeout_s=120)
    assert rc != 0
    assert "fewer than --min-np 2 workers available for 3 s" in job.output()


@pytest.mark.long
def test_two_discovery_changes_within_one_second_are_both_acted_on(tmp_path, job_factory):
    job = job_factory(ELASTIC, long_digits(tmp_path), hosts="localhost:2")
    job.wait_generation(1)
    job.set_hosts("localhost:3")
    job.wait_for("w3 to start", lambda: job.worker_pid("w3"), 30)
    job.set_hosts("localhost:3\n127.0.0.2:1")
    ev = job.wait_for("a generation with 4 members", lambda: next(
        (e for e in job.events() if e["world_size"] == 4), None), 120)
    assert any(m.endswith("@127.0.0.2:0") for m in ev["members"])
    assert any(m.startswith("w3@localhost:2") for m in ev["members"])
    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]
    _assert_continuity(job.events())


@pytest.mark.long
def test_host_added_while_first_workers_build_their_model(tmp_path, job_factory):
    job = job_factory(ELASTIC, long_digits(tmp_path, "--build-delay", "4"), hosts="localhost:2")
    job.wait_for("w2 to start", lambda: job.worker_pid("w2"), 30)
    assert job.events() == []  # generation 1 not formed yet: the workers are still building
    job.set_hosts("localhost:3")
    ev = job.wait_for("a generation with 3 members", lambda: next(
        (e for e in job.events() if e["world_size"] == 3), None), 120)
    assert _members(ev) == ["w1", "w2", "w3"]
    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]
    _assert_continuity(job.events())


def test_sigterm_to_the_launcher_stops_the_workers_without_blaming_them(tmp_path, job_factory):
    """horovodrun's behaviour: the launcher passes the signal on and exits 128 + 15; stopping
    is not a failure, so no slot rests and no host is blacklisted."""
    import psutil
    job = job_factory(ELASTIC, long_digits(tmp_path), hosts="localhost:2")
    job.wait_generation(1)
    workers = psutil.Process(job.proc.pid).children(recursive=True)
    job.proc.send_signal(signal.SIGTERM)
    assert job.proc.wait(timeout=60) == 128 + signal.SIGTERM, job.output()[-3000:]
    said = [line for line in job.output().splitlines() if line.startswith("hvd-edl-run:")]
    assert any("got signal 15: stopping workers" in line for line in said), said
    for word in ("failed", "rests", "blacklisted"):
        assert not any(word in line for line in said), said
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers)


# marker long (make test's 15 minutes): test_faults_membership.py's finishing orders end jobs the same way
@pytest.mark.long
def test_a_leaving_last_member_that_finishes_ends_the_job(tmp_path, job_factory):
    """The only member's slot goes away while its replacement still builds, so it trains on;
    when its script then finishes, the job is over: the replacement must not start a new ring
    from the initial state (it used to: "1 -> 1 workers at step 0")."""
    job = job_factory(["-np", "1", "--min-np", "1", "--max-np", "1", "--discovery-interval", "0.2"],
                      long_digits(tmp_path, "--build-delay", "8"), hosts="localhost:1")
    job.wait_generation(1)
    job.set_hosts("127.0.0.2:1")
    job.wait_for("the replacement spawned", lambda: job.worker_pid("w2"), 60)
    job.end_training()  # w1 ends at this epoch's end, long before w2 is built
    assert job.finish() == 0, job.output()[-3000:]
    assert [e["kind"] for e in job.events()] == ["start"], job.events()
    assert summary(tmp_path)["world_size"] == 1


@pytest.mark.long
def test_when_every_member_leaves_the_state_is_handed_to_the_joiners(tmp_path, job_factory,
                                                                      monkeypatch):
    """The only member's host leaves discovery while a new host arrives: the leaver stays one
    generation to sync its state to the joiner, so no work is lost (ledger resume steps)."""
    from hvd_edl import audit
    ledger = tmp_path / "ledger"
    monkeypatch.setenv(audit.ENV_AUDIT_DIR, str(ledger))
    job = job_factory(["-np", "1", "--min-np", "1", "--max-np", "2", "--discovery-interval", "0.2"],
                      long_digits(tmp_path), hosts="localhost:1")
    job.wait_generation(1)
    job.wait_for("20 steps", lambda: any(
        r["kind"] == "step" and r["step"] >= 20 for r in audit.read_records(ledger)), 60)
    job.set_hosts("127.0.0.2:1")
    ev = job.wait_for("w2 alone in the ring", lambda: next(
        (e for e in job.events() if _members(e) == ["w2"]), None), 120)
    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]
    kinds = [e["kind"] for e in job.events()]
    assert kinds == ["start", "scale_out", "scale_in"], kinds  # w1 + w2, then w2
    resumes = {r["gen"]: r["step"] for r in audit.read_records(ledger) if r["kind"] == "sync"}
    assert resumes[ev["generation"]] >= 20 and resumes[2] >= 20, resumes
    assert audit.check(ledger, 1347).ok
