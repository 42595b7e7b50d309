"""What a test run left behind, said at its end (tests/conftest.py calls :func:`start` when the
run begins and prints :func:`report` when it ends; nothing is ended or removed here).

* Processes: the run's first process puts ``HVD_EDL_TEST_SESSION=<token>`` in its environment;
  every process a test starts inherits it (xdist's workers, the launchers, the cluster service,
  its jobs, forked workers, which show their environment in ``/proc``), so whatever still
  carries the token once the run is over was started by it and outlived it.  Processes that are
  ending get a bounded grace (:data:`GRACE_S`) before they count.
* Namespace clusters (tests/cluster.py) and Unix users (tests/unix_users.py): each is listed in
  a registry (``/run/hvdedl-clusters/<id>``, ``/run/hvdedl-users/<name>``, holding the pid of the
  process that made it); an entry that appeared during the run and whose maker is gone was
  left behind by it (another session's live clusters and users have live makers).
"""
from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Dict, List, Optional

SESSION_ENV = "HVD_EDL_TEST_SESSION"
REGISTRIES = (Path("/run") / "hvdedl-clusters", Path("/run") / "hvdedl-users")
GRACE_S = 10.0   # processes still ending when the run ends get this long


def _registered() -> Dict[Path, Optional[int]]:
    """Every registry entry now, with the pid it names (None: unreadable)."""
    out: Dict[Path, Optional[int]] = {}
    for folder in REGISTRIES:
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        for entry in entries:
            try:
                out[entry] = int(entry.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                out[entry] = None
    return out


_before: Dict[Path, Optional[int]] = {}


def start() -> str:
    """Mark this process's environment with a fresh session token (inherited by everything the
    run starts) and note the registries' entries; returns the token."""
    token = secrets.token_hex(8)
    os.environ[SESSION_ENV] = token
    _before.clear()
    _before.update(_registered())
    return token


def _marked(token: str) -> Dict[int, str]:
    """pid -> command line of every process but this one whose environment has the token."""
    want = f"{SESSION_ENV}={token}".encode()
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if want not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                out[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
        except OSError:
            continue
    return out


def _alive(pid: Optional[int]) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def report(token: Optional[str] = None) -> List[str]:
    """One line per process, namespace cluster or test user the run left behind (empty: none).
    ``token``: the session's (default: this process's environment's)."""
    token = token or os.environ.get(SESSION_ENV)
    lines = []
    if token:
        deadline = time.monotonic() + GRACE_S
        left = _marked(token)
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = _marked(token)
        lines += [f"left behind: process {pid}: {cmd}" for pid, cmd in sorted(left.items())]
    for entry, maker in sorted(_registered().items()):
        if entry not in _before and not _alive(maker):
            kind = "namespace cluster" if entry.parent == REGISTRIES[0] else "test user"
            lines.append(f"left behind: {kind} {entry.name} (its maker, pid {maker}, is gone)")
    return lines
