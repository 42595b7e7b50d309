"""HTTP client a worker uses to talk to the launcher's coordinator (JSON, HMAC-signed)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Type, TypeVar

import requests

from hvd_edl import messages

log = logging.getLogger(__name__)
T = TypeVar("T")


class CoordinatorUnreachable(RuntimeError):
    """The coordinator did not answer within the retry budget (the launcher is gone)."""


class CoordinatorClient:
    """Signed JSON requests to ``http://addr:port``.

    One ``requests.Session`` per thread (keep-alive), so the watcher thread and the training thread
    never share a connection.  Transient connection errors are retried for ``retry_s`` seconds,
    then :class:`CoordinatorUnreachable` is raised; so is a 503 (the coordinator at its connection
    cap, e.g. while someone floods it), which is retried on a fresh connection.
    """

    def __init__(self, addr: str, port: int, secret: str, retry_s: float = 30.0):
        self.addr = addr
        self.base = f"http://{addr}:{port}"
        self.port = int(port)
        self.secret = secret
        self.retry_s = retry_s
        self._local = threading.local()

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
        return s

    def post(self, path: str, msg, reply_cls: Type[T], timeout_s: float = 60.0) -> T:
        """POST ``msg`` to ``path`` and decode the answer as ``reply_cls``.

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
                r = self._session().post(self.base + path, data=body, headers=headers,
                                         timeout=timeout_s)
            except requests.RequestException as e:
                if time.monotonic() > deadline:
                    raise CoordinatorUnreachable(f"{self.base}{path}: {e}") from None
                time.sleep(0.2)
                continue
            if r.status_code == 503 and time.monotonic() <= deadline:
                log.debug("coordinator busy (503) on %s: retrying", path)
                self._local.session = None  # the server closed this connection
                time.sleep(0.2)
                continue
            if r.status_code != 200:
                raise RuntimeError(f"coordinator refused {path}: HTTP {r.status_code} {r.text}")
            return messages.decode(reply_cls, r.content)
