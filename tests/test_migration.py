"""Job migration (EDL): ``hvd-edl-ctl migrate`` moves the workers of one host to another in one
stop-free switch, and a straggler's replacement through the same swap; the coordinator's
reservation that holds the new workers back until the swap."""
import json
import re
import subprocess

import pytest

from benchmarks.common.formed_ring import NoRingRendezvous as _Rendezvous, ring_of_two
from conftest import VENV_BIN, Job, long_digits
from hvd_edl import audit, messages
from launcher import ctl
from launcher.job.coordinator import Coordinator
from launcher.observe.events import EventLog
from launcher.job.registry import WorkerRecord, WorkerState


def _ring_of_two(events=None, rendezvous=None) -> Coordinator:
    """A real coordinator (unit tests: no servers) whose generation 1 is w1, w2 on localhost."""
    return ring_of_two(events=events, rendezvous=rendezvous)

CTL = str(VENV_BIN / "hvd-edl-ctl")
DIGITS_TRAIN = 1347


def _ctl(job_file, *args, timeout_s=150):
    return subprocess.run([CTL, "--job", str(job_file), *args], capture_output=True, text=True,
                          timeout=timeout_s)


def _ctl_here(capsys, job_file, *args):
    """hvd-edl-ctl's entry point in this process (no interpreter start): (code, stdout, stderr)."""
    capsys.readouterr()
    code = ctl.main(["--job", str(job_file), *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.long
def test_migration_and_straggler_replacement_each_take_one_replace_generation(
        tmp_path, monkeypatch, capsys):
    """One job (EDL's job migration, then straggler mitigation on the moved job): ``migrate``
    moves localhost's 2 workers to 127.0.0.1 in one "replace" generation (nothing rolled back,
    exactly-once data, localhost drained); one of the moved workers' slot is 3x slow
    (``--slow-worker``): it is found from its compute time and replaced in one more "replace"
    generation on another slot.  Beside it, the same job without a slow worker (policy evict)
    sees no straggler at all (the false-positive check)."""
    hosts = "localhost:2\n127.0.0.1:4"  # two hosts for the launcher and for Horovod's cross ranks
    flags = ["-np", "3", "--min-np", "1", "--max-np", "3", "--discovery-interval", "0.2"]
    moved_dir, clean_dir = tmp_path / "moved", tmp_path / "clean"
    moved_dir.mkdir()
    clean_dir.mkdir()
    ledger = tmp_path / "ledger"
    job_file = moved_dir / "job.json"
    monkeypatch.setenv(audit.ENV_AUDIT_DIR, str(ledger))  # taken at spawn: this job only
    job = Job(moved_dir, flags + ["--job-file", str(job_file), "--straggler-policy", "replace"],
              long_digits(moved_dir, "--step-delay", "0.05", "--slow-worker", "127.0.0.1:1:3"),
              hosts=hosts)
    monkeypatch.delenv(audit.ENV_AUDIT_DIR)
    clean = Job(clean_dir, flags + ["--straggler-policy", "evict"],
                long_digits(clean_dir, "--step-delay", "0.05"), hosts=hosts)
    try:
        ev = job.wait_generation(1)
        assert [m.split("@")[1] for m in ev["members"]] == ["localhost:0", "localhost:1",
                                                            "127.0.0.1:0"]
        job.wait_for("the job file", job_file.exists, 30)
        for args, message in (
                (["--from", "nosuch", "--to", "127.0.0.1"], "unknown host 'nosuch'"),
                (["--from", "localhost", "--to", "localhost"], "the same host"),
                (["--from", "127.0.0.1", "--to", "localhost"],
                 "localhost cannot take the 1 worker of 127.0.0.1: 0 free usable")):
            code, _, err = _ctl_here(capsys, job_file, "migrate", *args)
            assert code == 1 and message in err, (args, err)
        with pytest.raises(SystemExit) as usage:
            ctl.main(["--job", str(job_file), "migrate", "--from", "localhost"])
        assert usage.value.code == 2

        r = _ctl(job_file, "migrate", "--from", "localhost", "--to", "127.0.0.1",
                 "--wait", "120")
        assert r.returncode == 0, r.stdout + r.stderr + job.output()[-3000:]
        assert "migrated w1, w2 on localhost to 127.0.0.1 as w4, w5" in r.stdout, r.stdout
        assert "localhost stays drained" in r.stdout
        swap = job.wait_generation(2)
        assert swap["kind"] == "replace" and swap["rolled_back_steps"] == 0, swap
        assert swap["members"] == ["w3@127.0.0.1:0", "w4@127.0.0.1:1", "w5@127.0.0.1:2"]
        assert swap["left"] == ["w1@localhost:0", "w2@localhost:1"]
        # the old workers trained while the new ones built: the switch costs a scale-out's
        assert swap["stall_s"] < 2.0, swap
        notes = job.notes("migration")
        assert [n["phase"] for n in notes] == ["start", "done"], notes
        code, out, _ = _ctl_here(capsys, job_file, "status", "--json")
        s = json.loads(out)
        assert s["drained"] == ["localhost"] and s["migration"]["phase"] == "done"
        code, out, _ = _ctl_here(capsys, job_file, "status")
        assert "migration:  w1, w2 localhost -> 127.0.0.1: done" in out, out

        # w4's slot (127.0.0.1:1) computes 3x slower: found, replaced on a free slot
        found = job.wait_for("the straggler note", lambda: job.notes("straggler"), 60)[0]
        assert found["worker"] == "w4" and found["phase"] == "found", found
        assert found["compute_ms"] > 2 * found["median_ms"], found
        assert found["replacement_slot"] == "127.0.0.1:3"  # localhost is drained
        assert re.search(r"hvd-edl-run: straggler: worker w4 on 127.0.0.1:1 compute [\d.]+ "
                         r"ms/step vs median [\d.]+ ms for \d+ s", job.output())
        third = job.wait_generation(3, timeout_s=90)
        assert third["kind"] == "replace" and third["rolled_back_steps"] == 0, third
        assert third["members"] == ["w3@127.0.0.1:0", "w5@127.0.0.1:2", "w6@127.0.0.1:3"]
        # the replacement is a migration too (issue 30: status said "done", the counter 0)
        code, out, _ = _ctl_here(capsys, job_file, "status", "--json")
        assert json.loads(out)["telemetry"]["counters"]["migration"] == 2, out
        print(f"migration: stall {swap['stall_s']:.3f} s ({notes[1]['seconds']:.1f} s from "
              f"the request); straggler {found['compute_ms']:.1f} vs {found['median_ms']:.1f} "
              f"ms/step, replaced with stall {third['stall_s']:.3f} s")
        clean_gens = clean.events()
        job.end_training()
        clean.end_training()
        assert job.finish() == 0, job.output()[-3000:]
        assert clean.finish() == 0, clean.output()[-3000:]
        # nothing moved back (localhost drained, the slow slot resting); the clean job unchanged
        assert [e["kind"] for e in job.events()] == ["start", "replace", "replace"]
        assert clean_gens and [e["kind"] for e in clean.events()] == ["start"]
        assert clean.notes("straggler") == [] and "straggler" not in clean.output()
        report = audit.check(ledger, DIGITS_TRAIN)
        assert (report.repeated, report.missing) == (0, 0), report.to_dict()
    finally:
        job.stop()
        clean.stop()


def test_reserved_ready_worker_joins_only_at_the_swap(tmp_path):
    """Unit level: a reserved worker that is ready does not make the ring scale out (room under
    max_np notwithstanding); swap() asks the leaver to leave and releases it in one call, and
    the generation formed at the next boundary replaces one with the other."""
    rdv = _Rendezvous()
    try:
        coord = _ring_of_two(rendezvous=rdv)
        assert coord.current.members == ["w1", "w2"]
        coord.add_worker(WorkerRecord("w3", "127.0.0.1", 0, 3, 0.0))
        coord.reserve("w3")
        coord.ready(messages.Ready("w3"))
        assert coord.workers["w3"].state == WorkerState.READY
        assert not coord._watch_reply(1).change_pending  # held back: no scale-out wanted
        assert coord.swap(["w2"], ["w3"]) == []
        assert coord._watch_reply(1).change_pending
        for w in ("w1", "w2"):
            coord.switch(messages.SwitchRequest(w, 1, "update", 10, 10, wait_s=0))
        g = coord.current
        assert (g.number, g.kind, g.members, g.rolled_back_steps) == (2, "replace",
                                                                     ["w1", "w3"], 0)
        assert coord.assignments["w2"].action == "exit"
    finally:
        rdv.close()


class _Driver:
    """The driver's public interface a :class:`Migration` uses (``launcher.job.driver.Driver``:
    start_worker, ask_to_leave, worker, ring, swap, release_reserved, note, the slot book),
    around a real coordinator and a real :class:`SlotBook`; no processes."""

    def __init__(self, coord, hosts):
        from launcher.job.slot_book import SlotBook
        self.coord, self.events = coord, coord.events
        self.slots, self.left = SlotBook(hosts), []
        self._seq = len(coord.workers)

    def start_worker(self, host, slot, reserve=False, initial=False):
        self._seq += 1
        rec = WorkerRecord(f"w{self._seq}", host, slot, self._seq, 0.0)
        self.coord.add_worker(rec)
        if reserve:
            self.coord.reserve(rec.worker_id)
        return rec

    def ask_to_leave(self, rec, reason):
        self.left.append(rec.worker_id)
        self.coord.request_leave(rec.worker_id)

    def worker(self, worker_id):
        return self.coord.workers.get(worker_id)

    def live_workers(self):
        return self.coord.live_workers()

    def taken_slots(self):
        return {(w.host, w.slot) for w in self.coord.live_workers()}

    def ring(self, since=None):
        return self.coord.ring(since)

    def swap(self, leavers, joiners):
        self.coord.swap(leavers, joiners)

    def release_reserved(self, worker_id):
        self.coord.unreserve(worker_id)

    def note(self, kind, text, **fields):
        return self.events.note(kind, text, **fields)


def test_migration_is_abandoned_when_a_new_worker_dies_while_building(tmp_path):
    """Unit level: a new worker that dies before the swap abandons the migration: the other new
    worker is sent away, the old ones stay members, the source is not drained, a note says why."""
    from launcher.apps.migration import Migration, Phase
    rdv = _Rendezvous()
    try:
        events = EventLog(str(tmp_path / "events.jsonl"))
        coord = _ring_of_two(events, rdv)
        driver = _Driver(coord, {"localhost": 2, "127.0.0.1": 2})
        m = Migration("localhost", "127.0.0.1", ["w1", "w2"],
                      [("127.0.0.1", 0), ("127.0.0.1", 1)])
        m.advance(driver, 1.0)
        assert m.joiners == ["w3", "w4"] and coord.reserved == {"w3", "w4"}
        coord.ready(messages.Ready("w3"))
        m.advance(driver, 2.0)
        assert m.phase == Phase.BUILDING  # w4 still builds: no swap yet
        coord.on_exit("w4", 1)
        m.advance(driver, 3.0)
        assert m.phase == Phase.ABANDONED and "w4@127.0.0.1:1 died" in m.reason
        assert driver.left == ["w3"] and not coord.reserved and not driver.slots.drained()
        assert coord.current.members == ["w1", "w2"]
        assert all(coord.workers[w].state == WorkerState.MEMBER for w in ("w1", "w2"))
        note = json.loads((tmp_path / "events.jsonl").read_text().splitlines()[-1])
        assert note["event"] == "migration" and note["phase"] == "abandoned"
    finally:
        rdv.close()


def test_moving_every_member_hands_the_state_over_in_two_switches(tmp_path):
    """Unit level: when every member is on the source host no member stays to hand the state
    to the new workers inside one ring: the oldest leaver stays one generation more as rank 0
    (a scale-out), then leaves (a scale-in); the migration ends after both, the source
    drained."""
    from launcher.apps.migration import Migration, Phase
    coord = _ring_of_two()
    driver = _Driver(coord, {"localhost": 2, "127.0.0.1": 2})
    m = Migration("localhost", "127.0.0.1", ["w1", "w2"], [("127.0.0.1", 0), ("127.0.0.1", 1)])
    m.advance(driver, 1.0)
    for w in m.joiners:
        coord.ready(messages.Ready(w))
    m.advance(driver, 2.0)
    assert m.phase == Phase.SWAPPING and driver.slots.drained() == {"localhost"}

    def boundary(generation, members, step):
        for w in members:
            coord.switch(messages.SwitchRequest(w, generation, "update", step, step, wait_s=0))
        g = coord.current
        for w in g.continuing:
            coord.started(messages.Started(w, g.number, 0.1, step, {}))
        return g

    g2 = boundary(1, ["w1", "w2"], 10)
    assert (g2.kind, g2.members) == ("scale_out", ["w1", "w3", "w4"])  # w1 hands the state on
    m.advance(driver, 3.0)
    assert m.phase == Phase.SWAPPING
    g3 = boundary(2, ["w1", "w3", "w4"], 20)
    assert (g3.kind, g3.members) == ("scale_in", ["w3", "w4"])
    m.advance(driver, 4.0)
    assert m.phase == Phase.DONE
    assert [g["kind"] for g in m.result()["generations"]] == ["scale_out", "scale_in"]


def _leave_lines(text: str):
    """The workers that the launcher's lines say leave now (``worker X ... leaves: ...``)."""
    return [m.group(1) for m in re.finditer(r"^hvd-edl-run: worker (\S+) .*? leaves: ",
                                            text, re.M)]


def _generation_left(text: str):
    """Each generation line's ``left:`` workers (ids, labels cut at '@'), in order."""
    out = []
    for line in text.splitlines():
        if line.startswith("hvd-edl-run: generation "):
            m = re.search(r"left: ([^;)]*)", line)
            out.append(sorted(w.split("@")[0] for w in m.group(1).split(", ")) if m else [])
    return out


@pytest.mark.parametrize("leavers", [["w2"], ["w1", "w2"]], ids=["one_host_of_two",
                                                                 "every_member"])
def test_a_migrations_leave_lines_name_the_workers_its_generation_line_says_left(
        leavers, capsys):
    """Unit level: the lines printed at the swap name as leaving now exactly the workers the
    next generation's line lists as left; when every member is on the source host, the oldest
    stays one more generation as rank 0, and its line says so (it is named as left by the
    generation after)."""
    import sys
    from launcher.apps.migration import Migration, Phase
    coord = _ring_of_two(events=EventLog(None, out=sys.stdout))  # capsys's stdout
    coord.workers["w2"].host = "other"  # w1 on localhost, w2 on "other"
    if leavers == ["w1", "w2"]:
        coord.workers["w1"].host = "other"
    driver = _Driver(coord, {"localhost": 2, "other": 2, "127.0.0.1": 2})
    m = Migration("other", "127.0.0.1", leavers,
                  [("127.0.0.1", i) for i in range(len(leavers))])
    m.advance(driver, 1.0)
    for w in m.joiners:
        coord.ready(messages.Ready(w))
    capsys.readouterr()
    m.advance(driver, 2.0)
    assert m.phase == Phase.SWAPPING
    at_swap = capsys.readouterr().out
    step, generation = 10, 1
    while m.phase == Phase.SWAPPING and generation < 4:
        members = list(coord.current.members)
        for w in members:
            coord.switch(messages.SwitchRequest(w, generation, "update", step, step, wait_s=0))
        g = coord.current
        for w in g.continuing:
            coord.started(messages.Started(w, g.number, 0.1, step, {}))
        m.advance(driver, 3.0 + generation)
        step, generation = step + 10, g.number
    assert m.phase == Phase.DONE
    after = capsys.readouterr().out
    lefts = _generation_left(after)
    assert sorted(_leave_lines(at_swap)) == lefts[0], (at_swap, after)
    if leavers == ["w1", "w2"]:  # the oldest: named at the swap as staying, then as left
        assert "w1" not in _leave_lines(at_swap) and "w1" in at_swap, at_swap
        assert lefts == [["w2"], ["w1"]], after
