"""Who is on the other end of a TCP connection from this machine (the owning user of the peer's
socket, as the kernel reports it): :mod:`hvd_edl.peer_uid`, re-exported here for the launcher's
servers (:mod:`launcher.serve.bounded_http`).  The implementation moved to ``hvd_edl/`` so that rank
0's state stream (worker side, which never imports the launcher) refuses other users' sockets
with the same check.
"""
from __future__ import annotations

from hvd_edl.peer_uid import (INET_DIAG_NOCOOKIE, NETLINK_SOCK_DIAG, NLM_F_REQUEST,  # noqa: F401
                              NLMSG_ERROR, PROC_TCP, SOCK_DIAG_BY_FAMILY, allowed_uid,
                              is_local_peer, local_addresses, other_users_peer, parse_ip,
                              peer_of, peer_uid)
