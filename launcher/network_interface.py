"""Which address a launcher's servers bind to when ``--network-interface`` names a NIC
(horovodrun's flag): shared by ``hvd-edl-run`` (:mod:`launcher.cli`) and the Ray engine
(:mod:`launcher.ray.engine`), which must not import each other."""
from __future__ import annotations

import socket
from typing import Optional


def interface_address(nic: str) -> Optional[str]:
    """The first IPv4 address of network interface ``nic`` (the first listed when a comma
    separated list is given, as horovodrun accepts), or None when it has none."""
    import psutil  # here: only --network-interface needs it (60 ms of a launcher's start)
    name = nic.split(",")[0].strip()
    for entry in psutil.net_if_addrs().get(name, []):
        if entry.family == socket.AF_INET:
            return entry.address
    return None
