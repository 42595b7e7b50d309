"""The cluster service's HTTP API, on the bounded server of :mod:`launcher.serve.bounded_http`
with the control API's checks (:mod:`launcher.serve.coordinator_server`'s order): POST only, a
bounded ``Content-Length``, a signature header (401 without), a valid, fresh, unseen signature
under the per-cluster secret (403 otherwise, :class:`launcher.serve.control_auth.
RequestAuthenticator`), and only then the JSON body.  Local peers of another user are refused
before anything.  Every answer is a JSON object; a refused request answers ``{"error": "..."}``
and changes nothing.

====================  =====================================  ==================================
path                  body                                   answer
====================  =====================================  ==================================
``/cluster/submit``   ``{"argv", "cwd", "env", "name", "np",  ``{"id", "state"}``
                      "min_np", "max_np", "priority",
                      "checkpoint_dir", "goal",
                      "speed_profile"}``
``/cluster/status``   ``{"job": ID}`` or ``{}``              ``{"jobs": [...], "pool", "slots",
                                                             "queue", "holders", "policy"}``
``/cluster/cancel``   ``{"job": ID}``                        ``{"id", "state"}``
``/cluster/events``   ``{"since": N}``                       ``{"events": [...]}``
``/cluster/logs``     ``{"job": ID, "run": N or null,        ``{"id", "run", "runs", "state",
                      "offset": BYTES}``                     "offset", "next", "size", "data",
                                                             "ended"}`` (:func:`.handlers.logs`)
====================  =====================================  ==================================

An unknown job answers 404, bad input 400 (the message is one line for people).
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Callable, Dict

from hvd_edl import messages
from launcher.serve.bounded_http import (ServingThread, BodyReader, BoundedHTTPServer, HttpError, Limits,
                                         Request, Response, connection_cap, listen_socket)
from launcher.serve.control_auth import CallRefused, Refused, RequestAuthenticator, post_signed

log = logging.getLogger(__name__)

PREFIX = "/cluster/"
MAX_CONNECTIONS = 256


def _json(status: int, obj, close: bool = False) -> Response:
    return Response(status, json.dumps(obj).encode(), close=close, authenticated=status < 500)


class ClusterServer:
    """Serves ``routes`` (path -> handler(dict) -> dict; a handler raising ``ValueError`` with a
    ``status`` attribute answers that status, else 400) on ``(bind_addr, port)``, every request
    signed with ``secret``.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, routes: Dict[str, Callable[[dict], dict]], secret: str, bind_addr: str,
                 port: int = 0):
        self.routes = routes
        self.auth = RequestAuthenticator(secret)
        self.limits = Limits(max_connections=connection_cap(MAX_CONNECTIONS, share=8))
        self._sock = listen_socket(bind_addr, port, self.limits.backlog)
        self.port = self._sock.getsockname()[1]
        from launcher.job.rendezvous import local_addresses
        self.http = BoundedHTTPServer(self._handle, self.limits, name="cluster",
                                      keep_alive=False, same_user_only=True,
                                      local_addresses=local_addresses())
        self.serving = ServingThread(self.http, self._sock, "cluster-http")

    def start(self) -> int:
        """Start serving; returns the port."""
        self.serving.start()
        return self.port

    def stop(self) -> None:
        """Stop serving (requests in flight are abandoned)."""
        self.serving.stop()

    def _refuse(self, request: Request, refusal: Refused) -> Response:
        self.auth.note_refusal("cluster", request.peer, refusal)
        return _json(refusal.status, {"error": refusal.reason}, close=True)

    async def _handle(self, request: Request, body_reader: BodyReader) -> Response:
        if request.method != "POST":
            return _json(405, {"error": "POST only"}, close=True)
        try:
            length = body_reader.length(messages.MAX_BODY_BYTES)
        except HttpError as e:
            return self._refuse(request, Refused(e.status, e.reason))
        signature = request.headers.get(messages.AUTH_HEADER.lower())
        if not signature:
            return self._refuse(request, Refused(401, "missing signature header "
                                                 + messages.AUTH_HEADER))
        body = await body_reader.read(length)
        try:
            self.auth.check("POST", request.path, body, signature)
        except Refused as refusal:
            return self._refuse(request, refusal)
        handler = self.routes.get(request.path)
        if handler is None:
            return _json(404, {"error": f"no such endpoint {request.path[:60]}"})
        loop = asyncio.get_running_loop()
        answer = loop.create_future()

        def run() -> None:
            resp = self._dispatch(handler, body)
            loop.call_soon_threadsafe(lambda: answer.done() or answer.set_result(resp))
        threading.Thread(target=run, name="cluster-request", daemon=True).start()
        return await answer

    @staticmethod
    def _dispatch(handler, body: bytes) -> Response:
        try:
            data = messages.loads(body) if body else {}
            if not isinstance(data, dict):
                raise ValueError("expected a JSON object")
            return _json(200, handler(data))
        except (ValueError, KeyError, TypeError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            return _json(getattr(e, "status", 400), {"error": str(msg)})
        except TimeoutError:
            return _json(503, {"error": "the service is busy: try again"})
        except Exception:  # noqa: BLE001 - a bug of ours: 500, keep serving
            log.exception("cluster: error serving a request")
            return _json(500, {"error": "internal error"}, close=True)


def routes(service) -> Dict[str, Callable[[dict], dict]]:
    """The API's handlers over a :class:`launcher.cluster.service.Service`."""
    def job_id(data: dict) -> str:
        v = data.get("job")
        if not isinstance(v, str) or not v:
            raise ValueError(f"'job' must be a job id, got {v!r}")
        return v

    def events(data: dict) -> dict:
        since = data.get("since", 0)
        if isinstance(since, bool) or not isinstance(since, int):
            raise ValueError(f"'since' must be an integer, got {since!r}")
        return {"events": service.store.events(since)}

    def logs(data: dict) -> dict:
        from launcher.cluster import handlers
        run, offset = data.get("run"), data.get("offset", 0)
        if run is not None and (isinstance(run, bool) or not isinstance(run, int)):
            raise ValueError(f"'run' must be a run number, got {run!r}")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"'offset' must be a byte offset, got {offset!r}")
        return handlers.logs(service, job_id(data), run, offset)

    def drain(data: dict) -> dict:
        from launcher.cluster import drains
        host, deadline = data.get("host"), data.get("deadline_s")
        if not isinstance(host, str) or not host:
            raise ValueError(f"'host' must be a host name, got {host!r}")
        if deadline is not None and (isinstance(deadline, bool)
                                     or not isinstance(deadline, (int, float))):
            raise ValueError(f"'deadline_s' must be seconds, got {deadline!r}")
        return service.call(lambda: drains.drain(service, host, deadline,
                                                 bool(data.get("undo"))))

    return {
        PREFIX + "drain": drain,
        PREFIX + "logs": logs,
        PREFIX + "submit": lambda data: service.call(lambda: service.submit(data)),
        PREFIX + "cancel": lambda data: service.call(lambda: service.cancel(job_id(data))),
        PREFIX + "status": lambda data: service.status(job_id(data) if data.get("job")
                                                      is not None else None),
        PREFIX + "events": events,
    }


class ClusterClient:
    """Signed calls to a running service, from its cluster file's ``url`` and ``secret``."""

    def __init__(self, cluster: dict, timeout_s: float = 30.0):
        self.url = str(cluster["url"]).rstrip("/")
        self.secret = str(cluster["secret"])
        self.timeout_s = timeout_s

    def call(self, route: str, **args) -> dict:
        """POST ``args`` to ``/cluster/<route>``.

        Raises:
            ClusterRefused: the service answered an error (``status``: its HTTP code; None
                when it cannot be reached)."""
        import requests
        try:
            return post_signed(self.url, PREFIX + route, self.secret, args, self.timeout_s)
        except CallRefused as e:
            raise ClusterRefused(str(e), e.status) from None
        except requests.RequestException as e:
            raise ClusterRefused(f"cannot reach the cluster service at {self.url}: "
                                 f"{type(e).__name__} (is hvd-edl-cluster serve running?)") \
                from None


class ClusterRefused(RuntimeError):
    """A request the service refused (``status`` its HTTP code) or could not get (None)."""

    def __init__(self, message: str, status=None):
        super().__init__(message)
        self.status = status
