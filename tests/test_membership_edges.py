"""Membership at its edges, where Horovod's own bug classes live (issue 26, items 5-8): a READY
joiner lost before its generation forms (horovod 3014), a dip below ``--min-np`` (horovod 3494),
the end of a job in any order, a worker that exits 0 in the middle of training.  Unit level: a
real ``Coordinator`` fed the workers' messages in the order that used to break it; the jobs
themselves run in ``test_faults_membership.py``."""
import time

from hvd_edl import messages
from launcher.job import liveness
from launcher.job.coordinator import Coordinator
from launcher.observe.events import EventLog, read as read_events
from launcher.job.registry import WorkerRecord, WorkerState

from test_migration import _Rendezvous


def _ring(min_np=1, max_np=4, n=2, elastic_run=True) -> Coordinator:
    """A real coordinator whose generation 1 is w1..wn on localhost (their scripts entered
    ``hvd.elastic.run`` unless ``elastic_run`` is False)."""
    coord = Coordinator(min_np=min_np, max_np=max_np, elastic=True, events=EventLog(None),
                        rendezvous=_Rendezvous(), rendezvous_addr="127.0.0.1")
    for i in range(1, n + 1):
        coord.add_worker(WorkerRecord(f"w{i}", "localhost", i - 1, i, 0.0, initial=True))
    for i in range(1, n + 1):
        coord.ready(messages.Ready(f"w{i}", elastic_run=elastic_run))
    assert coord.current.number == 1 and coord.current.members == [f"w{i}" for i in
                                                                    range(1, n + 1)]
    return coord


def _report(coord, worker, generation, step=10, reason="update"):
    return coord.switch(messages.SwitchRequest(worker, generation, reason, step, step, wait_s=0))


def _joiner(coord, worker="w3", slot=2, order=3):
    coord.add_worker(WorkerRecord(worker, "localhost", slot, order, time.monotonic()))
    coord.ready(messages.Ready(worker, elastic_run=True))
    assert coord._watch_reply(1).change_pending  # the ring is asked to switch for it


def test_a_ready_joiner_killed_before_its_generation_forms_costs_the_ring_nothing():
    coord = _ring()
    _joiner(coord)
    _report(coord, "w1", 1)           # w1 at the agreed boundary, its ring shut down
    coord.on_exit("w3", -9)           # the joiner is lost before w2 got there
    a = _report(coord, "w2", 1)
    assert a.action == "join" and a.generation == 2, a  # used to wait for ever
    g = coord.current
    assert (g.number, g.kind, g.members, g.rolled_back_steps) == (2, "reform", ["w1", "w2"], 0)
    assert not g.state_lost
    assert coord.assignments["w1"].generation == 2


def test_a_ready_joiner_removed_by_discovery_before_its_generation_forms():
    coord = _ring()
    _joiner(coord)
    _report(coord, "w1", 1)
    assert coord.request_leave("w3")  # its host left discovery: not a member, exits at once
    assert _report(coord, "w2", 1).generation == 2
    assert (coord.current.kind, coord.current.members) == ("reform", ["w1", "w2"])
    assert coord.assignments["w3"].action == "exit"


def test_below_min_np_the_members_wait_and_the_leaver_leaves():
    """-np 2 --min-np 2: a slot goes for a while and comes back."""
    coord = _ring(min_np=2)
    coord.request_leave("w2")         # its slot left discovery
    assert coord._watch_reply(1).change_pending
    assert _report(coord, "w1", 1).action == "wait"   # w1 holds the state, below the minimum
    a = _report(coord, "w2", 1)
    assert a.action == "exit", a      # the leaver finishes leaving (it used to wait for ever)
    assert coord.on_exit("w2", 0) == ""
    assert not coord.finishing and coord.failure is None  # a leave, not the job's end
    assert coord.current.number == 1 and coord.usable_count() == 1
    assert _report(coord, "w1", 1).action == "wait"
    # the slot comes back: a new worker there joins and gets the state from w1
    coord.add_worker(WorkerRecord("w3", "localhost", 1, 3, time.monotonic()))
    coord.ready(messages.Ready("w3", elastic_run=True))
    a = _report(coord, "w1", 1)
    assert (a.action, a.generation, a.sync, a.members) == ("join", 2, True, ["w1", "w3"])


def test_below_min_np_with_joiners_in_flight():
    """2 -> 4 asked (two joiners building), then the hosts shrink to 1 slot."""
    coord = _ring(min_np=2)
    for w, slot, order in (("w3", 2, 3), ("w4", 3, 4)):
        coord.add_worker(WorkerRecord(w, "localhost", slot, order, time.monotonic()))
    assert coord.request_leave("w3") and coord.request_leave("w4")  # not members: exit now
    coord.on_exit("w3", 0)
    coord.on_exit("w4", 0)
    coord.request_leave("w2")
    assert _report(coord, "w1", 1).action == "wait"
    assert _report(coord, "w2", 1).action == "exit"
    coord.on_exit("w2", 0)
    assert not coord.finishing
    coord.add_worker(WorkerRecord("w5", "localhost", 1, 5, time.monotonic()))
    coord.ready(messages.Ready("w5", elastic_run=True))
    assert coord.current.number == 2 and coord.current.members == ["w1", "w5"]


def test_every_member_leaving_below_min_np_keeps_the_oldest_as_holder():
    coord = _ring(min_np=2)
    coord.request_leave("w1")
    coord.request_leave("w2")
    assert _report(coord, "w1", 1).action == "wait"  # the oldest keeps the state
    assert _report(coord, "w2", 1).action == "exit"
    coord.on_exit("w2", 0)
    coord.add_worker(WorkerRecord("w3", "localhost", 1, 3, time.monotonic()))
    coord.ready(messages.Ready("w3", elastic_run=True))
    # w1 hands its state over as rank 0 of one more generation, then leaves in turn
    g = coord.current
    assert (g.number, g.members) == (2, ["w1", "w3"]) and coord.assignments["w3"].sync


def test_a_worker_whose_training_returned_is_never_fenced(monkeypatch):
    coord = _ring()
    coord.finished(messages.Finished("w1", 1, 100))
    assert coord.finishing
    # w1 is in its interpreter's teardown (no beat for far longer than the silence bound)
    # while w2 beats on: no fence, no release, no failure generation
    silent = coord.liveness.silent_after_s
    coord.beat(messages.Beat("w2", 1, 100))
    coord.liveness._last["w1"] = time.monotonic() - 3 * silent  # w1's last beat, long ago
    assert coord.liveness.silent(["w1", "w2"], time.monotonic()) == ["w1"]
    for _ in range(3):
        coord._silence_checked_at = float("-inf")
        reply = coord.beat(messages.Beat("w2", 1, 100))
        assert not reply.fenced and not reply.release
    assert not coord.workers["w1"].fenced and coord.workers["w1"].state == WorkerState.MEMBER
    # w2's last collective fails as w1 shuts Horovod down: it is told to exit, not re-run
    a = _report(coord, "w2", 1, step=99, reason="failure")
    assert a.action == "exit" and coord.current.number == 1
    coord.on_exit("w1", 0)
    coord.on_exit("w2", 0)
    assert coord.failure is None and len(coord.history) == 1


def test_a_member_silent_long_after_training_finished_is_handed_to_the_driver(monkeypatch):
    coord = _ring()
    quiet = []
    coord.on_end_silent = lambda rec, s: quiet.append(rec.worker_id)
    coord.finished(messages.Finished("w2", 1, 100))
    coord.beat(messages.Beat("w2", 1, 100))
    coord.liveness._last["w1"] = time.monotonic() - liveness.END_SILENT_S - 1
    coord._silence_checked_at = float("-inf")
    coord.beat(messages.Beat("w2", 1, 100))
    assert quiet == ["w1"] and not coord.workers["w1"].fenced


def test_the_end_of_a_job_in_any_order_never_forms_a_generation():
    for order in (("w1", "w2", "w3"), ("w3", "w2", "w1"), ("w2", "w1", "w3")):
        coord = _ring(n=3)
        first, *rest = order
        coord.finished(messages.Finished(first, 1, 50))
        coord.on_exit(first, 0)
        for w in rest:  # the others: one returns too, one's collective fails meanwhile
            if w == rest[0]:
                assert _report(coord, w, 1, reason="failure").action == "exit"
                coord.on_exit(w, 0)
            else:
                coord.finished(messages.Finished(w, 1, 50))
                coord.on_exit(w, 0)
        assert len(coord.history) == 1 and coord.failure is None and coord.finishing


def test_exit_0_inside_training_is_a_leave_not_the_end():
    coord = _ring()
    assert coord.on_exit("w2", 0) == "left"  # sys.exit(0) at step 58 of 333
    assert not coord.finishing
    assert 1 in coord.released  # w1's ring is released (no wait for Gloo's timeout)
    a = _report(coord, "w1", 1, reason="failure")
    assert (a.action, a.generation, a.members) == ("join", 2, ["w1"])


def test_exit_0_of_a_script_without_elastic_run_is_the_end_of_the_job():
    coord = _ring(elastic_run=False)
    assert coord.on_exit("w2", 0) == "finished"
    assert coord.finishing


def test_a_generation_whose_last_reporter_dies_is_still_logged(tmp_path):
    """A continuing member lost before it reported its first step in the new ring used to leave
    that generation's line unwritten (until a 30 s timeout, or for ever if the job ended)."""
    log_path = tmp_path / "events.jsonl"
    coord = _ring()
    coord.events = EventLog(str(log_path))
    _joiner(coord)
    for w in ("w1", "w2"):
        _report(coord, w, 1)
    assert coord.current.number == 2 and coord.current.kind == "scale_out"
    coord.started(messages.Started("w1", 2, 0.05, 10, {}))
    assert not coord.current.logged
    coord.on_exit("w2", -9)  # w2 dies before its /started
    assert [e["generation"] for e in read_events(log_path)[0]] == [2]


def test_the_end_of_the_job_writes_every_generation_not_logged_yet(tmp_path):
    log_path = tmp_path / "events.jsonl"
    coord = _ring()
    coord.events = EventLog(str(log_path))
    _joiner(coord)
    for w in ("w1", "w2"):
        _report(coord, w, 1)
    coord.flush_events()  # the driver, as the job ends
    assert [e["generation"] for e in read_events(log_path)[0]] == [2]


def test_a_member_exiting_is_never_fenced_for_its_teardown_and_releases_its_peers():
    """sys.exit(0) inside training: the process reports it is exiting (atexit), then its
    teardown keeps it silent longer than the silence bound before it is gone."""
    coord = _ring()
    coord.exiting(messages.Exiting("w2", 1))
    assert 1 in coord.released  # w1 need not wait for w2's sockets to close
    coord.beat(messages.Beat("w1", 1, 10))
    coord.liveness._last["w2"] = time.monotonic() - 3 * coord.liveness.silent_after_s
    coord._silence_checked_at = float("-inf")
    coord.beat(messages.Beat("w1", 1, 10))
    assert not coord.workers["w2"].fenced  # its teardown is not a freeze
    assert coord.on_exit("w2", 0) == "left" and not coord.finishing


def test_a_second_elastic_function_after_the_first_returned_keeps_the_job_elastic():
    """A script with two elastic functions (training, then an evaluation phase): between them
    the job is finishing; entering the second makes it elastic again (a failure then forms a
    generation instead of ending the job)."""
    coord = _ring()
    for w in ("w1", "w2"):
        coord.finished(messages.Finished(w, 1, 50))
    assert coord.finishing
    for w in ("w1", "w2"):
        coord.finished(messages.Finished(w, 1, 50, done=False))
    assert not coord.finishing
    coord.on_exit("w2", -9)
    assert _report(coord, "w1", 1, reason="failure").generation == 2


def test_a_worker_that_exited_after_training_ends_the_job_for_good():
    coord = _ring()
    coord.finished(messages.Finished("w2", 1, 50))
    coord.on_exit("w2", 0)
    coord.finished(messages.Finished("w1", 1, 50, done=False))
    assert coord.finishing  # w2 is gone having finished: the job ends


def test_every_member_exiting_0_inside_training_ends_the_job_instead_of_restarting_it():
    """Every rank calls sys.exit(0) inside its training function (a script that ends its
    training itself): nobody holds the state; restarting the script from scratch would do the
    same for ever (a breaker's run: 41 generations in 90 s)."""
    coord = _ring()
    assert coord.on_exit("w2", 0) == "left"
    assert coord.on_exit("w1", 0) == "ended_early"
    assert coord.finishing and len(coord.history) == 1


def test_the_last_member_frozen_after_training_is_killed_without_a_beating_peer():
    coord = _ring()
    quiet = []
    coord.on_end_silent = lambda rec, s: quiet.append(rec.worker_id)
    coord.finished(messages.Finished("w1", 1, 100))
    coord.on_exit("w1", 0)
    coord.liveness._last["w2"] = time.monotonic() - liveness.END_SILENT_S - 1  # no one beats
    coord.tick(time.monotonic())
    assert quiet == ["w2"]


def test_a_fenced_members_slot_is_never_free_between_its_fence_and_its_rest():
    """The liveness thread fences a silent member and only then hands it to the driver, which
    rests its slot; a spawn decided in between used to put a new worker on the fenced slot
    (a Ray node cut off: the new worker died there too).  Until the driver has rested the slot,
    the coordinator counts it occupied, so the slot book never offers it."""
    from launcher.job.slot_book import SlotBook
    coord = _ring()
    book = SlotBook({"localhost": 2})
    seen = []

    def on_fence(rec, silent_s):   # what a spawn racing the driver's _on_fence would see
        seen.append(book.free_slots("localhost", time.monotonic(), coord.occupied_slots()))
        book.record_failure(rec.host, rec.slot, time.monotonic(), None)
        rec.fence_pending = False  # Driver._on_fence, once the slot rests

    coord.on_fence = on_fence
    coord.beat(messages.Beat("w2", 1, 10))
    coord.liveness._last["w1"] = time.monotonic() - 3 * coord.liveness.silent_after_s
    coord._silence_checked_at = float("-inf")
    coord.beat(messages.Beat("w2", 1, 10))
    assert coord.workers["w1"].fenced and seen == [[]], seen
    assert ("localhost", 0) not in coord.occupied_slots()
    assert book.free_slots("localhost", time.monotonic(), coord.occupied_slots()) == []
