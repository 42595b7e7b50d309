"""Starting a worker on a remote host over ssh.  The remote supervisor
(``launcher/spawn/remote_worker.py``) and the worker's environment (the job secret included)
travel over the ssh session's stdin, never on a command line; the supervisor kills the worker's
process group when the session ends, so a remote worker cannot outlive its job.  ssh's own
failures (exit 255 before the worker started: host unreachable, key refused, host key changed,
no ``ssh``) are reported in one line naming the host and ssh's message."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Dict, List, Optional

from hvd_edl.messages import ENV_SECRET, ENV_WORKER_ID
from launcher.spawn import zygote_client
from launcher.spawn.process import WorkerProcess, WorkerSpec, _NotStarted, die_with_parent, say

# the launcher's environment carried to remote workers, less these (horovodrun's list and what
# only makes sense on this host or in this shell)
NOT_CARRIED = re.compile(r"BASH_FUNC_.*|OLDPWD|PWD|_|SHLVL|HOSTNAME|SSH_.*|.*CUDA_VISIBLE_DEVICES"
                         r"|DISPLAY|TERM|TERMCAP|XAUTHORITY")
# the remote command line: read the supervisor's source from stdin and run it (nothing secret)
BOOTSTRAP = "import json,sys;exec(json.loads(sys.stdin.readline()))"
REMOTE_PYTHON = "python3"
# the zygote client travels ahead of the supervisor, as a module object named zygote_client
SUPERVISOR_SOURCE = (
    "import types as _types\n"
    "zygote_client = _types.ModuleType('zygote_client')\n"
    f"exec({(Path(__file__).with_name('zygote_client.py')).read_text()!r}, "
    "zygote_client.__dict__)\n"
    + (Path(__file__).with_name("remote_worker.py")).read_text())


def ssh_command(host: str, port: Optional[int] = None,
                identity_file: Optional[str] = None) -> List[str]:
    """The ssh client's argv up to the remote command: no prompts (``BatchMode``), a host seen
    for the first time is accepted but a changed host key refused (``accept-new``), a dead
    link noticed within 15 s (``ServerAlive*``); ``-p`` / ``-i`` as horovodrun passes them."""
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
           "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=5",
           "-o", "ServerAliveCountMax=3", "-o", "LogLevel=ERROR"]
    if port:
        cmd += ["-p", str(port)]
    if identity_file:
        cmd += ["-i", identity_file]
    return cmd + [host]


def remote_environment(spec: WorkerSpec, extra_env: Dict[str, str]) -> Dict[str, str]:
    """What a remote worker's environment adds to its host's: the launcher's own environment
    (as horovodrun carries it, less :data:`NOT_CARRIED`), the job's and the worker's variables."""
    env = {k: v for k, v in os.environ.items() if not NOT_CARRIED.fullmatch(k)}
    env.update(spec.env)
    env.update(extra_env)
    return env


def start_ssh(spec: WorkerSpec, host: str, extra_env: Dict[str, str], label: Callable[[], str],
              on_exit: Callable[[int], None], files: Optional[Dict[str, object]] = None):
    """Start ``spec.command`` on ``host`` under the remote supervisor.  Returns a
    :class:`WorkerProcess` (or, when ``ssh`` is missing, a worker that exits at once with 255
    after one line saying so)."""
    if shutil.which("ssh") is None:
        say(f"ssh to host {host} failed: no 'ssh' command on PATH (install openssh-client)")
        return _NotStarted(on_exit)
    remote = f"exec {REMOTE_PYTHON} -c {shlex.quote(BOOTSTRAP)} hvd-edl-worker " \
             f"{shlex.quote(extra_env.get(ENV_WORKER_ID, '?'))}"
    cmd = ssh_command(host, spec.ssh_port, spec.ssh_identity_file) + [remote]
    # the ssh client itself gets no secret; the worker id stays findable in its environment
    local_env = {k: v for k, v in {**os.environ, **extra_env}.items() if k != ENV_SECRET}
    popen = subprocess.Popen(cmd, env=local_env, cwd=spec.cwd, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, stdin=subprocess.PIPE,
                             start_new_session=True, preexec_fn=die_with_parent)
    proc = WorkerProcess(popen, label, on_exit, files=files, host=host,
                         timestamps=spec.timestamps)
    job = {"cwd": spec.cwd, "env": remote_environment(spec, extra_env),
           "command": list(spec.command), "label": f"{extra_env.get(ENV_WORKER_ID)}@{host}",
           "zygote": zygote_client.wanted(spec.zygote), "per_worker": sorted(extra_env)}
    proc.send(json.dumps(SUPERVISOR_SOURCE) + "\n" + json.dumps(job) + "\n")
    return proc
