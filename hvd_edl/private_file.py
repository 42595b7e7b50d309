"""Files that hold a secret (a job file, the checkpoint key, a cluster file): written atomically
with mode 0600 in a 0700 folder, and read only after checking that nobody else could have written
or read them.

One check for every such file, so the rules cannot drift apart: the file is opened with
``O_NOFOLLOW`` (a symbolic link is refused, a planted link cannot redirect the read) and
``O_NONBLOCK`` (a planted FIFO cannot hang the reader), then ``fstat`` of the open descriptor
(no race between the check and the read) must show a regular file owned by this user with no
group or other permission bits.  Callers turn a :class:`PrivateFileError` into their own error
and message, using its ``reason``.
"""
from __future__ import annotations

import errno
import os
import stat

# standard library only, and none of its heavier modules (typing, pathlib, secrets: 13-17 ms of
# CPU each in a fresh interpreter): a job's discovery under the cluster service runs
# ``launcher/cluster/allocation.py`` with this module every 0.2 s
TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Iterable, Optional, Tuple, Union
    PathLike = Union[str, os.PathLike]

MISSING = "missing"            # no such file
SYMLINK = "symlink"            # a symbolic link
NOT_REGULAR = "not_regular"    # a folder, FIFO, device, socket
OTHER_OWNER = "other_owner"    # owned by another uid (``uid`` holds it)
OPEN_TO_OTHERS = "open"        # group or others may read or write it (``mode`` holds it)
UNREADABLE = "unreadable"      # any other OSError (``detail`` holds strerror)
TOO_LARGE = "too_large"        # more than ``max_bytes``


class PrivateFileError(OSError):
    """A private file cannot be used.  ``reason`` is one of the module's constants; ``uid``
    (the owner, for OTHER_OWNER), ``mode`` (permission bits, for OPEN_TO_OTHERS) and ``detail``
    (strerror, for UNREADABLE) say more."""

    def __init__(self, path: PathLike, reason: str, uid: int = -1, mode: int = 0,
                 detail: str = ""):
        self.path, self.reason, self.uid, self.mode, self.detail = path, reason, uid, mode, detail
        super().__init__(f"{path}: {reason} {detail or ''}".strip())


def open_checked(path: PathLike, owners: Optional[Iterable[int]] = None,
                 flags: int = os.O_RDONLY, mode: int = 0o600) -> Tuple[int, os.stat_result]:
    """An open descriptor of ``path`` and its ``fstat``, after the open and owner checks of the
    module's docstring: ``O_NOFOLLOW | O_NONBLOCK`` are added to ``flags`` (a link is refused, a
    FIFO never blocks), then it must be a regular file owned by a uid in ``owners`` (default:
    this user only).  The permission bits are not checked here (:func:`read_private` does).
    The caller closes the descriptor.  ``mode``: a file ``O_CREAT`` in ``flags`` creates.

    Raises:
        PrivateFileError: missing, a symbolic link, not a regular file, owned by a uid not in
            ``owners``, or unopenable.
    """
    accepted = {os.geteuid()} if owners is None else set(owners)
    try:
        fd = os.open(os.fspath(path), flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    except FileNotFoundError:
        raise PrivateFileError(path, MISSING) from None
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            raise PrivateFileError(path, SYMLINK) from None
        raise PrivateFileError(path, UNREADABLE, detail=e.strerror or str(e)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PrivateFileError(path, NOT_REGULAR)
        if st.st_uid not in accepted:
            raise PrivateFileError(path, OTHER_OWNER, uid=st.st_uid)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_private(path: PathLike, max_bytes: int = 1 << 20,
                 owners: Optional[Iterable[int]] = None) -> bytes:
    """The contents of ``path`` (at most ``max_bytes`` bytes), after the checks of the module's
    docstring.  ``owners``: the uids whose file is accepted (default: this user only; a root
    service reading a file in a user's job folder also accepts that user's uid,
    :mod:`launcher.cluster.user_files`).

    Raises:
        PrivateFileError: missing, a symbolic link, not a regular file, owned by a uid not in
            ``owners``, open to group or others, larger than ``max_bytes``, or unreadable.
    """
    fd, st = open_checked(path, owners)
    try:
        if st.st_mode & 0o077:
            raise PrivateFileError(path, OPEN_TO_OTHERS, mode=stat.S_IMODE(st.st_mode))
        chunks, size = [], 0
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise PrivateFileError(path, TOO_LARGE, detail=f"over {max_bytes} bytes")
        return b"".join(chunks)
    except PrivateFileError:
        raise
    except OSError as e:
        raise PrivateFileError(path, UNREADABLE, detail=e.strerror or str(e)) from None
    finally:
        os.close(fd)


def write_private(path: PathLike, data: bytes, replace: bool = True, fsync: bool = False,
                  owner: Optional[Tuple[int, int]] = None) -> Path:
    """Write ``data`` to ``path`` atomically with mode 0600 (its folder created 0700 if missing)
    and return the path.  ``replace`` False never replaces an existing file: a concurrent writer's
    file wins and FileExistsError is raised (used to create a key exactly once).  ``owner``
    ``(uid, gid)``: the file is theirs before it appears (root writing a user's file).

    Raises:
        OSError: the folder or the file cannot be written; FileExistsError as above.
    """
    from pathlib import Path
    target = Path(path)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(str(tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if owner is not None:
                os.fchown(fd, owner[0], owner[1])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, target)
        else:
            os.link(tmp, target)  # atomic, never replaces
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    return target
