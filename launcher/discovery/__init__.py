"""Host discovery: one question, ``find_available_hosts_and_slots()`` (Horovod's interface in
``horovod.runner.elastic.discovery``), answered by a script or by a fixed host list."""
from __future__ import annotations

import logging
import os
import subprocess
from typing import Dict

from launcher.hosts import HostSpecError, parse_host_lines

log = logging.getLogger(__name__)

MAX_OUTPUT_BYTES = 1 << 20


class DiscoveryError(RuntimeError):
    """The discovery script failed: not executable, non-zero exit, timeout, output too large or
    malformed.  The message names the script and the offending line."""


class FixedHosts:
    """Discovery that always answers the same hosts (``-H`` / ``--hostfile``)."""

    def __init__(self, hosts: Dict[str, int]):
        self.hosts = dict(hosts)

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        return dict(self.hosts)


class HostDiscoveryScript:
    """Runs ``script`` and parses Horovod's format, one ``host[:slots]`` a line.

    Args:
        script: path of an executable (or a shell command line).
        slots: slots for lines that give none (``--slots-per-host``), >= 1.
        timeout_s: the script is killed and the call fails after this many seconds.
    """

    def __init__(self, script: str, slots: int = 1, timeout_s: float = 5.0):
        self.script = script
        self.slots = slots
        self.timeout_s = timeout_s

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        """Raises :class:`DiscoveryError` with a message naming the script and the problem."""
        path = self.script.split()[0]
        if os.path.exists(path) and not os.access(path, os.X_OK):
            raise DiscoveryError(f"host discovery script {path} is not executable (chmod +x it)")
        try:
            proc = subprocess.run(self.script, shell=True, capture_output=True,
                                  timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise DiscoveryError(f"host discovery script {self.script} did not finish within "
                                 f"{self.timeout_s:g} s (--discovery-timeout)") from None
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
            raise DiscoveryError(f"host discovery script {self.script} exited with code "
                                 f"{proc.returncode}: {err[0]}")
        if len(proc.stdout) > MAX_OUTPUT_BYTES:
            raise DiscoveryError(f"host discovery script {self.script} printed "
                                 f"{len(proc.stdout)} bytes, over the {MAX_OUTPUT_BYTES} limit")
        try:
            hosts = parse_host_lines(proc.stdout.decode(errors="replace"), self.slots)
        except HostSpecError as e:
            raise DiscoveryError(f"host discovery script {self.script}: {e}") from None
        if not hosts:
            raise DiscoveryError(f"host discovery script {self.script} printed no hosts")
        return hosts
