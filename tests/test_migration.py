"""Job migration (EDL): ``hvd-edl-ctl migrate`` moves the workers of one host to another in one
stop-free switch; the coordinator's reservation that holds the new workers back until the swap."""
import json
import subprocess

import pytest

from conftest import VENV_BIN, long_digits
from hvd_edl import audit, messages
from launcher import ctl
from launcher.coordinator import Coordinator
from launcher.events import EventLog
from launcher.registry import WorkerRecord, WorkerState


class _Rendezvous:
    """The coordinator's view of a rendezvous (unit tests: no servers; no ring is formed)."""

    def open(self, generation, hosts=(), **kwargs):
        return 1

    def token(self, generation):
        return "token"

    def abort(self, generation):
        pass

    def close(self):
        pass

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


def _notes(job, kind):
    lines = [json.loads(x) for x in job.events_path.read_text().splitlines() if x]
    return [e for e in lines if e.get("event") == kind]


def test_migrate_moves_a_hosts_workers_in_one_replace_generation_rolling_back_nothing(
        tmp_path, job_factory, monkeypatch, capsys):
    ledger = tmp_path / "ledger"
    monkeypatch.setenv(audit.ENV_AUDIT_DIR, str(ledger))
    job_file = tmp_path / "job.json"
    # localhost and 127.0.0.1 are two hosts for the launcher (and for Horovod's cross ranks)
    job = job_factory(["-np", "3", "--min-np", "1", "--max-np", "3", "--discovery-interval",
                       "0.2", "--job-file", str(job_file)],
                      long_digits(tmp_path, "--step-delay", "0.05"),
                      hosts="localhost:2\n127.0.0.1:3")
    ev = job.wait_generation(1)
    assert [m.split("@")[1] for m in ev["members"]] == ["localhost:0", "localhost:1",
                                                        "127.0.0.1:0"]
    job.wait_for("the job file", job_file.exists, 30)

    for args, message in ((["--from", "nosuch", "--to", "127.0.0.1"], "unknown host 'nosuch'"),
                          (["--from", "localhost", "--to", "localhost"], "the same host"),
                          (["--from", "127.0.0.1", "--to", "localhost"],
                           "localhost cannot take the 1 worker of 127.0.0.1: 0 free usable")):
        code, _, err = _ctl_here(capsys, job_file, "migrate", *args)
        assert code == 1 and message in err, (args, err)
    with pytest.raises(SystemExit) as usage:
        ctl.main(["--job", str(job_file), "migrate", "--from", "localhost"])
    assert usage.value.code == 2

    r = _ctl(job_file, "migrate", "--from", "localhost", "--to", "127.0.0.1", "--wait", "120")
    assert r.returncode == 0, r.stdout + r.stderr + job.output()[-3000:]
    assert "migrated w1, w2 on localhost to 127.0.0.1 as w4, w5" in r.stdout, r.stdout
    assert "localhost stays drained" in r.stdout

    gens = job.events()
    assert [e["kind"] for e in gens] == ["start", "replace"], gens
    swap = gens[1]
    assert swap["world_size"] == 3 and swap["rolled_back_steps"] == 0
    assert swap["members"] == ["w3@127.0.0.1:0", "w4@127.0.0.1:1", "w5@127.0.0.1:2"]
    assert swap["left"] == ["w1@localhost:0", "w2@localhost:1"]
    assert swap["joined"] == ["w4@127.0.0.1:1", "w5@127.0.0.1:2"]
    # the old workers trained while the new ones built: the switch costs a scale-out's stall
    assert swap["stall_s"] < 2.0, swap
    notes = _notes(job, "migration")
    assert [n["phase"] for n in notes] == ["start", "done"], notes
    assert notes[1]["generations"][0]["kind"] == "replace"
    print(f"migration: stall {swap['stall_s']:.3f} s, phases {swap['phases']}, "
          f"{notes[1]['seconds']:.1f} s from the request to the end")

    code, out, _ = _ctl_here(capsys, job_file, "status", "--json")
    s = json.loads(out)
    assert s["drained"] == ["localhost"] and s["migration"]["phase"] == "done"
    code, out, _ = _ctl_here(capsys, job_file, "status")
    assert "migration:  w1, w2 localhost -> 127.0.0.1: done" in out, out
    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]
    assert [e["kind"] for e in job.events()] == ["start", "replace"]  # nothing moved back
    report = audit.check(ledger, DIGITS_TRAIN)
    assert (report.repeated, report.missing) == (0, 0), report.to_dict()


def test_reserved_ready_worker_joins_only_at_the_swap(tmp_path):
    """Unit level: a reserved worker that is ready does not make the ring scale out (room under
    max_np notwithstanding); swap() asks the leaver to leave and releases it in one call, and
    the generation formed at the next boundary replaces one with the other."""
    rdv = _Rendezvous()
    try:
        coord = Coordinator(min_np=1, max_np=4, elastic=True, events=EventLog(None),
                            rendezvous=rdv, rendezvous_addr="127.0.0.1")
        for i in (1, 2):
            coord.add_worker(WorkerRecord(f"w{i}", "localhost", i - 1, i, 0.0, initial=True))
        for i in (1, 2):
            coord.ready(messages.Ready(f"w{i}"))
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
    """The few driver parts a :class:`Migration` uses, around a real coordinator."""

    def __init__(self, coord, hosts):
        import threading
        self.coord, self.hosts, self.events = coord, hosts, coord.events
        self.procs, self.drained, self._lock = {}, set(), threading.Lock()
        self.slot_cooldown, self.host_blacklist, self.left = {}, {}, []
        self._seq = len(coord.workers)

    def _start_worker(self, host, slot, initial, reserve=False):
        self._seq += 1
        rec = WorkerRecord(f"w{self._seq}", host, slot, self._seq, 0.0)
        self.coord.add_worker(rec)
        if reserve:
            self.coord.reserve(rec.worker_id)
        return rec

    def _ask_to_leave(self, rec, reason):
        self.left.append(rec.worker_id)
        self.coord.request_leave(rec.worker_id)

    def _drained(self):
        return set(self.drained)


def test_migration_is_abandoned_when_a_new_worker_dies_while_building(tmp_path):
    """Unit level: a new worker that dies before the swap abandons the migration: the other new
    worker is sent away, the old ones stay members, the source is not drained, a note says why."""
    from launcher.migration import Migration, Phase
    rdv = _Rendezvous()
    try:
        events = EventLog(str(tmp_path / "events.jsonl"))
        coord = Coordinator(min_np=1, max_np=4, elastic=True, events=events, rendezvous=rdv,
                            rendezvous_addr="127.0.0.1")
        for i in (1, 2):
            coord.add_worker(WorkerRecord(f"w{i}", "localhost", i - 1, i, 0.0, initial=True))
        for i in (1, 2):
            coord.ready(messages.Ready(f"w{i}"))
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
        assert driver.left == ["w3"] and not coord.reserved and not driver.drained
        assert coord.current.members == ["w1", "w2"]
        assert all(coord.workers[w].state == WorkerState.MEMBER for w in ("w1", "w2"))
        note = json.loads((tmp_path / "events.jsonl").read_text().splitlines()[-1])
        assert note["event"] == "migration" and note["phase"] == "abandoned"
    finally:
        rdv.close()
