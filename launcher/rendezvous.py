"""One Gloo rendezvous per generation, served by Horovod's own rendezvous HTTP server
(``horovod.runner.http.http_server.RendezvousHTTPServer`` with its ``RendezvousHandler``).

Horovod's Gloo controller reads ``HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT`` at every ``hvd.init()`` and
keeps its keys under fixed scopes ("global", "local<host>", "cross<n>"), so each generation gets a
fresh server: no stale key of an old ring can reach a new one.  A spare server is started ahead of
time so that forming a generation never waits for a socket or a thread.  Servers bind to the
launcher's chosen address, not every interface.
"""
from __future__ import annotations

import logging
import threading
from typing import Dict, Optional, Tuple

from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

log = logging.getLogger(__name__)


class GenerationRendezvous:
    """Hands out a started rendezvous server per generation; keeps the last two running.

    Args:
        bind_addr: address the servers listen on (e.g. "127.0.0.1").
    """

    def __init__(self, bind_addr: str, verbose: bool = False):
        self.bind_addr = bind_addr
        self.verbose = verbose
        self._servers: Dict[int, Tuple[RendezvousHTTPServer, threading.Thread]] = {}
        self._lock = threading.Lock()
        self._spare: Optional[Tuple[RendezvousHTTPServer, threading.Thread]] = self._start()

    def _start(self) -> Tuple[RendezvousHTTPServer, threading.Thread]:
        httpd = RendezvousHTTPServer((self.bind_addr, 0), RendezvousHandler, self.verbose)
        thread = threading.Thread(target=httpd.serve_forever, name="rendezvous", daemon=True)
        thread.start()
        return httpd, thread

    def open(self, generation: int) -> int:
        """A fresh rendezvous for ``generation``; returns its TCP port.  Servers of generations
        before ``generation - 1`` are stopped."""
        with self._lock:
            spare = self._spare or self._start()
            self._spare = None
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
            httpd.shutdown()
            httpd.server_close()
