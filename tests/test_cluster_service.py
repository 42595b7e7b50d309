"""The cluster service (``hvd-edl-cluster``, issue 28) with real processes: the service as its
command, real ``hvd-edl-run`` jobs of Horovod-style scripts (tests/horovod_style/ledger_main.py)
over Gloo on this machine's slots, each audited exactly-once (``hvd_edl.audit``), real
``kill -9`` of the service.  Waits poll conditions with deadlines, never fixed sleeps."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

import pytest

from conftest import wait_for  # noqa: F401 - the other cluster tests import it from here
from hvd_edl import audit

ROOT = Path(__file__).resolve().parent.parent
LEDGER = str(ROOT / "tests" / "horovod_style" / "ledger_main.py")
CLI = [sys.executable, "-m", "launcher.cluster.cli"]




class Service:
    """One ``hvd-edl-cluster serve`` in ``tmp``; the jobs it started are ended at teardown (they
    outlive the service by design)."""

    def __init__(self, tmp: Path, *args: str):
        self.tmp = tmp
        self.state = tmp / "state"
        self.cluster = tmp / "cluster.json"
        self.args = list(args)
        self.proc: Optional[subprocess.Popen] = None
        self.logs: List[Path] = []
        self.start()

    def start(self) -> None:
        if self.cluster.exists():
            self.cluster.unlink()
        log = self.tmp / f"serve{len(self.logs)}.log"
        self.logs.append(log)
        self.proc = subprocess.Popen(CLI + ["serve", "--state-dir", str(self.state),
                                            "--cluster-file", str(self.cluster)] + self.args,
                                     stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                     cwd=str(ROOT))
        try:
            # a bound for a loaded machine: importing the service's modules alone took 19 s of
            # wall time (0.3 CPU-s) at load average 32, and a restarted service's 30 s ran out
            wait_for("the cluster file",
                     lambda: self.cluster.exists() or self.proc.poll() is not None, 90,
                     self.output)
            assert self.proc.poll() is None, self.output()
        except BaseException:
            self._end_service()  # a start that failed in the constructor had no stop(): the
            raise                # service lived on after its test (seen: orphaned, serving)

    def _end_service(self) -> None:
        """SIGTERM the service process, SIGKILL it after 20 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def output(self) -> str:
        return "\n".join(p.read_text() for p in self.logs if p.exists())[-4000:]

    def cli(self, *args: str, cluster: Optional[Path] = None) -> subprocess.CompletedProcess:
        return subprocess.run(CLI + ["--cluster", str(cluster or self.cluster)] + list(args),
                              capture_output=True, text=True, timeout=60, cwd=str(ROOT))

    def submit(self, *args: str, audit_dir: Optional[Path] = None) -> str:
        env = ["--env", f"{audit.ENV_AUDIT_DIR}={audit_dir}"] if audit_dir else []
        r = self.cli("submit", *env, *args)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip().splitlines()[-1]

    def jobs(self) -> dict:
        """Every job by id (the API in this process: polling through the command would cost a
        Python start a poll)."""
        from launcher.cluster import cluster_file
        from launcher.cluster.server import ClusterClient
        status = ClusterClient(cluster_file.read(self.cluster)).call("status")
        return {j["id"]: j for j in status["jobs"]}

    def events(self, job: Optional[str] = None, kind: Optional[str] = None) -> List[dict]:
        out = []
        for line in (self.state / "events.jsonl").read_text().splitlines():
            e = json.loads(line)
            if (job is None or e.get("job") == job) and (kind is None or e.get("kind") == kind):
                out.append(e)
        return out

    def wait_jobs(self, pred: Callable[[dict], bool], what: str, timeout_s: float = 90.0):
        return wait_for(what, lambda: (lambda j: j if pred(j) else None)(self.jobs()),
                        timeout_s, lambda: json.dumps(self.jobs(), indent=1)[-3000:]
                        + self.output() + self.job_logs())

    def job_logs(self) -> str:
        return "".join(f"\n--- {p}\n" + p.read_text()[-1500:]
                       for p in sorted(self.state.glob("jobs/*/run*.log")))

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        self._end_service()
        from launcher.cluster.runs import JobFiles, Run
        runs = []
        for pid_file in self.state.glob("jobs/*/run*.pid"):
            files = JobFiles(self.state, pid_file.parent.name)
            run = Run(files, int(pid_file.stem[3:]))
            if run.stop(signal.SIGTERM):
                runs.append(run)
        deadline = time.monotonic() + 40
        for run in runs:
            while run.probe()[0] == "alive" and time.monotonic() < deadline:
                time.sleep(0.1)


@pytest.fixture
def service(tmp_path):
    made: List[Service] = []

    def make(*args: str) -> Service:
        s = Service(tmp_path, *args)
        made.append(s)
        return s
    yield make
    for s in made:
        s.stop()


def ledger(tmp: Path, name: str, samples: int, epochs: int = 1, delay: float = 0.02) -> List[str]:
    return ["--", sys.executable, LEDGER, "--dataset-size", str(samples), "--batch-size", "8",
            "--epochs", str(epochs), "--step-delay", str(delay),
            "--done-log", str(tmp / f"{name}.done")]


def assert_exactly_once(directory: Path, samples: int) -> None:
    report = audit.check(directory, samples)
    assert report.ok and report.repeated == 0 and report.missing == 0, report.verdict()


def ended_once(svc: Service, job: str) -> None:
    ends = svc.events(job, "end")
    assert len(ends) == 1, ends
    assert ends[0]["state"] == "done" and ends[0]["exit_code"] == 0, ends


# ---- bad input and authentication ----------------------------------------------------------------

def test_bad_input_and_refused_requests_are_one_line_exit_2(service, tmp_path):
    svc = service("--policy", "fifo", "-H", "localhost:2")
    cases = [
        (["submit", "--min-np", "3", "--max-np", "2", "--", "python", "x.py"],
         "--min-np 3 is larger than --max-np 2"),
        (["submit", "--np", "5", "--min-np", "1", "--max-np", "4", "--", "python", "x.py"],
         "--np 5 must lie within"),
        (["submit", "--min-np", "1"], "no training command"),
        (["submit", "--", "no-such-command-xyz"], "not found"),
        (["submit", "--min-np", "3", "--", sys.executable, "x.py"], "can never fit"),
        (["status", "j99"], "no job 'j99'"),
        (["cancel", "j99"], "no job 'j99'"),
    ]
    for args, words in cases:
        r = svc.cli(*args)
        assert r.returncode == 2 and words in r.stderr, (args, r.returncode, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    # an unreadable cluster file, one that others could rewrite
    r = svc.cli("queue", cluster=tmp_path / "missing.json")
    assert r.returncode == 2 and "cannot read cluster file" in r.stderr, r.stderr
    loose = tmp_path / "loose.json"
    shutil.copy(svc.cluster, loose)
    os.chmod(loose, 0o664)
    r = svc.cli("queue", cluster=loose)
    assert r.returncode == 2 and "writable by others" in r.stderr, r.stderr
    # what a web page could send (no JSON type; a DNS rebinding's host name) is refused
    import requests
    data = json.loads(svc.cluster.read_text())
    resp = requests.post(data["url"] + "/cluster/submit", data=b'{"argv": ["python"]}',
                         headers={"Content-Type": "text/plain"}, timeout=10)
    assert resp.status_code == 403 and "Content-Type" in resp.json()["error"]
    port = data["url"].rsplit(":", 1)[1]
    resp = requests.post(data["url"] + "/cluster/submit", json={"argv": ["python"]},
                         headers={"Host": f"evil.example:{port}"}, timeout=10)
    assert resp.status_code == 403 and "Host" in resp.json()["error"]
    assert svc.jobs() == {}   # nothing was queued by any refused request
    # the cluster file holds no secret and every user may read it
    assert set(data) == {"url", "pid", "user", "state_dir", "started"}, data
    assert os.stat(svc.cluster).st_mode & 0o777 == 0o644
    # a second service on the same state directory is refused
    r = subprocess.run(CLI + ["serve", "-H", "localhost:1", "--state-dir", str(svc.state),
                              "--cluster-file", str(tmp_path / "other.json")],
                       capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert r.returncode == 2 and "in use by another" in r.stderr, r.stderr


# ---- the policies on small real streams ----------------------------------------------------------

def test_fifo_queue_and_jobs_survive_a_service_kill9(service, tmp_path):
    """fifo: the second job waits for the first's slots (gang, first come first served); the
    service is killed -9 while the first trains: the job keeps training, the restarted service
    re-adopts it, resumes the queue, and every job ends exactly once.  j1 trains epochs until
    the test has seen it adopted (its stop file), so it cannot end before the kill under load."""
    svc = service("--policy", "fifo", "-H", "localhost:2")
    a1, a2 = tmp_path / "a1", tmp_path / "a2"
    stop = tmp_path / "j1.stop"
    j1 = svc.submit("--np", "2", *ledger(tmp_path, "j1", 192, epochs=1000),
                    "--stop-file", str(stop), audit_dir=a1)
    j2 = svc.submit("--np", "1", *ledger(tmp_path, "j2", 64), audit_dir=a2)
    svc.wait_jobs(lambda j: j[j1]["state"] == "running" and j[j2]["state"] == "queued",
                  "j1 running, j2 queued")
    wait_for("j1 training", lambda: any(a1.glob("*.jsonl")), 60, svc.job_logs)
    launcher = json.loads((svc.state / "jobs" / j1 / "job.json").read_text())["pid"]
    svc.kill9()
    steps_before = sum(len(p.read_text().splitlines()) for p in a1.glob("*.jsonl"))
    wait_for("j1 training on without the service", lambda: sum(
        len(p.read_text().splitlines()) for p in a1.glob("*.jsonl")) > steps_before + 4, 30)
    os.kill(launcher, 0)  # the job's launcher is alive
    svc.start()
    wait_for("j1 re-adopted", lambda: svc.events(j1, "adopt"), 60, svc.output)
    assert svc.jobs()[j2]["state"] == "queued"   # j1 still holds both slots
    stop.touch()
    jobs = svc.wait_jobs(lambda j: all(x["state"] == "done" for x in j.values()), "both done")
    assert jobs[j2]["started_at"] >= jobs[j1]["finished_at"] - 0.5, jobs   # fifo, gang
    for j in (j1, j2):
        assert jobs[j]["runs"] == 1 and jobs[j]["exit_code"] == 0, jobs[j]  # never started twice
        ended_once(svc, j)
    assert_exactly_once(a1, 192)
    assert_exactly_once(a2, 64)


def test_edl_lends_spare_slots_and_takes_them_back_stop_free(service, tmp_path):
    """edl: a lone job grows to the whole pool; when a second arrives, the lent slots are
    taken back by a stop-free scale-in (no restart: one run, nothing rolled back), the second
    starts on them once they are free, and both finish exactly once."""
    svc = service("--policy", "edl", "--hold", "2", "-H", "localhost:2")  # 3 worker starts
    a1, a2 = tmp_path / "a1", tmp_path / "a2"
    stop = tmp_path / "j1.stop"  # j1 trains epochs of 96 samples until j2 has run
    j1 = svc.submit("--min-np", "1", "--max-np", "2",
                    *ledger(tmp_path, "j1", 96, epochs=1000, delay=0.03),
                    "--stop-file", str(stop), audit_dir=a1)
    svc.wait_jobs(lambda j: j[j1]["allocated"] == 2, "j1 on 2 slots")
    wait_for("j1 training", lambda: any(a1.glob("*.jsonl")), 60, svc.job_logs)
    j2 = svc.submit("--np", "1", *ledger(tmp_path, "j2", 64), audit_dir=a2)
    svc.wait_jobs(lambda j: j[j2]["state"] == "done", "j2 done")
    stop.touch()
    jobs = svc.wait_jobs(lambda j: all(x["state"] == "done" for x in j.values()), "both done")
    shrink = svc.events(j1, "shrink")
    assert shrink and shrink[0]["hosts"] == {"localhost": 1}, svc.events(j1)
    released = svc.events(j1, "released")
    assert released, svc.events(j1)
    start2 = svc.events(j2, "run")
    assert start2[0]["at"] >= released[0]["at"], (released, start2)  # never two on a slot
    assert jobs[j1]["runs"] == 1, jobs[j1]   # shrunk, not restarted
    gens = [json.loads(x) for x in (svc.state / "jobs" / j1 / "run1.events.jsonl").read_text()
            .splitlines() if '"generation"' in x]
    assert any(g.get("kind") == "scale_in" and g["rolled_back_steps"] == 0 for g in gens), gens
    for j in (j1, j2):
        ended_once(svc, j)
    assert_exactly_once(a1, 96)
    assert_exactly_once(a2, 64)


@pytest.mark.long
def test_tiresias_preempts_to_a_checkpoint_and_resumes(service, tmp_path):
    """tiresias: a job past the attained-service threshold is preempted (checkpoint, SIGTERM)
    when a fresh one arrives, and resumes from its checkpoint afterwards: two runs, every
    sample still exactly once."""
    svc = service("--policy", "tiresias", "--queue-thresholds", "4", "-H", "localhost:2")
    a1, a2 = tmp_path / "a1", tmp_path / "a2"
    j1 = svc.submit("--np", "2", *ledger(tmp_path, "j1", 640, delay=0.03), audit_dir=a1)
    svc.wait_jobs(lambda j: j[j1]["state"] == "running" and j[j1]["attained_gpu_s"] > 4,
                  "j1 past the threshold")
    wait_for("j1 training", lambda: any(a1.glob("*.jsonl")), 60, svc.job_logs)
    j2 = svc.submit("--np", "2", *ledger(tmp_path, "j2", 64), audit_dir=a2)
    jobs = svc.wait_jobs(lambda j: all(x["state"] == "done" for x in j.values()), "both done",
                         timeout_s=120)
    assert svc.events(j1, "suspended"), svc.events(j1)
    assert jobs[j1]["runs"] == 2 and jobs[j2]["runs"] == 1, jobs
    assert jobs[j2]["finished_at"] <= jobs[j1]["finished_at"], jobs
    for j in (j1, j2):
        ended_once(svc, j)
    assert_exactly_once(a1, 640)
    assert_exactly_once(a2, 64)


# ---- the pool changes under running jobs ------------------------------------------------------------

# a host leaving the pool under a running job: test_cluster_drain.py (with drains and an announced end)
