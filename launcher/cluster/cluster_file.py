"""The cluster file: where a running ``hvd-edl-cluster serve`` listens and the per-cluster
secret every client request is signed with (``hvd_edl.messages.sign``, as the control API of a
job), ``{"url", "secret", "pid", "state_dir", "started"}``.  Written by the service with mode
0600 in a 0700 folder (default :data:`DEFAULT_PATH`, ``serve --cluster-file``), read by the
client commands (``--cluster F``); the secret is never in any command line.  A file that is a
symbolic link, another user's, or readable or writable by others is refused (its secret would be
someone else's, or no longer secret).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hvd_edl import private_file
from hvd_edl.private_file import PrivateFileError, read_private, write_private

DEFAULT_PATH = Path("~/.hvd_edl/cluster.json")
ENV_CLUSTER = "HVD_EDL_CLUSTER"


class ClusterFileError(RuntimeError):
    """The cluster file is missing, unreadable, unsafe or malformed (one line for people)."""


def default_path() -> Path:
    """``$HVD_EDL_CLUSTER``, else ``~/.hvd_edl/cluster.json``."""
    return Path(os.environ.get(ENV_CLUSTER) or DEFAULT_PATH).expanduser()


def write(path: Path, url: str, secret: str, state_dir: str) -> Path:
    """Write the cluster file atomically, mode 0600 (its folder made 0700 when created).

    Raises:
        OSError: it cannot be written.
    """
    path = Path(path).expanduser()
    write_private(path, json.dumps({"url": url, "secret": secret, "pid": os.getpid(),
                                    "state_dir": str(state_dir), "started": time.time()}).encode())
    return path


def read(path: Path) -> dict:
    """The cluster file's contents after the checks of the module docstring.

    Raises:
        ClusterFileError: missing, unreadable, unsafe (the message says which check failed)
            or malformed.
    """
    path = Path(path).expanduser()
    try:
        text = read_private(path)
    except PrivateFileError as e:
        if e.reason == private_file.SYMLINK:
            raise ClusterFileError(f"cluster file {path} is a symbolic link: refused (give "
                                   f"its real path)") from None
        if e.reason == private_file.NOT_REGULAR:
            raise ClusterFileError(f"cluster file {path} is not a regular file: refused") from None
        if e.reason == private_file.OTHER_OWNER:
            raise ClusterFileError(f"cluster file {path} is owned by uid {e.uid}, not by "
                                   f"you (uid {os.geteuid()}): refused (its secret is not "
                                   f"yours to use)") from None
        if e.reason == private_file.OPEN_TO_OTHERS:
            raise ClusterFileError(f"cluster file {path} is readable or writable by others "
                                   f"(mode {e.mode:04o}): refused, its "
                                   f"secret may be known; restart the service (it writes the "
                                   f"file 0600), or chmod 600 {path} if no one else read it") \
                from None
        if e.reason == private_file.MISSING:
            raise ClusterFileError(f"cannot read cluster file {path}: No such file or directory "
                                   f"(is hvd-edl-cluster serve running? it writes this file)") \
                from None
        raise ClusterFileError(f"cannot read cluster file {path}: {e.detail or e.reason}") \
            from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ClusterFileError(f"cannot read cluster file {path}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("url"), str) \
            or not isinstance(data.get("secret"), str):
        raise ClusterFileError(f"cannot read cluster file {path}: not a cluster file (no url "
                               f"and secret)")
    return data
