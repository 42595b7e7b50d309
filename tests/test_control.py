"""hvd-edl-ctl against real jobs: scale out and in through the stop-free protocol, status, drain,
refused requests that leave the job untouched."""
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import VENV_BIN, long_digits
from launcher import control

CTL = str(VENV_BIN / "hvd-edl-ctl")


def _ctl(job_file, *args, timeout_s=60):
    return subprocess.run([CTL, "--job", str(job_file), *args], capture_output=True, text=True,
                          timeout=timeout_s)


def _status(job_file) -> dict:
    r = _ctl(job_file, "status", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _members(ev):
    return [m.split("@")[0] for m in ev["members"]]


def _event(job, pred, what):
    return job.wait_for(what, lambda: next((e for e in job.events() if pred(e)), None), 120)


def test_ctl_scale_brings_a_worker_in_stop_free_and_scale_in_rolls_back_nothing(
        tmp_path, job_factory):
    job_file = tmp_path / "job.json"
    job = job_factory(["-np", "2", "--min-np", "1", "--max-np", "4", "--target-np", "2",
                       "--discovery-interval", "0.2", "--job-file", str(job_file)],
                      long_digits(tmp_path), hosts="localhost:4")
    job.wait_generation(1)
    job.wait_for("the job file", job_file.exists, 30)
    assert job_file.stat().st_mode & 0o777 == 0o600
    text = _ctl(job_file, "status")
    assert text.returncode == 0, text.stderr
    assert "generation: 1" in text.stdout and "world size: 2" in text.stdout
    assert "target np:  2 (min-np 1, max-np 4)" in text.stdout
    assert "w1     rank 0   localhost:0   member" in text.stdout

    refused = _ctl(job_file, "scale", "--np", "5")
    assert refused.returncode == 1
    assert "np 5 is outside [--min-np 1, --max-np 4]; the job is unchanged" in refused.stderr
    assert _status(job_file)["target_np"] == 2

    assert _ctl(job_file, "scale", "--np", "3").returncode == 0
    ev = job.wait_generation(2, timeout_s=120)
    assert ev["kind"] == "scale_out" and ev["world_size"] == 3
    assert _members(ev) == ["w1", "w2", "w3"] and ev["rolled_back_steps"] == 0

    assert _ctl(job_file, "scale", "--np", "1").returncode == 0
    ev = _event(job, lambda e: e["world_size"] == 1, "a generation of 1 worker")
    assert ev["kind"] == "scale_in" and ev["rolled_back_steps"] == 0
    assert _members(ev) == ["w1"]  # the youngest left; rank 0 kept the state
    job.wait_for("w2 and w3 gone", lambda: len(_status(job_file)["workers"]) == 1, 60)
    s = _status(job_file)
    assert s["world_size"] == 1 and s["target_np"] == 1 and s["last_change"]["kind"] == "scale_in"

    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]
    assert not [line for line in job.output().splitlines()  # the leavers left, did not fail
                if line.startswith("hvd-edl-run:") and "failed" in line]
    assert not job_file.exists()  # removed when the job ends


def test_ctl_drain_moves_workers_off_a_host_and_places_none_there(tmp_path, job_factory):
    job_file = tmp_path / "job.json"
    job = job_factory(["-np", "2", "--min-np", "1", "--max-np", "4", "--discovery-interval", "0.2",
                       "--job-file", str(job_file)],
                      long_digits(tmp_path), hosts="localhost:1\n127.0.0.2:1")
    ev = job.wait_generation(1)
    assert [m.split("@")[1] for m in ev["members"]] == ["localhost:0", "127.0.0.2:0"]

    unknown = _ctl(job_file, "drain", "nosuchhost")
    assert unknown.returncode == 1 and "unknown host 'nosuchhost'" in unknown.stderr

    assert _ctl(job_file, "drain", "127.0.0.2").returncode == 0
    ev = job.wait_generation(2, timeout_s=120)
    assert ev["kind"] == "scale_in" and ev["rolled_back_steps"] == 0
    assert ev["members"] == ["w1@localhost:0"]
    # the last usable host cannot be drained: it would leave fewer than --min-np slots
    last = _ctl(job_file, "drain", "localhost")
    assert last.returncode == 1 and "fewer than --min-np 1; the job is unchanged" in last.stderr
    job.wait_for("w2 to exit", lambda: [w["worker_id"] for w in _status(job_file)["workers"]]
                 == ["w1"], 60)
    assert _status(job_file)["drained"] == ["127.0.0.2"]

    assert _ctl(job_file, "undrain", "127.0.0.2").returncode == 0
    ev = job.wait_generation(3, timeout_s=120)
    assert ev["kind"] == "scale_out"
    assert ev["members"] == ["w1@localhost:0", "w3@127.0.0.2:0"]  # w3: none placed while drained
    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]


def test_job_file_of_a_killed_launcher_is_not_taken_for_a_process_reusing_its_pid(
        tmp_path, monkeypatch):
    """A launcher ended by kill -9 leaves its job file behind; a later process with the same
    pid must not make hvd-edl-ctl think that job still runs."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    folder = tmp_path / "hvd-edl"
    folder.mkdir()
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = folder / "stale.json"
        stale.write_text(json.dumps({"url": "http://127.0.0.1:1", "secret": "x",
                                     "pid": later.pid}))
        stale.chmod(0o600)  # as hvd-edl-run writes it (others' files are refused anyway)
        written = time.time() - 60  # the dead launcher wrote it a minute before `later` started
        os.utime(stale, (written, written))
        with pytest.raises(control.ControlError, match="no running job"):
            control.find_job_file()
        mine = folder / "mine.json"  # this process started before its file was written
        mine.write_text(json.dumps({"url": "http://127.0.0.1:1", "secret": "x",
                                    "pid": os.getpid()}))
        mine.chmod(0o600)
        assert control.find_job_file() == mine
    finally:
        later.kill()
        later.wait()
