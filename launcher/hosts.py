"""Host lists in Horovod's syntax: ``host[:slots]``, comma separated (``-H``) or one a line
(``--hostfile``, host discovery output).  IPv6 addresses are written ``[::1]:2``."""
from __future__ import annotations

import re
import socket
from typing import Dict, List, Tuple

_NAME = r"[A-Za-z0-9_](?:[A-Za-z0-9_.\-]*[A-Za-z0-9_])?"
_HOST_RE = re.compile(rf"^(?P<host>{_NAME}|\[[0-9A-Fa-f:.]+\])(?::(?P<slots>[^:]*))?$")


class HostSpecError(ValueError):
    """A host entry that does not follow ``host[:slots]`` with slots a positive integer."""


def parse_host_entry(entry: str, default_slots: int = 1) -> Tuple[str, int]:
    """``"node1:4"`` -> ``("node1", 4)``; ``"[::1]:2"`` -> ``("::1", 2)``.

    Raises:
        HostSpecError: unknown host syntax, or slots not a positive integer.
    """
    entry = entry.strip()
    if entry.startswith("[") and "]" not in entry:
        raise HostSpecError(f"unknown host syntax {entry!r} (expected host[:slots])")
    m = _HOST_RE.match(entry)
    if not m:
        raise HostSpecError(f"unknown host syntax {entry!r} (expected host[:slots])")
    host = m.group("host").strip("[]")
    slots_text = m.group("slots")
    if slots_text is None:
        return host, default_slots
    if not slots_text.isdigit() or int(slots_text) < 1:
        raise HostSpecError(f"slots of host {host!r} must be a positive integer, got {slots_text!r}")
    return host, int(slots_text)


def parse_hosts_arg(text: str) -> Dict[str, int]:
    """``-H a:2,b:1`` -> ``{"a": 2, "b": 1}`` (order kept; a repeated host is an error)."""
    return _collect(p for p in text.split(",") if p.strip())


def parse_host_lines(text: str, default_slots: int = 1) -> Dict[str, int]:
    """Hostfile or discovery output: one ``host[:slots]`` (or ``host slots=N``) a line; blank
    lines and ``#`` comments are skipped.

    Raises:
        HostSpecError: a malformed line (the message names it) or a host listed twice.
    """
    entries: List[str] = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.match(r"^(\S+)\s+slots\s*=\s*(\S+)$", line)
        entries.append(f"{m.group(1)}:{m.group(2)}" if m else line)
    return _collect(entries, default_slots)


def _collect(entries, default_slots: int = 1) -> Dict[str, int]:
    hosts: Dict[str, int] = {}
    for entry in entries:
        host, slots = parse_host_entry(entry, default_slots)
        if host in hosts:
            raise HostSpecError(f"host {host!r} is listed twice")
        hosts[host] = slots
    return hosts


def is_local(host: str) -> bool:
    """True for loopback names and addresses and this machine's own name (spawned without ssh)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    return host.startswith("127.") or host == "::1"
