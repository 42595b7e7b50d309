"""Who is on the other end of a TCP connection from this machine: the owning user of the peer's
socket, as the kernel reports it.  Used by both sides (the launcher's servers through
:mod:`launcher.serve.peer_uid`, which re-exports this module; rank 0's state stream directly): it
lives here because the worker side never imports the launcher.

On Linux the kernel answers "which socket has local end A and remote end B, and whose is it"
over netlink (``NETLINK_SOCK_DIAG``, the interface ``ss`` uses): for a connection accepted from a
process on this machine, the peer's socket is the one whose local end is the peer's address and
whose remote end is ours.  That lookup costs tens of microseconds whatever the number of sockets;
reading ``/proc/net/tcp{,6}`` (the fallback, where netlink is not allowed) costs about 20 ms per
lookup with 2,000 sockets open, too slow to run on every connection under a flood.  Elsewhere the
answer is ``None``: the OS does not tell.
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import struct
from typing import FrozenSet, Iterator, Optional, Tuple, Union

log = logging.getLogger(__name__)

PROC_TCP = ("/proc/net/tcp", "/proc/net/tcp6")


def parse_ip(addr: str):
    """``addr`` as an ``ipaddress`` address (a ``%zone`` dropped, an IPv4-mapped IPv6 address
    turned into IPv4), or None when it is not an IP address.  Here, on the worker side, so that
    both sides use it (``launcher.discovery.hosts`` re-exports it)."""
    try:
        ip = ipaddress.ip_address(addr.split("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip


def _hex_endpoint(ip: Union[ipaddress.IPv4Address, ipaddress.IPv6Address], port: int) -> str:
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


NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_NOT_FOUND = -1


def _sock_diag_uid(peer: Tuple[str, int], local: Tuple[str, int]) -> Optional[int]:
    """The uid by an exact netlink sock_diag lookup; ``_NOT_FOUND`` when the kernel has no such
    socket, None when the lookup itself is not possible."""
    p_ip = ipaddress.ip_address(peer[0].split("%")[0])
    l_ip = ipaddress.ip_address(local[0].split("%")[0])
    if p_ip.version == 6 and p_ip.ipv4_mapped is not None:  # an IPv4 client of a dual-stack
        p_ip = p_ip.ipv4_mapped                             # socket: its socket is IPv4
        l_ip = l_ip.ipv4_mapped if l_ip.version == 6 and l_ip.ipv4_mapped else l_ip
    if p_ip.version != l_ip.version:
        return None
    family = socket.AF_INET if p_ip.version == 4 else socket.AF_INET6
    req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
    req += struct.pack("!HH", peer[1], local[1])
    req += p_ip.packed.ljust(16, b"\0") + l_ip.packed.ljust(16, b"\0")
    req += struct.pack("=III", 0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)
    msg = struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + req
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)
            nl.send(msg)
            data = nl.recv(65536)
    except (OSError, AttributeError):
        return None
    if len(data) < 20:
        return None
    _, kind = struct.unpack_from("=IH", data, 0)
    if kind == NLMSG_ERROR:
        (err,) = struct.unpack_from("=i", data, 16)
        return _NOT_FOUND if err in (-2, -errno.ENOENT) else None
    if kind != SOCK_DIAG_BY_FAMILY or len(data) < 16 + 72:
        return None
    # inet_diag_msg: family, state, timer, retrans (4 bytes), sockid (48), then
    # expires, rqueue, wqueue, uid, inode
    return struct.unpack_from("=IIIII", data, 16 + 52)[3]


def peer_uid(peer: Tuple[str, int], local: Tuple[str, int]) -> Optional[int]:
    """The uid owning the socket at ``peer`` (address, port) connected to our ``local`` (address,
    port), or None when the OS does not say (no sock_diag and no ``/proc/net/tcp*``, or no such
    socket: the peer is on another machine or already closed).

    Raises nothing: an unreadable or odd answer counts as "not found".
    """
    try:
        uid = _sock_diag_uid(peer, local)
        if uid is not None:
            return None if uid == _NOT_FOUND else uid
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
    ip = parse_ip(addr)
    if ip is None:
        return False
    return ip.is_loopback or str(ip) in local_addresses


def allowed_uid(uid: int) -> bool:
    """Whether a local peer owned by ``uid`` may talk to our servers: this process's user, or
    root (who can read this process's memory anyway)."""
    return uid in (os.geteuid(), 0)


def peer_of(sock: socket.socket) -> Tuple[Tuple[str, int], Tuple[str, int]]:
    """(peer, local) (address, port) pairs of a connected socket."""
    return sock.getpeername()[:2], sock.getsockname()[:2]


def local_addresses() -> FrozenSet[str]:
    """This machine's IPv4 and IPv6 addresses in canonical text (loopback's included), read now
    (psutil): a peer connecting from one of them is a process on this machine."""
    import psutil
    addrs = {"127.0.0.1", "::1"}
    for entries in psutil.net_if_addrs().values():
        for e in entries:
            if e.family in (socket.AF_INET, socket.AF_INET6):
                ip = parse_ip(e.address)
                addrs.add(e.address if ip is None else str(ip))
    return frozenset(addrs)


def other_users_peer(sock: socket.socket, local_addrs) -> Optional[int]:
    """The uid of the peer of connected ``sock`` when it is a process on this machine
    (:func:`is_local_peer` with ``local_addrs``) owned by a user :func:`allowed_uid` refuses;
    None otherwise (this user or root, a remote peer, or the OS does not tell).

    Raises:
        OSError: ``sock`` is not connected (the peer already went away).
    """
    peer, local = peer_of(sock)
    if not is_local_peer(peer[0], local_addrs):
        return None
    uid = peer_uid(peer, local)
    return None if uid is None or allowed_uid(uid) else uid
