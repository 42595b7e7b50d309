"""The cluster service's kept zygotes (``docs/zygote.md``): its jobs' launchers fork their local
Python workers from one zygote per (user, host, zygote key) that the service keeps across
jobs, so a job's start pays no ``import hvd_edl.torch`` once another job of the same user and
key started on that host (EDL's point: start-up paid before joining; Android's zygote).

Each user whose job runs here gets a folder of its own (``mkdtemp`` in the temporary directory:
a name nobody can plant, 0700, made the user's under a root service), which the run's launcher
is told in its flags (``--keep-zygote=IDLE_S --zygote-dir FOLDER``: nothing is added to the
workers' environment); the launcher, running as
the user, finds or starts the zygote for its key there
(:func:`launcher.spawn.zygote_client.kept_zygote`).  A zygote serves only processes of its own
user (``SO_PEERCRED``), so user A is never handed user B's.  A submitter whose environment
names its own ``HVD_EDL_ZYGOTE_DIR`` keeps it; ``HVD_EDL_ZYGOTE=0`` still means no zygote.

``HVD_EDL_ZYGOTE_KEEP=SECONDS`` in the service's own environment sets their idle life (0: none
kept).  Bounded: a zygote exits after :data:`IDLE_S` without workers, and when the service closes it
SIGTERMs every one (each stops taking workers and exits once the workers it forked have: the
jobs outlive the service by design) and removes the folders.  The folders are recorded in
``STATE_DIR/kept_zygotes.json``, so a service restarted after a ``kill -9`` ends those too.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Dict, Optional, Tuple

from launcher.cluster import users
from launcher.spawn import zygote_client

log = logging.getLogger(__name__)

IDLE_S = 300.0          # a kept zygote of the service exits after this long without workers
PREFIX = "hvd-edl-kz-"  # its folders' names in the temporary directory


def service_idle_s() -> Optional[float]:
    """The service's kept zygotes' idle life: ``HVD_EDL_ZYGOTE_KEEP=SECONDS`` in its own
    environment (0: keep none, each job's launcher its own zygote), else :data:`IDLE_S`."""
    if zygote_client.KEEP_ENV not in os.environ:
        return IDLE_S
    return zygote_client.keep_seconds(None, os.environ)


class KeptZygotes:
    """The service's per-user folders of kept zygotes: :meth:`launcher_args` for a run,
    :meth:`close` at the service's end (module docstring)."""

    def __init__(self, state_dir: Path, idle_s: Optional[float] = None):
        self.record = Path(state_dir) / "kept_zygotes.json"
        self.idle_s = idle_s if idle_s is not None else service_idle_s()
        self.folders: Dict[int, str] = {}   # uid -> its folder

    def open(self) -> None:
        """End the zygotes and remove the folders a previous service recorded (it was killed
        before its :meth:`close`)."""
        try:
            old = json.loads(self.record.read_text())
        except (OSError, ValueError):
            old = []
        for folder in old if isinstance(old, list) else []:
            if isinstance(folder, str) and _ours(folder):
                _end(folder)
        self._save()

    def launcher_args(self, uid: Optional[int], env: Optional[Dict[str, str]] = None
                      ) -> Tuple[str, ...]:
        """The ``hvd-edl-run`` flags a run of user ``uid`` (None: the service's) gets:
        ``--keep-zygote=IDLE_S --zygote-dir FOLDER``; none when keeping is off, when ``env``
        (the run's environment) names its own ``HVD_EDL_ZYGOTE_DIR`` (no folder is made for
        it), or when no folder can be made (the run's launcher then uses its own zygote)."""
        if self.idle_s is None or zygote_client.KEEP_DIR_ENV in (env or {}):
            return ()
        uid = os.geteuid() if uid is None or not users.runs_as_other(uid) else uid
        folder = self.folders.get(uid)
        if folder is None:
            try:
                label = zygote_client.mark()   # a test run's (tests/leftovers.py)
                folder = tempfile.mkdtemp(prefix=f"{PREFIX}{label}-" if label else PREFIX)
                users.give(folder, uid)
            except OSError as e:
                log.warning("no kept zygote folder for uid %d: %s", uid, e)
                return ()
            self.folders[uid] = folder
            self._save()
        return (f"--keep-zygote={self.idle_s:g}", "--zygote-dir", folder)

    def close(self) -> None:
        """SIGTERM every kept zygote (each exits once its workers have) and remove the
        folders."""
        for folder in self.folders.values():
            _end(folder)
        self.folders.clear()
        try:
            self.record.unlink()
        except OSError:
            pass

    def _save(self) -> None:
        try:
            tmp = self.record.with_suffix(".tmp")
            tmp.write_text(json.dumps(sorted(self.folders.values())))
            os.replace(tmp, self.record)
        except OSError as e:
            log.warning("cannot record the kept zygotes' folders: %s", e)


def _ours(folder: str) -> bool:
    """Whether ``folder`` is one this class makes: a real folder named :data:`PREFIX`... right
    in the temporary directory, not a link, 0700."""
    path = Path(folder)
    if path.parent != Path(tempfile.gettempdir()) or not path.name.startswith(PREFIX):
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o077


def _end(folder: str) -> None:
    zygote_client.end_kept(folder)   # checked: the folder owner's zygotes of that folder only
    shutil.rmtree(folder, ignore_errors=True)
