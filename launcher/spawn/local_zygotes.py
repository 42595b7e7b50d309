"""The launcher's zygotes for local workers (``hvd_edl/zygote.py``): one per worker
interpreter and import-time environment (:func:`launcher.spawn.zygote_client.zygote_key`),
started on the first worker that needs it, in a private 0700 directory of this launcher, and
gone with the launcher (its end of a pipe closes: the zygote kills its workers and exits).

Or, when asked to keep one (``hvd-edl-run --keep-zygote[=SECONDS]``, ``HVD_EDL_ZYGOTE_KEEP``;
a cluster service's jobs), this user's *kept* zygote for the key, found in a per-user folder
(``HVD_EDL_ZYGOTE_DIR``, else ``$TMPDIR/hvd-edl-zygote-UID``) and started there if none serves:
it outlives the launcher, serves the next launchers of the same user and key, and exits after
SECONDS without workers (:func:`launcher.spawn.zygote_client.kept_zygote`)."""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from launcher.spawn import zygote_client

log = logging.getLogger(__name__)

STUB = str(Path(zygote_client.__file__).resolve())


class LocalZygotes:
    """Zygotes of one launcher, by key.  :meth:`stub_command` is what the launcher runs instead
    of a worker's command (None: run the command itself)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._dir: Optional[str] = None
        self._zygotes: Dict[str, Tuple[str, object, int]] = {}  # key -> socket, Popen, pipe fd

    def stub_command(self, command: List[str], env: Dict[str, str],
                     per_worker: Dict[str, str], keep_s: Optional[float] = None,
                     keep_dir: Optional[str] = None) -> Optional[List[str]]:
        """The stub's argv for a worker with ``command`` and full environment ``env`` (of which
        ``per_worker`` are the worker's own variables, left out of the zygote's environment);
        None when the command is not one a zygote runs or no zygote could be started.
        ``keep_s``: use this user's kept zygote (started if none, idle life ``keep_s``
        seconds; :func:`launcher.spawn.zygote_client.keep_seconds`) in ``keep_dir`` (None:
        :func:`launcher.spawn.zygote_client.keep_folder`'s), else this launcher's."""
        if not zygote_client.eligible(command, env):
            return None
        if keep_s is not None:
            kept = self._kept(command, env, keep_s, keep_dir)
            if kept is not None:
                return kept
        key = zygote_client.zygote_key(command[0], env)
        with self._lock:
            sock = self._running(key, command[0], zygote_client.zygote_env(env, per_worker))
        if sock is None:
            return None
        return [sys.executable, "-I", "-S", STUB, sock, str(zygote_client.WAIT_S), "--",
                *command]

    def _kept(self, command: List[str], env: Dict[str, str], keep_s: float,
              keep_dir: Optional[str]) -> Optional[List[str]]:
        """The stub's argv through the kept zygote (None: none can be had: this launcher's own
        then, as without keeping)."""
        try:
            folder = zygote_client.private_dir(keep_dir) if keep_dir else \
                zygote_client.keep_folder(env)
            sock = zygote_client.kept_zygote(command[0], env, folder, keep_s)
        except OSError as e:
            log.info("no kept zygote (%s): this launcher's own", e)
            return None
        if sock is None:
            return None
        return [sys.executable, "-I", "-S", STUB, sock, str(zygote_client.wait_for(sock)),
                "--", *command]

    def _running(self, key: str, python: str, env: Dict[str, str]) -> Optional[str]:
        known = self._zygotes.get(key)
        if known is not None:   # running, or failed / gone: then exec, never another import
            return known[0] if known[1].poll() is None else None
        try:
            if self._dir is None:
                self._dir = tempfile.mkdtemp(prefix="hvd-edl-zygote-")   # 0700
                atexit.register(self.close)
            sock = os.path.join(self._dir, f"{key}.{len(self._zygotes)}.sock")
            read_fd, write_fd = os.pipe()   # the launcher holds the writer for its life
            try:
                popen = zygote_client.start_zygote(python, sock, env, parent_fd=read_fd)
            finally:
                os.close(read_fd)
        except OSError as e:
            log.info("no zygote for %s (%s): workers exec", python, e)
            return None
        self._zygotes[key] = (sock, popen, write_fd)
        return sock

    def close(self) -> None:
        """End every zygote (closing its pipe: it kills its workers) and remove the directory."""
        with self._lock:
            for _sock, popen, write_fd in self._zygotes.values():
                try:
                    os.close(write_fd)
                except OSError:
                    pass
            for _sock, popen, _fd in self._zygotes.values():
                try:
                    popen.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    popen.kill()
                    popen.wait()
            self._zygotes.clear()
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None


ZYGOTES = LocalZygotes()
