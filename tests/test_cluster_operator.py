"""What an operator of ``hvd-edl-cluster`` reaches for (issue 39, section 2), with real
processes: the service as its command, real ``hvd-edl-run`` jobs (tests/horovod_style/
ledger_main.py, or a script that fails at start), the commands as a user types them.  Waits poll
conditions with deadlines, never fixed sleeps."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from test_cluster_service import CLI, LEDGER, ROOT, ledger, service, wait_for  # noqa: F401


def talker(tmp: Path, gate: Path) -> Path:
    """tests/horovod_style/ledger_main.py run by a script that prints a line before it (then
    waits, idle, for ``gate`` to exist) and one after it: what a worker's own output looks
    like in ``logs``."""
    path = tmp / "talker.py"
    path.write_text(
        "import os, runpy, sys, time\n"
        "me = os.environ['HVD_EDL_WORKER_ID']\n"
        "print(f'{me} says hello', flush=True)\n"
        f"while not os.path.exists({str(gate)!r}):\n"
        "    time.sleep(0.05)\n"
        f"sys.argv = [{LEDGER!r}] + sys.argv[1:]\n"
        f"runpy.run_path({LEDGER!r}, run_name='__main__')\n"
        "print(f'{me} says goodbye', flush=True)\n")
    return path


def typo_script(tmp: Path) -> Path:
    """A script that fails at start the way a typo does: every worker exits 1 before training."""
    bad = tmp / "typo.py"
    bad.write_text("print('starting')\nimport no_such_module_xyz\n")
    return bad


def gated(tmp: Path, gate: Path) -> Path:
    """tests/horovod_style/ledger_main.py once ``gate`` exists: until then the job's workers
    are started but no ring forms (its allocation and its ring differ)."""
    path = tmp / "gated.py"
    path.write_text(
        "import os, runpy, sys, time\n"
        f"while not os.path.exists({str(gate)!r}):\n"
        "    time.sleep(0.05)\n"
        f"sys.argv = [{LEDGER!r}] + sys.argv[1:]\n"
        f"runpy.run_path({LEDGER!r}, run_name='__main__')\n")
    return path


# ---- a job that fails at start ------------------------------------------------------------------

def test_a_job_failing_at_start_ends_failed_at_once_with_its_error_and_frees_its_slots(
        service, tmp_path):
    """Every worker of a job exits 1 before training: the job ends ``failed`` within 30 s of its
    start (not after --elastic-timeout's 600 s), its reason quotes the error and where it was
    raised, the job queued behind it (failing alike) starts on its slots at once, and neither
    is ever started again.  ``submit`` refuses a script that is not a readable file at once."""
    svc = service("--policy", "fifo", "-H", "localhost:2")
    (tmp_path / "dir.py").mkdir()
    for script, words in [("missing.py", "no such file"), ("dir.py", "not a readable file")]:
        r = svc.cli("submit", "--", sys.executable, str(tmp_path / script))
        assert r.returncode == 2 and words in r.stderr, (script, r.returncode, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert svc.jobs() == {}

    j1 = svc.submit("--np", "2", "--", sys.executable, str(typo_script(tmp_path)))
    j2 = svc.submit("--np", "2", "--", sys.executable, str(typo_script(tmp_path)))  # behind j1
    jobs = svc.wait_jobs(lambda j: j[j1]["state"] == "failed", "j1 failed", timeout_s=45)
    failed = jobs[j1]
    assert failed["finished_at"] - failed["started_at"] < 30, failed
    assert failed["exit_code"] == 1, failed
    reason = failed["reason"]
    assert "ModuleNotFoundError: No module named 'no_such_module_xyz'" in reason, reason
    assert 'typo.py", line 2' in reason, reason
    assert "every worker failed before a ring formed" in reason, reason
    end = svc.events(j1, "end")[0]["at"]
    start2 = wait_for("j2 started", lambda: svc.events(j2, "run"), 30, svc.output)
    assert start2 and start2[0]["at"] - end < 2.0, (end, start2)   # its slots free at once
    jobs = svc.wait_jobs(lambda j: j[j2]["state"] == "failed", "j2 failed too", timeout_s=45)
    assert jobs[j1]["state"] == "failed" and jobs[j1]["runs"] == 1, jobs[j1]   # no loop
    assert jobs[j2]["runs"] == 1 and svc.jobs()[j1]["runs"] == 1, jobs
    assert len(svc.events(j1, "run")) == 1 and len(svc.events(j1, "end")) == 1


# ---- logs ------------------------------------------------------------------------------------------

def test_logs_show_launcher_and_worker_output_during_and_after_the_run(service, tmp_path):
    """``logs JOB`` prints the run's launcher and worker lines while it runs and after it
    ended (also a failed one); ``--follow`` streams until the run ends and exits 0 by itself,
    Ctrl-C ends it with 0; an unknown job or run is one line."""
    svc = service("--policy", "fifo", "-H", "localhost:2")
    gate = tmp_path / "gate"
    j1 = svc.submit("--np", "2", "--", sys.executable, str(talker(tmp_path, gate)),
                    *ledger(tmp_path, "j1", 64)[3:])
    during = wait_for("both workers' hello in logs", lambda: (lambda r: r.stdout if r.returncode
                      == 0 and r.stdout.count("says hello") == 2 else None)(svc.cli("logs", j1)),
                      60, svc.job_logs)
    assert "[w1]<stdout>:w1 says hello" in during and "worker w2 started" in during, during
    assert svc.jobs()[j1]["state"] == "running"

    def follow(*extra: str):
        out = open(tmp_path / f"follow{len(extra)}.txt", "w+")
        # as a shell starts it: Ctrl-C's default disposition (code run earlier in this pytest
        # worker can leave SIGINT ignored, which exec passes on: see test_telemetry.py)
        return subprocess.Popen(CLI + ["--cluster", str(svc.cluster), "logs", j1, *extra],
                                stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                 signal.SIG_DFL)), out
    interrupted, out0 = follow("--follow", "--run", "1")
    following, out = follow("--follow")
    wait_for("the followers printing", lambda: "says hello" in (tmp_path / "follow1.txt")
             .read_text() and "says hello" in (tmp_path / "follow3.txt").read_text(), 30)
    interrupted.send_signal(signal.SIGINT)
    assert interrupted.wait(30) == 0, out0.read()
    assert following.poll() is None   # the run goes on: so does --follow
    gate.touch()
    assert following.wait(60) == 0
    followed = (tmp_path / "follow1.txt").read_text()
    jobs = svc.wait_jobs(lambda j: j[j1]["state"] == "done", "j1 done")
    after = svc.cli("logs", j1)
    assert after.returncode == 0 and after.stdout == followed, (after.stdout[-2000:], followed)
    assert followed.startswith(during) and "<stdout>:w2 says goodbye" in followed, followed
    assert svc.cli("logs", j1, "--run", "1").stdout == followed
    for args, words in [((j1, "--run", "2"), f"job {j1} has no run 2"),
                        (("j99",), "no job 'j99'")]:
        r = svc.cli("logs", *args)
        assert r.returncode == 2 and words in r.stderr and not r.stdout, (args, r)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert jobs[j1]["runs"] == 1

    j2 = svc.submit("--np", "1", "--", sys.executable, str(typo_script(tmp_path)))
    svc.wait_jobs(lambda j: j[j2]["state"] == "failed", "j2 failed", timeout_s=45)
    r = svc.cli("logs", j2)
    assert r.returncode == 0 and "[w1]<stderr>:ModuleNotFoundError: No module named " \
        "'no_such_module_xyz'" in r.stdout and "hvd-edl-run: error:" in r.stdout, r


# ---- why a job waits -------------------------------------------------------------------------------

def test_queue_and_status_say_why_each_job_waits(service, tmp_path):
    """fifo on 3 slots, a job of 2 running: a queued job of 2 needs 2 slots with 1 free, the
    job of 1 behind it fits but waits for the head of the line; ``queue``, ``status`` and
    ``status --json`` say so, in one line each, and a running job gives its last decision."""
    svc = service("--policy", "fifo", "-H", "localhost:3")
    gate = tmp_path / "gate"
    j1 = svc.submit("--np", "2", "--", sys.executable, str(gated(tmp_path, gate)),
                    *ledger(tmp_path, "j1", 64)[3:])   # holds its slots, idle
    j2 = svc.submit("--np", "2", *ledger(tmp_path, "j2", 64))
    j3 = svc.submit("--np", "1", *ledger(tmp_path, "j3", 64))
    jobs = svc.wait_jobs(lambda j: j[j1]["state"] == "running" and j[j3]["reason"]
                         and "ahead" in j[j3]["reason"], "j1 running, j3 told why it waits")
    assert jobs[j2]["reason"] == "needs 2 slots, 1 free; 0 jobs ahead", jobs[j2]
    assert jobs[j3]["reason"] == (f"needs 1 slot, 1 free; 1 job ahead (fifo: none passes "
                                  f"{j2}, first in line)"), jobs[j3]
    assert jobs[j1]["reason"] == "fifo: starts on 2 slots", jobs[j1]
    r = svc.cli("queue")
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stdout
    assert lines[0].split()[:2] == ["1.", j2] and lines[0].endswith(jobs[j2]["reason"]), lines
    assert lines[1].split()[:2] == ["2.", j3] and lines[1].endswith(jobs[j3]["reason"]), lines
    r = svc.cli("status")
    assert r.returncode == 0 and "      needs 2 slots, 1 free; 0 jobs ahead" in r.stdout, r.stdout
    r = svc.cli("status", "--json")
    assert all("reason" in j for j in json.loads(r.stdout)["jobs"]), r.stdout
    for j in (j3, j2):   # the last first: none of them starts meanwhile
        svc.cli("cancel", j)
    gate.touch()


# ---- metrics -------------------------------------------------------------------------------------

def scrape(url: str) -> dict:
    """``/metrics`` as {(name, labels as a sorted tuple): value}."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for family in text_string_to_metric_families(requests.get(url, timeout=10).text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_count_jobs_slots_failures_and_give_the_ring_size(service, tmp_path):
    """``/metrics`` has jobs pending and running, slots allocated, preemptions, restarts and
    failures in Prometheus' names, and a job's ``job_world_size`` is its ring's size from its
    telemetry: 0 while its 2 allocated workers have formed no ring, 2 once they have."""
    svc = service("--policy", "fifo", "-H", "localhost:2", "--metrics-port", "0")
    url = wait_for("the metrics URL", lambda: next((
        line.split("metrics: ", 1)[1].strip() for line in svc.output().splitlines()
        if "metrics: " in line), None), 30, svc.output)
    j0 = svc.submit("--np", "2", "--", sys.executable, str(typo_script(tmp_path)))
    svc.wait_jobs(lambda j: j[j0]["state"] == "failed", "j0 failed", timeout_s=45)
    gate, stop = tmp_path / "gate", tmp_path / "stop"
    j1 = svc.submit("--np", "2", "--", sys.executable, str(gated(tmp_path, gate)),
                    *ledger(tmp_path, "j1", 64, epochs=1000, delay=0.05)[3:],
                    "--stop-file", str(stop))
    j2 = svc.submit("--np", "1", *ledger(tmp_path, "j2", 64))
    svc.wait_jobs(lambda j: j[j1]["state"] == "running", "j1 running")
    wait_for("j1's workers started", lambda: svc.cli("logs", j1).stdout.count(" started on ")
             == 2, 30)
    m = scrape(url)
    job = (("job", j1),)
    assert m[("hvd_edl_cluster_job_world_size", job)] == 0, m   # no ring yet
    assert m[("hvd_edl_cluster_job_slots_allocated", job)] == 2, m
    for name, value in [("hvd_edl_cluster_jobs_pending", 1), ("hvd_edl_cluster_jobs_running", 1),
                        ("hvd_edl_cluster_slots_allocated", 2),
                        ("hvd_edl_cluster_preemptions_total", 0),
                        ("hvd_edl_cluster_job_restarts_total", 0),
                        ("hvd_edl_cluster_job_failures_total", 1)]:
        assert m[(name, ())] == value, (name, m)
    gate.touch()
    wait_for("j1's ring of 2 in /metrics", lambda: scrape(url).get(
        ("hvd_edl_cluster_job_world_size", job)) == 2, 60, svc.job_logs)
    svc.cli("cancel", j2)
    stop.touch()


# ---- bad input -------------------------------------------------------------------------------------

def test_bad_input_is_one_line_a_priority_out_of_range_an_empty_or_unknown_pool(service,
                                                                               tmp_path):
    """``submit --priority`` beyond the store's integers is argparse's one line (exit 2), and
    the API refuses it as bad input (not an internal error); ``serve -H ""``, an empty hostfile
    or discovery command, and a host name that does not resolve are one line, exit 2, before
    anything starts."""
    svc = service("--policy", "fifo", "-H", "localhost:1")
    r = svc.cli("submit", "--priority", "99999999999999999999999", "--", sys.executable,
                LEDGER)
    assert r.returncode == 2 and "--priority: expected an integer from" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    from launcher.cluster import cluster_file
    from launcher.cluster.server import ClusterClient, ClusterRefused
    client = ClusterClient(cluster_file.read(svc.cluster))
    try:
        client.call("submit", argv=[sys.executable, LEDGER], cwd=str(ROOT),
                    priority=99999999999999999999999)
        raise AssertionError("accepted")
    except ClusterRefused as e:
        assert e.status == 400 and "priority" in str(e) and "out of range" in str(e), e
    assert svc.jobs() == {}

    (tmp_path / "empty").write_text("# no host\n")
    for args, words in [(["-H", ""], "-H '' names no host"),
                        (["--hostfile", str(tmp_path / "empty")], "names no host"),
                        (["--host-discovery-script", " "], "--host-discovery-script is empty"),
                        (["-H", "localhost:1,no-such-host.invalid:2"],
                         "host no-such-host.invalid d")]:   # does not / did not resolve
        r = subprocess.run(CLI + ["serve", "--state-dir", str(tmp_path / "st"), *args],
                           capture_output=True, text=True, timeout=60, cwd=str(ROOT))
        assert r.returncode == 2 and words in r.stderr, (args, r.returncode, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_a_name_lookup_that_hangs_is_refused_after_the_bound(monkeypatch):
    """A resolver that never answers (``getaddrinfo`` blocked) holds ``serve`` for the bound
    only: the name is refused as not resolved in time."""
    import socket
    import threading
    import time
    from launcher.cluster import resolve
    release = threading.Event()
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: release.wait(30))
    t0 = time.monotonic()
    try:
        bad = resolve.unresolved(["slow.example", "localhost"], timeout_s=0.5)
    finally:
        release.set()
    assert time.monotonic() - t0 < 3.0
    assert bad == {"slow.example": "did not resolve within 0.5 s"}, bad


def test_a_killed_launchers_ref_pointer_is_removed_by_the_next_reader(tmp_path):
    """``hvd-edl-run --job-file F`` leaves a ``<pid>.ref`` pointer in the default job folder;
    after a ``kill -9`` of the launcher the next ``hvd-edl-ctl list`` ignores and removes it."""
    import os
    import psutil
    env = dict(os.environ, HOME=str(tmp_path))
    env.pop("XDG_RUNTIME_DIR", None)
    env.pop("HVD_EDL_JOB", None)
    bin_dir = Path(sys.executable).parent
    launcher = subprocess.Popen(
        [str(bin_dir / "hvd-edl-run"), "-np", "1", "--job-file", str(tmp_path / "job.json"),
         "--", sys.executable, "-c", "import time; time.sleep(120)"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=str(tmp_path))
    ref = tmp_path / ".hvd_edl" / "jobs" / f"{launcher.pid}.ref"
    workers = []
    try:
        wait_for("the launcher's pointer and its worker", lambda: ref.exists() and psutil.Process(
            launcher.pid).children(), 30)
        workers = psutil.Process(launcher.pid).children(recursive=True)
        listed = subprocess.run([str(bin_dir / "hvd-edl-ctl"), "list"], capture_output=True,
                                text=True, timeout=60, env=env)
        assert str(launcher.pid) in listed.stdout and ref.exists(), listed   # alive: kept
        launcher.kill()
        launcher.wait(10)
        assert ref.exists()   # nobody removed it
        listed = subprocess.run([str(bin_dir / "hvd-edl-ctl"), "list"], capture_output=True,
                                text=True, timeout=60, env=env)
        assert str(launcher.pid) not in listed.stdout + listed.stderr, listed
        assert not ref.exists()
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for w in workers:
            try:
                w.kill()
            except psutil.Error:
                pass
