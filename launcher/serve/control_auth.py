"""Authentication and size limits for the launcher's HTTP servers (coordinator and control API).

Every request must carry :data:`hvd_edl.messages.AUTH_HEADER` as :func:`hvd_edl.messages.sign`
makes it: an HMAC-SHA256 under the per-job secret over the method, path, a wall-clock timestamp,
a random nonce and the body.  The server

* refuses a body over ``messages.MAX_BODY_BYTES`` with 413 *before reading it*, and a body without
  a ``Content-Length`` (chunked) with 411;
* refuses a request without the header with 401 (also before reading its body, and without the
  ``100 Continue`` an ``Expect: 100-continue`` asks for), and one whose header is malformed
  (a timestamp that is not ASCII digits included), whose HMAC is wrong, whose timestamp is more
  than ``messages.AUTH_WINDOW_S`` seconds off, or whose nonce it has seen before, with 403;
* parses the body (JSON, never pickle) only after all of that passed; a body too deeply nested
  or with a field of the wrong type answers 400.

Before any of this, :mod:`launcher.serve.bounded_http` bounds what an unauthenticated client can hold
(connections, header bytes and lines, time to send them, unauthenticated body bytes) and refuses
local peers of another user.

Refusals change nothing in the job; they are logged at most once every ``LOG_EVERY_S`` seconds
with a count, so a flood cannot fill the launcher's output.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Dict, Optional

from hvd_edl import messages

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
MAX_NONCES = 200_000   # authentic requests remembered for replay checks (about 20 MB at most)


class Refused(Exception):
    """A request the server refuses: ``status`` is the HTTP code, ``reason`` one line."""

    def __init__(self, status: int, reason: str):
        super().__init__(f"{status} {reason}")
        self.status = status
        self.reason = reason


class RequestAuthenticator:
    """Checks signed requests for one job and remembers their nonces (replay guard).

    Args:
        secret: the per-job secret (:func:`hvd_edl.messages.new_secret`).
        window_s: how far (seconds, wall clock) a signature's timestamp may be from now; also how
            long a nonce is remembered.
    """

    def __init__(self, secret: str, window_s: float = messages.AUTH_WINDOW_S):
        self.secret = secret
        self.window_s = window_s
        self._nonces: Dict[str, float] = {}   # nonce -> time.monotonic() when it may be forgotten
        self._lock = threading.Lock()
        self._refused = 0
        self._last_log = float("-inf")

    def check(self, method: str, path: str, body: bytes, header: Optional[str]) -> None:
        """Accept the request once.

        Raises:
            Refused: 401 without a signature; 403 for a wrong, expired or replayed one.
        """
        if not header:
            raise Refused(401, "missing signature header " + messages.AUTH_HEADER)
        nonce = messages.verify(self.secret, method, path, body, header, window_s=self.window_s)
        if nonce is None:
            raise Refused(403, "bad or expired signature")
        now = time.monotonic()
        # remembered while its timestamp is inside the window (later, verify refuses it
        # anyway): about window_s, not 2 x window_s, so a job answering 1,000 requests per
        # second (1,024 workers) stays under MAX_NONCES (benchmarks/job/control_plane.py)
        stamp_s = int(header.split(":")[1]) / 1000.0
        forget_at = now + max(0.0, stamp_s + self.window_s - time.time()) + 1.0
        with self._lock:
            if nonce in self._nonces:
                raise Refused(403, "replayed request")
            if len(self._nonces) >= MAX_NONCES:
                self._nonces = {n: t for n, t in self._nonces.items() if t > now}
                if len(self._nonces) >= MAX_NONCES:
                    raise Refused(403, "too many requests in the replay window")
            self._nonces[nonce] = forget_at

    def note_refusal(self, server: str, client: str, refusal: Refused) -> None:
        """Log a refusal (rate-limited: one line per ``LOG_EVERY_S`` seconds with a count)."""
        now = time.monotonic()
        with self._lock:
            self._refused += 1
            if now - self._last_log < LOG_EVERY_S:
                return
            self._last_log = now
            count = self._refused
        log.warning("%s refused a request from %s: %s (%d refused so far)",
                    server, client, refusal, count)


class CallRefused(Exception):
    """A signed call got an answer that is not 200 with a JSON object: ``str()`` is the server's
    ``error`` line (else ``HTTP <status>``), ``status`` its HTTP status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def post_signed(url: str, path: str, secret: str, args: dict, timeout_s: float) -> dict:
    """POST ``args`` as JSON to ``url + path``, signed with ``secret`` (:func:`hvd_edl.messages.
    sign`, what :class:`RequestAuthenticator` checks), and return the JSON object answered: the
    client side of the control API.  ``url``: ``http://HOST:PORT`` (no proxy is asked: the job
    is reached directly, as its workers reach it).  Through the standard library's
    ``http.client``: ``hvd-edl-ctl`` is one short process per call, and ``requests`` took 120 ms
    of its CPU to import.

    Raises:
        TimeoutError: no connection or no answer within ``timeout_s`` seconds (each).
        ConnectionError: the connection was refused or broken.
        OSError, http.client.HTTPException: no connection for another reason, or a broken answer.
        CallRefused: the answer was an error or not a JSON object.
    """
    import http.client
    from urllib.parse import urlsplit
    body = json.dumps(args).encode()
    headers = {messages.AUTH_HEADER: messages.sign(secret, "POST", path, body),
               "Content-Type": "application/json"}
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port or 80, timeout=timeout_s)
    try:
        conn.request("POST", where.path.rstrip("/") + path, body=body, headers=headers)
        r = conn.getresponse()
        status, answer = r.status, r.read()
    finally:
        conn.close()
    try:
        data = json.loads(answer)
    except ValueError:
        data = {}
    if status != 200 or not isinstance(data, dict):
        why = data.get("error") if isinstance(data, dict) else None
        raise CallRefused(why or f"HTTP {status}", status)
    return data
