"""One Gloo rendezvous per generation: the key-value store Horovod's C++ ``HTTPStore`` talks to,
with the semantics of Horovod's own ``RendezvousHandler`` (``horovod.runner.http.http_server``:
``PUT`` stores, ``GET`` answers the value or 404, ``DELETE`` removes a rank's key), served by an
asyncio server in the launcher instead of Horovod's thread-per-request ``http.server``: each of the
about 28 requests a rank sends per ``hvd.init()`` then costs the launcher a fraction of a
millisecond of CPU, on the same CPUs the members need to initialise Gloo.

Horovod's Gloo controller reads ``HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT`` at every ``hvd.init()`` and
keeps its keys under fixed scopes ("global", "local<host>", "cross<n>"), so each generation gets a
fresh server on a fresh ephemeral port: no stale key of an old ring can reach a new one.  A spare
server is started ahead of time so that forming a generation never waits for a socket or a thread.
Servers bind to the launcher's chosen address, not every interface.

Guarding it.  The client is Horovod's C++ ``HTTPStore`` (``horovod/common/gloo/http_store.cc``),
which we patch at build time (``cmake/patches/0002-rendezvous-token.patch``) to send the
``ENV_TOKEN`` environment variable as the ``TOKEN_HEADER`` header of every request.  Each
generation's server draws its own random token; the coordinator hands it to that generation's
members only, in their (signed) :class:`hvd_edl.messages.Assignment`.  What each server does:

* every bound of :mod:`launcher.serve.bounded_http` before anything else: ``MAX_CONNECTIONS``
  connections (503 past it), a head of ``MAX_HEADER_BYTES`` / ``MAX_HEADERS`` lines (431) sent
  within ``REQUEST_TIMEOUT_S`` (408), a ``BACKLOG`` of 1024, and no connection from another
  user's process on this machine (403, where the OS says who owns the peer's socket);
* answers only the addresses of that generation's member hosts (this machine's own addresses
  for local hosts); everything else gets 403 before its request is looked at;
* answers only requests carrying the generation's token: none 401, a wrong one 403, and neither
  reads, stores nor deletes anything;
* accepts only ``/<scope>/<key>`` paths of printable characters up to ``MAX_PATH_CHARS``, values
  up to ``MAX_VALUE_BYTES`` (413) and a store of at most ``MAX_STORE_BYTES`` in all (plus
  what Gloo's full mesh of the generation's size needs, see ``mesh_bytes``), key names
  counted (``KEY_OVERHEAD_BYTES`` each beyond the name), and at most ``MAX_KEYS`` keys (413);
* refuses ``HEAD`` (Horovod's handler inherits ``SimpleHTTPRequestHandler.do_HEAD``, which would
  report on files in the launcher's working directory) and every other method but GET/PUT/DELETE
  and the ``POST /<scope>/multi_get`` below (405), a PUT or POST without ``Content-Length``
  (411), a multi_get of more than ``MULTI_GET_MAX_KEYS`` keys (400);
* is *sealed* once the next generation forms (every live member has then left it): it answers
  only the ``DELETE`` Horovod sends at shutdown, so its keys can no longer be read or planted.

Serving it fast.  Horovod's ``HTTPStore::wait`` polls for a missing key every 10 ms, and its
``get`` of the ``rank_<i>`` keys does not wait at all; one ``hvd.init()`` runs six rendezvous (global,
local and cross, then the same three for the global process set), each a few such waits.  A GET
of a key that is not there yet is therefore *held* here (up to ``HOLD_S``) until a PUT brings it,
and answered at once with the value: every wait ends the moment the key exists instead of at the
next 10 ms poll, and the ``rank_<i>`` reads see the real host names.  After ``HOLD_S`` a held GET
gets Horovod's usual 404 and the client polls again, so a member that never comes still ends in
Gloo's own timeout (``HOROVOD_GLOO_TIMEOUT_SECONDS``).

With our patch 0007 (``HVD_EDL_GLOO_FAST_INIT=1``) Gloo's ``connectFullMesh`` asks for all the keys
it needs in one ``POST /<scope>/multi_get`` (the keys one per line; the answer, each value behind
its 4-byte big-endian length, about a megabyte an answer), held the same way until every key
exists: three requests per rank and rendezvous (its two PUTs and the multi_get) instead of one per
key and peer, 48 instead of 456 for a 16-rank ``hvd.init()`` (``benchmarks/job/scale.py --parts
init``).

Residual risk: the token travels in clear text, like the rest of the rendezvous; whoever can
read a member's traffic or environment (root, or that member's own user) can use it while its
generation lasts.  What is left beyond that is Gloo's own peer-to-peer TCP: the ring's pairs are
not authenticated, so a process that can reach a member's Gloo port may connect to it or send
it what ``state.sync()`` unpickles.  Run jobs on hosts and networks whose other users you trust.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import ipaddress
import logging
import secrets
import socket
import threading
from typing import Dict, FrozenSet, Iterable, List, Optional, Set, Tuple


from launcher.serve.bounded_http import (BodyReader, BoundedHTTPServer, HttpError, Limits, Request,
                                   Response, connection_cap, listen_socket)
from hvd_edl import peer_uid
from launcher.discovery.hosts import is_local, parse_ip

log = logging.getLogger(__name__)

MAX_PATH_CHARS = 512
MAX_VALUE_BYTES = 1 << 20    # Gloo stores a few hundred bytes of addresses per rank
MAX_STORE_BYTES = 64 << 20   # all values of one generation together
LOOPBACK = "loopback"        # in an allow-list: any loopback address
HOLD_S = 2.0                 # longest a GET of a missing key waits for its PUT (seconds)
REQUEST_TIMEOUT_S = 3.0      # to send a request's head or body (Horovod's server: the same)
MAX_KEYS = 100_000           # keys of one generation (Gloo: a few per rank and rendezvous)
KEY_OVERHEAD_BYTES = 64      # what a key costs beyond its name, counted against MAX_STORE_BYTES
GLOO_ADDRESS_BYTES = 136     # one pair address in Gloo's full-mesh key (tcp::Address::Impl)
MAX_CONNECTIONS = 4096       # concurrent connections per server (a rank holds one at a time,
                             # but a closed one is counted until the loop sees it end: at 1,024
                             # ranks a cap of 1,024 turned PUTs away, and Horovod's store gives
                             # up after 3 tries: benchmarks/job/control_plane.py)
MAX_HEADER_BYTES = 16 << 10  # request line and headers (Horovod sends about 150 bytes)
MAX_HEADERS = 32
BACKLOG = 1024               # every rank of a large job connects at once
MULTI_GET = "multi_get"        # POST /<scope>/multi_get: many keys in one request (patch 0007)
MULTI_GET_MAX_KEYS = 1024     # keys per multi_get request (Horovod's side sends 64 at most)
MULTI_GET_MAX_BYTES = 1 << 20  # a multi_get answer ends after the value that reaches this
TOKEN_HEADER = "X-Hvd-Edl-Rendezvous-Token"   # sent by our patch of Horovod's HTTPStore
ENV_TOKEN = "HOROVOD_GLOO_RENDEZVOUS_TOKEN"   # where the patched HTTPStore reads it


def _normalise(addr: str) -> str:
    """An IP address in canonical text, IPv4-mapped IPv6 turned into IPv4 (``addr`` itself when
    it is not an IP address)."""
    ip = parse_ip(addr)
    return addr if ip is None else str(ip)


@functools.lru_cache(maxsize=1)
def local_addresses() -> FrozenSet[str]:
    """This machine's addresses (:func:`hvd_edl.peer_uid.local_addresses`), read once per
    process: the same frozenset each call (:func:`know_host` tells local hosts by identity)."""
    return peer_uid.local_addresses()


@functools.lru_cache(maxsize=1024)
def _host_addresses(host: str) -> FrozenSet[str]:
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if is_local(host) or is_local(name):
        return local_addresses()
    try:
        return frozenset(_normalise(info[4][0]) for info in socket.getaddrinfo(name, None))
    except OSError as e:
        log.warning("rendezvous: cannot resolve member host %s (%s); its workers will be "
                    "refused by the Gloo rendezvous", host, e)
        return frozenset()


_KNOWN_HOSTS: Dict[str, FrozenSet[str]] = {}   # hosts an engine names itself (--ray: node ids)


def know_host(host: str, addresses: Iterable[str]) -> None:
    """Host ``host`` has ``addresses`` (no name resolution for it): an engine whose hosts are
    not DNS names says so (``launcher/ray/engine.py``: a Ray node id -> the node's address)."""
    _KNOWN_HOSTS[host] = frozenset(_normalise(a) for a in addresses)


def allowed_peers(hosts: Iterable[str]) -> FrozenSet[str]:
    """Addresses the workers of ``hosts`` may connect from: each host's resolved addresses (or
    those :func:`know_host` gave), and every address of this machine plus loopback for local
    hosts."""
    out: Set[str] = set()
    for h in hosts:
        addrs = _KNOWN_HOSTS.get(h) or _host_addresses(h)
        out |= addrs
        if addrs is local_addresses():
            out.add(LOOPBACK)  # all of 127.0.0.0/8, not only the interface's 127.0.0.1
    return frozenset(out)


def peer_allowed(peer: str, allowed: FrozenSet[str]) -> bool:
    """Whether a connection from ``peer`` (an IP address) is in ``allowed``."""
    addr = _normalise(peer)
    if addr in allowed:
        return True
    try:
        return LOOPBACK in allowed and ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


class GenerationStore:
    """One generation's key-value store and its listening socket (state owned by the event
    loop's thread; ``allowed`` is replaced whole, so reading it from there is safe)."""

    def __init__(self):
        self.token = secrets.token_hex(32)   # the members' proof (HOROVOD_GLOO_RENDEZVOUS_TOKEN)
        self.cache: Dict[str, Dict[str, bytes]] = {}
        self.allowed: FrozenSet[str] = frozenset()
        self.sealed = False
        self.refused = 0
        self.bytes = 0      # values and key names together
        self.mesh_bytes = 0  # allowed beyond MAX_STORE_BYTES for this generation's size
        self.keys = 0
        self.waiters: Dict[Tuple[str, str], List[asyncio.Future]] = {}
        self.server: Optional[BoundedHTTPServer] = None
        self.port = 0

    def key_bytes(self, scope: str, key: str) -> int:
        """What a new key ``scope/key`` adds to ``bytes`` beyond its value (0 if it exists)."""
        if key in self.cache.get(scope, {}):
            return 0
        return len(scope) + len(key) + KEY_OVERHEAD_BYTES

    def put(self, scope: str, key: str, value: bytes) -> None:
        old = self.cache.setdefault(scope, {}).get(key)
        if old is None:
            self.bytes += self.key_bytes(scope, key)
            self.keys += 1
        self.bytes += len(value) - (len(old) if old is not None else 0)
        self.cache[scope][key] = value
        for f in self.waiters.pop((scope, key), []):
            if not f.done():
                f.set_result(None)

    def delete(self, scope: str, key: str) -> None:
        # Horovod's RendezvousHandler.do_DELETE for an "ad hoc" scope (no allocation plan)
        d = self.cache.get(scope)
        if d is not None:
            value = d.pop(key, None)
            if value is not None:
                self.bytes -= len(value) + len(scope) + len(key) + KEY_OVERHEAD_BYTES
                self.keys -= 1
            if not d:
                del self.cache[scope]

    def seal(self) -> None:
        self.sealed = True
        for futures in self.waiters.values():
            for f in futures:
                if not f.done():
                    f.set_result(None)
        self.waiters.clear()


class GenerationRendezvous:
    """Hands out a started rendezvous server per generation; keeps the last two running (the
    older one sealed: Horovod's shutdown still sends it a DELETE).

    All servers run on one asyncio event loop in one thread: a request costs a fraction of a
    millisecond of the launcher's CPU (no thread per request, no ``http.server`` parsing), which
    matters while the members' Gloo initialisation needs the same CPUs.

    Args:
        bind_addr: address the servers listen on (e.g. "127.0.0.1").
        verbose: log every request at INFO.
    """

    def __init__(self, bind_addr: str, verbose: bool = False):
        self.bind_addr = bind_addr
        self.verbose = verbose
        self._servers: Dict[int, GenerationStore] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rendezvous",
                                        daemon=True)
        self._thread.start()
        self._spare: Optional[GenerationStore] = self._start()

    # ---- called from the launcher's threads ----------------------------------------------------

    def _call(self, coroutine_fn, *args):
        """Run ``coroutine_fn(*args)`` on the event loop; wait (at most 30 s) for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine_fn(*args), self._loop).result(30)

    def _start(self) -> GenerationStore:
        return self._call(self._listen)

    def open(self, generation: int, hosts: Iterable[str] = ("localhost",), size: int = 0) -> int:
        """A fresh rendezvous for ``generation`` of ``size`` ranks whose members run on
        ``hosts``; returns its TCP port.  Earlier generations' servers are sealed; those before
        ``generation - 1`` stopped.

        Gloo's ``connectFullMesh`` has every rank store (size - 1) pair addresses of
        ``GLOO_ADDRESS_BYTES``: size^2 x 136 bytes per scope, 142 MB at 1,024 ranks, more than
        ``MAX_STORE_BYTES`` (a ring above ~690 ranks could not form), so the store may hold
        twice that beyond it."""
        peers = allowed_peers(hosts)
        with self._lock:
            store = self._spare or self._start()
            self._spare = None
            store.allowed = peers
            store.mesh_bytes = 2 * size * size * GLOO_ADDRESS_BYTES
            earlier = list(self._servers.values())
            self._servers[generation] = store
            stale = [self._servers.pop(g) for g in [g for g in self._servers
                                                    if g < generation - 1]]
        for old in earlier:
            self._loop.call_soon_threadsafe(old.seal)
        threading.Thread(target=self._refill_and_stop, args=(stale,), daemon=True).start()
        return store.port

    def abort(self, generation: int) -> None:
        """Seal ``generation``'s server now (a member of it died, possibly while its rings
        form): held GETs are answered and every further GET/PUT is refused (403), so Horovod's
        store in the survivors gives up after its retries (3 x 0.5 s) instead of polling until
        Gloo's timeout (30 s); with our patched Horovod their ``hvd.init()`` then fails
        cleanly.  Harmless after the rings formed: Horovod uses the store only in init."""
        with self._lock:
            store = self._servers.get(generation)
        if store is not None:
            self._loop.call_soon_threadsafe(store.seal)

    def token(self, generation: int) -> str:
        """The token the members of ``generation`` send with every request (each worker gets it
        in its :class:`hvd_edl.messages.Assignment` and sets ``ENV_TOKEN`` before ``hvd.init()``).

        Raises:
            KeyError: ``generation`` has no running server (never opened, or stopped).
        """
        with self._lock:
            return self._servers[generation].token

    def _refill_and_stop(self, stale: List[GenerationStore]) -> None:
        for store in stale:
            self._call(self._stop, store)
        with self._lock:
            if self._closed:
                return
        fresh = self._start()
        with self._lock:
            if self._spare is None and not self._closed:
                self._spare = fresh
                return
        self._call(self._stop, fresh)

    def close(self) -> None:
        """Stop every server and the event loop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            stores = list(self._servers.values()) + ([self._spare] if self._spare else [])
            self._servers.clear()
            self._spare = None
        for store in stores:
            try:
                self._call(self._stop, store)
            except Exception:  # noqa: BLE001 - closing down: keep stopping the others
                log.debug("rendezvous: stopping port %d failed", store.port, exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    # ---- on the event loop -----------------------------------------------------------------------

    async def _listen(self) -> GenerationStore:
        store = GenerationStore()
        limits = Limits(max_connections=connection_cap(MAX_CONNECTIONS),
                        max_header_bytes=MAX_HEADER_BYTES, max_headers=MAX_HEADERS,
                        header_timeout_s=REQUEST_TIMEOUT_S, body_timeout_s=REQUEST_TIMEOUT_S,
                        write_timeout_s=REQUEST_TIMEOUT_S, backlog=BACKLOG)
        sock = listen_socket(self.bind_addr, 0, limits.backlog)
        store.port = sock.getsockname()[1]
        store.server = BoundedHTTPServer(
            functools.partial(self._answer, store), limits, name=f"rendezvous on port {store.port}",
            keep_alive=False, same_user_only=True, local_addresses=local_addresses())
        await store.server.start(sock)
        return store

    async def _stop(self, store: GenerationStore) -> None:
        store.seal()
        if store.server is not None:
            await store.server.shutdown()

    def _refuse(self, store: GenerationStore, code: int, why: str, request: Request) -> Response:
        store.refused += 1
        if store.refused == 1 or store.refused % 100 == 0:
            log.warning("rendezvous on port %d refused %s %s from %s: %s (%d refused)",
                        store.port, request.method, request.path[:80], request.peer, why,
                        store.refused)
        return Response(code, b"", content_type="text/plain", close=True)

    async def _answer(self, store: GenerationStore, request: Request,
                      body: BodyReader) -> Response:
        """The answer to one request, after the checks of the module docstring."""
        method, path = request.method, request.path
        if not peer_allowed(request.peer, store.allowed):
            return self._refuse(store, 403, "not a member host of this generation", request)
        token = request.headers.get(TOKEN_HEADER.lower())
        if not token:
            return self._refuse(store, 401, "no rendezvous token", request)
        if not hmac.compare_digest(token.encode("latin-1"), store.token.encode()):
            return self._refuse(store, 403, "wrong rendezvous token", request)
        if self.verbose:
            log.info("rendezvous %d: %s %s from %s", store.port, method, path, request.peer)
        if method not in ("GET", "PUT", "DELETE", "POST"):
            return self._refuse(store, 405, "method not allowed", request)
        if store.sealed and method != "DELETE":
            return self._refuse(store, 403, "generation over (sealed)", request)
        fields = path.split("/")
        if len(path) > MAX_PATH_CHARS or len(fields) != 3 or fields[0] or not fields[1] \
                or not path.isprintable():
            return self._refuse(store, 400, "path must be /<scope>/<key>", request)
        _, scope, key = fields
        if method == "PUT":
            try:
                length = body.length(MAX_VALUE_BYTES, required=True)
            except HttpError as e:
                return self._refuse(store, e.status, e.reason, request)
            if store.bytes + length + store.key_bytes(scope, key) \
                    > MAX_STORE_BYTES + store.mesh_bytes:
                return self._refuse(store, 413, "store full", request)
            if store.keys >= MAX_KEYS and key not in store.cache.get(scope, {}):
                return self._refuse(store, 413, f"store holds {MAX_KEYS} keys", request)
            value = await body.read(length)
            if store.sealed:
                return self._refuse(store, 403, "generation over (sealed)", request)
            store.put(scope, key, value)
            return Response(200, b"", content_type="text/plain")
        if method == "DELETE":
            store.delete(scope, key)
            return Response(200, b"", content_type="text/plain")
        if method == "POST":
            return await self._multi_get(store, scope, key, request, body)
        value = await self._held_value(store, scope, key, self._loop.time() + HOLD_S)
        if value is None:
            return Response(404, b"", content_type="text/plain")
        return Response(200, value, content_type="application/octet-stream")

    async def _held_value(self, store: GenerationStore, scope: str, key: str,
                          deadline: float) -> Optional[bytes]:
        """``scope/key``'s value, waiting until its PUT or ``deadline`` (loop time, seconds)
        when it is missing (see "Serving it fast"); None when still missing or sealed."""
        value = store.cache.get(scope, {}).get(key)
        if value is None and not store.sealed and deadline > self._loop.time():
            f = self._loop.create_future()
            store.waiters.setdefault((scope, key), []).append(f)
            try:
                await asyncio.wait_for(f, deadline - self._loop.time())
            except asyncio.TimeoutError:
                pass
            finally:
                waiting = store.waiters.get((scope, key), [])
                if f in waiting:
                    waiting.remove(f)
                if not waiting:
                    store.waiters.pop((scope, key), None)
            value = None if store.sealed else store.cache.get(scope, {}).get(key)
        return value

    async def _multi_get(self, store: GenerationStore, scope: str, name: str,
                         request: Request, body: BodyReader) -> Response:
        """``POST /<scope>/multi_get`` (our patch 0007 of Horovod's ``HTTPStore``, which Gloo's
        ``connectFullMesh`` calls once instead of a request per key): the body names up to
        ``MULTI_GET_MAX_KEYS`` keys, one per line; held like a GET until every key exists
        (at most ``HOLD_S`` in all), then 200 with each value in order behind its length (4
        bytes, big-endian), or 404 when one is still missing.  An answer stops after the value
        that brings it to ``MULTI_GET_MAX_BYTES`` (the patched client asks again for the
        keys left): at 1,024 ranks a peer's key holds 139 kB of pair addresses, and 64 of
        them in one answer per rank would hold gigabytes of the launcher's memory at once."""
        if name != MULTI_GET:
            return self._refuse(store, 404, "POST only to /<scope>/multi_get", request)
        try:
            length = body.length(MAX_VALUE_BYTES, required=True)
        except HttpError as e:
            return self._refuse(store, e.status, e.reason, request)
        raw = await body.read(length)
        keys = raw.decode("latin-1").split("\n")
        if keys and keys[-1] == "":
            keys.pop()
        if not keys or len(keys) > MULTI_GET_MAX_KEYS \
                or not all(k and k.isprintable() and len(k) <= MAX_PATH_CHARS for k in keys):
            return self._refuse(store, 400, f"multi_get: 1 to {MULTI_GET_MAX_KEYS} printable "
                                            "keys, one per line", request)
        deadline = self._loop.time() + HOLD_S
        parts, size = [], 0
        for k in keys:
            if size >= MULTI_GET_MAX_BYTES:
                break  # the client asks again for the rest
            value = await self._held_value(store, scope, k, deadline)
            if value is None:
                return Response(404, b"", content_type="text/plain")
            parts += (len(value).to_bytes(4, "big"), value)
            size += 4 + len(value)
        return Response(200, b"".join(parts), content_type="application/octet-stream")
