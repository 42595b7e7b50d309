"""What the ``gce`` and ``aws`` discovery scripts share: read the candidate hosts from a hosts
file, ask each host's metadata server (in parallel, short timeouts) whether the provider has
announced that the machine is going, and print every host in Horovod's format, a host with a
notice with the time its notice gives for its end (``host ends=UNIX_S``,
:mod:`launcher.discovery.hosts`): no new worker goes there, and the job's workers there leave
stop-free at their next commit (after a checkpoint where the job keeps them) before the machine
goes.  Leaving such a host out instead would read as the host gone at once: no time to commit.

When the end is: AWS's notice says it (``spot/instance-action``'s ``time``, two minutes after the
notice); GCE's does not, and gives about 30 s from the notice (``instance/preempted`` turning
TRUE, ``instance/maintenance-event`` announcing a termination), so the script prints the time it
first sees the notice plus 30 s (:data:`GCE_NOTICE_S`).  A later call prints a later time for the
same notice; the launcher keeps the first end it was given for a host (the earliest), and the
cluster service's drain takes the first too.

How the driver reaches each host's metadata: a cloud metadata server answers only the VM it runs
on (``169.254.169.254`` / ``metadata.google.internal`` is link-local), so the driver cannot ask it
about another host directly.  ``--metadata-url`` is a template with a ``{host}`` placeholder; run a
plain TCP relay on every worker host and point the template at it, e.g. on each host::

    socat TCP-LISTEN:8181,fork,reuseaddr TCP:169.254.169.254:80

and ``--metadata-url 'http://{host}:8181/computeMetadata/v1'`` (GCE) or
``'http://{host}:8181/latest'`` (AWS).  A TCP relay adds no ``X-Forwarded-For`` header, which both
clouds refuse, and its requests leave the host itself, so the IMDSv2 hop limit is met.  Open the
relay port to the driver only.  Without ``{host}`` every host gets the same URL: right only
for a job whose hosts are all this one machine (the default URLs are the clouds' own).

An unreachable metadata endpoint (connection refused, timeout, an unexpected HTTP status) is
*unknown*, not *going*: with ``--unreachable keep`` (the default) the host stays listed, because
removing a healthy host costs a generation change, while a host that really vanished is caught
anyway when its workers die (the failure path).  ``--unreachable drop`` leaves it out instead.
When no host's metadata answers at all the script exits 1 (most likely a wrong URL template):
the launcher then keeps its last good host set and says why, and refuses to start on a first
call that fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import requests

from launcher.discovery.hosts import (HostLine, HostSpecError, format_host_entry,
                                     parse_host_specs)

MAX_PARALLEL = 32
GCE_NOTICE_S = 30.0   # GCE: a preemption / termination notice comes about 30 s before the end
AWS_NOTICE_S = 120.0  # AWS: the spot interruption notice, two minutes (when its time is unreadable)


class Verdict(enum.Enum):
    """What a host's metadata says: it ``STAYS``, it is ``GOING`` (a notice), or ``UNKNOWN``
    (the metadata could not be read)."""
    STAYS = "stays"
    GOING = "going"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class HostCheck:
    """One host's answer; ``reason`` says why for GOING / UNKNOWN; ``ends``: for GOING, the unix
    time (seconds) the notice gives for the machine's end."""
    host: str
    slots: Optional[int]
    verdict: Verdict
    reason: str = ""
    ends: Optional[float] = None


# probe(session, base_url, timeout_s) -> (verdict, reason, ends: unix seconds for GOING, else
# None); may raise requests.RequestException
Probe = Callable[[requests.Session, str, float], Tuple[Verdict, str, Optional[float]]]


def metadata_base(template: str, host: str) -> str:
    """``"http://{host}:8181/latest"`` for host ``"::1"`` -> ``"http://[::1]:8181/latest"``."""
    return template.replace("{host}", format_host_entry(host)).rstrip("/")


def check_hosts(hosts: List[Tuple[str, Optional[int]]], probe: Probe, url_template: str,
                timeout_s: float) -> List[HostCheck]:
    """Runs ``probe`` for every host in parallel (at most MAX_PARALLEL at once), each HTTP
    request with ``timeout_s`` seconds to connect and ``timeout_s`` to answer; results in the
    order of ``hosts``.  Never raises for a host: failures come back as UNKNOWN."""
    def one(entry):
        host, slots = entry
        with requests.Session() as session:
            session.trust_env = False  # never send metadata requests through an HTTP proxy
            try:
                verdict, reason, ends = probe(session, metadata_base(url_template, host),
                                              timeout_s)
            except requests.RequestException as e:
                verdict, reason, ends = Verdict.UNKNOWN, f"unreachable ({type(e).__name__})", None
        return HostCheck(host, slots, verdict, reason, ends)

    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(hosts))) as pool:
        return list(pool.map(one, hosts))


def read_candidates(path: str) -> List[Tuple[str, Optional[int]]]:
    """The hosts file, ``host[:slots]`` a line, as ``[(host, slots or None)]`` in order.

    Raises:
        OSError: the file cannot be read.
        HostSpecError: a malformed line (its number in the message) or a host listed twice.
    """
    return [(h, e.slots) for h, e in read_lines(path).items()]


def read_lines(path: str) -> Dict[str, HostLine]:
    """The hosts file's lines, host -> :class:`HostLine` in order, with what they give beyond
    slots (``type=``, ``price=``, ``spot``: printed again for the hosts that stay, so the
    cluster service knows each host's GPU type, price and transience).

    Raises:
        OSError: the file cannot be read.
        HostSpecError: a malformed line (its number in the message) or a host listed twice.
    """
    with open(path) as f:
        return parse_host_specs(f.read(), default_slots=None)


def main(argv: Optional[List[str]], prog: str, description: str, default_url: str,
         probe: Probe) -> int:
    """The command line both cloud scripts share; returns the exit code (0: hosts printed,
    1: nothing usable or a bad hosts file, 2: bad flags)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--hosts-file", required=True,
                   help="candidate hosts, one 'host[:slots] [type=NAME] [price=D] [spot]' a "
                        "line (re-read every call; the attributes are printed again)")
    p.add_argument("--metadata-url", default=default_url,
                   help="metadata base URL; '{host}' is replaced by each host "
                        f"(default {default_url}, i.e. this machine's own metadata)")
    p.add_argument("--request-timeout", type=float, default=1.0,
                   help="seconds per HTTP request to connect, and again to answer (default 1)")
    p.add_argument("--unreachable", choices=("keep", "drop"), default="keep",
                   help="a host whose metadata cannot be read stays listed (keep, default) "
                        "or is left out (drop)")
    a = p.parse_args(argv)
    try:
        lines = read_lines(a.hosts_file)
        candidates = [(h, e.slots) for h, e in lines.items()]
    except (OSError, HostSpecError) as e:
        print(f"{prog}: {a.hosts_file}: {e}", file=sys.stderr)
        return 1
    if not candidates:
        print(f"{prog}: {a.hosts_file} lists no hosts", file=sys.stderr)
        return 1
    checks = check_hosts(candidates, probe, a.metadata_url, a.request_timeout)
    unknown = [c for c in checks if c.verdict is Verdict.UNKNOWN]
    if len(unknown) == len(checks):
        print(f"{prog}: metadata of all {len(checks)} hosts unreachable (is --metadata-url "
              f"right?), e.g. {unknown[0].host}: {unknown[0].reason} at "
              f"{metadata_base(a.metadata_url, unknown[0].host)}", file=sys.stderr)
        return 1
    keep = {Verdict.STAYS, Verdict.GOING} | \
        ({Verdict.UNKNOWN} if a.unreachable == "keep" else set())
    for c in checks:
        if c.verdict is Verdict.GOING:
            print(f"{prog}: {c.host} ends in {c.ends - time.time():.0f} s: {c.reason}",
                  file=sys.stderr)
        elif c.verdict is Verdict.UNKNOWN:
            print(f"{prog}: {c.host} metadata {c.reason}: "
                  f"{'kept' if a.unreachable == 'keep' else 'left out'}", file=sys.stderr)
    listed = [c for c in checks if c.verdict in keep]
    if not listed:
        print(f"{prog}: no host left: " + "; ".join(f"{c.host}: {c.reason}" for c in checks),
              file=sys.stderr)
        return 1
    print("\n".join(dataclasses.replace(lines[c.host], ends=c.ends or lines[c.host].ends)
                     .format() for c in listed), flush=True)
    return 0
