#!/usr/bin/env python3
"""Host discovery for AWS spot instances: the hosts of ``--hosts-file``, a host with a spot
interruption notice with its end (``host ends=UNIX_S``).

    python -m launcher.discovery.aws --hosts-file hosts.txt \\
        --metadata-url 'http://{host}:8181/latest'

A host is going when ``meta-data/spot/instance-action`` exists (HTTP 200, the two-minute notice);
404 means no notice.  Its end is the notice's ``time`` (``{"action": "terminate", "time":
"2026-11-30T08:22:00Z"}``), or 120 s from now when that cannot be read.  IMDSv2 first: ``PUT {base}/api/token``, then the GET with the token; when
the PUT is answered with anything but 200 (IMDSv1-only setups, relays that refuse PUT) the GET
goes without a token.  How the driver reaches each host's metadata, and what an unreachable
endpoint means: see :mod:`launcher.discovery.spot`.
"""
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import List, Optional, Tuple

if not __package__:  # run as a file: import from the repository, not from this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import requests  # noqa: E402

from launcher.discovery import spot  # noqa: E402
from launcher.discovery.spot import Verdict  # noqa: E402

DEFAULT_URL = "http://169.254.169.254/latest"
TOKEN_TTL_S = 60


def notice_end(notice: object, now: float) -> float:
    """The end (unix seconds) an ``instance-action`` notice gives: its ``time`` (ISO 8601 UTC,
    ``2026-11-30T08:22:00Z``), else ``now`` + 120 s (the two minutes AWS promises)."""
    try:
        when = datetime.fromisoformat(str(notice["time"]).replace("Z", "+00:00"))
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        return when.timestamp()
    except (KeyError, TypeError, ValueError):
        return now + spot.AWS_NOTICE_S


def probe(session: requests.Session, base: str,
          timeout_s: float) -> Tuple[Verdict, str, Optional[float]]:
    """One host's verdict from ``{base}/meta-data/spot/instance-action``, and for a notice the
    end it gives (unix seconds, :func:`notice_end`).

    Raises:
        requests.RequestException: the metadata server cannot be reached (the caller counts
            the host UNKNOWN; no IMDSv1 retry then, it would only double the wait).
    """
    headers = {}
    r = session.put(f"{base}/api/token", timeout=timeout_s,
                    headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
    if r.status_code == 200:
        headers["X-aws-ec2-metadata-token"] = r.text.strip()
    r = session.get(f"{base}/meta-data/spot/instance-action", headers=headers, timeout=timeout_s)
    if r.status_code == 404:
        return Verdict.STAYS, "", None
    if r.status_code != 200:
        return Verdict.UNKNOWN, f"spot/instance-action: HTTP {r.status_code}", None
    now = time.time()
    try:
        notice = json.loads(r.text)
        what = f"{notice.get('action', '?')} at {notice.get('time', '?')}"
    except (ValueError, AttributeError):
        notice, what = None, r.text.strip()[:80]
    return Verdict.GOING, f"spot/instance-action: {what}", notice_end(notice, now)


def main(argv: Optional[List[str]] = None) -> int:
    return spot.main(argv, "aws", __doc__.split("\n\n")[0], DEFAULT_URL, probe)


if __name__ == "__main__":
    sys.exit(main())
