#!/usr/bin/env python3
"""Host discovery for GCE spot / preemptible VMs: the hosts of ``--hosts-file``, a host whose
metadata announces a preemption or a maintenance event with its end (``host ends=UNIX_S``).

    python -m launcher.discovery.gce --hosts-file hosts.txt \\
        --metadata-url 'http://{host}:8181/computeMetadata/v1'

A host is going when ``instance/preempted`` is ``TRUE`` or ``instance/maintenance-event`` is not
``NONE`` (spot VMs cannot live-migrate, so any maintenance event ends them; GCE gives about 30 s
of notice: the end printed is the time the notice is seen plus 30 s, as the metadata gives no
time).  Requests carry ``Metadata-Flavor: Google``.  How the driver reaches each host's
metadata, and what an unreachable endpoint means: see :mod:`launcher.discovery.spot`.
"""
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

if not __package__:  # run as a file: import from the repository, not from this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import requests  # noqa: E402

from launcher.discovery import spot  # noqa: E402
from launcher.discovery.spot import Verdict  # noqa: E402

DEFAULT_URL = "http://metadata.google.internal/computeMetadata/v1"
HEADERS = {"Metadata-Flavor": "Google"}


def probe(session: requests.Session, base: str,
          timeout_s: float) -> Tuple[Verdict, str, Optional[float]]:
    """One host's verdict from ``{base}/instance/preempted`` and ``/instance/maintenance-event``,
    and for a notice its end: now + 30 s (:data:`launcher.discovery.spot.GCE_NOTICE_S`).

    Raises:
        requests.RequestException: the metadata server cannot be reached (the caller counts
            the host UNKNOWN).
    """
    answers = {}
    for key in ("preempted", "maintenance-event"):
        r = session.get(f"{base}/instance/{key}", headers=HEADERS, timeout=timeout_s)
        if r.status_code != 200:
            return Verdict.UNKNOWN, f"instance/{key}: HTTP {r.status_code}", None
        answers[key] = r.text.strip()
        if key == "preempted" and answers[key].upper() == "TRUE":
            return Verdict.GOING, "instance/preempted is TRUE", time.time() + spot.GCE_NOTICE_S
    if answers["maintenance-event"].upper() != "NONE":
        return (Verdict.GOING, f"instance/maintenance-event is "
                f"{answers['maintenance-event'][:80]}", time.time() + spot.GCE_NOTICE_S)
    return Verdict.STAYS, "", None


def main(argv: Optional[List[str]] = None) -> int:
    return spot.main(argv, "gce", __doc__.split("\n\n")[0], DEFAULT_URL, probe)


if __name__ == "__main__":
    sys.exit(main())
