"""The state transfer of ``TorchState.sync()``: rank 0 streams its tensors' bytes over TCP to the
ranks that lack the state, straight from and into tensor memory.

Rank 0 splits its state into a small *skeleton* (the nested dicts and lists, every tensor
replaced by a :class:`TensorRef`: index, dtype, shape, bytes) and the list of tensors
(:func:`split`).  Under ``hvd-edl-run`` the skeleton comes over the stream itself, first on the
connection to rank 0's :class:`Listener`, whose address the assignment names (see "the header
over the stream" below: no collective at all); otherwise it travels in one small Horovod
broadcast with the :class:`StreamServer`'s endpoint (address, port, one-time random token).
Each receiver builds
its destination tensors from it (:func:`fill`: its own parameters and buffers where they fit,
fresh tensors otherwise), connects, sends the token, and receives every tensor's bytes with
``recvmsg_into`` directly into them (:func:`receive`); rank 0 ``sendmsg``s memoryviews of its
tensors, several small tensors per system call, large ones in 8 MiB pieces.  Nothing is
pickled for the stream and nothing received from it is unpickled: it carries raw tensor bytes
in the order the skeleton names.  Peak extra memory is zero on rank 0 and the receivers'
destination tensors on the receivers (only what they lacked, e.g. a joiner's optimizer state).

Every socket operation has a timeout (``HVD_EDL_STREAM_TIMEOUT_S``, default 30 s, Gloo's
default): a stall is bounded per operation, not per transfer.  A failure on either side raises
:class:`StreamError`, a ``HorovodInternalError``, so the elastic loop recovers as after any failed
collective; a connection with a wrong token is refused (:class:`TokenRefused` on its side) and
does not count as a receiver.  :func:`release` shuts every socket of a running transfer down
(the runtime calls it when the coordinator declares a member of the ring dead).

Rank 0's port faces anyone who can reach it, so connections are accepted and authenticated
concurrently (one ``selectors`` loop on the serving thread, no thread per connection): a
process on this machine owned by another user is closed at once (:mod:`hvd_edl.peer_uid`, as
the launcher's servers do); every other connection must send its token within
``TOKEN_TIMEOUT_S`` of being accepted, and at most ``MAX_PENDING`` wait for theirs (past it the
oldest is closed).  A receiver sends its token in the same moment it connects, so silent or
slow connections neither delay it nor count as one; the wait for the receivers is bounded by
``timeout_s`` since the last one that authenticated, however many others come.

The idea: EDL (arXiv 1909.11985) hands a joiner the model from a live member instead of a
checkpoint, and its cost is what the stall is made of; the one-pickled-tensor broadcast this
replaces is Horovod's ``broadcast_object`` (``horovod/torch/functions.py``).
"""
from __future__ import annotations

import collections
import copy
import errno
import hashlib
import hmac
import logging
import os
import pickle
import struct
import secrets
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from horovod.common.exceptions import HorovodInternalError

from hvd_edl import peer_uid

log = logging.getLogger(__name__)

TIMEOUT_S = float(os.environ.get("HVD_EDL_STREAM_TIMEOUT_S", "30"))
"""Longest any one socket operation of the transfer may wait (seconds)."""
PARALLEL = os.environ.get("HVD_EDL_STREAM_PARALLEL", "1") != "0"
"""One sending thread per receiver (default) rather than one receiver after another."""
PIECE_BYTES = 8 << 20   # most bytes handed to one sendmsg / recvmsg_into call
MAX_BUFFERS = 512       # most buffers in one call (Linux's IOV_MAX is 1024)
TOKEN_BYTES = 32
TOKEN_TIMEOUT_S = float(os.environ.get("HVD_EDL_STREAM_TOKEN_TIMEOUT_S", "2"))
"""Longest a connection to rank 0 may take to send its token once accepted (seconds).  A
receiver sends it with no round trip in between (right after ``connect``): it is usually in the
socket before the accept, and 2 s leave room for a descheduled receiver on loaded cores and for
a lost segment's retransmissions (Linux's minimum RTO is 0.2 s) while bounding how long a silent
connection holds a slot."""
MAX_PENDING = 64
"""Most accepted connections waiting for their token at once; one more closes the oldest."""
_LOG_EVERY = 100  # a kind of refusal is logged the first time and every 100th time
_ACCEPTED, _REFUSED, _DONE = b"\x01", b"\x00", b"\x02"
_ALL, _PREFIX, _NOTHING = b"A", b"P", b"N"  # what a receiver asks for, after its token


class StreamError(HorovodInternalError):
    """The state transfer failed (a peer died, went silent past the timeout, or was refused);
    a ``HorovodInternalError``, so ``hvd.elastic.run`` restores the last commit and moves to
    the next generation."""


class TokenRefused(StreamError):
    """The sender refused this receiver's token."""


@dataclass(frozen=True)
class TensorRef:
    """A tensor in the skeleton: its position in the stream, dtype (``str(torch.dtype)``),
    shape and size in bytes."""
    index: int
    dtype: str
    shape: Tuple[int, ...]
    nbytes: int


def _streamable(t) -> bool:
    import torch
    return (t.layout == torch.strided and not t.is_quantized and not t.is_nested
            and t.device.type == "cpu" and t.numel() > 0)


def split(*parts: Any) -> Tuple[List[Any], List[Any], List[int]]:
    """``parts`` (nested dicts, lists and tuples of tensors and plain values) as skeletons in
    which every dense CPU tensor is a :class:`TensorRef`, the list of those tensors (contiguous;
    the same tensor twice, as tied weights are, is sent once) in stream order, and after each
    part the number of tensors so far (so the first part's tensors are a prefix of the stream).
    Other values (sparse or quantized tensors, scalars) stay in the skeleton as they are."""
    import torch
    tensors: List[torch.Tensor] = []
    seen: Dict[tuple, int] = {}

    def walk(x):
        if isinstance(x, torch.Tensor) and _streamable(x):
            t = x.detach()
            key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
            index = seen.get(key)
            if index is None:
                index = seen[key] = len(tensors)
                tensors.append(t if t.is_contiguous() else t.contiguous())
            return TensorRef(index, str(t.dtype), tuple(t.shape),
                             t.numel() * t.element_size())
        if isinstance(x, dict):
            return _map_dict(x, lambda k, v: walk(v))
        if type(x) in (list, tuple):
            return type(x)(walk(v) for v in x)
        return x

    skeletons, ends = [], []
    for part in parts:
        skeletons.append(walk(part))
        ends.append(len(tensors))
    return skeletons, tensors, ends


def _map_dict(x: dict, fn) -> dict:
    """A shallow copy of dict ``x`` (its type and attributes kept: ``state_dict()``'s
    ``OrderedDict`` carries the modules' versions in ``_metadata``) with ``fn(key, value)`` as
    the values."""
    out = copy.copy(x)
    for k, v in x.items():
        out[k] = fn(k, v)
    return out


def _dtype(name: str):
    import torch
    dtype = getattr(torch, name.split(".", 1)[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise StreamError(f"state stream: unknown dtype {name!r}")
    return dtype


def _fits(t, ref: TensorRef) -> bool:
    import torch
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided
            and str(t.dtype) == ref.dtype and tuple(t.shape) == tuple(ref.shape)
            and t.is_contiguous() and not t.is_quantized)


def fill(skeleton: Any, *candidates: Any, pin: bool = False) -> Tuple[Any, List[Any]]:
    """Rebuild ``skeleton`` on a receiver: each :class:`TensorRef` becomes a destination tensor,
    the first of ``candidates`` (structures like the skeleton, e.g. the receiver's own
    ``state_dict()``) that has a contiguous CPU tensor of the same dtype and shape at the same
    place, else a new ``torch.empty`` (pinned with ``pin``).  Returns the rebuilt object and the
    destination of every stream index (what :func:`receive` writes into)."""
    import torch
    dests: Dict[int, torch.Tensor] = {}

    def child(c, k):
        if isinstance(c, dict):
            return c.get(k)
        if isinstance(c, (list, tuple)) and isinstance(k, int) and k < len(c):
            return c[k]
        return None

    def walk(x, cands):
        if isinstance(x, TensorRef):
            t = dests.get(x.index)
            if t is None:
                t = next((c.detach() for c in cands if _fits(c, x)), None)
                if t is None:
                    t = torch.empty(x.shape, dtype=_dtype(x.dtype),
                                    pin_memory=pin and torch.cuda.is_available())
                dests[x.index] = t
            return t
        if isinstance(x, dict):
            return _map_dict(x, lambda k, v: walk(v, [child(c, k) for c in cands]))
        if type(x) in (list, tuple):
            return type(x)(walk(v, [child(c, i) for c in cands]) for i, v in enumerate(x))
        return x

    rebuilt = walk(skeleton, list(candidates))
    missing = [i for i in range(len(dests)) if i not in dests]
    if missing or (dests and max(dests) != len(dests) - 1):
        raise StreamError("state stream: the skeleton's tensor indices are not 0..n-1")
    return rebuilt, [dests[i] for i in range(len(dests))]


def _byte_view(t) -> memoryview:
    """The bytes of contiguous CPU tensor ``t`` (any dtype, also bfloat16 and 0-dim), no copy."""
    import torch
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _pieces(views: Sequence[memoryview]) -> List[List[memoryview]]:
    """Group ``views`` into batches for one ``sendmsg`` / ``recvmsg_into`` each: at most
    ``MAX_BUFFERS`` buffers and about ``PIECE_BYTES`` bytes, large views cut in pieces."""
    batches: List[List[memoryview]] = []
    batch: List[memoryview] = []
    size = 0
    for v in views:
        for off in range(0, len(v), PIECE_BYTES):
            piece = v[off:off + PIECE_BYTES]
            if batch and (size + len(piece) > PIECE_BYTES or len(batch) >= MAX_BUFFERS):
                batches.append(batch)
                batch, size = [], 0
            batch.append(piece)
            size += len(piece)
    if batch:
        batches.append(batch)
    return batches


def _advance(batch: List[memoryview], n: int) -> List[memoryview]:
    """What is left of ``batch`` once its first ``n`` bytes went through."""
    while batch and n >= len(batch[0]):
        n -= len(batch[0])
        batch = batch[1:]
    if batch and n:
        batch = [batch[0][n:]] + batch[1:]
    return batch


def _send_all(sock: socket.socket, views: Sequence[memoryview]) -> int:
    sent = 0
    for batch in _pieces(views):
        while batch:
            n = sock.sendmsg(batch)
            sent += n
            batch = _advance(batch, n)
    return sent


def _recv_all(sock: socket.socket, views: Sequence[memoryview]) -> int:
    got = 0
    for batch in _pieces(views):
        while batch:
            n = sock.recvmsg_into(batch)[0]
            if n == 0:
                raise StreamError(f"state stream: the sender closed the connection after "
                                  f"{got} bytes")
            got += n
            batch = _advance(batch, n)
    return got


def _listening_socket(address: str) -> socket.socket:
    """A TCP socket listening on ``address`` (IPv4 or IPv6) at a port the system picks.

    Raises:
        StreamError: the address cannot be bound here.
    """
    sock = None
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET,
                             socket.SOCK_STREAM)
        sock.bind((address, 0))
        sock.listen(128)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise StreamError(f"state stream: cannot listen on {address}: {e}") from None
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    if n and _recv_all(sock, [memoryview(buf)]) != n:
        raise StreamError("state stream: short read")
    return bytes(buf)


# ---- release: the runtime shuts a running transfer down ---------------------------------------

_active: set = set()
_active_lock = threading.Lock()


def _track(sock: socket.socket) -> socket.socket:
    with _active_lock:
        _active.add(sock)
    return sock


def _untrack(sock: socket.socket) -> None:
    with _active_lock:
        _active.discard(sock)
    try:
        sock.close()
    except OSError:
        pass


_released = 0  # release() calls so far (an accept that fails after one says so)


def release() -> int:
    """Shut down (``SHUT_RDWR``) every socket of a transfer in progress in this process, so that
    a send, receive or accept blocked on a lost peer fails now; returns how many.  Called by
    ``WorkerRuntime.release_ring`` (any thread)."""
    global _released
    with _active_lock:
        socks = list(_active)
        _released += 1
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    return len(socks)


# ---- the two ends ------------------------------------------------------------------------------

def transfer_address() -> str:
    """The address rank 0 listens on, reachable by its peers: the IPv4 address of the interface
    Gloo uses (``HOROVOD_GLOO_IFACE``, which ``hvd-edl-run`` sets from ``--network-interface``,
    else ``lo``), else the local address of the route to the coordinator."""
    import psutil
    iface = os.environ.get("HOROVOD_GLOO_IFACE", "").split(",")[0].strip()
    for entry in psutil.net_if_addrs().get(iface, []) if iface else []:
        if entry.family == socket.AF_INET:
            return entry.address
    coord = os.environ.get("HVD_EDL_COORDINATOR_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((coord, int(os.environ.get("HVD_EDL_COORDINATOR_PORT", "9"))))
            return s.getsockname()[0]  # no packet is sent: the kernel only picks the route
    except OSError:
        return "127.0.0.1"


class StreamServer:
    """Rank 0's end: a listening socket on ``address`` (an ephemeral port) and a one-time
    32-byte random token; :meth:`serve` streams ``tensors`` (contiguous CPU tensors, as
    :func:`split` returns them) to a given number of receivers.

    Connections are accepted and authenticated concurrently on the serving thread (module
    docstring): another user's local process is closed unread, a wrong token refused, a
    connection silent for ``token_timeout_s`` closed, the oldest waiting one closed when
    ``max_pending`` wait; none of them counts as a receiver or delays one.  The counters
    :attr:`refused`, :attr:`other_users`, :attr:`silent` and :attr:`turned_away` say how many.

    Args:
        tensors: what to send, in stream order.
        prefix: how many of the first tensors a receiver asking for the prefix gets (the
            module buffers, which members holding the commit receive too).
        address: interface address to listen on (:func:`transfer_address`).
        timeout_s: bound of every socket operation, and of the wait for the next receiver
            (seconds).
        parallel: one sending thread per receiver rather than one after another (default
            :data:`PARALLEL`).
        token_timeout_s: how long an accepted connection may take to send its token (seconds;
            default :data:`TOKEN_TIMEOUT_S`, at most ``timeout_s``).
        max_pending: most connections waiting for their token at once (default
            :data:`MAX_PENDING`).

    Raises:
        StreamError: the socket cannot be opened.
    """

    request_extra = 1  # bytes a receiver sends after its token: the part it asks for

    def __init__(self, tensors: Sequence[Any], address: str, timeout_s: float = TIMEOUT_S,
                 parallel: Optional[bool] = None, prefix: int = 0,
                 token_timeout_s: Optional[float] = None, max_pending: int = MAX_PENDING,
                 listener: Optional["Listener"] = None, token: Optional[bytes] = None,
                 next_token: Optional[bytes] = None):
        self._views = [_byte_view(t) for t in tensors]
        self.nbytes = sum(len(v) for v in self._views)
        self._prefix = prefix
        self.prefix_nbytes = sum(len(v) for v in self._views[:prefix])
        self.timeout_s = timeout_s
        self.token_timeout_s = min(TOKEN_TIMEOUT_S if token_timeout_s is None
                                   else token_timeout_s, timeout_s)
        self.max_pending = max(1, int(max_pending))
        self.parallel = PARALLEL if parallel is None else parallel
        self.token = token if token is not None else secrets.token_bytes(TOKEN_BYTES)
        self.next_token = next_token  # a receiver already at the next sync (shared listener)
        self.shared = listener
        self.refused = 0      # connections whose token was wrong
        self.other_users = 0  # local connections owned by another user, closed unread
        self.silent = 0       # connections that closed or sent no whole token in time
        self.turned_away = 0  # waiting connections closed because max_pending were waiting
        self.receivers = 0  # connections that asked for the stream or its prefix (not nothing)
        if listener is not None:
            self._listener = listener.sock
            self.address, self.port = listener.address, listener.port
            return
        self._listener = _track(_listening_socket(address))
        self.address = address
        self.port = self._listener.getsockname()[1]

    def endpoint(self) -> Dict[str, Any]:
        """What receivers need (address, port, token hex, bytes of the stream and of its
        prefix): goes with the skeleton."""
        return {"address": self.address, "port": self.port, "token": self.token.hex(),
                "nbytes": self.nbytes, "prefix_nbytes": self.prefix_nbytes}

    def serve(self, receivers: int) -> int:
        """Accept ``receivers`` connections with the right token (others are closed and not
        counted) and send each the whole stream, its prefix or nothing, as it asks; returns
        once each acknowledged, with the bytes sent in all (``self.receivers``: how many asked
        for the stream or its prefix).

        Raises:
            StreamError: no next receiver authenticated within ``timeout_s`` (however many
                other connections came), a receiver stalled or failed within the timeout, or
                :func:`release` was called.
        """
        errors: List[BaseException] = []
        threads: List[threading.Thread] = []
        sent = [0]
        lock = threading.Lock()

        def send(conn, part):
            try:
                n = self._send_to(conn, part)
                with lock:
                    sent[0] += n
            except BaseException as e:  # noqa: BLE001 - reported by serve()
                errors.append(e)
            finally:
                _untrack(conn)

        conns: List[socket.socket] = []
        door = _Door(self)
        try:
            deadline = time.monotonic() + self.timeout_s
            while len(conns) < receivers and not errors:
                got = door.next(deadline, lambda: bool(errors))
                if got is None:
                    break  # a sending thread failed: reported below
                conns.append(got[0])
                if self.parallel:
                    th = threading.Thread(target=send, args=got, daemon=True,
                                          name="hvd_edl-stream")
                    th.start()
                    threads.append(th)
                else:
                    send(*got)
                deadline = time.monotonic() + self.timeout_s
        except BaseException:
            for conn in conns:  # the other receivers fail now, not after the timeout
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            raise
        finally:
            door.close()
            for th in threads:
                th.join()
            if self.shared is None:
                _untrack(self._listener)
            self._log_refusals(len(conns))
        if errors:
            e = errors[0]
            raise e if isinstance(e, StreamError) else StreamError(
                f"state stream: sending failed: {e}") from None
        return sent[0]

    def close(self) -> None:
        """Stop listening (when :meth:`serve` is not called; a shared :class:`Listener` stays
        open)."""
        if self.shared is None:
            _untrack(self._listener)

    def _log_refusals(self, served: int) -> None:
        closed = self.refused + self.other_users + self.silent + self.turned_away
        if closed:
            log.warning("state stream: %d receiver(s) served; %d other connection(s) closed: "
                        "%d wrong token, %d another user's, %d no token within %.1f s, %d past "
                        "%d waiting", served, closed, self.refused, self.other_users,
                        self.silent, self.token_timeout_s, self.turned_away, self.max_pending)

    def _part(self, request: bytes) -> bytes:
        """The part of the stream a receiver gets for the bytes it sent after its token."""
        return request

    def _preamble(self, part: bytes) -> bytes:
        """What a receiver gets after ``_ACCEPTED``, before the tensors' bytes."""
        return b""

    def _send_to(self, conn: socket.socket, request: bytes) -> int:
        try:
            part = self._part(request)
            conn.sendall(_ACCEPTED + self._preamble(part))
            if part == _NOTHING:
                n = 0
            else:
                n = _send_all(conn, self._views[:self._prefix] if part == _PREFIX else self._views)
                self.receivers += 1  # one sending thread per connection: += under the GIL
            if _recv_exactly(conn, 1) != _DONE:
                raise StreamError("state stream: the receiver did not confirm")
            return n
        except OSError as e:
            raise StreamError(f"state stream: sending to a receiver failed: {e}") from None


class _Door:
    """Accepts connections to a :class:`StreamServer`'s listener and authenticates them
    concurrently on the calling thread: one ``selectors`` loop, no thread per connection, each
    connection at most ``token_timeout_s`` and at most ``max_pending`` of them at once."""

    def __init__(self, server: StreamServer):
        self.server = server
        self.listener = server._listener
        self.listener.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ)
        # connection -> [token deadline (monotonic), bytes so far, peer], oldest first
        self.pending: "collections.OrderedDict[socket.socket, list]" = collections.OrderedDict()
        self.ready: "collections.deque[Tuple[socket.socket, bytes]]" = collections.deque()
        self.released = _released
        self.local_addrs: Optional[frozenset] = None  # read at the first connection
        self.want = TOKEN_BYTES + server.request_extra  # bytes of a receiver's request
        if server.shared is not None:  # receivers that came during the sync before this one
            for token, early in list(server.shared.early.items()):
                del server.shared.early[token]
                for conn, request in early:
                    if hmac.compare_digest(token, server.token):
                        self.ready.append((conn, request))
                    else:  # stale: meant for a sync of an earlier generation
                        _untrack(conn)
            # accepted by the sync before this one, whose last receiver came before their
            # token had arrived: read on here (their token deadline unchanged)
            carried, server.shared.unread = server.shared.unread, []
            for conn, entry in carried:
                self.pending[conn] = entry
                self.sel.register(conn, selectors.EVENT_READ)
                self._read(conn)

    def next(self, deadline: float, stop: Callable[[], bool]
             ) -> Optional[Tuple[socket.socket, bytes]]:
        """The next connection that sent the right token, as (socket, blocking with the server's
        timeout; the part it asks for); None as soon as ``stop()`` holds.

        Raises:
            StreamError: none before ``deadline`` (``time.monotonic()``), or :func:`release`
                was called, or accepting failed for good.
        """
        while not self.ready:
            if stop():
                return None
            if _released != self.released:
                raise StreamError("state stream: released while waiting for a receiver (a "
                                  "member of the ring was lost)")
            now = time.monotonic()
            if now >= deadline:
                raise StreamError(f"state stream: a receiver did not connect within "
                                  f"{self.server.timeout_s:.0f} s")
            wake = deadline
            if self.pending:  # the oldest waits longest (one token timeout for all)
                wake = min(wake, next(iter(self.pending.values()))[0])
            for key, _ in self.sel.select(min(max(wake - now, 0.0), 0.25)):
                if key.fileobj is self.listener:
                    self._accept()
                else:
                    self._read(key.fileobj)
            self._expire(time.monotonic())
        return self.ready.popleft()

    def close(self) -> None:
        """Close every connection not handed out yet, and the selector (not the listener); on a
        shared :class:`Listener` (unless :func:`release` was called) the ones still waiting for
        their token stay open for the next server on it: under load a receiver already at the
        next sync can be accepted here a moment before its token arrives (closing it failed
        that receiver's sync: a reset connection, a rollback)."""
        carry = self.server.shared is not None and _released == self.released
        for conn in list(self.pending):
            if carry:
                self.server.shared.unread.append((conn, self._forget(conn)))
            else:
                _untrack(conn)
        self.pending.clear()
        while self.ready:
            _untrack(self.ready.popleft()[0])
        self.sel.close()

    def _accept(self) -> None:
        server = self.server
        for _ in range(server.max_pending):  # then back to select: the waiting ones read too
            try:
                conn, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if _released != self.released:
                    return  # next() says so
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if self.pending:
                        self._drop(next(iter(self.pending)), "turned_away",
                                   f"out of descriptors ({e.strerror}): closed the oldest "
                                   f"connection waiting for its token")
                        continue
                    log.warning("state stream: cannot accept a connection: %s", e)
                    time.sleep(0.05)  # bounded by next()'s deadline
                    return
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue  # that connection went away before the accept
                raise StreamError(f"state stream: accepting a receiver failed: {e}") from None
            _track(conn)
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            try:
                conn.setblocking(False)
                uid = self._other_user(conn)
            except OSError as e:
                self.pending[conn] = [0.0, bytearray(), peer]
                self._drop(conn, "silent", f"closed before sending its token ({e})")
                continue
            if uid is not None:
                server.other_users += 1
                self._note(server.other_users, f"closed a connection from {peer}: owned by "
                                                f"uid {uid}, not this job's user")
                _untrack(conn)
                continue
            self.pending[conn] = [time.monotonic() + server.token_timeout_s, bytearray(), peer]
            self.sel.register(conn, selectors.EVENT_READ)
            self._read(conn)  # a receiver's token is usually there already
            if len(self.pending) > server.max_pending:
                self._drop(next(iter(self.pending)), "turned_away",
                           f"{server.max_pending} connections waiting for their token: "
                           f"closed the oldest")

    def _other_user(self, conn: socket.socket) -> Optional[int]:
        if self.local_addrs is None:
            try:
                self.local_addrs = peer_uid.local_addresses()
            except Exception:  # noqa: BLE001 - psutil failing: loopback is still checked
                log.debug("state stream: cannot list this machine's addresses", exc_info=True)
                self.local_addrs = frozenset()
        return peer_uid.other_users_peer(conn, self.local_addrs)

    def _read(self, conn: socket.socket) -> None:
        entry = self.pending.get(conn)
        if entry is None:
            return
        buf = entry[1]
        try:
            data = conn.recv(self.want - len(buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._drop(conn, "silent", f"failed before sending its whole token ({e})")
            return
        if not data:
            self._drop(conn, "silent", f"closed after {len(buf)} of {self.want} bytes "
                                       f"of its token")
            return
        buf += data
        if len(buf) < self.want:
            return
        self._forget(conn)
        token, part = bytes(buf[:TOKEN_BYTES]), bytes(buf[TOKEN_BYTES:])
        nxt = self.server.next_token
        if self.server.shared is not None and nxt is not None \
                and hmac.compare_digest(token, nxt):
            # a receiver done with this sync and already at the next one (every rank syncs in
            # the same order): kept for the next StreamServer on this listener
            conn.settimeout(self.server.timeout_s)
            self.server.shared.early.setdefault(nxt, []).append((conn, part))
            return
        if not hmac.compare_digest(token, self.server.token):
            self.server.refused += 1
            self._note(self.server.refused, f"refused a connection from {entry[2]} with a "
                                            f"wrong token")
            try:
                conn.send(_REFUSED)
            except OSError:
                pass
            _untrack(conn)
            return
        conn.settimeout(self.server.timeout_s)
        self.ready.append((conn, part))

    def _expire(self, now: float) -> None:
        while self.pending:
            conn, entry = next(iter(self.pending.items()))
            if entry[0] > now:
                return
            self._drop(conn, "silent", f"sent no token within {self.server.token_timeout_s:.1f}"
                                       f" s of being accepted")

    def _forget(self, conn: socket.socket) -> Optional[list]:
        entry = self.pending.pop(conn, None)
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        return entry

    def _drop(self, conn: socket.socket, kind: str, why: str) -> None:
        entry = self._forget(conn)
        count = getattr(self.server, kind) + 1
        setattr(self.server, kind, count)
        self._note(count, f"closed a connection from {entry[2] if entry else '?'}: {why}")
        _untrack(conn)

    @staticmethod
    def _note(count: int, what: str) -> None:
        if count == 1 or count % _LOG_EVERY == 0:
            log.warning("state stream: %s (%d of this kind so far)", what, count)


def decline(endpoint: Dict[str, Any], timeout_s: float = TIMEOUT_S) -> int:
    """A member that holds everything: connect to ``endpoint``, send the token and ask for
    nothing (the sender counts every member, so none needs a collective to say who lacks what);
    returns 0, the bytes received.

    Raises:
        TokenRefused, StreamError: as :func:`receive`.
    """
    return receive(endpoint, [], timeout_s, part=_NOTHING)


def receive(endpoint: Dict[str, Any], dests: Sequence[Any], timeout_s: float = TIMEOUT_S,
            prefix: bool = False, part: Optional[bytes] = None) -> int:
    """A receiver's end: connect to ``endpoint`` (:meth:`StreamServer.endpoint`), send the token
    and receive every tensor of the stream (with ``prefix``, of its prefix) into ``dests``
    (contiguous CPU tensors, in stream order, as :func:`fill` returns them).  Returns the bytes
    received.  (``part``: :func:`decline`'s request for nothing.)

    Raises:
        TokenRefused: the sender refused the token.
        StreamError: the sender could not be reached, stalled past ``timeout_s`` (any one
            operation) or closed early, or ``dests`` do not add up to the bytes it sends.
    """
    views = [_byte_view(t) for t in dests]
    if part is None:
        part = _PREFIX if prefix else _ALL
    expected = 0 if part == _NOTHING else int(
        endpoint.get("prefix_nbytes" if prefix else "nbytes", -1))
    if sum(len(v) for v in views) != expected:
        raise StreamError(f"state stream: destinations hold {sum(len(v) for v in views)} "
                          f"bytes, the sender sends {expected}")
    try:
        sock = socket.create_connection((endpoint["address"], int(endpoint["port"])),
                                        timeout=timeout_s)
    except OSError as e:
        raise StreamError(f"state stream: cannot reach rank 0 at {endpoint['address']}:"
                          f"{endpoint['port']}: {e}") from None
    _track(sock)
    try:
        sock.settimeout(timeout_s)
        sock.sendall(bytes.fromhex(str(endpoint["token"])) + part)
        status = sock.recv(1)
        if status == _REFUSED:
            raise TokenRefused("state stream: rank 0 refused this receiver's token")
        if status != _ACCEPTED:
            raise StreamError("state stream: rank 0 closed the connection before sending")
        got = _recv_all(sock, views)
        sock.sendall(_DONE)
        return got
    except OSError as e:
        raise StreamError(f"state stream: receiving from rank 0 failed: {e}") from None
    finally:
        _untrack(sock)


# ---- the header over the stream: rank 0's endpoint known from the assignment -----------------
#
# Every worker under hvd-edl-run listens on one socket for its whole life (:class:`Listener`,
# opened before it registers; its address and port go with ``messages.Register``).  The
# coordinator puts rank 0's in every member's ``Assignment`` with a fresh per-generation
# ``state_token``, so a receiver connects at once after ``hvd.init()``: the header (scalars,
# samplers, steps, rank 0's held step, the skeleton) comes over the same connection as the
# tensors, and no Horovod collective runs in the sync at all.  A receiver's request is its key
# and the (step, commit count) it holds; rank 0 decides from them what it sends (everything,
# the prefix or nothing) and says so in the header.
#
# Keys come from the job's secret (which never travels), the generation's token and the sync's
# number within the generation (:func:`sync_keys`): the receiver proves it with one key, rank 0
# signs the header with the other (HMAC-SHA256), and a receiver unpickles a header only after
# that signature checks, so nobody who lacks the job's secret can hand one a pickle (the header
# is pickled as Horovod's ``broadcast_object`` pickles the whole state: scalars are any
# picklable objects in Horovod's ``TorchState``).

_HELD = struct.Struct("!qq")   # a receiver's held step and commit count
_LENGTH = struct.Struct("!Q")  # the header's length
MAX_HEADER_BYTES = 64 << 20
"""Largest header a receiver accepts (the skeleton of a model with millions of tensors fits)."""


class Listener:
    """This process's listening socket for the state syncs in which it is rank 0, open for the
    process's life on ``address`` (an ephemeral port).  ``early`` holds connections that came
    while an earlier sync was still being served (:class:`StreamServer` ``next_token``);
    ``unread`` those an earlier sync's server accepted but had not read a whole token from when
    it finished (socket, [token deadline (monotonic s), bytes so far, peer]).

    Raises:
        StreamError: the socket cannot be opened.
    """

    def __init__(self, address: str):
        self.sock = _listening_socket(address)
        self.address = address
        self.port = self.sock.getsockname()[1]
        self.early: Dict[bytes, List[Tuple[socket.socket, bytes]]] = {}
        self.unread: List[Tuple[socket.socket, list]] = []


_listener: Optional[Listener] = None


def open_listener() -> Optional[Listener]:
    """Open this process's :class:`Listener` on :func:`transfer_address` (once); None when it
    cannot be opened (the sync then sends its header in a broadcast, as before; logged)."""
    global _listener
    if _listener is None:
        try:
            _listener = Listener(transfer_address())
        except (StreamError, OSError) as e:
            log.warning("state stream: no listening socket (%s): the state sync's header "
                        "goes in a Horovod broadcast", e)
    return _listener


def listener() -> Optional[Listener]:
    """This process's :class:`Listener`, None before :func:`open_listener` (or if it failed)."""
    return _listener


def sync_keys(secret: str, token: str, seq: int) -> Tuple[bytes, bytes]:
    """(receiver key, sender key) of sync number ``seq`` (from 1) of the generation whose
    ``Assignment.state_token`` is ``token``, under the job's ``secret``: HMAC-SHA256 of
    distinct labels, 32 bytes each."""
    def key(label: str) -> bytes:
        return hmac.new(secret.encode(), f"hvd_edl state {label} {token} {seq}".encode(),
                        hashlib.sha256).digest()
    return key("receiver"), key("sender")


def lacks(root: Sequence[int], mine: Sequence[int]) -> bool:
    """Whether a rank holding (step, commit count) ``mine`` lacks rank 0's ``root`` (-1: none)."""
    return root[0] < 0 or mine[0] < 0 or tuple(mine) != tuple(root)


class HeaderStreamServer(StreamServer):
    """Rank 0's end when the header travels over the stream: a :class:`StreamServer` on this
    process's :class:`Listener` whose receivers send their key and held (step, commit count)
    and get ``_ACCEPTED``, the part rank 0 chose for them, the header's length, the pickled
    ``header`` and its HMAC-SHA256 under ``sender_key``, then that part's bytes.

    Args:
        tensors, prefix, timeout_s, parallel: as :class:`StreamServer`.
        listener: this process's :class:`Listener`.
        keys: :func:`sync_keys` of this sync; ``next_key``: the receiver key of the next one.
        header: what every receiver gets (picklable).
        root_held: rank 0's (step, commit count).
    """

    request_extra = _HELD.size

    def __init__(self, tensors: Sequence[Any], listener: Listener, keys: Tuple[bytes, bytes],
                 next_key: bytes, header: Any, root_held: Sequence[int], prefix: int = 0,
                 timeout_s: float = TIMEOUT_S, parallel: Optional[bool] = None):
        super().__init__(tensors, listener.address, timeout_s=timeout_s, parallel=parallel,
                         prefix=prefix, listener=listener, token=keys[0], next_token=next_key)
        self.root_held = tuple(int(x) for x in root_held)
        self._blob = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
        self._sender_key = keys[1]
        self.holders = 0  # receivers that held rank 0's commit

    def _part(self, request: bytes) -> bytes:
        if not self._views:
            return _NOTHING
        if lacks(self.root_held, _HELD.unpack(request)):
            return _ALL
        self.holders += 1
        return _PREFIX if self.prefix_nbytes > 0 else _NOTHING

    def _preamble(self, part: bytes) -> bytes:
        nbytes = {_ALL: self.nbytes, _PREFIX: self.prefix_nbytes}.get(part, 0)
        head = part + _LENGTH.pack(nbytes) + _LENGTH.pack(len(self._blob)) + self._blob
        return head + hmac.new(self._sender_key, head, hashlib.sha256).digest()


def fetch(address: str, port: int, keys: Tuple[bytes, bytes], held: Sequence[int],
          destinations: Callable[[Any, bytes], Sequence[Any]],
          timeout_s: float = TIMEOUT_S) -> Dict[str, Any]:
    """A receiver's end of :class:`HeaderStreamServer`: connect to rank 0 at ``address:port``,
    send the receiver key and ``held`` (step, commit count), read and check the header, call
    ``destinations(header, part)`` (``part``: b"A" everything, b"P" the prefix, b"N" nothing)
    for the tensors to receive into (contiguous CPU tensors, in stream order) and receive them.

    Returns ``{"header", "part", "received_bytes", "header_s", "skeleton_s", "transfer_s"}``
    (seconds: connect to header checked and unpickled; ``destinations``; the tensors' bytes).

    Raises:
        TokenRefused: rank 0 refused the key.
        StreamError: rank 0 could not be reached, stalled past ``timeout_s`` (any one
            operation; :func:`release` ends the wait at once), closed early, sent a header
            whose signature does not check, or ``destinations`` do not fit the bytes it sends.
    """
    t0 = time.monotonic()
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = _track(socket.socket(family, socket.SOCK_STREAM))  # release() can end the connect
    try:
        sock.settimeout(timeout_s)
        try:
            sock.connect((address, int(port)))
        except OSError as e:
            raise StreamError(f"state stream: cannot reach rank 0 at {address}:{port}: "
                              f"{e}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(keys[0] + _HELD.pack(*(int(x) for x in held)))
            status = sock.recv(1)
            if status == _REFUSED:
                raise TokenRefused("state stream: rank 0 refused this receiver's key")
            if status != _ACCEPTED:
                raise StreamError("state stream: rank 0 closed the connection before sending")
            lengths = _recv_exactly(sock, 1 + 2 * _LENGTH.size)
            part = lengths[:1]
            nbytes, length = _LENGTH.unpack(lengths[1:9])[0], _LENGTH.unpack(lengths[9:])[0]
            if part not in (_ALL, _PREFIX, _NOTHING) or length > MAX_HEADER_BYTES:
                raise StreamError("state stream: rank 0's header is malformed")
            blob = _recv_exactly(sock, length)
            mac = _recv_exactly(sock, 32)
            want = hmac.new(keys[1], lengths + blob, hashlib.sha256).digest()
            if not hmac.compare_digest(mac, want):
                raise StreamError("state stream: rank 0's header does not carry this job's "
                                  "signature")
            header = pickle.loads(blob)  # signed under the job's secret: see above
            t1 = time.monotonic()
            dests = list(destinations(header, part))
            t2 = time.monotonic()
            views = [_byte_view(t) for t in dests]
            if sum(len(v) for v in views) != nbytes:
                raise StreamError(f"state stream: destinations hold "
                                  f"{sum(len(v) for v in views)} bytes, rank 0 sends {nbytes}")
            got = _recv_all(sock, views)
            sock.sendall(_DONE)
        except OSError as e:
            raise StreamError(f"state stream: receiving from rank 0 failed: {e}") from None
        return {"header": header, "part": part, "received_bytes": got,
                "header_s": t1 - t0, "skeleton_s": t2 - t1,
                "transfer_s": time.monotonic() - t2}
    finally:
        _untrack(sock)
