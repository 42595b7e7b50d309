"""How a worker process ends at once, from any thread: the exit status says why.

``signal.signal`` and ``sys.exit`` work only in the main thread, and the interpreter's normal
teardown runs Horovod's shutdown, which can block on peers; the watcher and heartbeat threads
(``hvd_edl.runtime``, ``hvd_edl.heartbeat``) and the signal handlers therefore end the process
with :func:`die`.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

log = logging.getLogger(__name__)


def die(signum: int) -> None:
    """End the process now with exit status ``128 + signum`` (as a shell reports a process killed
    by ``signum``); callable from any thread (``signal.signal`` is main-thread only)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(128 + signum)


def die_fenced(worker_id: str) -> None:
    """End a fenced worker now (exit status 128 + SIGTERM), from any thread."""
    log.error("worker %s was declared dead by the launcher (it fell silent): exiting",
              worker_id)
    die(signal.SIGTERM)
