"""Telemetry: the worker's step timer, the launcher's windows, the metrics endpoint and
``hvd-edl-ctl status`` / ``top`` on a real elastic job."""
from __future__ import annotations

import math

import pytest

from hvd_edl.step_timer import StepTimer
from launcher.observe.events import GenerationEvent
from launcher.observe.telemetry import COUNTER_KINDS, Telemetry


def test_step_timer_splits_steps_into_compute_and_wait_and_resends_unanswered_beats():
    t = StepTimer()
    t.step_end()                       # no restart yet: the first step is not timed
    assert t.totals == (0, 0.0, 0.0)
    t.restart()
    t.add_wait(10.0)                   # more wait than the step took: capped at the step
    t.step_end()
    steps, compute, wait = t.totals
    assert steps == 1 and compute == 0.0 and 0 < wait < 1.0
    t.add_samples(16)
    mark, sums = t.take()
    assert sums[0] == 1 and sums[3] == 16
    t.step_end()                       # not sent: the next take carries both steps
    mark, sums = t.take()
    assert sums[0] == 2 and sums[3] == 16 and sums[1] + sums[2] > 0
    t.sent(mark)
    assert t.take()[1] == (0, 0.0, 0.0, 0)


def _gen(number, kind, stall_s):
    return GenerationEvent(generation=number, kind=kind, world_size=2, members=[], step=0,
                           stall_s=stall_s, rolled_back_steps=0, time=0.0)


def test_telemetry_windows_means_throughput_and_counters():
    tel = Telemetry(window_s=2.0)
    tel.add_worker("w1", "hostA", 0)
    tel.add_worker("w2", "hostB", 0)
    tel.add_worker("w3", "hostB", 1)    # pending: no rank
    tel.on_members(1, ["w2", "w1"])
    assert math.isnan(tel.worker("w1").step_s)
    # w1: 10 steps/s of 0.1 s (0.07 compute + 0.03 wait), 160 samples/s, beats every 0.5 s
    for k in range(1, 21):
        now = 100.0 + 0.5 * k
        tel.observe("w1", 1, now, 5, 0.35, 0.15, 80)
        tel.observe("w2", 1, now, 5, 0.10, 0.40, 80)
        tel.observe("w3", 0, now, 0, 0.0, 0.0, 0)
    rows = tel.workers()
    assert [r.worker_id for r in rows] == ["w2", "w1", "w3"]
    assert [r.rank for r in rows] == [0, 1, -1]
    w1 = tel.worker("w1")
    assert (w1.host, w1.slot, w1.steps) == ("hostA", 0, 100)
    assert w1.step_s == pytest.approx(0.1) and w1.compute_s == pytest.approx(0.07)
    assert w1.wait_s == pytest.approx(0.03)
    assert w1.steps_per_s == pytest.approx(10.0) and w1.samples_per_s == pytest.approx(160.0)
    assert w1.updated_at == 110.0
    # the window forgets: w1 slows down to 2 steps/s of 0.5 s
    for k in range(1, 9):
        tel.observe("w1", 1, 110.0 + 0.5 * k, 1, 0.45, 0.05, 16)
    w1 = tel.worker("w1")
    assert w1.step_s == pytest.approx(0.5) and w1.steps_per_s == pytest.approx(2.0)
    assert math.isnan(tel.worker("w3").step_s) and tel.worker("w3").steps_per_s == 0.0
    job = tel.job()
    assert job["world_size"] == 2 and job["generation"] == 1
    assert job["samples_per_s"] == pytest.approx(32.0 + 160.0)  # w2's window ends at 110
    # throughput: samples of the beats in (since, until] over the interval
    assert tel.throughput(100.0, 110.0) == pytest.approx(2 * 20 * 80 / 10.0)
    assert tel.throughput(110.0, 114.0) == pytest.approx(8 * 16 / 4.0)
    with pytest.raises(ValueError):
        tel.throughput(200.0, 210.0)
    with pytest.raises(ValueError):
        tel.throughput(110.0, 110.0)
    # counters and stalls
    assert tel.counters() == {k: 0 for k in COUNTER_KINDS}
    tel.count("straggler")
    tel.count("migration", 2)
    with pytest.raises(ValueError):
        tel.count("failure", -1)
    assert tel.counters()["straggler"] == 1 and tel.counters()["migration"] == 2
    tel.on_generation(_gen(1, "start", 0.0))
    tel.on_generation(_gen(2, "scale_out", 0.15))
    assert tel.stalls() == [(2, "scale_out", 0.15)]
    assert tel.job()["last_stall_s"] == 0.15 and tel.job()["changes"] == 1
    tel.forget("w3")
    assert tel.worker("w3") is None and len(tel.workers()) == 2
    # an old sender's beat (no telemetry fields) and garbage are harmless
    tel.observe("w1", 1, 115.0, 0, float("nan"), -1.0, 0)
    assert tel.worker("w1").steps == 108


# ---- a real job: /metrics, status, top ------------------------------------------------------

def _scrape(url: str) -> dict:
    """{(sample name, frozenset(labels)): value} of a /metrics page, parsed by prometheus-client."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families
    text = requests.get(url, timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _per_worker(samples: dict, name: str) -> dict:
    return {dict(labels)["worker"]: (dict(labels), v) for (n, labels), v in samples.items()
            if n == name}


def _read_pty(fd: int, until, timeout_s: float) -> str:
    """Read a pseudo-terminal until ``until(text)`` holds or ``timeout_s`` passes."""
    import os
    import select
    import time
    text, deadline = "", time.monotonic() + timeout_s
    while not until(text) and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            text += chunk.decode(errors="replace")
    return text


def test_metrics_status_and_top_of_a_running_elastic_job(tmp_path, job_factory):
    import fcntl
    import os
    import pty
    import re
    import struct
    import termios
    import signal
    import subprocess
    import time
    from conftest import VENV_BIN, long_digits
    ctl = str(VENV_BIN / "hvd-edl-ctl")
    job_file = tmp_path / "job.json"
    job = job_factory(["-np", "2", "--min-np", "1", "--max-np", "2", "--metrics-port", "0",
                       "--job-file", str(job_file)], long_digits(tmp_path), hosts="localhost:2")
    url = job.wait_for("the metrics URL", lambda: next(iter(re.findall(
        r"hvd-edl-run: metrics: (http://\S+/metrics)", job.output())), None), 60)
    job.wait_generation(1)

    def both_timed():
        s = _scrape(url)
        return s if len(_per_worker(s, "hvd_edl_worker_compute_seconds")) == 2 else None

    m = job.wait_for("both workers' step times in /metrics", both_timed, 60)
    assert m[("hvd_edl_world_size", frozenset())] == 2
    assert m[("hvd_edl_target_world_size", frozenset())] == 2
    assert m[("hvd_edl_generation", frozenset())] == 1
    assert m[("hvd_edl_stall_seconds_count", frozenset())] == 0  # no change yet
    assert m[("hvd_edl_failures_total", frozenset())] == 0
    assert m[("hvd_edl_samples_per_second", frozenset())] > 0
    step = _per_worker(m, "hvd_edl_worker_step_seconds")
    compute = _per_worker(m, "hvd_edl_worker_compute_seconds")
    wait = _per_worker(m, "hvd_edl_worker_wait_seconds")
    for w, rank in (("w1", "0"), ("w2", "1")):
        labels, step_s = step[w]
        assert labels == {"worker": w, "host": "localhost", "rank": rank}
        # a digits step with --step-delay 0.01 on loaded cores: above 10 ms, well below 2 s
        assert 0.01 < step_s < 2.0, step_s
        assert compute[w][1] > 0 and wait[w][1] > 0  # two ranks: each waits in the allreduce
        assert compute[w][1] + wait[w][1] == pytest.approx(step_s, rel=1e-6)
        assert _per_worker(m, "hvd_edl_worker_samples_per_second")[w][1] > 0

    status = subprocess.run([ctl, "--job", str(job_file), "status"], capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert re.search(r"telemetry:  [0-9.]+ steps/s, [0-9.]+ samples/s", status.stdout)
    assert re.search(r"w1 +rank 0 +localhost:0 +member +[0-9.]+ = +[0-9.]+ \+ +[0-9.]+",
                     status.stdout), status.stdout

    # top on a terminal: it redraws with new step counts; Ctrl-C ends it with status 0
    pid, fd = pty.fork()
    if pid == 0:  # the child: hvd-edl-ctl top on the pseudo-terminal
        # as a shell starts it: Ctrl-C's default disposition (code run earlier in this pytest
        # worker can leave SIGINT ignored; exec passes that on and Python then installs no
        # Ctrl-C handler: top never ended in full make test runs)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execv(ctl, [ctl, "--job", str(job_file), "top", "--interval", "0.5"])
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    frame = re.compile(r"generation 1, world size 2 \(target 2\), step (\d+)")
    done = (0, 0)
    try:
        text = _read_pty(fd, lambda t: len(set(frame.findall(t))) >= 2, 30)
        assert len(set(frame.findall(text))) >= 2, text[-2000:]
        assert "comp ms" in text and "\x1b[" in text  # the live (terminal) view
        os.kill(pid, signal.SIGINT)
        _read_pty(fd, lambda t: False, 5)  # drain until the child closes the terminal
        deadline = time.monotonic() + 10
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        if done[0] != pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)

    # piped: one plain frame per interval, and a last line when the job ends; the job ends
    # only once top has shown its first frame (under load top's start can outlast the job's
    # last epoch, and a top that first asks an ended job exits 3, as it should)
    top_out = tmp_path / "top.out"
    with open(top_out, "w") as sink:
        piped = subprocess.Popen([ctl, "--job", str(job_file), "top", "--interval", "0.5"],
                                 stdout=sink, stderr=subprocess.STDOUT, text=True)
    try:
        job.wait_for("piped top's first frame", lambda: "worker  rank  host:slot" in
                     top_out.read_text() or piped.poll() is not None, 60)
        job.end_training()
        assert job.finish() == 0, job.output()[-3000:]
        piped.wait(timeout=30)
    finally:
        if piped.poll() is None:
            piped.kill()
            piped.wait()
    out = top_out.read_text()
    assert piped.returncode == 0, out
    assert "\x1b[" not in out and "worker  rank  host:slot" in out
    assert out.rstrip().splitlines()[-1].startswith("hvd-edl-ctl: the job ended")


# ---- the metrics server under slow connections (issue 26, item 3) ----------------------------

def test_slow_connections_to_metrics_get_no_thread_each_and_a_scrape_still_answers(monkeypatch):
    """Before: prometheus-client's server started a thread per connection, never timed a request
    head out and had a backlog of 5 (275 slow connections: 285 launcher threads).  Now 275 slow
    connections (half silent, half half a head) from another process cost no thread, a scrape
    meanwhile answers at once with prometheus-client's exposition (text, OpenMetrics, gzip), and
    each slow one gets 408 at the head timeout."""
    import gzip
    import time
    import psutil
    import requests
    from prometheus_client import generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
    from launcher.observe import metrics
    from test_stream_security import Attacker
    monkeypatch.setattr(metrics, "HEADER_TIMEOUT_S", 1.0, raising=False)
    tel = Telemetry(window_s=2.0)
    tel.add_worker("w1", "hostA", 0)
    tel.on_members(1, ["w1"])
    tel.observe("w1", 1, 100.0, 5, 0.35, 0.15, 80)
    tel.on_generation(_gen(2, "scale_out", 0.15))
    server = metrics.MetricsServer(metrics.JobCollector(tel, lambda: 2), "127.0.0.1", 0)
    me = psutil.Process()
    try:
        url = server.url("127.0.0.1")
        assert requests.get(url, timeout=10).status_code == 200
        threads = me.num_threads()
        attackers = [Attacker(server.port, 138, limit_s=8),
                     Attacker(server.port, 137, b"GET /metrics HTTP/1.1\r\nHost: a", limit_s=8)]
        t0 = time.monotonic()
        plain = requests.get(url, timeout=10)
        open_metrics = requests.get(url, timeout=10,
                                    headers={"Accept": "application/openmetrics-text"})
        raw = requests.get(url, timeout=10, stream=True, headers={"Accept-Encoding": "gzip"})
        scrape_s = time.monotonic() - t0
        during = me.num_threads()
        results = [a.result() for a in attackers]
    finally:
        server.stop()
    assert during <= threads + 2, (threads, during)  # before: one more per connection
    assert scrape_s < 2.0, scrape_s
    assert plain.status_code == 200 and plain.content == generate_latest(server.registry)
    assert plain.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert open_metrics.content == openmetrics_latest(server.registry)
    assert open_metrics.headers["Content-Type"].startswith("application/openmetrics-text")
    assert raw.headers["Content-Encoding"] == "gzip"
    assert gzip.decompress(raw.raw.read()) == generate_latest(server.registry)
    closed = [s for r in results for s in r["closed_s"]]
    answers = {bytes.fromhex(g)[:12] for r in results for g in r["got"]}
    assert all(s is not None and s < 1.0 + 2.0 for s in closed), closed  # the head timeout
    assert answers == {b"HTTP/1.0 408"}, answers


def test_top_fits_80_columns_whole_host_slots_and_one_line_headers():
    """Issue 30: at 80 columns ``top`` cut host:slot to ``localh...`` and split a header over
    two lines.  Now the least useful columns go first and what is shown is whole."""
    import io
    from rich.console import Console
    from launcher.observe import top
    w = {"worker_id": "w10", "rank": 1, "host": "localhost", "slot": 11, "state": "member",
         "step": 123456, "step_s": 0.1234, "compute_s": 0.0567, "wait_s": 0.0667,
         "steps_per_s": 8.1, "samples_per_s": 12345.6}
    t = {"job": {"generation": 12, "world_size": 3, "target_world_size": 3, "step": 123456,
                 "steps_per_s": 8.1, "samples_per_s": 37036.8, "step_s": 0.1234,
                 "compute_s": 0.0567, "wait_s": 0.0667, "last_stall_s": 0.123},
         "counters": {"failure": 1, "straggler": 2}, "window_s": 5.0,
         "workers": [dict(w, worker_id=f"w{i}", slot=i) for i in (9, 10, 11)]}
    for width in (80, 120):
        out = io.StringIO()
        Console(file=out, width=width, no_color=True, force_terminal=False).print(
            top.render(t, width))
        lines = out.getvalue().splitlines()
        assert all(len(x.rstrip()) <= width for x in lines), lines
        header = next(x for x in lines if x.lstrip().startswith("worker"))
        assert header.split()[:3] == ["worker", "rank", "host:slot"], lines
        assert "comp ms" in header and "wait ms" in header and "samples/s" in header, lines
        assert "localhost:11" in out.getvalue() and "12345.6" in out.getvalue(), lines
        assert ("steps/s" in header.replace("samples/s", "")) == (width == 120), lines
