"""The CPU of one heartbeat (``POST /beat``), on the worker and on the launcher (issue 38).

A worker beats every ``messages.BEAT_S`` (0.3 s) for its whole life; every test job's workers
and its launcher pay it.  One process: a real ``Coordinator`` (a ring of two members) behind its
real ``CoordinatorServer`` on loopback, and a client thread beating as ``hvd_edl.heartbeat``
does (signed ``messages.Beat``, a ``BeatReply`` decoded).  Per beat: the client thread's CPU
(``time.thread_time``) and the server's event-loop thread's CPU (``/proc/self/task/TID/stat``,
1/100 s ticks over the whole round).  Clients compared side by side, rounds alternating (the
machine may be loaded by others): ``requests`` (a ``Session`` per thread, the worker's client
before) and ``hvd_edl.client.CoordinatorClient`` (``http.client`` on a kept-alive connection).

Usage::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/job/beat_cost.py [--beats 2000] [--rounds 3]

Prints a table and writes ``benchmarks/results/beat_cost.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hvd_edl import messages  # noqa: E402
from hvd_edl.client import CoordinatorClient  # noqa: E402
from benchmarks.common.formed_ring import ring_of_two  # noqa: E402
from launcher.serve.coordinator_server import CoordinatorServer  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "beat_cost.json"
HZ = os.sysconf("SC_CLK_TCK")


class RequestsClient:
    """The worker's client before: ``requests``, one ``Session`` per thread (its ``post`` as it
    was, less the retries, which a beat never used: ``retry_s`` 0)."""

    def __init__(self, addr: str, port: int, secret: str):
        import requests
        self.base = f"http://{addr}:{port}"
        self.secret = secret
        self.session = requests.Session()

    def post(self, path, msg, reply_cls, timeout_s=60.0):
        body = messages.encode(msg)
        headers = {messages.AUTH_HEADER: messages.sign(self.secret, "POST", path, body),
                   "Content-Type": "application/json"}
        r = self.session.post(self.base + path, data=body, headers=headers, timeout=timeout_s)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code} {r.text}")
        return messages.decode(reply_cls, r.content)


def _thread_cpu_s(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / HZ


def _round(client, beats: int, server_tid: int) -> dict:
    """``beats`` beats of w1 back to back: CPU per beat of the client thread and the server's
    loop thread (milliseconds)."""
    out = {}

    def run():
        client.post("/beat", messages.Beat("w1", 1, 0), messages.BeatReply, timeout_s=1.2)  # connect
        s0, c0, t0 = _thread_cpu_s(server_tid), time.thread_time(), time.monotonic()
        for i in range(beats):
            reply = client.post("/beat", messages.Beat("w1", 1, i, 1, 0.01, 0.001, 16),
                                messages.BeatReply, timeout_s=1.2)
            assert not reply.fenced
        out.update(client_ms=(time.thread_time() - c0) * 1e3 / beats,
                   server_ms=(_thread_cpu_s(server_tid) - s0) * 1e3 / beats,
                   wall_ms=(time.monotonic() - t0) * 1e3 / beats)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--beats", type=int, default=2000, help="beats per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per client (alternating)")
    args = p.parse_args()
    coord = ring_of_two(max_np=2, elastic_run=True)
    secret = messages.new_secret()
    server = CoordinatorServer(coord, secret, "127.0.0.1")
    port = server.start()
    server_tid = server.serving.thread.native_id
    clients = {"requests": lambda: RequestsClient("127.0.0.1", port, secret),
               "http.client": lambda: CoordinatorClient("127.0.0.1", port, secret, retry_s=0.0)}
    rows = {name: [] for name in clients}
    try:
        for r in range(args.rounds):
            for name, make in clients.items():
                rows[name].append(_round(make(), args.beats, server_tid))
    finally:
        server.stop()
    print(f"{'client':12s} {'worker ms/beat':>15s} {'launcher ms/beat':>17s} {'wall ms/beat':>13s}")
    summary = {}
    for name, rs in rows.items():
        for r in rs:
            print(f"{name:12s} {r['client_ms']:15.3f} {r['server_ms']:17.3f} {r['wall_ms']:13.3f}")
        summary[name] = {k: min(r[k] for r in rs) for k in rs[0]}
    print("best of each:", json.dumps(summary))
    RESULTS.write_text(json.dumps({
        "what": "CPU per heartbeat (ms), one process, loopback, rounds alternating",
        "command": "PYTHONPATH=$PWD .venv/bin/python benchmarks/job/beat_cost.py "
                   f"--beats {args.beats} --rounds {args.rounds}",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_at_end": os.getloadavg()},
        "rounds": rows, "best": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
