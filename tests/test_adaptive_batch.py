"""An adaptive global batch (issue 41): a real elastic job whose script opted in
(hvd.elastic.AdaptiveBatchSampler + hvd.AdaptiveOptimizer) changes its global batch at a switch
asked for through the control API, and every sample of every epoch is still used exactly once
(the audit's ledger)."""
import json
import subprocess
import sys

from conftest import VENV_BIN, long_digits
from test_exactly_once import DIGITS_TRAIN
from hvd_edl import audit

CTL = str(VENV_BIN / "hvd-edl-ctl")


def _ctl(job_file, *args):
    r = subprocess.run([CTL, "--job", str(job_file), *args], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r


def test_batch_asked_through_the_control_api_changes_at_a_switch_exactly_once(
        tmp_path, job_factory, monkeypatch):
    """Two workers at global batch 32 (local 16); ``hvd-edl-ctl batch 96`` makes the ring switch
    to itself (kind "reform", nothing rolled back) and go on at 96 = 2 ranks x 3 micro-batches
    of 16.  The ledger shows both layouts and the audit finds no sample repeated or missing."""
    ledger = tmp_path / "ledger"
    monkeypatch.setenv(audit.ENV_AUDIT_DIR, str(ledger))
    job_file = tmp_path / "job.json"
    job = job_factory(["-np", "2", "--min-np", "1", "--max-np", "2", "--target-np", "2",
                       "--discovery-interval", "0.2", "--job-file", str(job_file)],
                      long_digits(tmp_path, "--adaptive-batch", "--global-batch-size", "32",
                                  "--max-local-batch", "16", "--commit-every", "4"),
                      hosts="localhost:2")
    job.wait_generation(1)
    status = lambda: json.loads(_ctl(job_file, "status", "--json").stdout)  # noqa: E731
    plan = job.wait_for("the adaptive batch reported", lambda: status()["adaptive_batch"], 60)
    assert plan["batch"] == 32 and plan["local_batch"] == 16 and plan["accumulation"] == 1
    assert "now 32" in _ctl(job_file, "batch", "96").stdout
    ev = job.wait_generation(2, timeout_s=120)
    assert ev["kind"] == "reform" and ev["rolled_back_steps"] == 0
    plan = job.wait_for("batch 96 in force", lambda: (status()["adaptive_batch"] or {}).get(
        "batch") == 96 and status()["adaptive_batch"], 60)
    assert plan["local_batch"] == 16 and plan["accumulation"] == 3
    # an operator's batch pins it (no --adapt-batch here: nothing else would change it);
    # the text status has the layout on one line
    st = status()
    assert st["batch_pinned"] == 96
    assert "batch:      96 = 2 ranks x 16 x 3 accumulation (pinned at 96" in _ctl(
        job_file, "status").stdout
    assert "no longer pinned" in _ctl(job_file, "batch", "auto").stdout
    assert status()["batch_pinned"] is None
    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]

    records = audit.read_records(ledger)
    shares = {(r["size"], len(r["indices"])) for r in records if r["kind"] == "step"}
    assert shares == {(2, 16), (2, 48)} or shares - {(2, 16), (2, 48)} and max(
        k for _, k in shares - {(2, 16), (2, 48)}) < 48, shares  # and epochs' short ends
    report = audit.check(ledger, DIGITS_TRAIN)
    assert report.ok and (report.repeated, report.missing) == (0, 0), report.to_dict()
    assert len(report.epochs) >= 2
