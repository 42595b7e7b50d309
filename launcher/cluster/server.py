"""The cluster service's HTTP API, on the bounded server of :mod:`launcher.serve.bounded_http`.
Who calls is the kernel's word, not a secret: the server answers only processes on its own host
and asks the kernel which user owns the caller's socket (``Request.uid``, sock_diag); that user
is the request's caller (:mod:`launcher.cluster.users` says what each may do).  Checks, in
order: POST only; a bounded ``Content-Length``; a caller on this host (403, one line, for a
peer on another machine: the kernel cannot name it); a ``Host`` header that is an IP address
or ``localhost`` and a JSON ``Content-Type`` (403 otherwise: what a web page in a user's browser
cannot send without a CORS preflight, which is refused, or a DNS rebinding's host name); only
then the JSON body.  Every answer is a JSON object; a refused request answers ``{"error":
"..."}`` and changes nothing.

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

An unknown job answers 404, bad input 400, a request this caller may not make 403 (another
user's job: cancel, logs; drain: not the operator; submit to a service of another ordinary
user); the message is one line for people.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Callable, Dict

import ipaddress
import time

from hvd_edl import messages
from launcher.cluster import users
from launcher.serve.bounded_http import (ServingThread, BodyReader, BoundedHTTPServer, HttpError, Limits,
                                         Request, Response, connection_cap, listen_socket)

log = logging.getLogger(__name__)

PREFIX = "/cluster/"
MAX_CONNECTIONS = 256
REFUSAL_LOG_S = 10.0  # refusals are logged at most this often


def _json(status: int, obj, close: bool = False) -> Response:
    return Response(status, json.dumps(obj).encode(), close=close, authenticated=status < 500)


def host_is_literal(host_header: str) -> bool:
    """Whether a ``Host`` header names this service the way its own clients do: an IP address
    (``127.0.0.1:PORT``, ``[::1]:PORT``) or ``localhost``, never another host name (a DNS
    rebinding's)."""
    host = host_header.strip()
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    if host.lower() == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


class ClusterServer:
    """Serves ``routes`` (path -> handler(dict, caller) -> dict, ``caller`` the
    :class:`launcher.cluster.users.User` calling; a handler raising ``ValueError`` with a
    ``status`` attribute answers that status, else 400) on ``(bind_addr, port)`` to processes of
    this host (module docstring).

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, routes: Dict[str, Callable[[dict, users.User], dict]], bind_addr: str,
                 port: int = 0):
        self.routes = routes
        self.limits = Limits(max_connections=connection_cap(MAX_CONNECTIONS, share=8))
        self._sock = listen_socket(bind_addr, port, self.limits.backlog)
        self.port = self._sock.getsockname()[1]
        from launcher.job.rendezvous import local_addresses
        self.http = BoundedHTTPServer(self._handle, self.limits, name="cluster",
                                      keep_alive=False, same_user_only=False,
                                      local_addresses=local_addresses(), identify_peers=True)
        self.serving = ServingThread(self.http, self._sock, "cluster-http")
        self.refused = 0
        self._logged_at = 0.0

    def start(self) -> int:
        """Start serving; returns the port."""
        self.serving.start()
        return self.port

    def stop(self) -> None:
        """Stop serving (requests in flight are abandoned)."""
        self.serving.stop()

    def _refuse(self, request: Request, status: int, reason: str) -> Response:
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at >= REFUSAL_LOG_S:
            self._logged_at = now
            log.warning("cluster: refused %s %s from %s (uid %s): %s (%d refused)",
                        request.method, request.path[:60], request.peer, request.uid, reason,
                        self.refused)
        return _json(status, {"error": reason}, close=True)

    async def _handle(self, request: Request, body_reader: BodyReader) -> Response:
        if request.method != "POST":
            return _json(405, {"error": "POST only"}, close=True)
        try:
            length = body_reader.length(messages.MAX_BODY_BYTES)
        except HttpError as e:
            return self._refuse(request, e.status, e.reason)
        if request.uid is None:
            return self._refuse(request, 403, "the cluster service answers only processes on "
                                "its own host (the kernel names their user there): run "
                                "hvd-edl-cluster there")
        if not host_is_literal(request.headers.get("host", "")):
            return self._refuse(request, 403, "Host header is not an IP address or localhost "
                                "(a web page's request?): refused")
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return self._refuse(request, 403, "Content-Type must be application/json")
        handler = self.routes.get(request.path)
        if handler is None:
            return _json(404, {"error": f"no such endpoint {request.path[:60]}"})
        body = await body_reader.read(length)
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        uid = request.uid

        def run() -> None:
            resp = self._dispatch(handler, body, uid)
            loop.call_soon_threadsafe(lambda: answer.done() or answer.set_result(resp))
        threading.Thread(target=run, name="cluster-request", daemon=True).start()
        return await answer

    @staticmethod
    def _dispatch(handler, body: bytes, uid: int) -> Response:
        try:
            data = messages.loads(body) if body else {}
            if not isinstance(data, dict):
                raise ValueError("expected a JSON object")
            return _json(200, handler(data, users.User.of_uid(uid)))
        except (ValueError, KeyError, TypeError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            return _json(getattr(e, "status", 400), {"error": str(msg)})
        except TimeoutError as e:  # Service.call: its message says whether it was done
            return _json(503, {"error": str(e) or "the service is busy: try again"})
        except Exception:  # noqa: BLE001 - a bug of ours: 500, keep serving
            log.exception("cluster: error serving a request")
            return _json(500, {"error": "internal error"}, close=True)


def routes(service) -> Dict[str, Callable[[dict, users.User], dict]]:
    """The API's handlers over a :class:`launcher.cluster.service.Service`: each takes the
    request's body and its caller (:mod:`launcher.cluster.users` decides what it may do)."""
    from launcher.cluster import drains, handlers

    def job_id(data: dict) -> str:
        v = data.get("job")
        if not isinstance(v, str) or not v:
            raise ValueError(f"'job' must be a job id, got {v!r}")
        return v

    def events(data: dict, caller: users.User) -> dict:
        since = data.get("since", 0)
        if isinstance(since, bool) or not isinstance(since, int):
            raise ValueError(f"'since' must be an integer, got {since!r}")
        return users.hide_output({"events": service.store.events(since)}, caller,
                                 service.store)

    def logs(data: dict, caller: users.User) -> dict:
        run, offset = data.get("run"), data.get("offset", 0)
        if run is not None and (isinstance(run, bool) or not isinstance(run, int)):
            raise ValueError(f"'run' must be a run number, got {run!r}")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"'offset' must be a byte offset, got {offset!r}")
        return handlers.logs(service, job_id(data), run, offset, caller=caller)

    def drain(data: dict, caller: users.User) -> dict:
        users.may_operate(caller, "drain a host")
        host, deadline = data.get("host"), data.get("deadline_s")
        if not isinstance(host, str) or not host:
            raise ValueError(f"'host' must be a host name, got {host!r}")
        if deadline is not None and (isinstance(deadline, bool)
                                     or not isinstance(deadline, (int, float))):
            raise ValueError(f"'deadline_s' must be seconds, got {deadline!r}")
        return service.call(lambda: drains.drain(service, host, deadline,
                                                 bool(data.get("undo"))))

    def submit(data: dict, caller: users.User) -> dict:
        users.may_submit(caller)
        return service.call(lambda: service.submit(data, caller))

    def cancel(data: dict, caller: users.User) -> dict:
        job = job_id(data)
        return service.call(lambda: service.cancel(job, caller))

    def status(data: dict, caller: users.User) -> dict:
        return users.hide_output(service.status(job_id(data) if data.get("job") is not None
                                                else None), caller, service.store)

    return {PREFIX + "drain": drain, PREFIX + "logs": logs, PREFIX + "submit": submit,
            PREFIX + "cancel": cancel, PREFIX + "status": status, PREFIX + "events": events}


def post_json(url: str, path: str, args: dict, timeout_s: float) -> dict:
    """POST ``args`` as JSON to ``url + path`` and return the JSON object answered.

    Raises:
        requests.RequestException: no answer within ``timeout_s`` seconds, or no connection.
        ClusterRefused: the answer was an error (``status`` its HTTP code) or not an object.
    """
    import requests
    r = requests.post(url + path, data=json.dumps(args).encode(), timeout=timeout_s,
                      headers={"Content-Type": "application/json"})
    try:
        data = r.json()
    except ValueError:
        data = {}
    if r.status_code != 200 or not isinstance(data, dict):
        why = data.get("error") if isinstance(data, dict) else None
        raise ClusterRefused(why or f"HTTP {r.status_code}", r.status_code)
    return data


class ClusterClient:
    """Calls to a running service at its cluster file's ``url``, as the user running this
    process (the service asks the kernel who that is)."""

    def __init__(self, cluster: dict, timeout_s: float = 30.0):
        self.url = str(cluster["url"]).rstrip("/")
        self.timeout_s = timeout_s
        self.expect_uid = cluster.get("owner_uid")  # the cluster file's owner: the service's
        self._checked = self.expect_uid is None

    def check_listener(self) -> None:
        """Make sure the process listening at ``url`` runs as the cluster file's owner before
        anything is sent (a submit carries the caller's whole environment): once the service
        is gone, any local user may bind its port.  The kernel says who owns the listening
        socket (:func:`hvd_edl.peer_uid.peer_uid`, as the service learns who calls it); when
        it cannot say, the call goes on.

        Raises:
            ClusterRefused: another user's process listens there (status None)."""
        import socket
        from urllib.parse import urlsplit
        from hvd_edl.peer_uid import peer_uid
        u = urlsplit(self.url)
        try:
            with socket.create_connection((u.hostname, u.port or 80),
                                          timeout=min(5.0, self.timeout_s)) as sock:
                uid = peer_uid(sock.getpeername()[:2], sock.getsockname()[:2])
        except OSError:
            return  # no connection: the call itself says it cannot reach the service
        if uid is not None and uid != self.expect_uid:
            raise ClusterRefused(
                f"the process listening at {self.url} runs as uid {uid}, not as the cluster "
                f"file's owner (uid {self.expect_uid}): not the cluster service, nothing sent")
        self._checked = True

    def call(self, route: str, **args) -> dict:
        """POST ``args`` to ``/cluster/<route>``, once :meth:`check_listener` passed.

        Raises:
            ClusterRefused: the service answered an error (``status``: its HTTP code; None
                when it cannot be reached or another user's process listens at its URL)."""
        import requests
        if not self._checked:
            self.check_listener()
        try:
            return post_json(self.url, PREFIX + route, args, self.timeout_s)
        except requests.RequestException as e:
            raise ClusterRefused(f"cannot reach the cluster service at {self.url}: "
                                 f"{type(e).__name__} (is hvd-edl-cluster serve running?)") \
                from None


class ClusterRefused(RuntimeError):
    """A request the service refused (``status`` its HTTP code) or could not get (None)."""

    def __init__(self, message: str, status=None):
        super().__init__(message)
        self.status = status
