"""The remote end of an ssh-spawned worker: a small supervisor that runs on the worker's host as
the ssh session's command and makes sure the worker never outlives its session.

:mod:`launcher.spawn.ssh` sends this file's source as the first line of the session's stdin (the
remote command line is only a bootstrap that reads and runs it, so nothing secret is ever in an
argv), then one JSON line ``{"cwd", "env", "command", "label", "zygote", "per_worker"}`` (the
environment, secret included, travels this way), then keeps stdin open.  With ``zygote`` true
and a Python command, the worker is forked by this user's zygote on this host
(``zygote_client.remote_session``, ``docs/zygote.md``); otherwise it is started here.  Later lines are ``signal N``: send signal N
to the worker's process group.  When stdin ends (the launcher stopped the worker, died, or the
ssh session broke) the whole process group gets SIGKILL, as ``PR_SET_PDEATHSIG`` does for local
workers.

On stderr the supervisor writes two marker lines, each starting with :data:`MARKER`:
``started PID`` once the worker runs and ``exit CODE`` (``subprocess`` convention: -N for a
signal) when it ends; the launcher takes them out of the output.  It exits with the worker's code
(128+N for a signal).  Standard library only: the remote host needs nothing but a Python 3.
"""
import json
import os
import signal
import subprocess
import sys
import threading

MARKER = "\x1ehvd-edl-remote:"


def _killpg(pid, sig):
    try:
        os.killpg(pid, sig)
    except OSError:
        pass


def _zygote(job, env):
    """The worker started by this user's zygote on this host (``zygote_client.py``, whose source
    travels ahead of this file's over ssh), or None: start the command itself.  Never raises."""
    if not job.get("zygote"):
        return None
    try:
        try:
            client = zygote_client   # noqa: F821 - sent ahead of this file (launcher/spawn/ssh.py)
        except NameError:
            from launcher.spawn import zygote_client as client
        with open(os.devnull, "rb") as devnull:
            return client.remote_session(job["command"], env, job["cwd"],
                                         job.get("per_worker", ()),
                                         (devnull.fileno(), 1, 2))
    except Exception:  # noqa: BLE001 - any trouble with a zygote means the exec path
        return None


def _supervise(pid, send, wait):
    """Say ``started PID``, pass each ``signal N`` line to ``send`` (SIGKILL when stdin ends),
    wait for the worker with ``wait()`` and say ``exit CODE``; the exit code as the module says."""
    sys.stderr.write(f"{MARKER}started {pid}\n")
    sys.stderr.flush()

    def control():
        for line in sys.stdin:
            parts = line.split()
            if len(parts) == 2 and parts[0] == "signal" and parts[1].isdigit():
                send(int(parts[1]))
        send(signal.SIGKILL)   # the session is gone: nothing may outlive it

    threading.Thread(target=control, daemon=True).start()
    code = wait()
    try:
        sys.stderr.write(f"{MARKER}exit {code}\n")
        sys.stderr.flush()
    except OSError:
        pass
    return code if code >= 0 else 128 - code


def main():
    job = json.loads(sys.stdin.readline())
    env = dict(os.environ)
    env.update(job["env"])
    session = _zygote(job, env)
    if session is not None:
        return _supervise(session.pid, session.signal, session.wait)   # signals via the zygote
    try:
        child = subprocess.Popen(job["command"], cwd=job["cwd"], env=env,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        sys.stderr.write(f"hvd-edl-run: cannot start {job['command'][0]!r} in {job['cwd']!r} "
                         f"on {job.get('label', '?')}: {e}\n")
        sys.stderr.write(f"{MARKER}exit 127\n")
        sys.stderr.flush()
        return 127

    def wait():
        code = child.wait()
        _killpg(child.pid, signal.SIGKILL)   # what the worker left behind in its group
        return code

    return _supervise(child.pid, lambda sig: _killpg(child.pid, sig), wait)


if __name__ == "__main__":
    sys.exit(main())
