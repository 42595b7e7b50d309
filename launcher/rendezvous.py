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

Guarding it.  The client is Horovod's C++ ``HTTPStore`` (``horovod/common/gloo/http_store.cc``):
plain ``GET/PUT/DELETE /<scope>/<key>``, no header we could add a secret to, so requests cannot be
authenticated without patching Horovod.  What each server does instead:

* answers only the addresses of that generation's member hosts (this machine's own addresses
  for local hosts); everything else gets 403 before its request is looked at;
* accepts only ``/<scope>/<key>`` paths of printable characters up to ``MAX_PATH_CHARS``, values
  up to ``MAX_VALUE_BYTES`` (413) and a store of at most ``MAX_STORE_BYTES`` in all (413);
* refuses ``HEAD`` (Horovod's handler inherits ``SimpleHTTPRequestHandler.do_HEAD``, which would
  report on files in the launcher's working directory) and every other method but GET/PUT/DELETE
  (405), a PUT without ``Content-Length`` (411), and a request not sent within
  ``REQUEST_TIMEOUT_S``;
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

Residual risk: a process on a member host (another user of that machine, or any process on this
one for local jobs) can still read and plant keys of the *current* generation while its ring
forms, and so learn Gloo's addresses or redirect a connection; Gloo's TCP pairs themselves are not
authenticated either.  Run jobs on hosts whose other users you trust, or on an isolated network.
"""
from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import socket
import threading
from typing import Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

import psutil

from launcher.hosts import is_local

log = logging.getLogger(__name__)

MAX_PATH_CHARS = 512
MAX_VALUE_BYTES = 1 << 20    # Gloo stores a few hundred bytes of addresses per rank
MAX_STORE_BYTES = 64 << 20   # all values of one generation together
LOOPBACK = "loopback"        # in an allow-list: any loopback address
HOLD_S = 2.0                 # longest a GET of a missing key waits for its PUT (seconds)
REQUEST_TIMEOUT_S = 3.0      # to send a request's head or body (Horovod's server: the same)


def _normalise(addr: str) -> str:
    """An IP address in canonical text, IPv4-mapped IPv6 turned into IPv4."""
    try:
        ip = ipaddress.ip_address(addr.split("%")[0])
    except ValueError:
        return addr
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


@functools.lru_cache(maxsize=1)
def _local_addresses() -> FrozenSet[str]:
    addrs = {"127.0.0.1", "::1"}
    for entries in psutil.net_if_addrs().values():
        for e in entries:
            if e.family in (socket.AF_INET, socket.AF_INET6):
                addrs.add(_normalise(e.address))
    return frozenset(addrs)


@functools.lru_cache(maxsize=1024)
def _host_addresses(host: str) -> FrozenSet[str]:
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if is_local(host) or is_local(name):
        return _local_addresses()
    try:
        return frozenset(_normalise(info[4][0]) for info in socket.getaddrinfo(name, None))
    except OSError as e:
        log.warning("rendezvous: cannot resolve member host %s (%s); its workers will be "
                    "refused by the Gloo rendezvous", host, e)
        return frozenset()


def allowed_peers(hosts: Iterable[str]) -> FrozenSet[str]:
    """Addresses the workers of ``hosts`` may connect from: each host's resolved addresses, and
    every address of this machine plus loopback for local hosts."""
    out: Set[str] = set()
    for h in hosts:
        addrs = _host_addresses(h)
        out |= addrs
        if addrs is _local_addresses():
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
        self.cache: Dict[str, Dict[str, bytes]] = {}
        self.allowed: FrozenSet[str] = frozenset()
        self.sealed = False
        self.refused = 0
        self.bytes = 0
        self.waiters: Dict[Tuple[str, str], List[asyncio.Future]] = {}
        self.server: Optional[asyncio.base_events.Server] = None
        self.port = 0

    def put(self, scope: str, key: str, value: bytes) -> None:
        old = self.cache.setdefault(scope, {}).get(key)
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
                self.bytes -= len(value)
            if not d:
                del self.cache[scope]

    def seal(self) -> None:
        self.sealed = True
        for futures in self.waiters.values():
            for f in futures:
                if not f.done():
                    f.set_result(None)
        self.waiters.clear()


_REASONS = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found",
            405: "Method Not Allowed", 408: "Request Timeout", 411: "Length Required",
            413: "Payload Too Large"}


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

    def open(self, generation: int, hosts: Iterable[str] = ("localhost",)) -> int:
        """A fresh rendezvous for ``generation`` whose members run on ``hosts``; returns its TCP
        port.  Earlier generations' servers are sealed; those before ``generation - 1`` stopped."""
        peers = allowed_peers(hosts)
        with self._lock:
            store = self._spare or self._start()
            self._spare = None
            store.allowed = peers
            earlier = list(self._servers.values())
            self._servers[generation] = store
            stale = [self._servers.pop(g) for g in [g for g in self._servers
                                                    if g < generation - 1]]
        for old in earlier:
            self._loop.call_soon_threadsafe(old.seal)
        threading.Thread(target=self._refill_and_stop, args=(stale,), daemon=True).start()
        return store.port

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
        family = socket.AF_INET6 if ":" in self.bind_addr else socket.AF_INET
        store.server = await asyncio.start_server(
            functools.partial(self._serve, store), self.bind_addr, 0, family=family,
            limit=MAX_PATH_CHARS + 4096)
        store.port = store.server.sockets[0].getsockname()[1]
        return store

    async def _stop(self, store: GenerationStore) -> None:
        store.seal()
        if store.server is not None:
            store.server.close()

    async def _serve(self, store: GenerationStore, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        try:
            code, body = await self._answer(store, reader, writer)
            writer.write(b"HTTP/1.0 %d %s\r\nContent-Length: %d\r\n\r\n"
                         % (code, _REASONS.get(code, "").encode(), len(body)) + body)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                asyncio.TimeoutError, ValueError):
            pass
        except Exception:  # noqa: BLE001 - one bad request must not reach the loop's handler
            log.debug("rendezvous: error serving a request on port %d", store.port,
                      exc_info=True)
        finally:
            writer.close()

    def _refuse(self, store: GenerationStore, code: int, why: str, method: str, path: str,
                peer: str) -> Tuple[int, bytes]:
        store.refused += 1
        if store.refused == 1 or store.refused % 100 == 0:
            log.warning("rendezvous on port %d refused %s %s from %s: %s (%d refused)",
                        store.port, method, path[:80], peer, why, store.refused)
        return code, b""

    async def _answer(self, store: GenerationStore, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> Tuple[int, bytes]:
        """(status, body) for one request, after the checks of the module docstring."""
        peer = (writer.get_extra_info("peername") or ("",))[0]
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        method, path = (parts[0], parts[1]) if len(parts) == 3 else ("", lines[0])
        if not peer_allowed(peer, store.allowed):
            return self._refuse(store, 403, "not a member host of this generation", method,
                                path, peer)
        if len(parts) != 3:
            return self._refuse(store, 400, "malformed request line", method, path, peer)
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if self.verbose:
            log.info("rendezvous %d: %s %s from %s", store.port, method, path, peer)
        if method not in ("GET", "PUT", "DELETE"):
            return self._refuse(store, 405, "method not allowed", method, path, peer)
        if store.sealed and method != "DELETE":
            return self._refuse(store, 403, "generation over (sealed)", method, path, peer)
        fields = path.split("/")
        if len(path) > MAX_PATH_CHARS or len(fields) != 3 or fields[0] or not fields[1] \
                or not path.isprintable():
            return self._refuse(store, 400, "path must be /<scope>/<key>", method, path, peer)
        _, scope, key = fields
        if method == "PUT":
            if "chunked" in headers.get("transfer-encoding", "").lower():
                return self._refuse(store, 411, "Content-Length required", method, path, peer)
            try:
                length = int(headers.get("content-length", ""))
            except ValueError:
                return self._refuse(store, 411, "Content-Length required", method, path, peer)
            if length < 0 or length > MAX_VALUE_BYTES:
                return self._refuse(store, 413, f"value of {length} bytes", method, path, peer)
            if store.bytes + length > MAX_STORE_BYTES:
                return self._refuse(store, 413, "store full", method, path, peer)
            value = await asyncio.wait_for(reader.readexactly(length), REQUEST_TIMEOUT_S)
            store.put(scope, key, value)
            return 200, b""
        if method == "DELETE":
            store.delete(scope, key)
            return 200, b""
        value = store.cache.get(scope, {}).get(key)
        if value is None and not store.sealed:
            # held until the PUT of this key (see "Serving it fast")
            f = self._loop.create_future()
            store.waiters.setdefault((scope, key), []).append(f)
            try:
                await asyncio.wait_for(f, HOLD_S)
            except asyncio.TimeoutError:
                pass
            finally:
                waiting = store.waiters.get((scope, key), [])
                if f in waiting:
                    waiting.remove(f)
                if not waiting:
                    store.waiters.pop((scope, key), None)
            value = None if store.sealed else store.cache.get(scope, {}).get(key)
        return (404, b"") if value is None else (200, value)
