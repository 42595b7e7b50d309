"""Checking the names of a fixed pool (``serve -H`` / ``--hostfile``) before the service takes
it: a host whose name does not resolve would be handed to jobs whose every worker there fails.

A name lookup can hang (a resolver that does not answer), so each runs on a daemon thread and
the whole check waits at most ``timeout_s`` seconds: a name still unanswered then is refused
too.  Hosts that :func:`launcher.discovery.hosts.is_local` knows are this machine, and IP
addresses, are not looked up.
"""
from __future__ import annotations

import ipaddress
import queue
import socket
import threading
import time
from typing import Dict, Iterable

RESOLVE_TIMEOUT_S = 5.0  # the longest the check waits for the resolver, all names together
MAX_THREADS = 32         # names looked up at once


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def unresolved(hosts: Iterable[str], timeout_s: float = RESOLVE_TIMEOUT_S) -> Dict[str, str]:
    """host -> why it cannot be used (``does not resolve: ...``, or ``did not resolve within
    5 s``) for each of ``hosts`` that is not this machine nor an IP address and whose name
    the resolver (:func:`socket.getaddrinfo`) does not turn into an address within
    ``timeout_s`` seconds; {} when all do."""
    from launcher.discovery.hosts import is_local
    names = [h for h in dict.fromkeys(hosts) if not _is_address(h) and not is_local(h)]
    if not names:
        return {}
    todo: "queue.Queue[str]" = queue.Queue()
    for h in names:
        todo.put(h)
    answers: Dict[str, str] = {}  # host -> "" (resolved) or why not
    done = threading.Condition()

    def work() -> None:
        while True:
            try:
                h = todo.get_nowait()
            except queue.Empty:
                return
            try:
                socket.getaddrinfo(h, None)
                why = ""
            except (OSError, UnicodeError) as e:
                why = f"does not resolve: {getattr(e, 'strerror', None) or e}"
            with done:
                answers[h] = why
                done.notify_all()
    for _ in range(min(MAX_THREADS, len(names))):
        threading.Thread(target=work, name="resolve", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    with done:
        while len(answers) < len(names) and time.monotonic() < deadline:
            done.wait(max(0.0, deadline - time.monotonic()))
        out = {h: answers.get(h, f"did not resolve within {timeout_s:g} s") for h in names}
    return {h: why for h, why in out.items() if why}
