"""Host discovery: one question, ``find_available_hosts_and_slots()`` (Horovod's interface in
``horovod.runner.elastic.discovery``), answered by a script or by a fixed host list.

The contract for a discovery script (Horovod's format): print one ``host[:slots]`` a line
(``[::1]:2`` for IPv6; blank lines and ``#`` comments are ignored) and exit 0, within
``--discovery-timeout`` seconds, printing at most 1 MiB.  Hosts are RFC 1123 names (at most 253
characters) or IP literals, see :mod:`launcher.discovery.hosts`.  Anything else (a malformed line, an
invalid host name, slots not an integer in [1, 1024], a host listed twice, no hosts at all, a
non-zero exit, a hang, a script that is missing or not executable) raises
:class:`DiscoveryError`; the driver then keeps the last good host set and prints one line each
time the problem changes (a failing script's last stderr line is part of the problem, so a hosts
file that goes from bad slots to a duplicate host to empty to deleted is reported four times,
not once).  One bad line fails the whole call rather than being skipped: a skipped line would
read as that host leaving, and its workers would be drained on the strength of a broken output.

A script that leaves a host out for a reason may say so on stderr, one line per host in the form
``<anything>: <host> left out: <reason>`` (the ``gce`` / ``aws`` scripts do, for spot and
preemption notices); the launcher then names that reason when the host's workers leave.

Ready scripts for clusters live beside this file: ``gce`` and ``aws`` (spot / preemptible
notices), ``k8s`` (pods by label), ``hostsfile`` (a validated file, re-read every call); each runs
as ``python -m launcher.discovery.<name> ...`` or as an executable file.
"""
from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from typing import Dict, Hashable, Optional, Tuple

from launcher.discovery.hosts import (HostLine, HostSpecError, check_host, format_host_entry,
                                     parse_host_specs)

log = logging.getLogger(__name__)

MAX_OUTPUT_BYTES = 1 << 20
_STDERR_TAIL_BYTES = 4096
_LEFT_OUT_RE = re.compile(r"^.*?:\s*(?P<host>\S+) left out: (?P<reason>.+)$")


class DiscoveryError(RuntimeError):
    """The discovery script failed: missing or not executable, non-zero exit, timeout, output
    too large, malformed or empty.  The message names the script and the offending line.

    ``key`` identifies the problem without its variable details (the byte count of an oversized
    output, the stderr of a failing script), so a caller can report each distinct problem once.
    """

    def __init__(self, message: str, key: Optional[Hashable] = None):
        super().__init__(message)
        self.key = key if key is not None else message


class FixedHosts:
    """Discovery that always answers the same hosts (``-H`` / ``--hostfile``); ``gpus``: the
    GPUs a hostfile names per host (``host gpus=0,1``: slot i is the i-th)."""

    def __init__(self, hosts: Dict[str, int],
                 gpus: Optional[Dict[str, Tuple[str, ...]]] = None):
        self.hosts = dict(hosts)
        self.gpus: Dict[str, Tuple[str, ...]] = dict(gpus or {})
        self.ends: Dict[str, float] = {}  # host -> its announced end (ends=), unix seconds
        self.lines: Dict[str, HostLine] = {}  # host -> its whole line (type=, price=, spot)

    @classmethod
    def from_lines(cls, text: str, default_slots: int = 1) -> "FixedHosts":
        """A hostfile's text (:func:`launcher.discovery.hosts.parse_host_specs`).

        Raises:
            HostSpecError: a malformed line."""
        specs = parse_host_specs(text, default_slots)
        out = cls({h: e.slots for h, e in specs.items()},
                  {h: e.gpus for h, e in specs.items() if e.gpus})
        out.ends = {h: e.ends for h, e in specs.items() if e.ends}
        out.lines = dict(specs)
        return out

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        return dict(self.hosts)


def describe_hosts(hosts: Dict[str, int]) -> str:
    """``{"a": 2, "::1": 1}`` -> ``"a:2,[::1]:1"`` (for log lines)."""
    return ",".join(format_host_entry(h, s) for h, s in hosts.items())


class HostDiscoveryScript:
    """Runs ``script`` and parses Horovod's format, one ``host[:slots]`` a line.

    Args:
        script: path of an executable, or a shell command line (``python d.py --flag``).
        slots: slots for lines that give none (``--slots-per-host``), >= 1.
        timeout_s: seconds the script may run; then it and every process it started (its
            process group) are killed and the call fails.
    """

    def __init__(self, script: str, slots: int = 1, timeout_s: float = 5.0):
        self.script = script
        self.slots = slots
        self.timeout_s = timeout_s
        self.reasons: Dict[str, str] = {}  # host -> why the last good call left it out
        self.gpus: Dict[str, Tuple[str, ...]] = {}  # host -> its gpus= in the last good call
        self.ends: Dict[str, float] = {}  # host -> its announced end (ends=), unix seconds
        self.lines: Dict[str, HostLine] = {}  # host -> its whole line in the last good call

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        """Returns ``{host: slots}`` in the script's order.

        Raises:
            DiscoveryError: with a message naming the script and the problem (for a malformed
                line: its number and text).
        """
        self._check_executable()
        name = f"host discovery script {self.script}"
        rc, out, err, why = _run_bounded(self.script, self.timeout_s, MAX_OUTPUT_BYTES)
        if why == "timeout":
            raise DiscoveryError(f"{name} did not finish within {self.timeout_s:g} s "
                                 f"(--discovery-timeout): killed", key="timeout")
        if why == "too large":
            raise DiscoveryError(f"{name} printed more than {MAX_OUTPUT_BYTES} bytes (1 MiB "
                                 f"limit): output ignored", key="too large")
        lines = err.decode(errors="replace").strip().splitlines()
        if rc != 0:
            last = lines[-1].strip()[:200] if lines else "(no stderr)"
            # the problem is the exit code and what the script said, digits aside (a time or a
            # count in the message is not a new problem; another message is)
            raise DiscoveryError(f"{name} exited with code {rc}: {last}",
                                 key=("exit", rc, re.sub(r"[0-9]+", "#", last)))
        try:
            specs = parse_host_specs(out.decode(errors="replace"), self.slots)
        except HostSpecError as e:
            raise DiscoveryError(f"{name}: output {e}") from None
        hosts = {h: e.slots for h, e in specs.items()}
        if not hosts:
            raise DiscoveryError(f"{name} printed no hosts (empty output is taken as a broken "
                                 f"script, not as 'no hosts')")
        self.reasons = {}
        self.gpus = {h: e.gpus for h, e in specs.items() if e.gpus}
        self.ends = {h: e.ends for h, e in specs.items() if e.ends}
        self.lines = dict(specs)
        for m in filter(None, map(_LEFT_OUT_RE.match, lines)):
            host = _canonical(m.group("host").strip("[]"))
            if host is not None:  # in the form the hosts take (lower case, ...)
                self.reasons[host] = m.group("reason").strip()[:200]
        return hosts

    def _check_executable(self) -> None:
        try:
            path = shlex.split(self.script)[0]
        except (ValueError, IndexError):
            raise DiscoveryError(f"host discovery script {self.script!r} is not a valid "
                                 f"command line") from None
        if os.sep not in path:
            return  # a command found on PATH (``cat file``): the shell reports if it is not
        if not os.path.isfile(path):
            raise DiscoveryError(f"host discovery script {path} does not exist")
        if not os.access(path, os.X_OK):
            raise DiscoveryError(f"host discovery script {path} is not executable "
                                 f"(chmod +x {path})")


def _canonical(host: str) -> Optional[str]:
    try:
        return check_host(host)
    except HostSpecError:
        return None


def _run_bounded(command: str, timeout_s: float, max_bytes: int):
    """Runs ``command`` through the shell in its own process group, reading at most
    ``max_bytes + 1`` bytes of stdout and the last few KiB of stderr.

    Returns ``(exit code, stdout, stderr tail, why)`` where ``why`` is None, "timeout" or
    "too large" (in both cases the whole process group was killed).  Never blocks past
    ``timeout_s`` (plus a second to collect the pipes), even if the script leaves children
    behind that hold its output open.
    """
    proc = subprocess.Popen(command, shell=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    out, err = bytearray(), bytearray()
    too_large = threading.Event()

    def kill_group():
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def read_out():
        while True:
            chunk = proc.stdout.read1(65536)
            if not chunk:
                return
            out.extend(chunk)
            if len(out) > max_bytes:
                too_large.set()
                kill_group()
                return

    def read_err():
        while True:
            chunk = proc.stderr.read1(65536)
            if not chunk:
                return
            err.extend(chunk)
            del err[:-_STDERR_TAIL_BYTES]

    readers = [threading.Thread(target=read_out, daemon=True),
               threading.Thread(target=read_err, daemon=True)]
    for t in readers:
        t.start()
    why = None
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        why = "timeout"
    if why is None:
        # the script exited; a child it left behind may still hold the pipes open
        _join_all(readers, 1.0)
    kill_group()
    proc.wait()
    _join_all(readers, 1.0)
    if not any(t.is_alive() for t in readers):  # else a stray child escaped the group
        proc.stdout.close()
        proc.stderr.close()
    if too_large.is_set():
        why = "too large"
    return proc.returncode, bytes(out), bytes(err), why


def _join_all(threads, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
