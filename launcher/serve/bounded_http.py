"""A small HTTP/1.1 server on asyncio whose every resource is bounded *before* a request is
authenticated: the launcher's servers (the coordinator with its control API, each Gloo
rendezvous, and the Prometheus metrics of ``--metrics-port``) face anyone who can reach their
port.

What a client without the job's secret can hold, per server:

* at most ``Limits.max_connections`` connections at once; one more gets a fast 503 and is closed
  (no thread, no parsing);
* per connection, a request head (request line and headers) of at most ``max_header_bytes``
  (431) and ``max_headers`` lines (431), sent within ``header_timeout_s`` of the connection
  opening (408), then nothing: the reader's buffer is the only memory held (asyncio pauses reading
  at twice that);
* bodies only after their length was checked (411 chunked, 413 too large, unread), and at most
  ``max_unauthenticated_body_bytes`` of not yet authenticated bodies over all connections (503
  past it);
* a listen backlog of ``backlog`` (large jobs connect in bursts).

Peers on this machine (loopback, or one of its own addresses) owned by another user are refused
with 403 where the OS says who owns them (:mod:`launcher.serve.peer_uid`).  Malformed input of any kind
gets a 4xx answer; an exception in a handler a 500; neither reaches the event loop.  A connection
whose request authenticated (the handler says so) may stay open between requests for
``idle_timeout_s`` (the workers' keep-alive sessions and long polls).  After a burst of
connections the heap pages their buffers used are handed back to the OS (``malloc_trim``), so
the launcher's memory returns to its baseline.
"""
from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import resource
import socket
import threading
from dataclasses import dataclass
from typing import Awaitable, Callable, Dict, FrozenSet, Optional, Set, Tuple

from launcher.serve import peer_uid

log = logging.getLogger(__name__)

REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 401: "Unauthorized",
           403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
           408: "Request Timeout", 411: "Length Required", 413: "Payload Too Large",
           431: "Request Header Fields Too Large", 500: "Internal Server Error",
           503: "Service Unavailable"}
LINGER_S = 1.0             # longest we discard a refused request's unread input (seconds)
LINGER_BYTES = 256 << 10   # most input discarded so (bytes)
MAX_LINGERING = 256        # connections lingering at once; past it, closed at once
GC_AFTER_REFUSED = 64      # refused requests that make the next trim collect garbage first
TRIM_DELAY_S = 1.0         # memory is handed back this long after a connection closed, at most
                           # once per TRIM_DELAY_S (glibc malloc_trim: about a millisecond)
FD_RESERVE = 256           # descriptors kept for everything but our servers' connections
WANTED_FDS = 65536         # the soft descriptor limit we raise to, if the hard limit allows


@dataclass(frozen=True)
class Limits:
    """Bounds of one server (see the module docstring); sizes in bytes, times in seconds."""
    max_connections: int = 1024
    max_header_bytes: int = 16 << 10
    max_headers: int = 64
    header_timeout_s: float = 5.0
    body_timeout_s: float = 10.0
    write_timeout_s: float = 10.0
    idle_timeout_s: float = 120.0
    max_unauthenticated_body_bytes: int = 16 << 20
    backlog: int = 1024


class HttpError(Exception):
    """A request answered with ``status`` (a 4xx/5xx) and closed; ``reason`` is one line."""

    def __init__(self, status: int, reason: str):
        super().__init__(f"{status} {reason}")
        self.status = status
        self.reason = reason


@dataclass
class Request:
    """One parsed request head; ``headers`` has lower-cased names (a repeated name: last wins)."""
    method: str
    path: str
    version: str
    headers: Dict[str, str]
    peer: str
    uid: Optional[int] = None  # the local peer's user (``identify_peers``), else None

    @property
    def keep_alive(self) -> bool:
        conn = self.headers.get("connection", "").lower()
        if self.version == "HTTP/1.1":
            return "close" not in conn
        return "keep-alive" in conn


@dataclass
class Response:
    """What a handler answers.  ``authenticated``: the request proved it came from the job, so
    its connection may be kept open ``idle_timeout_s``; ``close``: close after answering;
    ``headers``: further (name, value) header lines (e.g. ``Content-Encoding``)."""
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    close: bool = False
    authenticated: bool = False
    headers: Tuple[Tuple[str, str], ...] = ()


class BodyReader:
    """Reads the body of the request being served, within the server's bounds."""

    def __init__(self, server: "BoundedHTTPServer", request: Request,
                 reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._server, self._request, self._reader, self._writer = server, request, reader, writer
        self.unread = False   # a body was announced and not read: the connection must close

    def length(self, max_bytes: int, required: bool = False) -> int:
        """The announced body length (0 when none and not ``required``).

        Raises:
            HttpError: 411 chunked (or no length when ``required``), 400 malformed, 413 over
                ``max_bytes`` (nothing is read).
        """
        headers = self._request.headers
        if "transfer-encoding" in headers:
            raise HttpError(411, "Content-Length required (no chunked bodies)")
        text = headers.get("content-length")
        if text is None:
            if required:
                raise HttpError(411, "Content-Length required")
            return 0
        if not text.isascii() or not text.isdigit() or len(text) > 12:
            raise HttpError(400, f"bad Content-Length {text[:40]!r}")
        length = int(text)
        if length > max_bytes:
            raise HttpError(413, f"body of {length} bytes exceeds {max_bytes}")
        self.unread = length > 0
        return length

    async def read(self, length: int) -> bytes:
        """``length`` bytes of body (after :meth:`length`); sends ``100 Continue`` first when the
        client asked for it (call this only for requests worth reading).

        Raises:
            HttpError: 503 when unauthenticated bodies being read would exceed the server's
                budget, 408 when the body is not sent within ``body_timeout_s``.
        """
        if length == 0:
            return b""
        server = self._server
        if server.pending_body_bytes + length > server.limits.max_unauthenticated_body_bytes:
            raise HttpError(503, "busy: too many request bodies being read")
        server.pending_body_bytes += length
        try:
            if "100-continue" in self._request.headers.get("expect", "").lower():
                self._writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = await _within(self._reader.readexactly(length), server.limits.body_timeout_s)
            self.unread = False
            return body
        except asyncio.TimeoutError:
            raise HttpError(408, "body not sent in time") from None
        except asyncio.IncompleteReadError:
            raise ConnectionResetError("peer closed during the body") from None
        finally:
            server.pending_body_bytes -= length


Handler = Callable[[Request, BodyReader], Awaitable[Response]]


def raise_fd_limit(wanted: int = WANTED_FDS) -> int:
    """Raise this process's soft descriptor limit towards ``wanted`` (never above the hard
    limit, never lowered); returns the soft limit now in force."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        return soft if soft != resource.RLIM_INFINITY else wanted
    except (ValueError, OSError):
        return 1024


def connection_cap(wanted: int, share: int = 4) -> int:
    """``wanted`` connections, or fewer when the descriptor limit (raised first) cannot hold
    ``share`` servers that full next to ``FD_RESERVE`` other descriptors."""
    soft = raise_fd_limit()
    return max(16, min(wanted, (soft - FD_RESERVE) // share))


def listen_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket on ``(host, port)`` (IPv6 when ``host`` has a colon).

    Raises:
        OSError: the address cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def _discard(reader: asyncio.StreamReader, max_bytes: int) -> None:
    while max_bytes > 0:
        data = await reader.read(min(max_bytes, 65536))
        if not data:
            return
        max_bytes -= len(data)


def _malloc_trim() -> Optional[Callable[[int], int]]:
    try:  # the C library the interpreter runs on (ctypes.util.find_library ran ldconfig: a
        return ctypes.CDLL(None).malloc_trim  # process at every import of this module)
    except (OSError, AttributeError):
        return None  # not glibc: nothing to hand back explicitly


_TRIM = _malloc_trim()


def release_memory() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``): after a burst of
    connections the allocator otherwise keeps their buffers' pages, and the process its peak."""
    if _TRIM is not None:
        _TRIM(0)


if hasattr(asyncio, "timeout"):  # Python 3.11+: a deadline on the running task, no task of its own
    async def _within(awaitable, timeout_s: float):
        """``await awaitable``, or ``TimeoutError`` after ``timeout_s`` seconds: what
        ``asyncio.wait_for`` does, without the task it creates per call (a third of the event
        loop's own work per request here: benchmarks/job/beat_cost.py)."""
        async with asyncio.timeout(timeout_s):
            return await awaitable
else:  # pragma: no cover - Python < 3.11
    def _within(awaitable, timeout_s: float):
        return asyncio.wait_for(awaitable, timeout_s)


def _status_line(version: bytes, status: int) -> bytes:
    return b"%s %d %s\r\n" % (version, status, REASONS.get(status, "").encode())


class BoundedHTTPServer:
    """Serves ``handler`` on a listening socket with the bounds of :class:`Limits` (module
    docstring).  Create, :meth:`start` and :meth:`close` on the event loop that serves it.

    Args:
        handler: ``async handler(request, body_reader) -> Response``; raising
            :class:`HttpError` answers that status.
        limits: the bounds.
        name: for log lines.
        keep_alive: allow several requests per connection (else HTTP/1.0-style, one each).
        same_user_only: refuse local peers owned by another user (403).
        local_addresses: this machine's addresses (peers from them are local).
        identify_peers: ask the kernel which user owns each connection's peer socket (a
            peer on this machine) and give it to the handler as ``Request.uid`` (None for a
            peer on another machine, or where the OS does not say).
    """

    def __init__(self, handler: Handler, limits: Limits = Limits(), name: str = "http",
                 keep_alive: bool = True, same_user_only: bool = True,
                 local_addresses: FrozenSet[str] = frozenset(), identify_peers: bool = False):
        self.handler = handler
        self.limits = limits
        self.name = name
        self.keep_alive = keep_alive
        self.same_user_only = same_user_only
        self.local_addresses = local_addresses
        self.identify_peers = identify_peers
        self.version = b"HTTP/1.1" if keep_alive else b"HTTP/1.0"
        self.connections = 0
        self.pending_body_bytes = 0
        self.lingering = 0
        self._trim_pending = False
        self._refused_since_trim = 0
        self.turned_away = 0          # connections answered 503 at the cap
        self.other_users = 0          # local peers of another user refused
        self.server: Optional[asyncio.base_events.Server] = None
        self._writers: Set[asyncio.StreamWriter] = set()
        self._tasks: Set[asyncio.Task] = set()  # the connections' tasks (shutdown cancels them)

    async def start(self, sock: socket.socket) -> None:
        """Start serving on the listening ``sock`` (from :func:`listen_socket`)."""
        self.server = await asyncio.start_server(self._serve, sock=sock,
                                                 limit=self.limits.max_header_bytes,
                                                 backlog=self.limits.backlog)  # it listens again

    def close(self) -> None:
        """Stop accepting; connections being served finish on their own bounds."""
        if self.server is not None:
            self.server.close()

    async def shutdown(self, timeout_s: float = 2.0) -> None:
        """Stop accepting, close every connection and cancel its task (a long poll awaiting its
        answer would otherwise hold on until its own bound: 2 s of every job's end); wait (at
        most ``timeout_s``) until the tasks ended."""
        self.close()
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.connections and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    async def _send(self, writer: asyncio.StreamWriter, resp: Response, close: bool) -> None:
        head = [_status_line(self.version, resp.status),
                b"Content-Type: %s\r\n" % resp.content_type.encode(),
                b"Content-Length: %d\r\n" % len(resp.body)]
        head.extend(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1"))
                    for name, value in resp.headers)
        if close and self.keep_alive:
            head.append(b"Connection: close\r\n")
        if resp.status >= 400 and resp.status != 404:  # 404: a rendezvous key not there yet
            self._refused_since_trim += 1
        writer.write(b"".join(head) + b"\r\n" + resp.body)
        if writer.transport.get_write_buffer_size():  # else all was sent: nothing to wait for
            await _within(writer.drain(), self.limits.write_timeout_s)

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """After an answer sent while input was left unread: end our side and discard what the
        peer still sends (bounded), so closing does not reset the connection before the peer
        read the answer."""
        if self.lingering >= MAX_LINGERING:
            return
        self.lingering += 1
        try:
            if writer.can_write_eof():
                writer.write_eof()
            await asyncio.wait_for(_discard(reader, LINGER_BYTES), LINGER_S)
        except (ConnectionError, asyncio.TimeoutError, RuntimeError, OSError):
            pass
        finally:
            self.lingering -= 1

    def _parse(self, head: bytes, peer: str) -> Request:
        lines = head[:-4].decode("latin-1").split("\r\n")
        if len(lines) - 1 > self.limits.max_headers:
            raise HttpError(431, f"more than {self.limits.max_headers} header lines")
        parts = lines[0].split(" ")
        if len(parts) != 3 or parts[2] not in ("HTTP/1.0", "HTTP/1.1") or not parts[0].isalpha():
            raise HttpError(400, "malformed request line")
        headers: Dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise HttpError(400, "malformed header line")
            headers[name.lower()] = value.strip()
        return Request(parts[0], parts[1], parts[2], headers, peer)

    def _peer_user(self, writer: asyncio.StreamWriter) -> Optional[int]:
        """The uid owning the peer's socket when the peer is a process on this machine and the
        kernel says (``identify_peers``), else None."""
        if not self.identify_peers:
            return None
        try:
            peer, local = peer_uid.peer_of(writer.get_extra_info("socket"))
        except (OSError, AttributeError, TypeError):
            return None
        if not peer_uid.is_local_peer(peer[0], self.local_addresses):
            return None
        return peer_uid.peer_uid(peer, local)

    def _peer_refused(self, writer: asyncio.StreamWriter) -> bool:
        if not self.same_user_only:
            return False
        sock = writer.get_extra_info("socket")
        try:
            peer, local = peer_uid.peer_of(sock)
        except (OSError, AttributeError, TypeError):
            return True
        if not peer_uid.is_local_peer(peer[0], self.local_addresses):
            return False
        uid = peer_uid.peer_uid(peer, local)
        if uid is None or peer_uid.allowed_uid(uid):
            # None: the OS does not tell here (or the peer is gone); nothing to refuse on
            return False
        self.other_users += 1
        if self.other_users == 1 or self.other_users % 100 == 0:
            log.warning("%s refused a connection from %s: owned by uid %d, not this job's user "
                        "(%d refused)", self.name, peer[0], uid, self.other_users)
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        limits = self.limits
        if self.connections >= limits.max_connections:
            self.turned_away += 1
            if self.turned_away == 1 or self.turned_away % 1000 == 0:
                log.warning("%s: %d connections open, turned one away with 503 (%d so far)",
                            self.name, self.connections, self.turned_away)
            try:
                writer.write(_status_line(self.version, 503)
                             + b"Content-Length: 0\r\nConnection: close\r\n\r\n")
                await self._linger(reader, writer)
            except (ConnectionError, RuntimeError, OSError):
                pass
            writer.close()
            return
        self.connections += 1
        self._writers.add(writer)
        task = asyncio.current_task()
        self._tasks.add(task)
        peer = (writer.get_extra_info("peername") or ("",))[0]
        try:
            if self._peer_refused(writer):
                await self._send(writer, Response(403, b'{"error": "another user\'s process"}'),
                                 True)
                return
            uid = self._peer_user(writer)
            trusted = False
            while True:
                try:
                    head = await _within(
                        reader.readuntil(b"\r\n\r\n"),
                        limits.idle_timeout_s if trusted else limits.header_timeout_s)
                except asyncio.IncompleteReadError as e:
                    if e.partial.strip():
                        await self._send(writer, Response(400, b""), True)
                    return
                except asyncio.LimitOverrunError:
                    raise HttpError(431, "request head too large") from None
                except asyncio.TimeoutError:
                    if trusted:  # an idle keep-alive connection of the job's own
                        return
                    raise HttpError(408, "request head not sent in time") from None
                request = self._parse(head, peer)
                request.uid = uid
                body_reader = BodyReader(self, request, reader, writer)
                try:
                    resp = await self.handler(request, body_reader)
                except HttpError:
                    raise
                except ConnectionError as e:  # the peer left mid-request (e.g. a worker exiting
                    # while it sent its body): nothing to answer, not a bug
                    log.debug("%s: %s closed the connection during %s %s (%s)", self.name,
                              peer or "a peer", request.method, request.path[:80], e)
                    return
                except Exception:  # noqa: BLE001 - a handler's bug must not reach the loop
                    log.exception("%s: error serving %s %s", self.name, request.method,
                                  request.path[:80])
                    resp = Response(500, b'{"error": "internal error"}', close=True)
                trusted = trusted or resp.authenticated
                close = resp.close or not self.keep_alive or not request.keep_alive \
                    or body_reader.unread
                await self._send(writer, resp, close)
                if close:
                    if body_reader.unread:
                        await self._linger(reader, writer)
                    return
        except HttpError as e:
            try:
                body = ('{"error": "%s"}' % e.reason.replace('"', "'")).encode()
                await self._send(writer, Response(e.status, body), True)
                await self._linger(reader, writer)
            except (ConnectionError, asyncio.TimeoutError, RuntimeError):
                pass
        except (ConnectionError, asyncio.TimeoutError, RuntimeError):
            pass
        except Exception:  # noqa: BLE001 - never let a connection's error reach the loop
            log.debug("%s: error on a connection from %s", self.name, peer, exc_info=True)
        except asyncio.CancelledError:
            pass  # the loop is stopping
        finally:
            self.connections -= 1
            self._writers.discard(writer)
            self._tasks.discard(task)
            writer.close()
            if not self._trim_pending:
                self._trim_pending = True
                asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._trim)

    def _trim(self) -> None:
        """Connections ended: give their memory back (at most once per ``TRIM_DELAY_S``).  After
        ``GC_AFTER_REFUSED`` refusals (an attack, not the job's own traffic) first collect the
        reference cycles that asyncio's connection objects and exceptions form, which would
        otherwise keep the refused connections' buffers until the collector runs on its own."""
        self._trim_pending = False
        if self._refused_since_trim >= GC_AFTER_REFUSED:
            gc.collect()
        self._refused_since_trim = 0
        release_memory()


class ServingThread:
    """Serves a :class:`BoundedHTTPServer` on an event loop of its own, in a daemon thread: the
    coordinator's server, the metrics endpoint and the cluster service's API all run this way,
    so no caller's thread ever blocks on a connection.

    Args:
        http: the server.
        sock: its listening socket (:func:`listen_socket`); closed by :meth:`stop`.
        name: the thread's name.

    ``loop`` is the event loop (for futures and ``call_soon_threadsafe`` from other threads);
    closed once it stopped, so ``call_soon_threadsafe`` after :meth:`stop` raises RuntimeError.
    """

    def __init__(self, http: BoundedHTTPServer, sock: socket.socket, name: str):
        self.http = http
        self.sock = sock
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        """The thread: run the loop until :meth:`stop`, then close it here, on its own thread.
        A loop left open is closed by its ``__del__`` at interpreter exit, after the garbage
        collector may already have closed its self-pipe's sockets: "Exception ignored in
        BaseEventLoop.__del__ ... ValueError: Invalid file descriptor: -1" at the end of every
        launcher's run."""
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the thread and serve (waits at most ``timeout_s`` seconds for the server).

        Raises:
            OSError, concurrent.futures.TimeoutError: the server did not start.
        """
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.http.start(self.sock), self.loop).result(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close every connection, end the loop and its thread (each wait at most ``timeout_s``
        seconds; requests in flight are abandoned), close the loop and close the socket."""
        if self.thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self.http.shutdown(), self.loop).result(timeout_s)
            except Exception:  # noqa: BLE001 - stopping anyway
                log.debug("%s: closing connections failed", self.http.name, exc_info=True)
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:  # the loop ended and closed meanwhile
                pass
            self.thread.join(timeout_s)
            if self.thread.is_alive():
                log.debug("%s: the event loop did not stop in %.0f s", self.http.name, timeout_s)
        elif self.thread.ident is None and not self.loop.is_closed():
            self.loop.close()  # never started: nothing else will close it
        self.sock.close()
