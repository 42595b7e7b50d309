"""Starting a worker on this host: a child process in a session of its own, killed when the
launcher dies (``PR_SET_PDEATHSIG``), its output read by :class:`WorkerProcess`.  For a Python
worker the child is a stub that has the launcher's zygote fork the worker
(``local_zygotes.py``, ``docs/zygote.md``); otherwise the command itself."""
from __future__ import annotations

import os
import subprocess
from typing import Callable, Dict, Optional

from launcher.spawn import zygote_client
from launcher.spawn.local_zygotes import ZYGOTES
from launcher.spawn.process import WorkerProcess, WorkerSpec, die_with_parent


def start_local(spec: WorkerSpec, extra_env: Dict[str, str], label: Callable[[], str],
                on_exit: Callable[[int], None], files: Optional[Dict[str, object]] = None
                ) -> WorkerProcess:
    """Start ``spec.command`` here with the launcher's environment plus ``spec.env`` and
    ``extra_env`` (through a zygote when ``spec.zygote`` / ``HVD_EDL_ZYGOTE`` allow it).

    Raises:
        OSError: the command cannot be started.
    """
    env = dict(os.environ)
    env.update(spec.env)
    env.update(extra_env)
    argv = None
    if zygote_client.wanted(spec.zygote):
        argv = ZYGOTES.stub_command(list(spec.command), env, extra_env,
                                    keep_s=zygote_client.keep_seconds(spec.keep_zygote, env),
                                    keep_dir=spec.zygote_dir)
    popen = subprocess.Popen(argv or spec.command, env=env, cwd=spec.cwd,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, start_new_session=True,
                             preexec_fn=die_with_parent)
    return WorkerProcess(popen, label, on_exit, files=files, timestamps=spec.timestamps)
