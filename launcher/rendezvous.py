"""One Gloo rendezvous per generation, served by Horovod's own rendezvous HTTP server
(``horovod.runner.http.http_server.RendezvousHTTPServer`` with its ``RendezvousHandler``).

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
  report on files in the launcher's working directory) and every other method but GET/PUT/DELETE;
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

import functools
import ipaddress
import logging
import socket
import threading
import time
from typing import Dict, FrozenSet, Iterable, Optional, Set, Tuple

import psutil
from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

from launcher.hosts import is_local

log = logging.getLogger(__name__)

MAX_PATH_CHARS = 512
MAX_VALUE_BYTES = 1 << 20    # Gloo stores a few hundred bytes of addresses per rank
MAX_STORE_BYTES = 64 << 20   # all values of one generation together
LOOPBACK = "loopback"        # in an allow-list: any loopback address
HOLD_S = 2.0                 # longest a GET of a missing key waits for its PUT (seconds)


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


class GuardedRendezvousServer(RendezvousHTTPServer):
    """Horovod's rendezvous server with a peer allow-list, size limits and a seal (see module
    docstring).  ``allowed`` is empty until :meth:`admit` is called, so a spare answers no one."""

    def __init__(self, addr: Tuple[str, int], verbose: bool):
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        super().__init__(addr, GuardedRendezvousHandler, verbose)
        # Horovod's handlers take ``cache_lock`` with ``with``; a Condition on the same kind of
        # lock lets a held GET wait for the PUT of its key
        self.cache_lock = threading.Condition(threading.Lock())
        self.allowed: FrozenSet[str] = frozenset()
        self.sealed = False
        self.refused = 0

    def admit(self, peers: FrozenSet[str]) -> None:
        """Serve these peer addresses (canonical text, :func:`allowed_peers`)."""
        self.allowed = peers

    def seal(self) -> None:
        """The generation is over: answer only DELETEs from now on, and release held GETs."""
        with self.cache_lock:
            self.sealed = True
            self.cache_lock.notify_all()

    def store_bytes(self) -> int:
        with self.cache_lock:
            return sum(len(v) for scope in self.cache.values() for v in scope.values())

    def handle_error(self, request, client_address) -> None:
        log.debug("rendezvous: error serving %s", client_address, exc_info=True)


class GuardedRendezvousHandler(RendezvousHandler):
    """``RendezvousHandler`` that checks peer, seal, path and size before Horovod's code runs."""

    def _refuse(self, code: int, why: str) -> bool:
        server: GuardedRendezvousServer = self.server
        server.refused += 1
        if server.refused == 1 or server.refused % 100 == 0:
            log.warning("rendezvous on port %d refused %s %s from %s: %s (%d refused)",
                        server.server_address[1], self.command, self.path[:80],
                        self.client_address[0], why, server.refused)
        self.close_connection = True
        self.send_status_code(code)
        return False

    def _admit(self) -> bool:
        server: GuardedRendezvousServer = self.server
        if not peer_allowed(self.client_address[0], server.allowed):
            return self._refuse(403, "not a member host of this generation")
        if server.sealed and self.command != "DELETE":
            return self._refuse(403, "generation over (sealed)")
        parts = self.path.split("/")
        if len(self.path) > MAX_PATH_CHARS or len(parts) != 3 or parts[0] or not parts[1] \
                or not self.path.isprintable() or " " in self.path:
            return self._refuse(400, "path must be /<scope>/<key>")
        if self.command == "PUT":
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                return self._refuse(411, "Content-Length required")
            if length < 0 or length > MAX_VALUE_BYTES:
                return self._refuse(413, f"value of {length} bytes")
            if server.store_bytes() + length > MAX_STORE_BYTES:
                return self._refuse(413, "store full")
        return True

    def _get_value(self, scope, key):
        """The value of ``key`` in ``scope``; a missing key is waited for up to ``HOLD_S``
        (None after that, or once the server is sealed: Horovod's handler then answers 404)."""
        server: GuardedRendezvousServer = self.server
        deadline = time.monotonic() + HOLD_S
        with server.cache_lock:
            while True:
                value = server.cache.get(scope, {}).get(key)
                remaining = deadline - time.monotonic()
                if value is not None or server.sealed or remaining <= 0:
                    return value
                server.cache_lock.wait(remaining)

    def _put_value(self, scope, key, value):
        server: GuardedRendezvousServer = self.server
        super()._put_value(scope, key, value)
        with server.cache_lock:
            server.cache_lock.notify_all()

    def do_GET(self):  # noqa: N802
        if self._admit():
            super().do_GET()

    def do_PUT(self):  # noqa: N802
        if self._admit():
            super().do_PUT()

    def do_DELETE(self):  # noqa: N802
        if self._admit():
            super().do_DELETE()

    def do_HEAD(self):  # noqa: N802
        self._refuse(405, "method not allowed")

    do_POST = do_HEAD  # noqa: N815


class GenerationRendezvous:
    """Hands out a started rendezvous server per generation; keeps the last two running (the
    older one sealed: Horovod's shutdown still sends it a DELETE).

    Args:
        bind_addr: address the servers listen on (e.g. "127.0.0.1").
        verbose: Horovod's rendezvous logging.
    """

    def __init__(self, bind_addr: str, verbose: bool = False):
        self.bind_addr = bind_addr
        self.verbose = verbose
        self._servers: Dict[int, Tuple[GuardedRendezvousServer, threading.Thread]] = {}
        self._lock = threading.Lock()
        self._spare: Optional[Tuple[GuardedRendezvousServer, threading.Thread]] = self._start()

    def _start(self) -> Tuple[GuardedRendezvousServer, threading.Thread]:
        httpd = GuardedRendezvousServer((self.bind_addr, 0), self.verbose)
        thread = threading.Thread(target=httpd.serve_forever, name="rendezvous", daemon=True)
        thread.start()
        return httpd, thread

    def open(self, generation: int, hosts: Iterable[str] = ("localhost",)) -> int:
        """A fresh rendezvous for ``generation`` whose members run on ``hosts``; returns its TCP
        port.  Earlier generations' servers are sealed; those before ``generation - 1`` stopped."""
        peers = allowed_peers(hosts)
        with self._lock:
            spare = self._spare or self._start()
            self._spare = None
            spare[0].admit(peers)
            for httpd, _ in self._servers.values():
                httpd.seal()
            self._servers[generation] = spare
            old = [g for g in self._servers if g < generation - 1]
            stale = [self._servers.pop(g) for g in old]
        threading.Thread(target=self._refill_and_stop, args=(stale,), daemon=True).start()
        return spare[0].server_address[1]

    def _refill_and_stop(self, stale) -> None:
        for httpd, thread in stale:
            httpd.shutdown()
            httpd.server_close()
        fresh = self._start()
        with self._lock:
            if self._spare is None:
                self._spare = fresh
                return
        fresh[0].shutdown()
        fresh[0].server_close()

    def close(self) -> None:
        with self._lock:
            servers = list(self._servers.values()) + ([self._spare] if self._spare else [])
            self._servers.clear()
            self._spare = None
        for httpd, _ in servers:
            httpd.seal()
            httpd.shutdown()
            httpd.server_close()
