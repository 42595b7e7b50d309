"""Who is on the other end of a TCP connection from this machine: the owning user of the peer's
socket, as the kernel reports it.

On Linux every TCP socket of this network namespace is a line of ``/proc/net/tcp`` (IPv4) or
``/proc/net/tcp6`` (IPv6) with its local and remote ``address:port`` and its owner's uid.  For a
connection accepted from a process on this machine, the peer's socket is the line whose local
end is the peer's address and whose remote end is ours.  Elsewhere (no ``/proc``) the answer is
``None``: the OS does not tell.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct
from typing import Iterator, Optional, Tuple

log = logging.getLogger(__name__)

PROC_TCP = ("/proc/net/tcp", "/proc/net/tcp6")


def _hex_endpoint(ip: ipaddress._BaseAddress, port: int) -> str:
    """``ip:port`` as the kernel prints it: each 32-bit word of the address in host byte order."""
    packed = ip.packed
    words = struct.unpack("=%dI" % (len(packed) // 4), packed)
    return "".join("%08X" % w for w in words) + ":%04X" % port


def _candidates(peer: Tuple[str, int], local: Tuple[str, int]) -> Iterator[Tuple[str, str]]:
    """(file, "peer-endpoint local-endpoint") pairs to look for, IPv4-mapped forms included."""
    p_ip = ipaddress.ip_address(peer[0].split("%")[0])
    l_ip = ipaddress.ip_address(local[0].split("%")[0])
    forms = [(p_ip, l_ip)]
    if isinstance(p_ip, ipaddress.IPv6Address) and p_ip.ipv4_mapped is not None \
            and isinstance(l_ip, ipaddress.IPv6Address) and l_ip.ipv4_mapped is not None:
        forms.append((p_ip.ipv4_mapped, l_ip.ipv4_mapped))
    for p, loc in forms:
        path = PROC_TCP[0] if p.version == 4 else PROC_TCP[1]
        yield path, f"{_hex_endpoint(p, peer[1])} {_hex_endpoint(loc, local[1])}"


def peer_uid(peer: Tuple[str, int], local: Tuple[str, int]) -> Optional[int]:
    """The uid owning the socket at ``peer`` (address, port) connected to our ``local`` (address,
    port), or None when the OS does not say (no ``/proc/net/tcp*``, or no such socket: the peer
    is on another machine or already closed).

    Raises nothing: an unreadable or odd ``/proc`` line counts as "not found".
    """
    try:
        pairs = list(_candidates(peer, local))
    except ValueError:
        return None
    for path, needle in pairs:
        try:
            with open(path, "r") as f:
                text = f.read()
        except OSError:
            continue
        at = text.find(" " + needle + " ")
        if at < 0:
            continue
        end = text.find("\n", at)
        fields = text[at:end if end >= 0 else len(text)].split()
        try:
            return int(fields[6])  # local rem st tx:rx tr:when retrnsmt uid
        except (IndexError, ValueError):
            log.debug("peer_uid: odd line in %s: %r", path, fields)
            return None
    return None


def is_local_peer(addr: str, local_addresses) -> bool:
    """Whether ``addr`` (an IP address) is loopback or one of ``local_addresses`` (this machine's
    own addresses), i.e. the kernel here knows the peer's socket."""
    try:
        ip = ipaddress.ip_address(addr.split("%")[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or str(ip) in local_addresses


def allowed_uid(uid: int) -> bool:
    """Whether a local peer owned by ``uid`` may talk to our servers: this process's user, or
    root (who can read this process's memory anyway)."""
    return uid in (os.geteuid(), 0)


def peer_of(sock: socket.socket) -> Tuple[Tuple[str, int], Tuple[str, int]]:
    """(peer, local) (address, port) pairs of a connected socket."""
    return sock.getpeername()[:2], sock.getsockname()[:2]
