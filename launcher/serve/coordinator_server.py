"""The coordinator's HTTP API (the workers' routes and the control API) on one bounded asyncio
server.

Requests are checked on the event loop's thread, in this order, and a refused one changes nothing:

1. the bounds of :mod:`launcher.serve.bounded_http` (connections, head size and lines, time to send
   it, unauthenticated body bytes; another user's local process gets 403);
2. ``POST`` only (else 405), a ``Content-Length`` of at most ``messages.MAX_BODY_BYTES`` (else 411
   / 413, unread);
3. a signature header at all (else 401, unread, no ``100 Continue``), then a valid, fresh, not
   yet seen signature over the body (else 403, see :mod:`launcher.serve.control_auth`);
4. only then the JSON body is parsed and the route's handler runs: malformed JSON, JSON nested
   too deep and fields of the wrong type answer 400.

The workers' routes run on the event loop's thread: the short ones (``/beat``, ``/register``,
``/ready``, ``/started``, ``/leave``) take the coordinator's lock for microseconds; the long polls
(``/watch``, ``/switch``) record what they carry, then wait as futures (``Coordinator.poll_*``)
that are checked again when the coordinator's condition is notified: once per group of polls
with the same answer, and the ``/switch`` polls only when an assignment was written.  1,024
workers' open polls are 2,048 futures, not 2,048 threads (a thread per request cost the launcher
a thread start per heartbeat and woke every waiting thread at every report: benchmarks/job/
control_plane.py).  The control API's routes (which may wait for the workers) run on a daemon
thread each.  Unauthenticated clients never get a thread.  Connections that authenticated stay
open between requests (the workers' keep-alive sessions) for ``IDLE_CONNECTION_TIMEOUT_S``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any, Callable, Dict, Optional

from hvd_edl import messages
from launcher.serve.bounded_http import (ServingThread, BodyReader, BoundedHTTPServer, HttpError, Limits, Request,
                                   Response, connection_cap, listen_socket)
from launcher.serve.control_auth import Refused, RequestAuthenticator
from launcher.job.rendezvous import local_addresses

log = logging.getLogger(__name__)

IDLE_CONNECTION_TIMEOUT_S = 120.0  # a keep-alive connection of the job's own, between requests
MAX_CONNECTIONS = 4096             # a worker holds two (its watcher's long poll, its own calls)
HEADER_TIMEOUT_S = 5.0             # to send a request head on a new connection
BODY_TIMEOUT_S = 10.0

ROUTES = {
    "/register": (messages.Register, "register"),
    "/ready": (messages.Ready, "ready"),
    "/switch": (messages.SwitchRequest, "switch"),
    "/started": (messages.Started, "started"),
    "/watch": (messages.WatchRequest, "watch"),
    "/leave": (messages.Leave, "leave"),
    "/beat": (messages.Beat, "beat"),
    "/finished": (messages.Finished, "finished"),
    "/exiting": (messages.Exiting, "exiting"),
}


def _json(status: int, obj: Any, close: bool = False, authenticated: bool = False) -> Response:
    return Response(status, json.dumps(obj).encode(), close=close, authenticated=authenticated)


class CoordinatorServer:
    """Serves a :class:`launcher.job.coordinator.Coordinator` over HTTP on ``(bind_addr, port)``
    (port 0: any free), with the checks of the module docstring.

    ``extra_routes`` maps further paths to handlers taking and returning JSON objects (the
    control API); a handler raising ``ValueError`` / ``KeyError`` / ``TypeError`` answers 400
    with its message.

    Args:
        coordinator: answers the workers' routes (its methods block; they run on threads).
        secret: the per-job secret requests are signed with.
        bind_addr: address to listen on.
        port: TCP port, 0 for any free one.
        extra_routes: path -> handler(dict) -> dict.
        max_connections: concurrent connections (503 past it); lowered to what the descriptor
            limit allows.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, coordinator, secret: str, bind_addr: str, port: int = 0,
                 extra_routes: Optional[Dict[str, Callable[[dict], dict]]] = None,
                 max_connections: int = MAX_CONNECTIONS):
        self.coord = coordinator
        self.extra = extra_routes or {}
        self.auth = RequestAuthenticator(secret)
        self.limits = Limits(max_connections=connection_cap(max_connections),
                             header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S,
                             idle_timeout_s=IDLE_CONNECTION_TIMEOUT_S)
        self._sock = listen_socket(bind_addr, port, self.limits.backlog)
        self.port = self._sock.getsockname()[1]
        self.http = BoundedHTTPServer(self._handle, self.limits, name="coordinator",
                                      keep_alive=True, same_user_only=True,
                                      local_addresses=local_addresses())
        self._stopping = False
        # long polls waiting on the loop: /switch ones, and /watch ones by group (same answer)
        self._switch_polls: Dict[Any, asyncio.Future] = {}
        self._groups: Dict[tuple, Dict[Any, asyncio.Future]] = {}
        self._signature = None
        self._recheck_pending = False
        self._inline = hasattr(coordinator, "poll_switch") and hasattr(coordinator, "cond")
        if self._inline:
            coordinator.cond.listeners.append(self._notified)
        self.serving = ServingThread(self.http, self._sock, "coordinator")
        self._loop = self.serving.loop

    def start(self) -> int:
        """Start serving; returns the port."""
        self.serving.start()
        return self.port

    def stop(self) -> None:
        """Stop accepting, end the event loop (requests in flight are abandoned)."""
        self.serving.stop()
        self._stopping = True

    def _refuse(self, request: Request, refusal: Refused) -> Response:
        self.auth.note_refusal("coordinator", request.peer, refusal)
        return _json(refusal.status, {"error": refusal.reason}, close=True)

    async def _handle(self, request: Request, body_reader: BodyReader) -> Response:
        if request.method != "POST":
            return _json(405, {"error": "POST only"}, close=True)
        try:
            length = body_reader.length(messages.MAX_BODY_BYTES)
        except HttpError as e:  # 400 / 411 / 413, nothing read
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
        route = ROUTES.get(request.path)
        if route is None and request.path not in self.extra:
            return _json(404, {"error": "no such endpoint"}, authenticated=True)
        if self._stopping:
            return _json(503, {"error": "shutting down"}, close=True)
        if route is not None and self._inline:
            if route[1] in ("switch", "watch"):
                return await self._long_poll(route, body)
            return self._dispatch(request.path, body)  # microseconds under the lock
        # the control API: a daemon thread per request in flight (at most one per connection):
        # some wait for the workers, and none may delay the launcher's exit
        loop = asyncio.get_running_loop()
        answer = loop.create_future()

        def run() -> None:
            resp = self._dispatch(request.path, body)
            loop.call_soon_threadsafe(lambda: answer.done() or answer.set_result(resp))
        threading.Thread(target=run, name="coordinator-request", daemon=True).start()
        return await answer

    async def _long_poll(self, route, body: bytes) -> Response:
        """A ``/switch`` or ``/watch`` long poll as a future on the loop (see the module)."""
        cls, method = route
        try:
            poll = getattr(self.coord, "poll_" + method)(messages.decode(cls, body))
        except (ValueError, KeyError, TypeError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            return _json(400, {"error": str(msg)}, authenticated=True)
        reply = poll.answer
        if reply is None:
            future = self._loop.create_future()
            waiting = self._switch_polls if poll.group is None \
                else self._groups.setdefault(poll.group, {})
            waiting[poll] = future
            try:
                reply = await asyncio.wait_for(future, max(0.0, poll.deadline - time.monotonic()))
            except asyncio.TimeoutError:
                reply = self.coord.expire_poll(poll)
            finally:
                waiting.pop(poll, None)
                if poll.group is not None and not waiting:
                    self._groups.pop(poll.group, None)
        return Response(200, messages.encode(reply), authenticated=True)

    def _notified(self) -> None:
        """The coordinator's condition was notified (any thread, its lock held): check the
        waiting polls once on the loop, however many notifications come before that."""
        if not self._recheck_pending and not self._stopping:
            self._recheck_pending = True
            try:
                self._loop.call_soon_threadsafe(self._recheck)
            except RuntimeError:  # the loop is closed: the launcher is stopping
                pass

    def _recheck(self) -> None:
        self._recheck_pending = False
        if not self._switch_polls and not self._groups:
            return
        groups = [polls for polls in self._groups.values() if polls]
        self._signature, replies = self.coord.answer_polls(
            self._signature, list(self._switch_polls), [next(iter(polls)) for polls in groups])
        answered = [(future, replies[poll]) for poll, future in self._switch_polls.items()
                    if poll in replies]
        for polls in groups:
            reply = replies.get(next(iter(polls)))
            if reply is not None:
                answered.extend((future, reply) for future in polls.values())
        for future, reply in answered:
            if not future.done():
                future.set_result(reply)

    def _dispatch(self, path: str, body: bytes) -> Response:
        """Run an authenticated request's route; never raises."""
        try:
            route = ROUTES.get(path)
            if route is not None:
                cls, method = route
                reply = getattr(self.coord, method)(messages.decode(cls, body))
                return Response(200, messages.encode(reply), authenticated=True)
            data = messages.loads(body)
            if not isinstance(data, dict):
                raise ValueError("expected a JSON object")
            return _json(200, self.extra[path](data), authenticated=True)
        except (ValueError, KeyError, TypeError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            return _json(400, {"error": str(msg)}, authenticated=True)
        except Exception:  # noqa: BLE001 - a bug of ours: answer 500, keep serving
            log.exception("coordinator: error serving %s", path)
            return _json(500, {"error": "internal error"}, close=True, authenticated=True)
