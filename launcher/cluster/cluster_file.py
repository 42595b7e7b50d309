"""The cluster file: where a running ``hvd-edl-cluster serve`` listens, ``{"url", "pid",
"user", "state_dir", "started"}``.  It holds no secret (the service learns who calls from the
kernel: :mod:`launcher.cluster.users`), so every user may read it: the service writes it mode
0644 (``serve --cluster-file``, default :data:`DEFAULT_PATH`; a team's head host names one
every user can reach, e.g. :data:`SYSTEM_PATH`, the clients' last default).  The clients read
it (``--cluster F``) and refuse one that is a symbolic link, not a regular file, or writable by
group or others (anyone could send them to another service).
"""
from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Optional

from launcher.cluster.users import service_user

DEFAULT_PATH = Path("~/.hvd_edl/cluster.json")
SYSTEM_PATH = Path("/etc/hvd_edl/cluster.json")  # a team's head host: one file for everyone
ENV_CLUSTER = "HVD_EDL_CLUSTER"
MAX_BYTES = 64 * 1024


class ClusterFileError(RuntimeError):
    """The cluster file is missing, unreadable, unsafe or malformed (one line for people)."""


def default_path() -> Path:
    """``$HVD_EDL_CLUSTER``, else ``~/.hvd_edl/cluster.json`` when it exists, else
    :data:`SYSTEM_PATH` when it exists, else ``~/.hvd_edl/cluster.json``."""
    given = os.environ.get(ENV_CLUSTER)
    if given:
        return Path(given).expanduser()
    mine = DEFAULT_PATH.expanduser()
    return SYSTEM_PATH if not mine.exists() and SYSTEM_PATH.exists() else mine


def write(path: Path, url: str, state_dir: str) -> Path:
    """Write the cluster file atomically, mode 0644 (its folder made 0755 when created; an
    existing folder is left as it is: a 0700 one keeps other users out, docs/cluster.md).

    Raises:
        OSError: it cannot be written.
    """
    path = Path(path).expanduser()
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    text = json.dumps({"url": url, "pid": os.getpid(), "user": service_user().name,
                       "state_dir": str(state_dir), "started": time.time()})
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(str(tmp), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)  # whatever the umask
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def _unsafe(path: Path, st: os.stat_result) -> Optional[str]:
    """Why the file at ``path`` (its ``lstat``) must not be trusted, or None."""
    if stat.S_ISLNK(st.st_mode):
        return f"cluster file {path} is a symbolic link: refused (give its real path)"
    if not stat.S_ISREG(st.st_mode):
        return f"cluster file {path} is not a regular file: refused"
    if st.st_mode & 0o022:
        return (f"cluster file {path} is writable by others (mode {st.st_mode & 0o777:04o}): "
                f"refused, anyone could point it at another service (chmod go-w it)")
    return None


def read(path: Path) -> dict:
    """The cluster file's contents after the checks of the module docstring.

    Raises:
        ClusterFileError: missing, unreadable, unsafe (the message says which check failed)
            or malformed.
    """
    path = Path(path).expanduser()
    try:
        fd = os.open(str(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ClusterFileError(f"cannot read cluster file {path}: No such file or directory "
                               f"(is hvd-edl-cluster serve running? it writes this file; on a "
                               f"team's host, ask its operator where it is and set "
                               f"{ENV_CLUSTER})") from None
    except OSError as e:
        try:
            st = os.lstat(path)
            why = _unsafe(path, st)
        except OSError:
            why = None
        raise ClusterFileError(why or f"cannot read cluster file {path}: "
                               f"{e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        why = _unsafe(path, st)
        if why:
            raise ClusterFileError(why)
        with os.fdopen(fd, "rb") as f:
            fd = -1
            text = f.read(MAX_BYTES)
    finally:
        if fd >= 0:
            os.close(fd)
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ClusterFileError(f"cannot read cluster file {path}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("url"), str):
        raise ClusterFileError(f"cannot read cluster file {path}: not a cluster file (no url)")
    data["owner_uid"] = st.st_uid  # who wrote it: the service's user (ClusterClient checks)
    return data
