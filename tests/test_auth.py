"""Every request to the launcher carries the job's secret: unsigned, forged, replayed, expired and
oversized requests are refused and the job does not notice; the Gloo rendezvous answers only
member hosts carrying the generation's token, and only while that generation lasts."""
import http.client
import json
import time

import psutil
import pytest
import requests

from conftest import digits, summary
from hvd_edl import messages
from launcher.job.rendezvous import TOKEN_HEADER, GenerationRendezvous


def _post(url, path, body=b"{}", header=None):
    headers = {messages.AUTH_HEADER: header} if header is not None else {}
    return requests.post(url + path, data=body, headers=headers, timeout=30)


def test_unsigned_forged_replayed_and_oversized_requests_are_refused_while_the_job_runs(
        tmp_path, job_factory):
    job_file = tmp_path / "job.json"
    job = job_factory(["-np", "2", "--min-np", "1", "--max-np", "2", "--discovery-interval", "0.2",
                       "--job-file", str(job_file)],
                      digits(tmp_path, "--epochs", "6", "--step-delay", "0.01"),
                      hosts="localhost:2")
    job.wait_generation(1)
    job.wait_for("the job file", job_file.exists, 30)
    job_info = json.loads(job_file.read_text())
    url, secret = job_info["url"], job_info["secret"]
    forged = messages.new_secret()
    switch = json.dumps({"worker_id": "w1", "generation": 1, "reason": "failure"}).encode()

    assert _post(url, "/switch", switch).status_code == 401                   # no secret
    assert _post(url, "/switch", switch,                                      # wrong secret
                 messages.sign(forged, "POST", "/switch", switch)).status_code == 403
    assert _post(url, "/ctl/scale", b'{"np": 1}',
                 messages.sign(forged, "POST", "/ctl/scale", b'{"np": 1}')).status_code == 403
    other_body = messages.sign(secret, "POST", "/ctl/status", b"{}")          # body swapped
    assert _post(url, "/ctl/scale", b'{"np": 1}', other_body).status_code == 403
    stale = messages.sign(secret, "POST", "/ctl/status", b"{}").split(":")    # 10 minutes old
    stale[1] = str(int(stale[1]) - 600_000)
    assert _post(url, "/ctl/status", b"{}", ":".join(stale)).status_code == 403
    once = messages.sign(secret, "POST", "/ctl/status", b"{}")
    assert _post(url, "/ctl/status", b"{}", once).status_code == 200          # the real thing
    assert _post(url, "/ctl/status", b"{}", once).status_code == 403          # ... replayed
    assert requests.get(url + "/ctl/status", timeout=30).status_code == 405

    host, port = url[len("http://"):].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)            # 2 MiB announced,
    conn.putrequest("POST", "/register")                                      # none of it read
    conn.putheader("Content-Length", str(2 * messages.MAX_BODY_BYTES))
    conn.endheaders()
    assert conn.getresponse().status == 413
    conn.close()

    # every server of the job listens on the chosen address only (127.0.0.1), none on 0.0.0.0
    listening = [c.laddr.ip for c in psutil.Process(job.proc.pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening and set(listening) == {"127.0.0.1"}, listening

    assert job.finish() == 0, job.output()[-3000:]
    assert [e["kind"] for e in job.events()] == ["start"]  # nothing the requests asked happened
    assert summary(tmp_path)["world_size"] == 2
    assert "coordinator refused a request from 127.0.0.1: 401" in job.output()


def test_sign_covers_method_path_and_body():
    s = messages.new_secret()
    h = messages.sign(s, "POST", "/ready", b'{"worker_id": "w1"}')
    assert messages.verify(s, "POST", "/ready", b'{"worker_id": "w1"}', h)
    assert not messages.verify(s, "PUT", "/ready", b'{"worker_id": "w1"}', h)
    assert not messages.verify(s, "POST", "/register", b'{"worker_id": "w1"}', h)
    assert not messages.verify(s, "POST", "/ready", b'{"worker_id": "w2"}', h)
    assert not messages.verify(s, "POST", "/ready", b'{"worker_id": "w1"}', h,
                               now=time.time() + 2 * messages.AUTH_WINDOW_S)
    assert not messages.verify(s, "POST", "/ready", b"", "garbage")


@pytest.fixture
def rendezvous():
    r = GenerationRendezvous("127.0.0.1")
    yield r
    r.close()


def test_rendezvous_answers_member_hosts_only_and_only_while_its_generation_forms(rendezvous):
    foreign = rendezvous.open(1, ["192.0.2.77"])  # TEST-NET address: no member runs here
    assert requests.get(f"http://127.0.0.1:{foreign}/global/rank_0", timeout=10).status_code == 403

    port = rendezvous.open(2, ["localhost"])
    base, tok = f"http://127.0.0.1:{port}", {TOKEN_HEADER: rendezvous.token(2)}
    assert requests.put(base + "/global/rank_0", data=b"addr", headers=tok,
                        timeout=10).status_code == 200
    assert requests.get(base + "/global/rank_0", headers=tok, timeout=10).content == b"addr"
    assert requests.head(base + "/setup.py", headers=tok, timeout=10).status_code == 405
    assert requests.get(base + "/a/b/c", headers=tok, timeout=10).status_code == 400
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest("PUT", "/global/big")
    conn.putheader("Content-Length", str(64 << 20))
    conn.putheader(TOKEN_HEADER, rendezvous.token(2))
    conn.endheaders()
    assert conn.getresponse().status == 413
    conn.close()

    rendezvous.open(3, ["localhost"])  # generation 2 is over: sealed
    assert requests.get(base + "/global/rank_0", headers=tok, timeout=10).status_code == 403
    assert requests.put(base + "/global/rank_1", data=b"x", headers=tok,
                        timeout=10).status_code == 403
    assert requests.delete(base + "/global/0", headers=tok,
                           timeout=10).status_code == 200  # Horovod's shutdown
