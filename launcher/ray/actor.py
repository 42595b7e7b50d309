"""The actor that holds one worker's place on a Ray node: it reserves the worker's resources
(``num_cpus`` / ``num_gpus``, pinned to its node) for as long as it lives, and starts the
worker's supervisor there, detached from itself.

Why detached: Ray kills an actor's child processes when the actor exits, and every actor of a
node exits when that node's raylet does (60 s after the Ray head is lost, by Ray's
``gcs_rpc_server_reconnect_timeout_s``).  A worker that trains must not depend on Ray's head,
so the supervisor is a grandchild (double fork): it answers only to its link with the launcher
(:mod:`launcher.ray.link`), which ends the worker when the launcher stops or dies, as an ssh
session's end does for ``launcher/spawn/remote_worker.py``.

Standard library only besides Ray: this module is sent to the nodes by value (nothing of the
launcher needs to be installed there)."""
from __future__ import annotations

import fcntl
import os
import socket
import struct
import subprocess
import sys
from typing import Dict, List, Optional

_SIOCGIFADDR = 0x8915


def interface_of(ip: str) -> Optional[str]:
    """The name of this machine's network interface that carries IPv4 address ``ip`` (None when
    none does): what ``HOROVOD_GLOO_IFACE`` must be for the ring to use the node's address."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == ip:
            return name
    return None


def start_detached(argv: List[str], env: Dict[str, str], cwd: str) -> int:
    """Start ``argv`` as a grandchild of this process (double fork, its own session, stdio on
    /dev/null) so that no ancestor's exit takes it along; returns its pid.

    Raises:
        OSError: the fork or the exec failed (the exec's errno comes back through a pipe).
    """
    r, w = os.pipe()
    first = os.fork()
    if first == 0:  # the middle process: fork again and leave at once
        try:
            os.close(r)
            os.setsid()
            child = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     close_fds=True)
            os.write(w, f"{child.pid}\n".encode())
            os._exit(0)
        except BaseException as e:  # noqa: BLE001 - reported through the pipe
            try:
                os.write(w, f"error {e}\n".encode())
            finally:
                os._exit(1)
    os.close(w)
    with os.fdopen(r) as f:
        said = f.read().strip()
    os.waitpid(first, 0)
    if not said.isdigit():
        raise OSError(said.removeprefix("error ").strip() or "the middle process died")
    return int(said)


def device_order(own: List[str], node_gpus: int, slot: int) -> Optional[str]:
    """``CUDA_VISIBLE_DEVICES`` for a worker whose actor Ray gave the GPUs ``own`` (Ray's
    ``CUDA_VISIBLE_DEVICES`` for it) on a node of ``node_gpus`` GPUs: every GPU of the node,
    with its own first GPU at index ``slot``, so that a Horovod script's
    ``torch.cuda.set_device(hvd.local_rank())`` (the slot) picks the GPU Ray reserved for it.
    None (leave Ray's) when it has no GPU, more than one, or ``slot`` is past the node's GPUs.
    ``device_order(["3"], 4, 1) == "0,3,1,2"``."""
    if len(own) != 1 or not 0 <= slot < node_gpus:
        return None
    rest = [str(i) for i in range(node_gpus) if str(i) != own[0]]
    return ",".join(rest[:slot] + [own[0]] + rest[slot:])


class WorkerPlace:
    """One worker's place on a node (the class the agent makes a Ray actor of, with
    ``num_cpus`` / ``num_gpus`` and node affinity; see :mod:`launcher.ray.agent`)."""

    def start(self, argv: List[str], env: Dict[str, str], cwd: str, node_ip: str,
              auto_iface: bool, slot: int = 0, node_gpus: int = 0) -> dict:
        """Start the worker's link bootstrap (``argv``, the node's own Python) detached.

        ``env`` adds to the actor's environment (which keeps what Ray set for it, e.g.
        ``CUDA_VISIBLE_DEVICES`` for ``num_gpus``).  ``auto_iface``: set ``HOROVOD_GLOO_IFACE``
        to the interface that carries ``node_ip``.  A one-GPU worker sees every GPU of the node
        with its own at index ``slot`` (:func:`device_order`).  Returns ``{"pid", "iface",
        "python", "devices"}``.

        Raises:
            OSError: the process could not be started.
        """
        full = dict(os.environ)
        full.update(env)
        iface = interface_of(node_ip) if auto_iface else None
        if iface:
            full["HOROVOD_GLOO_IFACE"] = iface
        own = [d for d in full.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        devices = device_order(own, node_gpus, slot)
        if devices is not None:
            full["CUDA_VISIBLE_DEVICES"] = devices
        if not os.path.isdir(cwd):
            cwd = os.getcwd()  # the launcher's folder is not on this node: the actor's own
        pid = start_detached([sys.executable if a == "{python}" else a for a in argv], full, cwd)
        return {"pid": pid, "iface": iface, "python": sys.executable, "devices": devices}

    def ping(self) -> bool:
        return True
