"""Files in a user's job folder, opened by the service: under a root service a job's folder
``STATE_DIR/jobs/<id>/`` and every file in it are its user's (:mod:`launcher.cluster.runs`),
so the service accepts a file there owned by that user or by itself, and nobody else.

The folder is the user's, so anything in it may be planted: every open goes through
:func:`hvd_edl.private_file.open_checked` (``O_NOFOLLOW``: a symbolic link is refused and
cannot redirect root's read or write; ``O_NONBLOCK``: a FIFO cannot block the service; then
``fstat`` of the open descriptor, so no race between check and use: a regular file, owned by
one of the accepted uids).
"""
from __future__ import annotations

import os
from typing import Iterable, Optional

from hvd_edl.private_file import PrivateFileError, open_checked, read_private

__all__ = ["PrivateFileError", "job_uids", "open_owned", "read_owned"]


def job_uids(folder_uid: Optional[int]) -> frozenset:
    """The uids whose files the service accepts in a job's folder: its own and ``folder_uid``
    (the job's user: :meth:`launcher.cluster.runs.JobFiles.owner`'s first item; None when the
    folder is the service's own)."""
    return frozenset({os.geteuid()} | ({folder_uid} if folder_uid is not None else set()))


def open_owned(path: os.PathLike, uids: Iterable[int], flags: int = os.O_RDONLY,
               mode: int = 0o600) -> int:
    """A file descriptor of ``path`` opened with ``flags | O_NOFOLLOW | O_NONBLOCK`` (the
    descriptor keeps ``O_NONBLOCK``: harmless for a regular file), after ``fstat`` showed a
    regular file owned by a uid in ``uids``.  ``mode``: a file ``O_CREAT`` creates.  The
    caller closes it.

    Raises:
        PrivateFileError: ``reason`` missing, symlink, not_regular, other_owner (``uid``: the
            file's owner) or unreadable (:mod:`hvd_edl.private_file`).
    """
    fd, _ = open_checked(path, uids, flags, mode)
    return fd


def read_owned(path: os.PathLike, uids: Iterable[int], max_bytes: int = 1 << 20) -> bytes:
    """The contents of a private file (mode 0600 or stricter) in a job's folder owned by a uid
    in ``uids``.

    Raises:
        PrivateFileError: as :func:`open_owned`, or open to others, or over ``max_bytes``.
    """
    return read_private(path, max_bytes, owners=uids)
