"""The worker's client of the coordinator (``hvd_edl/client.py``, ``http.client`` on a kept-alive
connection per thread) against the launcher's real ``CoordinatorServer`` and ``Coordinator``, in
one process: one connection carries a thread's requests, a connection the server closed while
idle is replaced before it is used (a heartbeat, one attempt, must not be lost to it), a 503 at
the connection cap is retried on a fresh connection, a refusal is one ``RuntimeError``, a gone
launcher ``CoordinatorUnreachable`` within the retry budget."""
import dataclasses
import threading
import time

import pytest

from hvd_edl import messages
from hvd_edl.client import CoordinatorClient, CoordinatorUnreachable
from launcher.serve.bounded_http import listen_socket
from launcher.serve.coordinator_server import CoordinatorServer

from benchmarks.common.formed_ring import ring_of_two

DEADLINE_S = 10.0


@pytest.fixture
def served():
    """A real coordinator (generation 1: w1, w2) behind its real server; (server, secret)."""
    coord = ring_of_two(max_np=2, elastic_run=True)
    secret = messages.new_secret()
    server = CoordinatorServer(coord, secret, "127.0.0.1")
    server.start()
    yield server, secret
    server.stop()


def _beat(client, step=0):
    return client.post("/beat", messages.Beat("w1", 1, step), messages.BeatReply, timeout_s=2.0)


def _until(condition, what):
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.01)


def test_one_kept_alive_connection_per_thread_carries_its_requests(served):
    server, secret = served
    client = CoordinatorClient("127.0.0.1", server.port, secret, retry_s=0.0)
    for step in range(20):
        assert not _beat(client, step).fenced
    assert server.http.connections == 1
    other = threading.Thread(target=_beat, args=(client,))
    other.start()
    other.join(DEADLINE_S)
    _until(lambda: server.http.connections == 1, "the other thread's connection closes")
    assert not _beat(client).fenced and server.http.connections == 1


def test_a_connection_the_server_closed_while_idle_is_replaced_before_a_beat_uses_it(served):
    server, secret = served
    server.http.limits = dataclasses.replace(server.http.limits, idle_timeout_s=0.2)
    client = CoordinatorClient("127.0.0.1", server.port, secret, retry_s=0.0)  # one attempt
    _beat(client)
    _until(lambda: server.http.connections == 0, "the server closes the idle connection")
    for step in range(3):  # would raise CoordinatorUnreachable on the dead connection
        assert not _beat(client, step).fenced


def test_a_refusal_raises_and_the_next_request_goes_through(served):
    server, secret = served
    client = CoordinatorClient("127.0.0.1", server.port, "0" * 64, retry_s=0.0)
    with pytest.raises(RuntimeError, match="HTTP 403"):
        _beat(client)  # signed with another secret
    client.secret = secret
    assert not _beat(client).fenced


def test_a_503_at_the_connection_cap_is_retried_until_a_connection_frees(served):
    server, secret = served
    server.http.limits = dataclasses.replace(server.http.limits, max_connections=1)
    holder = CoordinatorClient("127.0.0.1", server.port, secret, retry_s=0.0)
    _beat(holder)  # holds the only connection, kept alive
    answer = {}

    def beat_when_free():
        answer["reply"] = _beat(CoordinatorClient("127.0.0.1", server.port, secret, retry_s=5.0))

    t = threading.Thread(target=beat_when_free)
    t.start()
    _until(lambda: server.http.turned_away >= 1, "the second client is turned away")
    holder.close()  # the holder's connection closes: the retry gets through
    t.join(DEADLINE_S)
    assert not t.is_alive() and not answer["reply"].fenced


def test_no_coordinator_is_unreachable_after_the_retry_budget():
    sock = listen_socket("127.0.0.1", 0, 1)
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    client = CoordinatorClient("127.0.0.1", port, messages.new_secret(), retry_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(CoordinatorUnreachable):
        _beat(client)
    assert 0.5 <= time.monotonic() - t0 < 5.0
