"""What a test run left behind, said at its end (tests/conftest.py calls :func:`start` when the
run begins and prints :func:`report` when it ends; nothing is ended or removed here).

* Processes: the run's first process puts ``HVD_EDL_TEST_SESSION=<token>`` in its environment;
  every process a test starts inherits it (xdist's workers, the launchers, the cluster service,
  its jobs, forked workers, which show their environment in ``/proc``), so whatever still
  carries the token once the run is over was started by it and outlived it.  Processes that are
  ending get a bounded grace (:data:`GRACE_S`) before they count.
* Kept zygotes (docs/zygote.md): their environment is the key's, not the starter's, so the token
  is also the run's ``HVD_EDL_KEPT_MARK``, which a kept zygote keeps in its own environment (its
  workers get their stubs' environments, not its); the run's kept-zygote folders
  (``$TMPDIR/hvd-edl-kz-<token>-*``: tests/conftest.py's, the zygote tests', the cluster
  service's under the mark) that still exist were left behind, empty or not.
* Namespace clusters (tests/cluster.py) and Unix users (tests/unix_users.py): each is listed in
  a registry (``/run/hvdedl-clusters/<id>``, ``/run/hvdedl-users/<name>``, holding the pid of the
  process that made it); an entry that appeared during the run and whose maker is gone was
  left behind by it (another session's live clusters and users have live makers).
"""
from __future__ import annotations

import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

SESSION_ENV = "HVD_EDL_TEST_SESSION"
MARK_ENV = "HVD_EDL_KEPT_MARK"   # launcher.spawn.zygote_client.KEPT_MARK_ENV
FOLDER_PREFIX = "hvd-edl-kz-"     # launcher.cluster.kept_zygotes.PREFIX
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
    os.environ[MARK_ENV] = token
    _before.clear()
    _before.update(_registered())
    return token


def kept_folder_prefix(token: Optional[str] = None) -> str:
    """The name prefix of this run's kept-zygote folders in the temporary directory (``token``:
    the session's, default this process's)."""
    return f"{FOLDER_PREFIX}{token or os.environ.get(SESSION_ENV, '')}-"


def _marked(token: str) -> Dict[int, str]:
    """pid -> command line of every process but this one whose environment has the token (as
    the session marker, or as the kept-zygote mark: a kept zygote's)."""
    wants = {f"{SESSION_ENV}={token}".encode(), f"{MARK_ENV}={token}".encode()}
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if not wants & set(f.read().split(b"\0")):
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
    """One line per process (kept zygotes included), kept-zygote folder, namespace cluster or
    test user the run left behind (empty: none).
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
        prefix = kept_folder_prefix(token)
        tmp = tempfile.gettempdir()
        for name in sorted(os.listdir(tmp)):
            if name.startswith(prefix):
                lines.append(f"left behind: kept-zygote folder {os.path.join(tmp, name)}")
    for entry, maker in sorted(_registered().items()):
        if entry not in _before and not _alive(maker):
            kind = "namespace cluster" if entry.parent == REGISTRIES[0] else "test user"
            lines.append(f"left behind: {kind} {entry.name} (its maker, pid {maker}, is gone)")
    return lines
