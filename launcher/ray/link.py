"""The link between the launcher and a worker on a Ray node: two TCP connections that the node
dials back to the launcher, carrying what an ssh session carries for ``launcher/spawn/ssh.py``.

The actor (:mod:`launcher.ray.actor`) starts :data:`NODE_BOOTSTRAP` on the node with the
launcher's address and the worker id on its command line and a one-time token in its
environment (``HVD_EDL_LINK``; never in an argv).  The bootstrap connects twice, sends
``<token> io`` and ``<token> err`` as first lines, puts the ``io`` connection on its stdin and
stdout and the ``err`` one on its stderr, and becomes the remote supervisor of
``launcher/spawn/remote_worker.py`` exactly as an ssh session runs it: the supervisor's source
and the job (environment, secret included) come as the first lines of its stdin, ``signal N``
lines follow, and the end of the connection ends the worker's process group.

Because the link is the launcher's own, a worker keeps training, and its output and exit code
keep coming, when Ray's head is lost.  TCP keepalive on both ends (idle 5 s, then 3 probes 5 s
apart) ends a link whose other side vanished silently within about 20 s; a worker that falls
silent is fenced by the coordinator's heartbeats long before that (``launcher/job/liveness.py``).
"""
from __future__ import annotations

import hmac
import logging
import secrets
import socket
import threading
from dataclasses import dataclass, field
from typing import Dict, Optional

log = logging.getLogger(__name__)

ENV_LINK_TOKEN = "HVD_EDL_LINK"
HANDSHAKE_TIMEOUT_S = 10.0   # a connection must say its token within this
STREAMS = ("io", "err")

# runs on the node as ``python -c NODE_BOOTSTRAP HOST PORT WORKER_ID`` (standard library only);
# after the two connections it execs the supervisor bootstrap of launcher/spawn/ssh.py
NODE_BOOTSTRAP = r"""
import os, socket, sys
host, port, worker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
token = os.environ.pop("HVD_EDL_LINK", "")
def dial(stream):
    s = socket.create_connection((host, port), timeout=10)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, v in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            s.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), v)
    s.sendall(("%s %s\n" % (token, stream)).encode())
    s.settimeout(None)
    return s
io, err = dial("io"), dial("err")
os.dup2(io.fileno(), 0); os.dup2(io.fileno(), 1); os.dup2(err.fileno(), 2)
os.execv(sys.executable, [sys.executable, "-c", sys.argv[4], "hvd-edl-worker", worker])
"""


def keepalive(sock: socket.socket) -> None:
    """TCP keepalive as the node side sets it (idle 5 s, 3 probes 5 s apart)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, v in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), v)


@dataclass
class PendingLink:
    """A link the launcher waits for: ``token`` (32 hex digits, one use), the connections as
    they arrive (``streams``: "io" / "err" -> socket), ``ready`` set once both are there."""
    token: str
    streams: Dict[str, socket.socket] = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)


class LinkServer:
    """Accepts the links of one job's Ray workers on ``bind_addr`` (an ephemeral port).

    A connection that does not give a known token and stream within
    :data:`HANDSHAKE_TIMEOUT_S`, or gives one already used, is closed.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, bind_addr: str):
        family = socket.AF_INET6 if ":" in bind_addr else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((bind_addr, 0))
        self._sock.listen(128)
        self.addr = bind_addr
        self.port = self._sock.getsockname()[1]
        self._pending: Dict[str, PendingLink] = {}
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept_loop, name="ray-link", daemon=True).start()

    def expect(self) -> PendingLink:
        """A new token to hand to one worker's bootstrap; its connections land in the result."""
        link = PendingLink(secrets.token_hex(16))
        with self._lock:
            self._pending[link.token] = link
        return link

    def forget(self, link: PendingLink) -> None:
        """Stop waiting for ``link`` (its token is refused from now on)."""
        with self._lock:
            self._pending.pop(link.token, None)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                continue
            threading.Thread(target=self._handshake, args=(conn,), daemon=True).start()

    def _handshake(self, conn: socket.socket) -> None:
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        line = b""
        try:
            while not line.endswith(b"\n") and len(line) < 128:
                chunk = conn.recv(1)
                if not chunk:
                    break
                line += chunk
        except OSError:
            line = b""
        token, _, stream = line.decode(errors="replace").strip().partition(" ")
        link = self._match(token, stream, conn)
        if link is None:
            log.warning("ray link: a connection with an unknown token or stream refused")
            conn.close()
            return
        conn.settimeout(None)
        keepalive(conn)
        if len(link.streams) == len(STREAMS):
            link.ready.set()

    def _match(self, token: str, stream: str, conn: socket.socket) -> Optional[PendingLink]:
        if stream not in STREAMS:
            return None
        with self._lock:
            for known, link in self._pending.items():
                if hmac.compare_digest(known.encode(), token.encode()):
                    if stream in link.streams:
                        return None
                    link.streams[stream] = conn
                    if len(link.streams) == len(STREAMS):
                        del self._pending[known]  # both ends are there: one use only
                    return link
        return None
