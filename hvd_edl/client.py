"""HTTP client a worker uses to talk to the launcher's coordinator (JSON, HMAC-signed).

Standard library only (``http.client`` on a kept-alive connection per thread): a worker beats
every ``messages.BEAT_S`` seconds for its whole life, and ``requests`` spent about 5x the CPU
of a bare ``http.client`` call per beat (session merge, proxy and ``netrc`` look-ups in the
environment, urllib3's pool, hooks; ``benchmarks/job/beat_cost.py``).  The coordinator is
reached directly, never through an ``http_proxy`` of the environment.
"""
from __future__ import annotations

import http.client
import logging
import select
import socket
import threading
import time
from typing import Optional, Type, TypeVar

from hvd_edl import messages

log = logging.getLogger(__name__)
T = TypeVar("T")
RETRY_PAUSE_S = 0.2  # between two attempts of a request that got no answer (seconds)


class CoordinatorUnreachable(RuntimeError):
    """The coordinator did not answer within the retry budget (the launcher is gone)."""


class CoordinatorClient:
    """Signed JSON requests to ``http://addr:port``.

    One kept-alive connection per thread, so the watcher thread and the training thread never
    share one.  A connection the server closed while it was idle is noticed before it is reused
    (one ``poll`` of the socket, as urllib3 does) and replaced.  Transient connection errors are
    retried for ``retry_s`` seconds, then :class:`CoordinatorUnreachable` is raised; so is a 503
    (the coordinator at its connection cap, e.g. while someone floods it), which is retried on a
    fresh connection.

    Args:
        addr: the coordinator's address (IPv4, IPv6 or a host name).
        port: its TCP port.
        secret: the job's secret (``messages.sign``).
        retry_s: seconds of retries before giving up (0: one attempt).
    """

    def __init__(self, addr: str, port: int, secret: str, retry_s: float = 30.0):
        self.addr = addr
        self.base = f"http://{addr}:{port}"
        self.port = int(port)
        self.secret = secret
        self.retry_s = retry_s
        self._local = threading.local()

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        """This thread's connection, with ``timeout_s`` as its socket timeout; a new one when
        there is none or the server closed it (readable while idle: EOF, or a stray answer)."""
        conn: Optional[http.client.HTTPConnection] = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is not None and _dropped(conn.sock):
            conn.close()
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self.addr, self.port,
                                                                 timeout=timeout_s)
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        return conn

    def close(self) -> None:
        """Close this thread's connection (the next request opens a new one)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def post(self, path: str, msg, reply_cls: Type[T], timeout_s: float = 60.0) -> T:
        """POST ``msg`` to ``path`` and decode the answer as ``reply_cls``; ``timeout_s``
        bounds the connection and each wait for the answer's bytes (seconds).

        Raises:
            CoordinatorUnreachable: no answer within ``retry_s`` seconds of retries.
            RuntimeError: the coordinator refused the request (HTTP 4xx/5xx).
        """
        body = messages.encode(msg)
        deadline = time.monotonic() + self.retry_s
        while True:
            # signed per attempt: the coordinator accepts each signature once (replay guard)
            headers = {messages.AUTH_HEADER: messages.sign(self.secret, "POST", path, body),
                       "Content-Type": "application/json"}
            try:
                conn = self._connection(timeout_s)
                conn.request("POST", path, body, headers)
                r = conn.getresponse()
                content = r.read()
                status = r.status
            except (OSError, http.client.HTTPException) as e:
                self.close()  # half-used: never reused
                if time.monotonic() > deadline:
                    raise CoordinatorUnreachable(f"{self.base}{path}: {e!r}") from None
                time.sleep(RETRY_PAUSE_S)
                continue
            if r.will_close:
                self.close()
            if status == 503 and time.monotonic() <= deadline:
                log.debug("coordinator busy (503) on %s: retrying", path)
                self.close()  # the server closed this connection
                time.sleep(RETRY_PAUSE_S)
                continue
            if status != 200:
                raise RuntimeError(f"coordinator refused {path}: HTTP {status} "
                                   f"{content.decode('utf-8', 'replace')}")
            return messages.decode(reply_cls, content)


def _dropped(sock: socket.socket) -> bool:
    """Whether an idle kept-alive socket can no longer carry a request: readable (the server's
    EOF or reset; it never speaks first) or in error."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True
