"""hvd-edl-ctl against real jobs: scale out and in through the stop-free protocol, status, drain,
refused requests that leave the job untouched."""
import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import VENV_BIN, long_digits
from hvd_edl import messages
from launcher.serve import control

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
    # every hvd.DistributedOptimizer measures the gradient noise scale (issue 41) ...
    noise = job.wait_for("a gradient noise estimate", lambda: _status(job_file)[
        "gradient_noise"], 60)
    assert set(noise) == {"sqr", "var", "noise_scale_samples", "batch", "step", "measured_steps",
                          "period"}
    assert noise["batch"] == 32 and noise["step"] > 0 and noise["var"] > 0  # 2 ranks x 16
    # ``step`` is the job's optimizer step (every k-th is measured), not a count of measurements
    s = _status(job_file)
    assert noise["measured_steps"] <= noise["step"] <= s["progress"]["step"]
    assert "batch:      32 (fixed: the script did not opt in); noise scale" in _ctl(
        job_file, "status").stdout
    # ... and a script that did not opt in to an adaptive batch keeps its batch: the API says so
    asked = _ctl(job_file, "batch", "64")
    assert asked.returncode == 0 and "did not opt in" in asked.stderr
    assert _status(job_file)["adaptive_batch"] is None

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


# ---- usage errors, unknown hosts, workers that hang up -------------------------------------------

@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_ctl_timeout_that_is_not_a_positive_number_is_a_usage_error(tmp_path, value):
    """Before: ``--timeout 0|-1|nan`` reached ``requests`` and ended in a raw ``ValueError``
    traceback, exit 1.  Now exit 2 with argparse's one line, before any job is contacted."""
    job_file = control.write_job_file(str(tmp_path / "job.json"), "http://127.0.0.1:9", "s")
    r = _ctl(job_file, "--timeout", value, "status", timeout_s=30)
    assert r.returncode == 2, r.stderr
    assert "argument --timeout: expected seconds (a positive number)" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 2


def test_ctl_undrain_of_an_unknown_host_is_refused_and_bad_names_are_usage_errors(
        tmp_path, job_factory):
    """Before: ``undrain nosuchhost`` printed ``drained hosts: none`` and exited 0.  Now exit 1
    with one line naming the host; a host in another spelling (``LOCALHOST``) is the same host;
    a name that is no host name (5,000 characters, ``0``) is a usage error (exit 2, one short
    line).  The job is unchanged throughout."""
    job_file = tmp_path / "job.json"
    job_factory(["-np", "1", "--min-np", "1", "--max-np", "1", "--job-file", str(job_file)],
                [sys.executable, "-c", "import time; time.sleep(120)"], hosts="localhost:1")
    deadline = time.monotonic() + 60
    while not job_file.exists():
        assert time.monotonic() < deadline, "no job file"
        time.sleep(0.05)

    unknown = _ctl(job_file, "undrain", "nosuchhost")
    assert unknown.returncode == 1, unknown.stdout + unknown.stderr
    assert unknown.stderr.strip() == ("hvd-edl-ctl: error: unknown host 'nosuchhost' (not "
                                      "discovered, not drained, no worker on it); the job "
                                      "knows localhost")
    same = _ctl(job_file, "undrain", "LOCALHOST")   # known, not drained: nothing to do
    assert same.returncode == 0 and "drained hosts: none" in same.stdout, same.stderr
    for cmd in ("drain", "undrain"):
        for bad in ("x" * 5000, "0"):
            r = _ctl(job_file, cmd, bad)
            assert r.returncode == 2, r.stderr[:500]
            assert len(r.stderr) < 400 and "argument host:" in r.stderr, r.stderr[:500]
    assert _status(job_file)["drained"] == []


def test_a_worker_hanging_up_mid_request_is_one_debug_line_not_a_traceback(caplog):
    """A client that closes (or resets) its connection while sending a request's body, as a
    worker exiting during ``/leave`` or ``/watch`` does.  Before: ``coordinator: error serving
    POST /leave`` with a ``ConnectionResetError`` traceback at ERROR level, for each one (any
    client could print them: the body is read before the signature is checked).  Now one
    debug line each, and the server goes on answering."""
    from launcher.serve.coordinator_server import CoordinatorServer
    server = CoordinatorServer(object(), messages.new_secret(), "127.0.0.1")
    port = server.start()
    head = (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
            + messages.AUTH_HEADER.encode() + b": 1 2 3\r\n\r\n{\"worker")
    try:
        with caplog.at_level(logging.DEBUG, logger="launcher"):
            for path, reset in ((b"/leave", False), (b"/watch", True)):
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                if reset:  # close with a TCP reset instead of a FIN
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                s.sendall(head % path)
                time.sleep(0.2)  # the server is now reading the body
                s.close()
            deadline = time.monotonic() + 10
            while len([r for r in caplog.records if "closed the connection" in r.message]) < 2:
                assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
                time.sleep(0.05)
            records = list(caplog.records)
            # still serving: an unsigned request gets its 401
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"POST /beat HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
                assert s.recv(100).startswith(b"HTTP/1.1 401")
    finally:
        server.stop()
    lines = [r for r in records if "closed the connection" in r.message]
    assert [r.levelno for r in lines] == [logging.DEBUG, logging.DEBUG]
    assert "POST /leave" in lines[0].getMessage() and "POST /watch" in lines[1].getMessage()
    assert not [r for r in records if r.exc_info or r.levelno >= logging.WARNING]


def test_ctl_of_a_job_that_ended_or_does_not_answer_is_one_line_and_a_reader_gone_is_quiet(
        tmp_path):
    """Issue 30: ``status`` of a job that had just ended printed urllib3's ``Max retries
    exceeded`` trace, and ``status | head`` a BrokenPipe trace.  Now: one line saying the job
    ended (its launcher is gone) or that nothing answers at its address (it still runs), exit
    3; a reader that went away ends it quietly, exit 0."""
    import http.server
    import threading
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = subprocess.Popen(["true"])
    dead.wait()
    for pid, said in [(dead.pid, f"the job ended (its launcher, pid {dead.pid}, is gone)"),
                      (os.getpid(), f"no job answers at http://127.0.0.1:{port} (connection "
                                    f"refused; its launcher, pid {os.getpid()}, still runs")]:
        job = tmp_path / f"job{pid}.json"
        job.write_text(json.dumps({"url": f"http://127.0.0.1:{port}", "secret": "s",
                                   "pid": pid}))
        job.chmod(0o600)
        r = _ctl(job, "status")
        assert r.returncode == 3 and r.stderr.count("\n") == 1, r.stderr
        assert said in r.stderr and "Max retries" not in r.stderr, r.stderr
    job.unlink()
    r = _ctl(job, "status")
    assert r.returncode == 3 and "the job ended (hvd-edl-run removes it" in r.stderr, r.stderr

    class Status(http.server.BaseHTTPRequestHandler):  # answers what a job would, unsigned
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"generation": 1, "workers": []}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Status)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        job.write_text(json.dumps({"url": f"http://127.0.0.1:{server.server_port}",
                                   "secret": "s", "pid": os.getpid()}))
        job.chmod(0o600)
        # `true` has exited long before hvd-edl-ctl writes: its output meets a closed pipe
        r = subprocess.run(f"set -o pipefail; {CTL} --job {job} status --json | true",
                           shell=True, executable="/bin/bash", capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and r.stderr == "", r.stderr   # before: 120, a trace
    finally:
        server.shutdown()


def test_text_status_has_one_batch_line_with_the_layout_and_the_noise_scale():
    from launcher.ctl import format_status
    s = {"generation": 3, "world_size": 2, "min_np": 1, "max_np": 4, "target_np": 2,
         "hosts": {}, "drained": [], "workers": [], "step": 700,
         "adaptive_batch": {"batch": 248.0, "world_size": 2.0, "local_batch": 62.0,
                            "accumulation": 2.0},
         "gradient_noise": {"batch": 248, "noise_scale_samples": 108.46, "step": 655,
                            "period": 13},
         "batch_pinned": 248}
    text = format_status(s)
    assert ("batch:      248 = 2 ranks x 62 x 2 accumulation (pinned at 248 by hvd-edl-ctl "
            "batch); noise scale 108.5 samples at step 655, measured every 13 steps") in text
    s["gradient_noise"]["noise_scale_samples"] = None  # |G|^2 <= 0 so far
    assert "noise scale unknown yet (|G|^2 <= 0) at step 655" in format_status(s)
    del s["adaptive_batch"], s["gradient_noise"]
    assert "batch:" not in format_status(s)  # nothing measured: no line
