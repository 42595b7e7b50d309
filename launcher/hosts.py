"""Host lists in Horovod's syntax: ``host[:slots]``, comma separated (``-H``) or one a line
(``--hostfile``, host discovery output).  IPv6 addresses are written in brackets, ``[::1]:2``
(a bare ``::1`` is ambiguous with ``host:slots`` and rejected)."""
from __future__ import annotations

import ipaddress
import re
import socket
from typing import Dict, List, Optional, Tuple

MAX_SLOTS_PER_HOST = 1024   # more is a typo or garbage, and the driver walks every slot

_NAME = r"[A-Za-z0-9_](?:[A-Za-z0-9_.\-]*[A-Za-z0-9_])?"
_HOST_RE = re.compile(rf"^(?:(?P<name>{_NAME})|\[(?P<v6>[^\[\]]+)\])(?::(?P<slots>.*))?$")


class HostSpecError(ValueError):
    """A host entry that does not follow ``host[:slots]`` with slots a positive integer."""


def _show(text: str, limit: int = 80) -> str:
    """``repr`` of a user's text, cut to ``limit`` characters (a 1 MiB line stays one line)."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def parse_host_entry(entry: str, default_slots: Optional[int] = 1) -> Tuple[str, Optional[int]]:
    """``"node1:4"`` -> ``("node1", 4)``; ``"[::1]:2"`` -> ``("::1", 2)``; ``"node1"`` ->
    ``("node1", default_slots)`` (``None`` keeps "no slots given" visible to the caller).

    Raises:
        HostSpecError: unknown host syntax, a bare or invalid IPv6 address, or slots not an
            integer in [1, MAX_SLOTS_PER_HOST].
    """
    entry = entry.strip()
    m = _HOST_RE.match(entry)
    if not m:
        if entry.count(":") >= 2 and "[" not in entry:
            raise HostSpecError(f"IPv6 address {_show(entry)} must be written in brackets, "
                                f"e.g. [::1]:2")
        raise HostSpecError(f"unknown host syntax {_show(entry)} (expected host[:slots])")
    host = m.group("name")
    if host is None:
        host = m.group("v6")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise HostSpecError(f"{_show(entry)}: {_show(host)} is not an IPv6 address") from None
    slots_text = m.group("slots")
    if slots_text is None:
        return host, default_slots
    if not re.fullmatch(r"[0-9]{1,9}", slots_text) or \
            not 1 <= int(slots_text) <= MAX_SLOTS_PER_HOST:
        raise HostSpecError(f"slots of host {_show(host)} must be a positive integer (at most "
                            f"{MAX_SLOTS_PER_HOST}), got {_show(slots_text)}")
    return host, int(slots_text)


def format_host_entry(host: str, slots: Optional[int] = None) -> str:
    """The inverse of :func:`parse_host_entry`: ``("::1", 2)`` -> ``"[::1]:2"``."""
    text = f"[{host}]" if ":" in host else host
    return text if slots is None else f"{text}:{slots}"


def parse_hosts_arg(text: str) -> Dict[str, int]:
    """``-H a:2,b:1`` -> ``{"a": 2, "b": 1}`` (order kept; a repeated host is an error)."""
    return _collect((p, None) for p in text.split(",") if p.strip())


def parse_host_lines(text: str, default_slots: Optional[int] = 1) -> Dict[str, Optional[int]]:
    """Hostfile or discovery output: one ``host[:slots]`` (or ``host slots=N``) a line; blank
    lines and ``#`` comments are skipped.  Order is kept.

    Raises:
        HostSpecError: a malformed line (the message gives its number and text) or a host
            listed twice (rejected rather than adding the slots up: a duplicate is far more
            often a broken script than a wish).
    """
    entries: List[Tuple[str, int]] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.match(r"^(\S+)\s+slots\s*=\s*(\S+)$", line)
        entries.append((f"{m.group(1)}:{m.group(2)}" if m else line, number))
    return _collect(entries, default_slots)


def _collect(entries, default_slots: Optional[int] = 1) -> Dict[str, Optional[int]]:
    hosts: Dict[str, Optional[int]] = {}
    for entry, number in entries:
        where = f"line {number}: " if number is not None else ""
        try:
            host, slots = parse_host_entry(entry, default_slots)
        except HostSpecError as e:
            raise HostSpecError(f"{where}{e}") from None
        if host in hosts:
            raise HostSpecError(f"{where}host {host!r} is listed twice")
        hosts[host] = slots
    return hosts


def is_local(host: str) -> bool:
    """True for loopback names and addresses and this machine's own name (spawned without ssh)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    return host.startswith("127.") or host == "::1"


def parse_ip(addr: str):
    """``addr`` as an ``ipaddress`` address (a ``%zone`` dropped, an IPv4-mapped IPv6 address
    turned into IPv4), or None when it is not an IP address."""
    try:
        ip = ipaddress.ip_address(addr.split("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip
