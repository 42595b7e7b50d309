"""The launcher's side of ``--checkpoint-dir``: one job per directory (a lock held for the job's
life), and the choice of the checkpoint a ring without any holder of the state resumes from.

The files and their checks are :mod:`hvd_edl.checkpoint`'s (shared with the workers, which
write them).  The lock is a ``filelock`` lock on ``DIR/.hvd-edl.lock`` (``fcntl`` on POSIX): the
kernel drops it when the launcher dies, even by ``kill -9``, so the same command run again gets
it at once.  On a network filesystem ``fcntl`` locks are as good as its lock manager (NFSv4:
leases; some FUSE filesystems: none); see the README.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import filelock

from hvd_edl import checkpoint


class CheckpointDirError(RuntimeError):
    """The directory cannot be used (not writable, held by another job) or holds no usable
    checkpoint; the message is one line for people."""


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
        self._lock: Optional[filelock.BaseFileLock] = None
        self._verified: Dict[Tuple[str, int, int], Optional[str]] = {}  # -> problem or None

    def acquire(self) -> None:
        """Create the directory if needed, check that it is writable, take the job lock and
        remove temporary files a killed writer left behind.

        Raises:
            CheckpointDirError: not creatable or not writable, or another job holds it.
        """
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=str(self.path), prefix=".probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise CheckpointDirError(f"--checkpoint-dir {self.path} is not writable: "
                                     f"{e.strerror or e}") from None
        lock = filelock.FileLock(str(self.path / checkpoint.LOCK_NAME))
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            raise CheckpointDirError(f"--checkpoint-dir {self.path} is in use by another job "
                                     f"(its lock {checkpoint.LOCK_NAME} is held): two jobs "
                                     f"never write one directory; give this job another "
                                     f"one") from None
        self._lock = lock
        for name in os.listdir(self.path):
            if name.startswith(".ckpt-") and name.endswith(".tmp"):
                try:
                    os.unlink(self.path / name)
                except OSError:
                    pass

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def worker_env(self) -> Dict[str, str]:
        """What every worker's environment gets."""
        return {checkpoint.ENV_DIR: str(self.path), checkpoint.ENV_EVERY_S: f"{self.every_s:g}",
                checkpoint.ENV_KEEP: str(self.keep)}

    def newest(self) -> Optional[Tuple[Path, dict]]:
        """The newest complete checkpoint and its sidecar (checksum not verified), or None."""
        for path in checkpoint.complete(self.path):
            try:
                return path, checkpoint.read_sidecar(path)
            except checkpoint.CheckpointError:
                continue
        return None

    def restore_candidates(self) -> List[Tuple[Path, dict]]:
        """The good checkpoints (size and SHA-256 match their sidecars), newest first, each with
        its sidecar; one line on stderr for each bad one, once per file.  Only the newest good
        one is verified here (with the bad ones newer than it: every byte is read; results are
        kept per file, size and mtime), when a ring has to resume; the older ones follow as
        fallbacks the worker verifies before loading.

        Raises:
            CheckpointDirError: the directory holds complete checkpoints but none is good: the
                job must not silently start from scratch.
        """
        good: List[Tuple[Path, dict]] = []
        bad: List[str] = []
        for path in checkpoint.complete(self.path):
            if good:  # older fallbacks: the worker verifies each before loading it
                try:
                    good.append((path, checkpoint.read_sidecar(path)))
                except checkpoint.CheckpointError:
                    pass
                continue
            try:
                st = path.stat()
            except OSError as e:
                bad.append(f"{path.name}: {e.strerror}")
                continue
            key = (path.name, st.st_size, st.st_mtime_ns)
            if key not in self._verified:
                try:
                    checkpoint.verify(path)
                    self._verified[key] = None
                except checkpoint.CheckpointError as e:
                    self._verified[key] = str(e)
                    print(f"hvd-edl-run: {e}: skipped", file=sys.stderr, flush=True)
            problem = self._verified[key]
            if problem is not None:
                bad.append(problem)
                continue
            try:
                good.append((path, checkpoint.read_sidecar(path)))
            except checkpoint.CheckpointError as e:
                bad.append(str(e))
        if bad and not good:
            raise CheckpointDirError(f"no good checkpoint in --checkpoint-dir {self.path} ("
                                     + "; ".join(bad) + "): not starting from scratch; remove "
                                     "them to do so")
        return good

    def describe_newest(self) -> str:
        """``"the last checkpoint is PATH (step S)"``, or that there is none."""
        newest = self.newest()
        if newest is None:
            return f"no checkpoint was written to {self.path}"
        path, meta = newest
        return f"the last checkpoint is {path} (step {meta.get('steps')})"
