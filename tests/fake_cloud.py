"""A fake cloud metadata server on loopback for the spot discovery scripts: one HTTP server,
one path prefix per host, so ``--metadata-url`` templates with ``{host}`` reach "each host's"
metadata.

    GCE: http://127.0.0.1:PORT/gce/{host}/computeMetadata/v1/instance/preempted
    AWS: http://127.0.0.1:PORT/aws/{host}/latest/meta-data/spot/instance-action
"""
from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple


@dataclass
class HostMetadata:
    """One fake VM.  ``imds``: "v2" (a GET needs the token), "v1" (PUT /api/token refused with
    405, GETs need none).  ``down``: every request's connection is closed unanswered."""
    preempted: str = "FALSE"
    maintenance_event: str = "NONE"
    instance_action: Optional[str] = None
    imds: str = "v2"
    down: bool = False


class FakeCloud:
    """Serves :class:`HostMetadata` per host; ``requests`` records (method, path, headers)."""

    def __init__(self):
        self.hosts: Dict[str, HostMetadata] = {}
        self.requests: List[Tuple[str, str, Dict[str, str]]] = []
        self.tokens = set()
        self.lock = threading.Lock()
        cloud = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                cloud._answer(self, "GET")

            def do_PUT(self):
                cloud._answer(self, "PUT")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def gce_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/gce/{{host}}/computeMetadata/v1"

    @property
    def aws_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/aws/{{host}}/latest"

    def set(self, host: str, **fields) -> None:
        with self.lock:
            meta = self.hosts.setdefault(host, HostMetadata())
            for k, v in fields.items():
                setattr(meta, k, v)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _answer(self, h: BaseHTTPRequestHandler, method: str) -> None:
        _, kind, host, rest = (h.path.split("/", 3) + ["", "", ""])[:4]
        with self.lock:
            self.requests.append((method, h.path, dict(h.headers)))
            meta = self.hosts.get(host)
            if meta is not None and meta.down:
                h.close_connection = True
                return
            status, body = self._route(kind, meta, method, rest, h.headers)
        h.send_response(status)
        h.send_header("Content-Type", "text/plain")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body.encode())

    def _route(self, kind, meta, method, rest, headers) -> Tuple[int, str]:
        if meta is None:
            return 404, "no such host"
        if kind == "gce":
            if headers.get("Metadata-Flavor") != "Google":
                return 403, "Missing Metadata-Flavor:Google header"
            if method == "GET" and rest == "computeMetadata/v1/instance/preempted":
                return 200, meta.preempted
            if method == "GET" and rest == "computeMetadata/v1/instance/maintenance-event":
                return 200, meta.maintenance_event
            return 404, "not found"
        if kind == "aws":
            if rest == "latest/api/token":
                if method != "PUT" or meta.imds == "v1":
                    return 405, "method not allowed"
                if not headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return 400, "missing ttl"
                token = uuid.uuid4().hex
                self.tokens.add(token)
                return 200, token
            if meta.imds == "v2" and headers.get("X-aws-ec2-metadata-token") not in self.tokens:
                return 401, "unauthorized"
            if method == "GET" and rest == "latest/meta-data/spot/instance-action":
                if meta.instance_action is None:
                    return 404, "not found"
                return 200, meta.instance_action
            return 404, "not found"
        return 404, "not found"
