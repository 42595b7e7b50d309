"""The cluster service under faults (issue 39, section 3), with real processes: slots (GPUs,
``serve --assume-gpus``) never used by two jobs' live processes, sampled from outside
(``/proc/PID/environ``, :class:`benchmarks.common.gpu_sampler.GpuSampler`)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Set

import psutil
import pytest

from test_cluster_service import ledger, service, wait_for  # noqa: F401

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks.common.gpu_sampler import GpuSampler, environ  # noqa: E402

pytestmark = pytest.mark.xdist_group("cluster-faults")

RUN_ENV = "HVD_EDL_CLUSTER_RUN"  # launcher.cluster.runs.MARKER_ENV


class RunSampler:
    """Every ``period_s``: the cluster runs (their ``HVD_EDL_CLUSTER_RUN``) of the live processes
    that carry ``HVD_EDL_TEST_MARKER=marker`` and a worker id (workers and what they started)."""

    def __init__(self, marker: str, period_s: float = 0.05):
        self.marker = marker
        self.samples: List[tuple] = []  # (monotonic, {run marker: pids})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
        self._thread.start()

    def _run(self, period_s: float) -> None:
        while not self._stop.is_set():
            runs: Dict[str, Set[int]] = {}
            for pid in psutil.pids():
                env = environ(pid)
                if env and env.get("HVD_EDL_TEST_MARKER") == self.marker \
                        and "HVD_EDL_WORKER_ID" in env:
                    runs.setdefault(env.get(RUN_ENV, "?"), set()).add(pid)
            self.samples.append((time.monotonic(), runs))
            self._stop.wait(period_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def ring_size(state: Path, job: str) -> int:
    path = state / "jobs" / job / "run1.events.jsonl"
    sizes = [json.loads(x)["world_size"] for x in path.read_text().splitlines()
             if '"generation"' in x] if path.exists() else []
    return sizes[-1] if sizes else 0


def test_a_killed_launchers_orphans_keep_its_slots_until_they_are_gone(service, tmp_path):
    """fifo on 2 GPUs: j1 holds both, j2 waits.  ``kill -9`` of j1's ``hvd-edl-run``: its
    workers die at once (PR_SET_PDEATHSIG), but each had started a helper process (as a data
    loader's worker) that lives 3 s longer, on the worker's GPU.  j2 starts only once they are
    gone: no sample shows j1's and j2's processes alive together (before the fix j2 started
    within about 1 s, beside them)."""
    marker = f"faults-{os.getpid()}-{time.monotonic_ns()}"
    os.environ["HVD_EDL_TEST_MARKER"] = marker
    gpus = runs = None
    try:
        svc = service("--policy", "fifo", "--assume-gpus", "-H", "localhost:2")
        gpus, runs = GpuSampler(marker, period_s=0.05), RunSampler(marker)
        j1 = svc.submit("--env", f"HVD_EDL_TEST_MARKER={marker}", "--np", "2",
                        *ledger(tmp_path, "j1", 256, epochs=1000, delay=0.03),
                        "--child-linger-s", "3")
        wait_for("j1 training on 2", lambda: ring_size(svc.state, j1) == 2, 90, svc.job_logs)
        j2 = svc.submit("--env", f"HVD_EDL_TEST_MARKER={marker}", "--np", "2",
                        *ledger(tmp_path, "j2", 32))
        launcher = json.loads((svc.state / "jobs" / j1 / "job.json").read_text())["pid"]
        os.kill(launcher, signal.SIGKILL)
        killed = time.monotonic()
        jobs = svc.wait_jobs(lambda j: j[j2]["state"] == "done", "j2 done", timeout_s=90)
    finally:
        os.environ.pop("HVD_EDL_TEST_MARKER", None)
        for s in (gpus, runs):
            if s is not None:
                s.stop()
    run1 = str(svc.state / "jobs" / j1 / "run1")
    run2 = str(svc.state / "jobs" / j2 / "run1")
    orphans = [t for t, r in runs.samples if t > killed + 0.5 and run1 in r]
    assert orphans, "j1's helpers were never seen after its launcher's kill"  # the window exists
    both = [(round(t - killed, 2), {k: sorted(v) for k, v in r.items()})
            for t, r in runs.samples if run1 in r and run2 in r]
    assert both == [], both[:5]
    # a worker's helper uses its worker's GPU (one job): two runs on one GPU is the fault
    run_of = {pid: run for _, r in runs.samples for run, pids in r.items() for pid in pids}
    shared = [(g, users) for g, users in gpus.shared_gpus()
              if len({run_of.get(pid, pid) for pid, _, _ in users}) > 1]
    assert shared == [], shared[:5]
    assert jobs[j1]["state"] == "failed", jobs[j1]
    held = svc.events(j1, "orphans")
    assert held and "still alive" in held[0]["reason"], svc.events(j1)
    started = [t for t, r in runs.samples if run2 in r][0]
    print(f"j1's orphans last seen {max(orphans) - killed:.2f} s after the kill; j2's first "
          f"process {started - killed:.2f} s after it")


# ---- a host no job reaches (issue 39 s3: a vanished host of a fixed pool) ---------------------
# The decision from the jobs' telemetry (Reach.observe) and what the service does with it (the
# host's slots taken from the jobs, the host out of the policy's pool for a cooldown, status/top
# showing the ring from telemetry), then end to end with a namespace host cut off the bridge
# (skipped where no namespace cluster can be built: not root).

def _tel(fetched: float, rows, generation: int = 2, finishing: bool = False):
    """A ``(fetched, /ctl/telemetry answer)`` with live member rows on ``rows`` (host list)."""
    workers = [{"worker_id": f"w{i}", "host": h, "slot": i, "state": "member", "rank": i}
               for i, h in enumerate(rows)]
    return fetched, {"job": {"world_size": len(rows), "generation": generation,
                             "finishing": finishing}, "workers": workers}


def test_a_host_no_job_reaches_rests_for_a_cooldown_decision():
    from launcher.cluster import reach
    r = reach.Reach()
    written = {"j1": {"localhost": 2, "h1": 2, "h2": 1}, "j2": {"h2": 1, "h3": 1}}
    t0 = 1000.0
    # j1's launcher fenced h1 and h2 (no live worker there); j2 still trains on h2; h3: j2's
    # telemetry is stale, so nobody can tell
    tel = {"j1": _tel(t0, ["localhost", "localhost"]), "j2": _tel(t0 - 60, ["h2", "h3"])}
    assert r.observe(written, tel, t0) == ([], [])
    tel["j2"] = _tel(t0 + reach.UNREACHED_S, ["h2"])
    tel["j1"] = _tel(t0 + reach.UNREACHED_S, ["localhost", "localhost"])
    rest, ended = r.observe(written, tel, t0 + reach.UNREACHED_S)
    assert rest == ["h1"] and ended == []          # h2 is reached (by j2); h3: j2 just fresh
    assert r.resting_hosts(t0 + reach.UNREACHED_S) == ["h1"]
    assert r.rest_left(t0 + reach.UNREACHED_S) == {"h1": reach.COOLDOWN_S}
    # a job that is finishing, or has formed no ring yet, says nothing of a host
    quiet = reach.Reach()
    for t in (t0, t0 + 2 * reach.UNREACHED_S):
        assert quiet.observe({"j3": {"h4": 1}}, {"j3": _tel(t, [], generation=0)}, t) == ([], [])
        assert quiet.observe({"j3": {"h4": 1}}, {"j3": _tel(t, ["x"], finishing=True)},
                             t) == ([], [])
    # the cooldown ends: offered again; unreached again: rests twice as long
    later = t0 + reach.UNREACHED_S + reach.COOLDOWN_S
    assert r.observe(written, {}, later) == ([], ["h1"])
    assert r.resting_hosts(later) == []
    tel = {"j1": _tel(later, ["localhost"])}
    r.observe(written, tel, later)
    tel = {"j1": _tel(later + reach.UNREACHED_S, ["localhost"])}
    rest, _ = r.observe(written, tel, later + reach.UNREACHED_S)
    assert "h1" in rest and r.rest_left(later + reach.UNREACHED_S)["h1"] == 2 * reach.COOLDOWN_S


def test_unreachable_after_sets_how_long_a_host_looks_unreached_before_it_rests(capsys):
    """``serve --unreachable-after S`` (default :data:`reach.UNREACHED_S`): a host rests S after
    it first looked unreached, not before; a value that is not a finite number above 0 is
    argparse's one line and exit code 2 (and :class:`reach.Reach` refuses it too)."""
    from launcher.cluster import cli, reach
    written, t0 = {"j1": {"localhost": 1, "h1": 1}}, 1000.0
    r = reach.Reach(2.5)
    assert r.observe(written, {"j1": _tel(t0, ["localhost"])}, t0) == ([], [])
    assert r.observe(written, {"j1": _tel(t0 + 2.4, ["localhost"])}, t0 + 2.4) == ([], [])
    assert r.observe(written, {"j1": _tel(t0 + 2.5, ["localhost"])}, t0 + 2.5) == (["h1"], [])
    a = cli.build_parser().parse_args(["serve", "-H", "h1:1", "--state-dir", "s",
                                       "--unreachable-after", "2.5"])
    assert a.unreachable_s == 2.5
    assert cli.build_parser().parse_args(["serve", "-H", "h1:1", "--state-dir",
                                          "s"]).unreachable_s is None  # the service's default
    for bad, words in [("0", "expected a positive number, got 0"), ("-1", "got -1"),
                       ("x", "got 'x'"), ("nan", "got nan"), ("inf", "finite")]:
        with pytest.raises(SystemExit) as e:
            cli.build_parser().parse_args(["serve", "-H", "h1:1", "--state-dir", "s",
                                           "--unreachable-after", bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--unreachable-after" in err and words in err, err
        assert len(err.strip().splitlines()) == 1, err
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            reach.Reach(bad)


def test_the_service_rests_an_unreached_host_and_shows_the_ring_from_telemetry(tmp_path):
    """A job allocated localhost:2 and h1:3 whose launcher fenced h1 (its telemetry: a ring of 2,
    no worker on h1): once h1 has been unreached for UNREACHED_S the service takes h1's slots
    from the job, leaves h1 out of the policy's pool for the cooldown and says so; status and
    top show the ring (2), not the allocation (5)."""
    from launcher.cluster import reach, top
    from launcher.cluster.policies import make_policy
    from launcher.cluster.service import Service
    from launcher.cluster.store import JobRecord
    from launcher.discovery import FixedHosts
    svc = Service(tmp_path / "state", FixedHosts({"localhost": 2, "h1": 3}), make_policy("edl"),
                  fixed_pool=True, assume_gpus=True)
    svc.open()
    try:
        job = svc.store.add_job(JobRecord(id="", name="t", argv=["python", "t.py"], cwd="/",
                                          env={}, np=5, min_np=1, max_np=5, priority=0,
                                          checkpoint_dir="", state="running",
                                          submitted_at=time.time()))
        alloc = {"localhost": 2, "h1": 3}
        svc.store.update(job.id, allocation=alloc, world_size=5, run=1)
        svc.runs[job.id] = object()  # a live run (only its presence is read here)
        svc.written[job.id] = dict(alloc)
        now = time.monotonic()
        svc.telemetry[job.id] = _tel(now, ["localhost", "localhost"])
        reach.check(svc)
        assert svc.reach.resting_hosts() == []  # not yet: unreached for a moment only
        shown = svc.status()["jobs"][0]
        assert shown["world_size"] == 2 and shown["allocated"] == 5, shown
        assert [w["host"] for w in shown["workers"]] == ["localhost", "localhost"]
        assert any(x.strip().startswith(f"{job.id} ") and " 2/5 " in x
                   for x in top.frame_lines(svc.status())), top.frame_lines(svc.status())
        svc.reach.since["h1"] = now - reach.UNREACHED_S  # as if seen unreached that long ago
        reach.check(svc)
        assert svc.reach.resting_hosts() == ["h1"]
        assert svc.store.allocations()[job.id] == {"localhost": 2}  # its h1 slots taken back
        assert "h1" not in svc.snapshot().pool and svc.snapshot().pool["localhost"] == 2
        status = svc.status()
        assert set(status["resting"]) == {"h1"}, status["resting"]
        assert any("resting" in x for x in top.frame_lines(status))
        events = [json.loads(x) for x in svc.events_path.read_text().splitlines()]
        assert [e["hosts"] for e in events if e["kind"] == "shrink"] == [{"localhost": 2}]
        assert [e["host"] for e in events if e["kind"] == "rest"] == ["h1"], events
    finally:
        svc.close()


@pytest.mark.xdist_group("namespace-cluster")  # one namespace cluster at a time (conftest.py)
@pytest.mark.timeout(240)
def test_a_vanished_pool_host_leaves_the_ring_shown_and_rests(shared_cluster, tmp_path):
    """End to end on namespace hosts (tests/cluster.py): ``serve -H h1:1,h2:1,h3:1``, a job on
    all three; h3 is cut off the bridge.  Its launcher fences w3; the service records the ring
    of 2 from the job's telemetry (a ``ring`` event, what ``status`` shows as ``world_size``)
    while h3 is still allocated to the job and not resting, and ``--unreachable-after`` (3 s
    here; default 10) later rests h3 (a ``rest`` event): its slot is taken from the job and no
    job is given h3 while it rests.  The order comes from the service's own event log (its
    times and the state it held at each), not from a polled ``status`` landing in a window."""
    from launcher.cluster import reach
    unreachable_s = 3.0
    c = shared_cluster   # test_cluster.py's (conftest.py): h3 reconnected before the end
    cli = [sys.executable, "-m", "launcher.cluster.cli"]
    state, cfile = tmp_path / "state", tmp_path / "cluster.json"
    out = open(tmp_path / "serve.log", "w")
    serve = c.popen("launcher", cli + [
        "serve", "-H", "h1:1,h2:1,h3:1", "--policy", "edl", "--hold", "1", "-i", c.identity_file,
        "--unreachable-after", str(unreachable_s),
        "--network-interface", c.nic, "--state-dir", str(state), "--cluster-file", str(cfile)],
        stdout=out, stderr=subprocess.STDOUT, cwd=str(Path(__file__).resolve().parent.parent))

    def job_status(jid):
        r = subprocess.run(c.exec_argv("launcher", cli + ["--cluster", str(cfile), "status",
                                                          "--json"]),
                           capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
        st = json.loads(r.stdout) if r.returncode == 0 else {"jobs": []}
        return st, next((j for j in st["jobs"] if j["id"] == jid), {})

    def events(kind=None):  # the service's own log (STATE_DIR/events.jsonl), oldest first
        path = state / "events.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        return [e for e in rows if kind is None or e["kind"] == kind]

    def logs():
        return (tmp_path / "serve.log").read_text()[-2000:] + "".join(
            p.read_text()[-2000:] for p in state.glob("jobs/*/run*.log"))
    try:
        wait_for("the cluster file", lambda: cfile.exists() or serve.poll() is not None, 60)
        r = subprocess.run(c.exec_argv("launcher", cli + [
            "--cluster", str(cfile), "submit", "--np", "3", "--min-np", "1", "--max-np", "3",
            *ledger(tmp_path, "j1", 256, epochs=1000, delay=0.03),
            "--stop-file", str(tmp_path / "stop1")]),
            capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
        assert r.returncode == 0, r.stderr
        jid = r.stdout.split()[-1]
        wait_for("a ring of 3", lambda: [e for e in events("ring")
                                         if e["job"] == jid and e["world_size"] == 3], 120, logs)
        cut = time.time()
        c.cut("h3")
        try:
            rest = wait_for("h3 resting", lambda: [e for e in events("rest")
                                                   if e.get("host") == "h3"], 60,
                            lambda: json.dumps(events()[-12:]) + logs())[0]
            st = wait_for("status: h3 resting, taken from the job", lambda: (
                lambda s: s if "h3" in s[0].get("resting", {})
                and s[1].get("allocation") == {"h1": 1, "h2": 1} else None)(job_status(jid)),
                60, lambda: json.dumps(events()[-12:]) + logs())
        finally:
            c.reconnect("h3")
        log = events()
        assert all(w["host"] != "h3" for w in st[1]["workers"]), st[1]["workers"]
        rested = rest["at"] - cut
        assert rested >= unreachable_s, (rested, log)
        # the ring of 2 from its telemetry, not from the rest's shrink: recorded while h3 was
        # still allocated to the job and not resting, before the rest
        two = [e for e in log if e["kind"] == "ring" and e["job"] == jid and e["at"] > cut]
        assert two and two[0]["world_size"] == 2 and two[0]["previous"] == 3, (two, log)
        assert two[0]["allocation"] == {"h1": 1, "h2": 1, "h3": 1} and \
            "h3" not in two[0]["resting"] and two[0]["at"] < rest["at"], (two[0], rest)
        shown = two[0]["at"] - cut
        assert shown < reach.UNREACHED_S, shown  # within the default's 10 s, as before
        # no job given h3 while it rests (up to the status read above)
        after = log[log.index(rest) + 1:]
        assert not [e for e in after if "h3" in (e.get("hosts") or {})
                    or "h3" in (e.get("allocation") or {})], after
        print(f"vanished h3: the service saw the ring of 2 {shown:.1f} s after the cut, h3 "
              f"rests {rested:.1f} s after it")
    finally:
        (tmp_path / "stop1").touch()
        serve.terminate()
        serve.wait(30)
        out.close()
        for p in psutil.process_iter(["cmdline"]):  # a job outlives its service by design
            if str(state) in " ".join(p.info["cmdline"] or []):
                p.kill()


def test_slots_its_launcher_rests_are_given_back_decision():
    """:func:`launcher.cluster.rested.given_back`: a host's last slots resting for good, their
    processes gone, leave the job's allocation; a resting slot below a live one, or one whose
    process is still exiting, stays."""
    from launcher.cluster.rested import given_back
    rows = [{"host": "a", "slot": 0, "state": "member"}, {"host": "a", "slot": 1,
                                                          "state": "member"}]
    assert given_back({"a": 2, "b": 1}, {"resting": {"b": [0]}, "workers": rows}) == {"b": 0}
    assert given_back({"a": 3}, {"resting": {"a": [2]}, "workers": rows}) == {"a": 2}
    assert given_back({"a": 3}, {"resting": {"a": [1]}, "workers": rows[:1]}) == {}
    assert given_back({"a": 3}, {"resting": {"a": [1, 2]}, "workers": rows[:1]}) == {"a": 1}
    exiting = rows + [{"host": "a", "slot": 2, "state": "leaving"}]
    assert given_back({"a": 3}, {"resting": {"a": [2]}, "workers": exiting}) == {}
    assert given_back({"a": 2}, {"workers": rows}) == {}
    # the launcher's side: a failed worker's slot rests for good and is offered; a fenced one
    # (its host cut off: its process may live on) is not, nor any slot of its host
    from launcher.job.slot_book import SlotBook
    book = SlotBook()
    book.set_hosts({"a": 3, "b": 2})
    book.record_failure("a", 2, 0.0, None)
    book.record_failure("b", 1, 0.0, None)
    assert book.resting_for_good() == {"a": [2], "b": [1]}
    book.note_fenced("b", 0)
    book.record_failure("b", 0, 0.0, None)
    assert book.resting_for_good() == {"a": [2]}


def test_a_slot_whose_joiner_failed_goes_back_to_the_pool(service, tmp_path):
    """``serve --assume-gpus -H localhost:2,127.0.0.2:1``: j1 (1 to 3) is lent all three GPUs,
    but its worker command fails on 127.0.0.2 (exit 1 at start) and its launcher rests that
    slot for the rest of the run.  The service learns it from j1's telemetry and gives the slot
    back (a ``rested`` event) once the failed process is gone; j2 (``--np 1``) then runs on it
    to the end while j1 still trains, instead of waiting for j1 to end."""
    marker = f"rested-{os.getpid()}-{time.monotonic_ns()}"
    os.environ["HVD_EDL_TEST_MARKER"] = marker
    sampler = None
    bad = tmp_path / "no_driver_on_127_0_0_2.py"
    bad.write_text("import os, runpy, sys\n"
                   "if os.environ.get('HOROVOD_HOSTNAME') == '127.0.0.2':\n"
                   "    sys.exit('CUDA driver not found on 127.0.0.2')\n"
                   "sys.argv = sys.argv[1:]\n"
                   "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    try:
        svc = service("--policy", "edl", "--hold", "1", "--assume-gpus",
                      "-H", "localhost:2,127.0.0.2:1")
        sampler = GpuSampler(marker)
        cmd = ledger(tmp_path, "j1", 64, epochs=1000, delay=0.03)
        cmd = cmd[:2] + [str(bad)] + cmd[2:] + ["--stop-file", str(tmp_path / "stop1")]
        j1 = svc.submit("--env", f"HVD_EDL_TEST_MARKER={marker}", "--min-np", "1",
                        "--max-np", "3", *cmd)
        rested = wait_for("j1's rested slot given back", lambda: svc.events(j1, "rested"), 90,
                          lambda: svc.output() + svc.job_logs())
        assert rested[0]["hosts"] == {"localhost": 2} and \
            rested[0]["slots"] == {"127.0.0.2": [0]}, rested
        j2 = svc.submit("--env", f"HVD_EDL_TEST_MARKER={marker}", "--np", "1",
                        *ledger(tmp_path, "j2", 48))
        jobs = svc.wait_jobs(lambda j: j[j2]["state"] == "done", "j2 done", timeout_s=90)
        assert jobs[j1]["state"] == "running" and jobs[j1]["allocation"] == {"localhost": 2}, \
            jobs[j1]
        assert [e["hosts"] for e in svc.events(j2, "run")] == [{"127.0.0.2": 1}]
        (tmp_path / "stop1").touch()
        jobs = svc.wait_jobs(lambda j: j[j1]["state"] == "done", "j1 done", timeout_s=90)
    finally:
        os.environ.pop("HVD_EDL_TEST_MARKER", None)
        if sampler is not None:
            sampler.stop()
    assert sampler.shared_gpus() == [], sampler.shared_gpus()[:5]
    assert jobs[j1]["runs"] == 1 and jobs[j2]["runs"] == 1, jobs


def _wrapper_run(files, number: int) -> subprocess.Popen:
    """Run ``number`` as :meth:`launcher.cluster.runs.Run.start` starts it (its wrapper, holding
    the run's lock, in a session of its own, its marker in its environment: the service
    signals only a process that carries it), with an idle stand-in for ``hvd-edl-run``."""
    import fcntl
    from launcher.cluster.runs import MARKER_ENV, Run
    lock_fd = os.open(files.run_file(number, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.cluster.wrapper", "--pid-file",
             str(files.run_file(number, "pid")), "--exit-file", str(files.run_file(number, "exit")),
             "--", sys.executable, "-c", "import time; time.sleep(120)"],
            start_new_session=True, pass_fds=(lock_fd,),
            env=dict(os.environ, **{MARKER_ENV: Run(files, number).marker()}),
            cwd=str(Path(__file__).resolve().parent.parent))
    finally:
        os.close(lock_fd)
    # its pid file written: from then on a SIGTERM is passed on (a loaded machine starts Python
    # slowly; a stop before it found no pid and signalled nothing)
    wait_for("the wrapper's pid file", lambda: Run(files, number).pid() is not None
             or proc.poll() is not None, 60)
    return proc


def test_a_service_killed_right_after_a_decision_restarts_from_what_was_done(tmp_path):
    """The state a service killed (-9) right after a round leaves: j1's run alive on 4 GPUs
    (its file) but decided down to 2 (the store), j2's run 1 recorded (``running``) but never
    started, j3 decided a start not begun.  The restarted service (a pool of 7 now) adopts j1
    with what its file gives it, puts j2 and j3 back in the queue with no ``run`` event (no
    start happened), names each dropped decision, and its own first round decides from that: j2
    and j3 start on the free GPUs and j1 is not shrunk (the old service shrank it before any
    round of its own, and started j2 on a stale decision)."""
    from launcher.cluster.policies import make_policy
    from launcher.cluster.runs import JobFiles, Run
    from launcher.cluster.service import Service
    from launcher.cluster.store import JobRecord
    from launcher.discovery import FixedHosts
    state = tmp_path / "state"

    def open_service(slots: int) -> Service:
        svc = Service(state, FixedHosts({"localhost": slots}), make_policy("edl"),
                      fixed_pool=True, assume_gpus=True)
        svc.open()
        return svc

    def job(np_: int, min_np: int, max_np: int, **fields) -> str:
        return old.store.add_job(JobRecord(
            id="", name="t", argv=["python", "t.py"], cwd="/", env={}, np=np_, min_np=min_np,
            max_np=max_np, priority=0, checkpoint_dir="", state="queued",
            submitted_at=time.time(), **fields)).id

    old = open_service(4)
    wrapper = None
    try:
        j1, j2, j3 = job(4, 1, 4), job(2, 2, 2), job(1, 1, 1)
        files = JobFiles(state, j1).make()
        files.write_hosts({"localhost": 4}, {"localhost": ("0", "1", "2", "3")})
        wrapper = _wrapper_run(files, 1)
        wait_for("j1's wrapper", lambda: Run(files, 1).probe()[0] == "alive", 30)
        old.store.update(j1, state="running", run=1, allocation={"localhost": 2},
                         started_at=time.time(), event={"kind": "shrink", "reason": "edl"})
        old.store.update(j2, state="running", run=1, allocation={"localhost": 2},
                         started_at=time.time(), event={"kind": "start", "reason": "edl"})
        old.store.update(j3, allocation={"localhost": 1}, event={"kind": "start",
                                                                 "reason": "edl"})
        old.close()  # what kill -9 leaves: the store as it was (the lock goes with the process)

        svc = open_service(7)
        try:
            jobs = {j.id: j for j in svc.store.jobs()}
            assert (jobs[j2].state, jobs[j2].run, jobs[j2].started_at) == ("queued", 0, None)
            assert jobs[j3].state == "queued" and jobs[j1].state == "running"
            assert svc.store.allocations() == {j1: {"localhost": 4}}  # what was done
            assert svc.written[j1] == {"localhost": 4} and j2 not in svc.runs
            events = [json.loads(x) for x in svc.events_path.read_text().splitlines()]
            stored = svc.store.events()
            assert not [e for e in events + stored if e["kind"] == "run"], events
            dropped = {e["job"]: e.get("dropped") for e in events
                       if e["kind"] in ("adopt", "undone")}
            assert dropped == {j1: {"localhost": 2}, j2: {"localhost": 2},
                               j3: {"localhost": 1}}, events
            svc._round()  # the restarted service's own first decision
            assert svc.store.allocations() == {j1: {"localhost": 4}, j2: {"localhost": 2},
                                               j3: {"localhost": 1}}, svc.store.allocations()
            kinds = [(e["job"], e["kind"]) for e in
                     map(json.loads, svc.events_path.read_text().splitlines())]
            assert (j1, "shrink") not in kinds[kinds.index((j1, "adopt")):], kinds
        finally:
            svc.close()
    finally:
        if wrapper is not None:
            wrapper.terminate()
            wrapper.wait(30)


def test_a_running_job_whose_hosts_leave_is_moved_not_said_resumed(tmp_path):
    """A running job whose only host leaves the pool (a drain) and that the same round places
    elsewhere is moved stop-free: the event says ``move`` (from the hosts its file gives it),
    not ``resume`` (no run was stopped or started), and it is not counted as waiting."""
    from launcher.cluster import pool as pool_
    from launcher.cluster.policies import make_policy
    from launcher.cluster.service import Service
    from launcher.cluster.store import JobRecord
    from launcher.discovery import FixedHosts
    svc = Service(tmp_path / "state", FixedHosts({"a": 2, "b": 2}), make_policy("edl"),
                  fixed_pool=True, assume_gpus=True)
    svc.open()
    try:
        job = svc.store.add_job(JobRecord(id="", name="t", argv=["python", "t.py"], cwd="/",
                                          env={}, np=2, min_np=1, max_np=2, priority=0,
                                          checkpoint_dir="", state="running", run=1,
                                          submitted_at=time.time()))
        svc.store.update(job.id, allocation={"a": 2}, world_size=2)
        svc.runs[job.id] = object()  # a live run (only its presence is read here)
        svc.written[job.id] = {"a": 2}
        svc.set_pool({"b": 2})
        pool_.hosts_left(svc, ["a"])
        svc._round()
        events = [json.loads(x) for x in svc.events_path.read_text().splitlines()]
        last = [e for e in events if e.get("job") == job.id][-1]
        assert (last["kind"], last["hosts"], last["from"]) == ("move", {"b": 2}, {"a": 2}), last
        assert not [e for e in events if e["kind"] == "resume"], events
        assert job.id not in svc.waiting_since
    finally:
        svc.close()
