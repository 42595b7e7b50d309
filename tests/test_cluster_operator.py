"""What an operator of ``hvd-edl-cluster`` reaches for (issue 39, section 2), with real
processes: the service as its command, real ``hvd-edl-run`` jobs (tests/horovod_style/
ledger_main.py, or a script that fails at start), the commands as a user types them.  Waits poll
conditions with deadlines, never fixed sleeps."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from test_cluster_service import ledger, service, wait_for  # noqa: F401 - service: a fixture


def typo_script(tmp: Path) -> Path:
    """A script that fails at start the way a typo does: every worker exits 1 before training."""
    bad = tmp / "typo.py"
    bad.write_text("print('starting')\nimport no_such_module_xyz\n")
    return bad


# ---- a job that fails at start ------------------------------------------------------------------

def test_a_job_failing_at_start_ends_failed_at_once_with_its_error_and_frees_its_slots(
        service, tmp_path):
    """Every worker of a job exits 1 before training: the job ends ``failed`` within 30 s of its
    start (not after --elastic-timeout's 600 s), its reason quotes the error and where it was
    raised, the job queued behind it starts on its slots at once, and the failed job is never
    started again.  ``submit`` refuses a script that is not a readable file at once."""
    svc = service("--policy", "fifo", "-H", "localhost:2")
    (tmp_path / "dir.py").mkdir()
    for script, words in [("missing.py", "no such file"), ("dir.py", "not a readable file")]:
        r = svc.cli("submit", "--", sys.executable, str(tmp_path / script))
        assert r.returncode == 2 and words in r.stderr, (script, r.returncode, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert svc.jobs() == {}

    j1 = svc.submit("--np", "2", "--", sys.executable, str(typo_script(tmp_path)))
    j2 = svc.submit("--np", "2", *ledger(tmp_path, "j2", 64))   # fifo: waits for j1's slots
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
    jobs = svc.wait_jobs(lambda j: j[j2]["state"] == "done", "j2 done")
    assert jobs[j1]["state"] == "failed" and jobs[j1]["runs"] == 1, jobs[j1]   # no loop
    assert len(svc.events(j1, "run")) == 1 and len(svc.events(j1, "end")) == 1
