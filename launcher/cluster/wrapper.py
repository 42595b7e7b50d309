"""The tiny process each cluster job runs under: it starts ``hvd-edl-run``, passes SIGTERM and
SIGINT on to it, waits, and writes the launcher's exit code to a file atomically, so the service
learns every run's end exactly once even when it is not the launcher's parent any more (after a
``kill -9`` and restart of the service).

    python -m launcher.cluster.wrapper --pid-file P --exit-file E -- hvd-edl-run ...

``--pid-file`` gets this process's pid first (the run has started); ``--exit-file`` gets
``{"exit_code": C, "at": UNIX_S}`` last (C: the launcher's code, 128 + N when a signal N ended
it).  The service hands this process an open descriptor holding an exclusive ``flock`` on the
run's lock file; it is kept open (and not passed to the launcher) until the exit file is
written, so "the lock is free and no exit file exists" means the run never started or died
without a word (``kill -9`` of this wrapper).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it (mode 0600)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="launcher.cluster.wrapper")
    p.add_argument("--pid-file", required=True)
    p.add_argument("--exit-file", required=True)
    p.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("no command")
    stop = []

    def forward(signum, frame):
        stop.append(signum)
        if child is not None:
            child.send_signal(signum)
    child = None
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    # the pid is written once a signal would be forwarded: one sent as soon as the pid file
    # names this process is passed on (before, it could end the wrapper with no exit file)
    write_atomic(a.pid_file, str(os.getpid()))
    try:
        child = subprocess.Popen(command)
        if stop:
            child.send_signal(stop[0])
        code = child.wait()
    except OSError as e:
        print(f"hvd-edl-cluster: cannot start {command[0]}: {e}", file=sys.stderr)
        code = 127
    code = 128 - code if code < 0 else code
    write_atomic(a.exit_file, json.dumps({"exit_code": code, "at": time.time()}))
    return code


if __name__ == "__main__":
    sys.exit(main())
