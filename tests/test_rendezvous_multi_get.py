"""The rendezvous's ``POST /<scope>/multi_get`` (what our patch 0007 of Horovod's ``HTTPStore``
sends for Gloo's ``connectFullMesh``), against a real :class:`GenerationRendezvous` over HTTP:
values come back in order behind their lengths, a request for missing keys is held until their
PUTs and answered 404 when one never comes, and every bound and guard of a GET applies.
"""
from __future__ import annotations

import threading
import time

import requests

from launcher.job import rendezvous
from launcher.job.rendezvous import MULTI_GET_MAX_KEYS, TOKEN_HEADER


def _frames(body: bytes):
    """The values of a multi_get answer, in order (each behind a 4-byte big-endian length)."""
    out, at = [], 0
    while at < len(body):
        n = int.from_bytes(body[at:at + 4], "big")
        out.append(body[at + 4:at + 4 + n])
        at += 4 + n
    assert at == len(body), "the answer ends inside a value"
    return out


def _multi_get(port, token, keys, scope="global", timeout=10):
    return requests.post(f"http://127.0.0.1:{port}/{scope}/multi_get",
                         data="".join(k + "\n" for k in keys).encode(),
                         headers={TOKEN_HEADER: token}, timeout=timeout)


def test_multi_get_answers_every_value_in_the_order_asked(rdv, monkeypatch):
    port = rdv.open(1, ["localhost"])
    tok = rdv.token(1)
    values = {"0": b"\x00\xff" * 500, "1": b"", "rank_0": b"host-a", "2": bytes(range(256))}
    for k, v in values.items():
        assert requests.put(f"http://127.0.0.1:{port}/global/{k}", data=v,
                            headers={TOKEN_HEADER: tok}, timeout=10).status_code == 200
    order = ["2", "rank_0", "1", "0", "2"]
    r = _multi_get(port, tok, order)
    assert r.status_code == 200
    assert _frames(r.content) == [values[k] for k in order]
    monkeypatch.setattr(rendezvous, "HOLD_S", 0.2)
    assert _multi_get(port, tok, ["0"], scope="local-h").status_code == 404  # not its scope


def test_multi_get_is_held_until_the_last_key_is_put(rdv):
    port = rdv.open(1, ["localhost"])
    tok = rdv.token(1)
    store = rdv._servers[1]
    answer = {}

    def ask():
        answer["r"] = _multi_get(port, tok, ["0", "1", "2"])

    t = threading.Thread(target=ask)
    t.start()
    for k in ("1", "0", "2"):
        # wait (bounded) until the request is held on a key, then PUT the next one
        deadline = time.monotonic() + 10
        while not store.waiters and time.monotonic() < deadline:
            time.sleep(0.005)
        assert store.waiters, "the multi_get was not held"
        assert "r" not in answer
        assert requests.put(f"http://127.0.0.1:{port}/global/{k}", data=k.encode() * 3,
                            headers={TOKEN_HEADER: tok}, timeout=10).status_code == 200
    t.join(10)
    assert answer["r"].status_code == 200
    assert _frames(answer["r"].content) == [b"000", b"111", b"222"]
    assert not store.waiters  # nothing left behind


def test_multi_get_of_a_key_that_never_comes_is_404_after_the_hold(rdv, monkeypatch):
    monkeypatch.setattr(rendezvous, "HOLD_S", 0.3)
    port = rdv.open(1, ["localhost"])
    tok = rdv.token(1)
    requests.put(f"http://127.0.0.1:{port}/global/0", data=b"x", headers={TOKEN_HEADER: tok},
                 timeout=10)
    t0 = time.monotonic()
    r = _multi_get(port, tok, ["0", "7"])
    held = time.monotonic() - t0
    assert r.status_code == 404 and r.content == b""
    assert 0.25 < held < 5, held  # one hold in all, not one per key
    assert not rdv._servers[1].waiters


def test_multi_get_keeps_every_guard_of_a_get(rdv):
    port = rdv.open(1, ["localhost"])
    tok = rdv.token(1)
    base = f"http://127.0.0.1:{port}/global"
    requests.put(base + "/0", data=b"secret", headers={TOKEN_HEADER: tok}, timeout=10)
    assert requests.post(base + "/multi_get", data=b"0\n", timeout=10).status_code == 401
    assert requests.post(base + "/multi_get", data=b"0\n", timeout=10,
                         headers={TOKEN_HEADER: "0" * 64}).status_code == 403
    assert requests.post(base + "/0", data=b"0\n", headers={TOKEN_HEADER: tok},
                         timeout=10).status_code == 404          # POST only to multi_get
    assert _multi_get(port, tok, []).status_code == 400
    assert _multi_get(port, tok, ["0", ""]).status_code == 400   # an empty key
    assert _multi_get(port, tok, ["0\t1"]).status_code == 400    # not printable
    too_many = [str(i) for i in range(MULTI_GET_MAX_KEYS + 1)]
    assert _multi_get(port, tok, too_many).status_code == 400
    rdv.open(2, ["localhost"])  # generation 1 is sealed now
    assert _multi_get(port, tok, ["0"]).status_code == 403


def test_a_multi_get_answer_stops_near_its_byte_cap_and_the_rest_can_be_asked(rdv, monkeypatch):
    """At 1,024 ranks a key holds 139 kB: answers are cut after the value that reaches
    MULTI_GET_MAX_BYTES (at least one value each), and asking again for the rest gets it."""
    monkeypatch.setattr(rendezvous, "MULTI_GET_MAX_BYTES", 1000)
    port = rdv.open(1, ["localhost"])
    tok = rdv.token(1)
    for k in range(5):
        requests.put(f"http://127.0.0.1:{port}/global/{k}", data=bytes([k]) * 600,
                     headers={TOKEN_HEADER: tok}, timeout=10)
    keys, got = [str(k) for k in range(5)], []
    while len(got) < len(keys):
        r = _multi_get(port, tok, keys[len(got):])
        assert r.status_code == 200
        values = _frames(r.content)
        assert 1 <= len(values) <= 2  # 604 bytes each: the second reaches the cap
        got += values
    assert got == [bytes([k]) * 600 for k in range(5)]
    monkeypatch.setattr(rendezvous, "MULTI_GET_MAX_BYTES", 100)
    assert len(_frames(_multi_get(port, tok, keys).content)) == 1  # one value past the cap
