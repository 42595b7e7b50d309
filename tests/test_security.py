"""Hostile neighbours and load against a running job (issue 19), over loopback only: every test
names the hole it closes and says what happened before the change.

Most tests share one real ``hvd-edl-run`` job (module fixture ``job``: 2 workers of the digits
job, elastic up to 3) and check that what they did changed nothing (no new generation); the
in-process tests drive a :class:`CoordinatorServer` or :class:`GenerationRendezvous` directly
where a limit has to be lowered to be reached quickly.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time

import psutil
import pytest
import requests

from conftest import VENV_BIN, Job, long_digits
from hvd_edl import messages
from launcher.serve import coordinator_server
from launcher.job import rendezvous
from launcher.serve.coordinator_server import CoordinatorServer
from launcher.job.rendezvous import TOKEN_HEADER

CTL = str(VENV_BIN / "hvd-edl-ctl")


# ---- the shared job --------------------------------------------------------------------------

class RunningJob:
    def __init__(self, job: Job, job_file):
        self.job = job
        info = json.loads(job_file.read_text())
        self.job_file = job_file
        self.url, self.secret = info["url"], info["secret"]
        self.host, port = self.url[len("http://"):].rsplit(":", 1)
        self.port = int(port)
        self.proc = psutil.Process(job.proc.pid)

    def signed(self, path: str, body: bytes = b"{}", timeout_s: float = 30) -> requests.Response:
        return requests.post(self.url + path, data=body, timeout=timeout_s, headers={
            messages.AUTH_HEADER: messages.sign(self.secret, "POST", path, body)})

    def status(self) -> dict:
        r = self.signed("/ctl/status")
        assert r.status_code == 200, r.text
        return r.json()

    def generations(self) -> int:
        return len(self.job.events())

    def rendezvous_ports(self):
        return sorted(c.laddr.port for c in self.proc.net_connections("inet")
                      if c.status == psutil.CONN_LISTEN and c.laddr.port != self.port)

    def rss(self) -> int:
        return self.proc.memory_info().rss


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("security")
    job_file = tmp / "job.json"
    j = Job(tmp, ["-np", "2", "--min-np", "1", "--max-np", "3", "--target-np", "2",
                  "--discovery-interval", "0.2", "--job-file", str(job_file)],
            long_digits(tmp), hosts="localhost:3")
    try:
        j.wait_generation(1, timeout_s=120)
        j.wait_for("the job file", job_file.exists, 30)
        yield RunningJob(j, job_file)
        j.end_training()
        assert j.finish(240) == 0, j.output()[-3000:]
        assert not [e for e in j.events() if e["kind"] == "failure"], j.events()
    finally:
        j.stop()


def _raw(host: str, port: int, data: bytes, timeout_s: float = 10) -> bytes:
    """Send ``data`` on a fresh connection and return the first line of the answer."""
    with socket.create_connection((host, port), timeout=timeout_s) as c:
        try:
            c.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        while b"\r\n" not in answer:
            chunk = c.recv(4096)
            if not chunk:
                break
            answer += chunk
    return answer.split(b"\r\n")[0]


# ---- measured hole 2: the rendezvous -----------------------------------------------------------

def _plant(ports, stop: threading.Event, codes: list) -> None:
    keys = ["/global/0", "/global/1", "/global/2", "/global/rank_0", "/global/rank_2",
            "/local/0", "/cross0/0"]
    s = requests.Session()
    while not stop.is_set():
        for port in ports:
            for key in keys:
                try:
                    codes.append(s.put(f"http://127.0.0.1:{port}{key}", data=b"\x00garbage" * 8,
                                       timeout=2).status_code)
                except requests.RequestException:
                    pass


def test_rendezvous_keys_planted_during_a_scale_change_nothing_and_the_job_survives(job):
    """Before: planting garbage Gloo keys 6 ms after ``hvd-edl-ctl scale --np 3`` opened the next
    generation's rendezvous made all 3 workers abort (gloo::EnforceNotMet), STATE LOST, a slot
    retired.  Now every request without the generation's token gets 401 and stores nothing."""
    before = job.generations()
    # the current generation's and the spare (the next one's), which the launcher opens on a
    # thread of its own after a generation formed: under load it can come a while later
    ports = job.job.wait_for("the rendezvous and its spare listening", lambda: (
        lambda p: p if len(p) >= 2 else None)(job.rendezvous_ports()), 30)
    stop, codes = threading.Event(), []
    planters = [threading.Thread(target=_plant, args=(ports, stop, codes)) for _ in range(2)]
    for t in planters:
        t.start()
    try:
        r = subprocess.run([CTL, "--job", str(job.job_file), "scale", "--np", "3"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        ev = job.job.wait_generation(before + 1, timeout_s=120)
        # keep planting into the new ring's rendezvous while it trains (it forms meanwhile)
        new_ports = set(job.rendezvous_ports()) - set(ports)
        if new_ports:
            ports.extend(new_ports)
        planted = len(codes)
        job.job.wait_for("200 more plants into the training ring",
                         lambda: len(codes) > planted + 200, 60)
    finally:
        stop.set()
        for t in planters:
            t.join(10)
    assert codes and set(codes) <= {401, 403}, sorted(set(codes))
    assert ev["kind"] == "scale_out" and ev["world_size"] == 3, ev
    assert ev["rolled_back_steps"] == 0 and not ev.get("state_lost"), ev
    assert [e["kind"] for e in job.job.events()][before:] == ["scale_out"]
    r = subprocess.run([CTL, "--job", str(job.job_file), "scale", "--np", "2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert job.job.wait_generation(before + 2, timeout_s=120)["kind"] == "scale_in"


def test_rendezvous_without_the_token_reads_plants_and_deletes_nothing(rdv):
    """Before: any local process could GET, PUT and DELETE a generation's keys for its whole
    life.  Now: no token 401, a wrong one 403, and the store is unchanged."""
    port = rdv.open(1, ["localhost"])
    base, tok = f"http://127.0.0.1:{port}", {TOKEN_HEADER: rdv.token(1)}
    assert requests.put(base + "/global/0", data=b"real", headers=tok,
                        timeout=10).status_code == 200
    assert requests.get(base + "/global/0", timeout=10).status_code == 401
    assert requests.put(base + "/global/0", data=b"fake", timeout=10).status_code == 401
    assert requests.put(base + "/global/0", data=b"fake", timeout=10,
                        headers={TOKEN_HEADER: "0" * 64}).status_code == 403
    assert requests.delete(base + "/global/0", timeout=10).status_code == 401
    assert requests.get(base + "/global/0", headers=tok, timeout=10).content == b"real"
    rdv.open(2, ["localhost"])
    assert rdv.token(2) != rdv.token(1)  # a token per generation


def test_rendezvous_key_names_count_against_its_size_and_key_count_is_bounded(rdv, monkeypatch):
    """Before: only values counted against MAX_STORE_BYTES, so empty values under long key names
    grew the store without bound (and the key count had no bound at all)."""
    monkeypatch.setattr(rendezvous, "MAX_STORE_BYTES", 20_000)
    port = rdv.open(1, ["localhost"])
    s, tok = requests.Session(), {TOKEN_HEADER: rdv.token(1)}
    codes = [s.put(f"http://127.0.0.1:{port}/global/{i:0500d}", data=b"", headers=tok,
                   timeout=10).status_code for i in range(60)]
    assert codes[:30] == [200] * 30 and codes[-1] == 413, codes      # ~564 bytes a key

    monkeypatch.setattr(rendezvous, "MAX_STORE_BYTES", 64 << 20)
    monkeypatch.setattr(rendezvous, "MAX_KEYS", 50)
    port = rdv.open(2, ["localhost"])
    tok = {TOKEN_HEADER: rdv.token(2)}
    codes = [s.put(f"http://127.0.0.1:{port}/global/k{i}", data=b"x", headers=tok,
                   timeout=10).status_code for i in range(60)]
    assert codes == [200] * 50 + [413] * 10, codes
    assert s.put(f"http://127.0.0.1:{port}/global/k0", data=b"y", headers=tok,
                 timeout=10).status_code == 200  # replacing a key adds none


# ---- measured hole 3: memory before authentication -------------------------------------------

def _flood_headers(host, port, n_bytes, answers):
    try:
        with socket.create_connection((host, port), timeout=20) as c:
            c.sendall(b"POST /register HTTP/1.1\r\n")
            # 64 kB lines, 100 of them: the most http.server accepted
            line = b"X-Pad: " + b"a" * 64000 + b"\r\n"
            sent = 0
            try:
                while sent < n_bytes:
                    c.sendall(line)
                    sent += len(line)
            except OSError:
                pass  # the server answered and closed
            answers.append(c.recv(64).split(b"\r\n")[0])
    except OSError as e:
        answers.append(repr(e).encode())


def test_oversized_headers_get_431_and_launcher_memory_stays_near_its_baseline(job):
    """Before: 40 connections sending 6.4 MB of headers each took the launcher from 440 MB to
    1,356 MB (about 23 MB each, never given back).  Now a head over 16 KiB gets 431 and the
    launcher's memory stays within a few MB of its baseline."""
    before, baseline = job.generations(), job.rss()
    answers, peak = [], baseline
    floods = [threading.Thread(target=_flood_headers, args=(job.host, job.port, 6_400_000, answers))
              for _ in range(40)]
    for t in floods:
        t.start()
    while any(t.is_alive() for t in floods):
        peak = max(peak, job.rss())
        time.sleep(0.02)
    after = job.rss()
    assert len(answers) == 40
    assert sum(a.startswith(b"HTTP/1.1 431") for a in answers) >= 36, answers  # RST may win a few
    assert peak - baseline < 60 << 20, (baseline, peak)
    assert after - baseline < 20 << 20, (baseline, after)
    assert job.status()["generation"] == before and job.generations() == before


# ---- measured hole 4: connections --------------------------------------------------------------

def test_a_thousand_idle_connections_leave_signed_requests_answered_and_no_thread_each(job):
    """Before: 1,441 idle connections (a thread each) under a 1,024-descriptor limit made
    ``accept()`` spin and ``hvd-edl-ctl`` fail (exit 3); the backlog was 5.  Now idle connections
    cost no thread, signed requests are answered meanwhile, and the backlog is 1024."""
    before, threads = job.generations(), job.proc.num_threads()
    conns = []
    try:
        for i in range(1000):
            c = socket.create_connection((job.host, job.port), timeout=10)
            if i % 2:
                c.sendall(b"POST /ctl/status HTTP/1.1\r\nContent-Le")  # half a head
            conns.append(c)
        t0 = time.monotonic()
        assert job.status()["generation"] == before
        assert time.monotonic() - t0 < 2.0
        assert job.proc.num_threads() < threads + 10, (threads, job.proc.num_threads())
        r = subprocess.run([CTL, "--job", str(job.job_file), "status"], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    finally:
        for c in conns:
            c.close()
    listen = subprocess.run(["ss", "-Hltn", f"sport = :{job.port}"], capture_output=True,
                            text=True, timeout=10).stdout.split()
    if listen:  # LISTEN Recv-Q Send-Q(backlog) ...
        assert int(listen[2]) >= 1024, listen
    assert job.generations() == before


def test_connections_past_the_cap_get_a_fast_503_and_the_idle_ones_408(monkeypatch):
    """Before: no cap (a thread per connection until descriptors ran out) and an idle
    connection kept its thread for 120 s.  Now past the cap a new connection gets 503 at once,
    and one that does not send its head within the header timeout gets 408."""
    monkeypatch.setattr(coordinator_server, "HEADER_TIMEOUT_S", 1.0)
    server = CoordinatorServer(object(), messages.new_secret(), "127.0.0.1", max_connections=20)
    port = server.start()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
    try:
        deadline = time.monotonic() + 10
        while server.http.connections < 20 and time.monotonic() < deadline:
            time.sleep(0.01)  # until the server holds all 20
        t0 = time.monotonic()
        assert _raw("127.0.0.1", port, b"POST /ctl/status HTTP/1.1\r\n\r\n") \
            == b"HTTP/1.1 503 Service Unavailable"
        assert time.monotonic() - t0 < 0.5
        t0 = time.monotonic()
        assert idle[0].recv(64).startswith(b"HTTP/1.1 408")
        assert time.monotonic() - t0 < 2.0
    finally:
        for c in idle:
            c.close()
        server.stop()


# ---- smaller holes -----------------------------------------------------------------------------

def test_malformed_timestamps_answer_403_not_a_dropped_connection(job):
    """Before: a timestamp that ``str.isdigit`` accepts but ``int`` does not ('²') or a
    non-ASCII HMAC made the signature check raise: the connection dropped without an answer."""
    good = messages.sign(job.secret, "POST", "/ctl/status", b"{}").split(":")
    for stamp, mac in [("\u00b2\u00b3", good[3]), ("9" * 5000, good[3]), (good[1], "\u00e9" * 64),
                       ("-1", good[3]), (good[1], good[3].upper())]:
        header = ":".join(["v1", stamp, good[2], mac])
        r = _raw(job.host, job.port, (f"POST /ctl/status HTTP/1.1\r\nContent-Length: 2\r\n"
                                      f"{messages.AUTH_HEADER}: {header}\r\n\r\n{{}}").encode())
        assert r == b"HTTP/1.1 403 Forbidden", (stamp[:8], mac[:8], r)


def test_unsigned_expect_100_continue_gets_401_without_continue(job):
    """Before: ``http.server`` answered ``100 Continue`` to anyone, inviting the body."""
    r = _raw(job.host, job.port, b"POST /ctl/scale HTTP/1.1\r\nContent-Length: 900000\r\n"
                                 b"Expect: 100-continue\r\n\r\n")
    assert r == b"HTTP/1.1 401 Unauthorized", r


def test_signed_deep_json_and_wrong_typed_fields_answer_400(job):
    """Before: a signed body of 50k nested lists (RecursionError) or a field of the wrong type
    (a TypeError deep in the coordinator) dropped the connection instead of answering 400."""
    before = job.generations()
    for path, body in [("/ctl/status", b"[" * 50_000), ("/register", b"[" * 50_000),
                       ("/ctl/scale", b'{"np": "3"}'), ("/ctl/drain", b'{"host": ["x"]}'),
                       ("/switch", b'{"worker_id": "w1", "generation": "1", "reason": "x"}'),
                       ("/watch", b'{"worker_id": ["w1"], "generation": 1}'),
                       ("/started", b'{"worker_id": "w1", "generation": 1, "stall_s": 0, '
                                    b'"step": 0, "phases": {"a": "b"}}')]:
        r = job.signed(path, body)
        assert r.status_code == 400, (path, r.status_code, r.text)
    assert job.generations() == before and job.status()["generation"] == before


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv to run a client as another user (nobody)")
def test_other_users_processes_are_refused_by_the_control_api_and_the_rendezvous(job):
    """Before: any local user could reach both servers (with the secret, take the job over).  Now
    a peer on this machine owned by another user gets 403, even with a valid signature."""
    header = messages.sign(job.secret, "POST", "/ctl/status", b"{}")
    client = (
        "import socket, sys\n"
        "for port in map(int, sys.argv[1:]):\n"
        "    c = socket.create_connection(('127.0.0.1', port), timeout=10)\n"
        f"    c.sendall(b'POST /ctl/status HTTP/1.1\\r\\nContent-Length: 2\\r\\n"
        f"{messages.AUTH_HEADER}: {header}\\r\\n\\r\\n{{}}')\n"
        "    print(c.recv(64).split(b'\\r\\n')[0].decode())\n")
    ports = [job.port] + job.rendezvous_ports()
    r = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                        "/usr/bin/python3", "-c", client, *map(str, ports)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:len(ports)] == ["HTTP/1.1 403 Forbidden",
                                                 *["HTTP/1.0 403 Forbidden"] * (len(ports) - 1)]
    assert job.signed("/ctl/status", b"{}").status_code == 200   # this user: answered


def test_local_workers_get_the_secret_in_their_environment_not_their_argv(job):
    """Guards what exists: no process of the job (launcher, workers) shows the secret in its
    command line, which every local user can read (``ps -eo args``)."""
    procs = [job.proc] + job.proc.children(recursive=True)
    assert len(procs) >= 3
    for p in procs:
        try:
            assert job.secret not in " ".join(p.cmdline()), p
        except psutil.NoSuchProcess:
            continue
    worker = next(p for p in job.proc.children() if "HVD_EDL_WORKER_ID" in p.environ())
    assert worker.environ()[messages.ENV_SECRET] == job.secret
