"""A stopping server ends the requests it is holding at once.

The coordinator's long polls (``/watch``, ``/switch``) await an answer on the server's event
loop; a server that only closed their connections waited for each poll's own bound, 2 s, at
the end of every job (its launcher exited 2 s after its last worker).  ``shutdown`` now cancels
the connections' tasks."""
from __future__ import annotations

import asyncio
import socket
import threading

from launcher.serve.bounded_http import (BoundedHTTPServer, Limits, Response, ServingThread,
                                         listen_socket)


def test_shutdown_cancels_a_request_held_by_its_handler():
    entered, cancelled = threading.Event(), threading.Event()

    async def hold_forever(request, body):
        entered.set()
        try:
            await asyncio.get_running_loop().create_future()  # never answered
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Response(200, b"")

    limits = Limits()
    sock = listen_socket("127.0.0.1", 0, limits.backlog)
    http = BoundedHTTPServer(hold_forever, limits, name="test")
    serving = ServingThread(http, sock, "test")
    serving.start()
    client = socket.create_connection(sock.getsockname(), timeout=30)
    try:
        client.sendall(b"GET /poll HTTP/1.1\r\nHost: x\r\n\r\n")
        assert entered.wait(30), "the handler never ran"
        assert http.connections == 1
        # a bound far above the old 2 s: without the cancel, it returns only at its deadline
        asyncio.run_coroutine_threadsafe(http.shutdown(timeout_s=20.0), serving.loop).result(60)
        assert cancelled.is_set(), "the held request was not cancelled"
        assert http.connections == 0
    finally:
        client.close()
        serving.stop()
