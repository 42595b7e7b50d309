"""Where a worker process starts: on this host (``local.py``) or over ssh (``ssh.py``, with the
remote supervisor ``remote_worker.py``); the process itself, its output and exit in
``process.py``.  :func:`spawn` chooses by host, or hands the start to the job's engine
(``--ray``: ``launcher/ray/``)."""
from __future__ import annotations

from typing import Callable, Dict, Optional

from hvd_edl.messages import ENV_WORKER_ID
from launcher.discovery.hosts import is_local
from launcher.spawn.local import start_local
from launcher.spawn.process import (SSH_FAILED, WorkerProcess, WorkerSpec, terminate_all,
                                    worker_output_files)
from launcher.spawn.ssh import BOOTSTRAP, NOT_CARRIED, remote_environment, ssh_command, start_ssh

__all__ = ["spawn", "WorkerSpec", "WorkerProcess", "terminate_all", "worker_output_files",
           "ssh_command", "remote_environment", "NOT_CARRIED", "BOOTSTRAP", "SSH_FAILED"]


def spawn(spec: WorkerSpec, host: str, extra_env: Dict[str, str], label: Callable[[], str],
          on_exit: Callable[[int], None], output_dir: Optional[str] = None):
    """Start ``spec.command`` for one worker on ``host`` (local hosts without ssh); with
    ``output_dir`` its output also goes to :func:`worker_output_files`.  Returns a
    :class:`WorkerProcess` (or, when ``ssh`` is missing, a worker that exits at once with 255
    after one line saying so)."""
    files = worker_output_files(output_dir, extra_env[ENV_WORKER_ID]) if output_dir else None
    if spec.engine is not None:  # --ray: the host is a Ray node (launcher/ray/)
        return spec.engine.start(spec, host, extra_env, label, on_exit, files)
    if is_local(host):
        return start_local(spec, extra_env, label, on_exit, files)
    return start_ssh(spec, host, extra_env, label, on_exit, files)
