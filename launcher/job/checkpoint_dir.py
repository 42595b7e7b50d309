"""The launcher's side of ``--checkpoint-dir``: the directory's ownership and mode checked at
start (:func:`check_directory`), the user's checkpoint key read and handed to the workers, one
job per directory (a lock held for the job's life), and the choice of the checkpoint a ring
without any holder of the state resumes from.

A directory another user can write lets that user plant a checkpoint for the job to resume from:
it is refused unless it is owned by this user and only its owner can write it, or it is sticky
(``/tmp``'s mode, 1777: others may add files there but not replace or delete ours), and each
folder above it (each could be replaced) is owned by this user or root and likewise.  ``--trust-checkpoint-dir`` skips
these checks for trusted shared storage (an NFS export or bucket whose other writers are you);
checkpoints are authenticated (an HMAC under the user's key, :mod:`hvd_edl.checkpoint`) and read
with ``weights_only=True`` either way.

The files and their checks are :mod:`hvd_edl.checkpoint`'s (shared with the workers, which
write them).  The lock is a ``filelock`` lock on ``DIR/.hvd-edl.lock`` (``fcntl`` on POSIX): the
kernel drops it when the launcher dies, even by ``kill -9``, so the same command run again gets
it at once.  On a network filesystem ``fcntl`` locks are as good as its lock manager (NFSv4:
leases; some FUSE filesystems: none); see docs/checkpoints.md, "On a cluster".
"""
from __future__ import annotations

import errno
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from hvd_edl import checkpoint


class CheckpointDirError(RuntimeError):
    """The directory cannot be used (not writable, held by another job) or holds no usable
    checkpoint; the message is one line for people."""


TRUST_FLAG = "--trust-checkpoint-dir"


def _unsafe(st: os.stat_result, uid: int, owners: Tuple[int, ...]) -> Optional[str]:
    """Why a folder with ``st`` lets another user change what is in it, or None."""
    if st.st_uid not in owners:
        return f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (f"is writable by {'others' if st.st_mode & 0o002 else 'its group'} (mode "
                f"{stat.S_IMODE(st.st_mode):04o}) and not sticky")
    return None


def check_directory(path: str, trusted: bool = False) -> Path:
    """Create ``--checkpoint-dir`` if missing and check that no other user can plant or replace
    a checkpoint in it; returns it resolved (symbolic links followed once, here).

    Refused: the directory owned by another user than this one; writable by group or others
    and not sticky; a folder above it owned by another user than this one or root, or writable
    by group or others and not sticky.  ``trusted`` (``--trust-checkpoint-dir``) skips those
    checks (checkpoints are still authenticated).

    Raises:
        CheckpointDirError: not creatable, not a directory, or refused (one line saying why and
            what to do).
    """
    p = Path(path).expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True)
        p = p.resolve(strict=True)
        st = os.stat(p)
    except OSError as e:
        raise CheckpointDirError(f"--checkpoint-dir {p} is not writable: "
                                 f"{e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointDirError(f"--checkpoint-dir {p} is not writable: "
                                 f"{os.strerror(errno.ENOTDIR)}")
    if trusted:
        return p
    uid = os.geteuid()
    why = _unsafe(st, uid, (uid,))
    if why is not None:
        raise CheckpointDirError(
            f"--checkpoint-dir {p} {why}: another user could plant a checkpoint this job would "
            f"resume from; use a directory of your own (chmod go-w, or chmod +t), or "
            f"{TRUST_FLAG} if every writer of this shared storage is you")
    for parent in p.parents:
        why = _unsafe(os.stat(parent), uid, (0, uid))
        if why is not None:
            raise CheckpointDirError(
                f"--checkpoint-dir {p}: the folder above it {parent} {why}: another user could "
                f"replace the directory; use one under a folder only you (or root) can write, "
                f"or {TRUST_FLAG} if every writer of this shared storage is you")
    return p


class CheckpointDir:
    """``--checkpoint-dir`` of one job.

    Args:
        path: the directory (created if missing).
        every_s: seconds between checkpoints (the workers' ``HVD_EDL_CHECKPOINT_EVERY_S``).
        keep: checkpoints kept (``HVD_EDL_CHECKPOINT_KEEP``).
    """

    def __init__(self, path: str, every_s: float = checkpoint.DEFAULT_EVERY_S,
                 keep: int = checkpoint.DEFAULT_KEEP):
        self.path = Path(path).resolve()
        self.every_s = every_s
        self.keep = keep
        self.key: Optional[checkpoint.Key] = None  # the user's checkpoint key (acquire)
        self._lock = None  # a filelock.FileLock while this job holds the directory
        self._verified: Dict[Tuple[str, int, int], Optional[str]] = {}  # -> problem or None

    def acquire(self) -> None:
        """Create the directory if needed, check that it is writable, read the user's checkpoint
        key (creating it the first time), take the job lock and remove temporary files a killed
        writer left behind.  (Ownership and mode: :func:`check_directory`, at parse time.)

        Raises:
            CheckpointDirError: not creatable or not writable, the key unusable, the lock file
                a symbolic link or not a regular file, or another job holds it.
        """
        try:
            self.key = checkpoint.read_key_file()
        except checkpoint.CheckpointError as e:
            raise CheckpointDirError(f"{e} (the key checkpoints are authenticated with; "
                                     f"{checkpoint.ENV_KEY_FILE} names another)") from None
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=str(self.path), prefix=".probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise CheckpointDirError(f"--checkpoint-dir {self.path} is not writable: "
                                     f"{e.strerror or e}") from None
        lock_path = self.path / checkpoint.LOCK_NAME
        try:  # a link planted as the lock is never opened through (and is said in one line)
            fd = os.open(str(lock_path), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK,
                         0o644)
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
            os.close(fd)
        except OSError as e:  # a link: ELOOP, or EACCES in a sticky directory (protected_regular)
            why = "it is a symbolic link" if e.errno == errno.ELOOP or os.path.islink(lock_path) \
                else e.strerror
            raise CheckpointDirError(f"--checkpoint-dir {self.path}: its lock "
                                     f"{checkpoint.LOCK_NAME} cannot be used: {why}; remove "
                                     f"it") from None
        if not regular:
            raise CheckpointDirError(f"--checkpoint-dir {self.path}: its lock "
                                     f"{checkpoint.LOCK_NAME} is not a regular file; remove it")
        import filelock  # here: a launcher without --checkpoint-dir need not import it
        lock = filelock.FileLock(str(lock_path))
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            raise CheckpointDirError(f"--checkpoint-dir {self.path} is in use by another job "
                                     f"(its lock {checkpoint.LOCK_NAME} is held): two jobs "
                                     f"never write one directory; give this job another "
                                     f"one") from None
        except OSError as e:  # e.g. a lock file another user created (filelock refuses it)
            raise CheckpointDirError(f"--checkpoint-dir {self.path}: its lock "
                                     f"{checkpoint.LOCK_NAME} cannot be taken: "
                                     f"{e.strerror or e}; remove it if no job of yours runs "
                                     f"there") from None
        self._lock = lock
        for name in os.listdir(self.path):
            if name.startswith(".ckpt-") and name.endswith(".tmp"):
                try:
                    if os.lstat(self.path / name).st_uid == os.geteuid():
                        os.unlink(self.path / name)
                except OSError:
                    pass

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def worker_env(self) -> Dict[str, str]:
        """What every worker's environment gets (after :meth:`acquire`): the directory, the
        interval, how many to keep, and the checkpoint key itself (``HVD_EDL_CHECKPOINT_KEY``:
        rank 0 signs with it, whichever host it runs on; it travels like the job's secret, in
        the environment, over ssh's stdin for remote workers, never on a command line)."""
        env = {checkpoint.ENV_DIR: str(self.path), checkpoint.ENV_EVERY_S: f"{self.every_s:g}",
               checkpoint.ENV_KEEP: str(self.keep)}
        if self.key is not None:
            env[checkpoint.ENV_KEY] = self.key.secret.decode("utf-8", "replace")
            env[checkpoint.ENV_KEY_FILE] = self.key.source
        return env

    def newest(self) -> Optional[Tuple[Path, dict]]:
        """The newest complete checkpoint of this user (its sidecar's HMAC checked once the key
        is read; the data not verified) and its sidecar, or None."""
        for path in checkpoint.complete(self.path):
            try:
                return path, checkpoint.read_sidecar(path, self.key)
            except checkpoint.CheckpointError:
                continue
        return None

    def restore_candidates(self) -> List[Tuple[Path, dict]]:
        """The good checkpoints (sidecar HMAC right under the user's key, size and SHA-256
        matching it), newest first, each with its sidecar; one line on stderr for each bad one
        (a planted or old unsigned one, a corrupt one), once per file.  Only the newest good one
        is verified here (with the bad ones newer than it: every byte is read; results are kept
        per file, size and mtime), when a ring has to resume; the older ones follow as
        fallbacks (their sidecars authenticated) the worker verifies before loading.

        Raises:
            CheckpointDirError: the directory holds complete checkpoints but none is good: the
                job must not silently start from scratch.
        """
        if self.key is None:  # acquire() reads it; never fall back to unauthenticated reads
            try:
                self.key = checkpoint.read_key_file()
            except checkpoint.CheckpointError as e:
                raise CheckpointDirError(str(e)) from None
        good: List[Tuple[Path, dict]] = []
        bad: List[str] = []
        for path in checkpoint.complete(self.path):
            try:
                st = path.lstat()
                mark = (path.name, st.st_size, st.st_mtime_ns)
            except OSError as e:
                bad.append(f"{path.name}: {e.strerror}")
                continue
            if good:  # older fallbacks: the worker verifies each before loading it
                try:
                    good.append((path, checkpoint.read_sidecar(path, self.key)))
                except checkpoint.CheckpointError as e:
                    self._skip(mark, e)
                continue
            if mark not in self._verified:
                try:
                    checkpoint.verify(path, self.key)
                    self._verified[mark] = None
                except checkpoint.CheckpointError as e:
                    self._skip(mark, e)
            problem = self._verified[mark]
            if problem is not None:
                bad.append(problem)
                continue
            try:
                good.append((path, checkpoint.read_sidecar(path, self.key)))
            except checkpoint.CheckpointError as e:
                bad.append(str(e))
        if bad and not good:
            raise CheckpointDirError(f"no good checkpoint in --checkpoint-dir {self.path} ("
                                     + "; ".join(bad) + "): not starting from scratch; remove "
                                     "them to do so")
        return good

    def _skip(self, mark: Tuple[str, int, int], e: Exception) -> None:
        """One line on stderr for a bad checkpoint, once per file (name, size, mtime)."""
        if mark not in self._verified:
            print(f"hvd-edl-run: {e}: skipped", file=sys.stderr, flush=True)
        self._verified[mark] = str(e)

    def describe_newest(self) -> str:
        """``"the last checkpoint is PATH (step S)"``, or that there is none."""
        newest = self.newest()
        if newest is None:
            return f"no checkpoint was written to {self.path}"
        path, meta = newest
        return f"the last checkpoint is {path} (step {meta.get('steps')})"
