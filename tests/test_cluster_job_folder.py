"""A root service and a job folder that belongs to the job's user (issue 40): the service never
follows a link the user planted there, never blocks on a FIFO, never uses another user's file,
and never signals a process a hand-written pid file names (the breaker's findings 1-3)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from launcher.cluster.runs import JobFiles, Run, open_in_folder

USER_UID = 54321  # a uid nobody has: the job's "user" (root may chown to any uid)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a root service's view: needs root")


@pytest.fixture
def folder(tmp_path):
    files = JobFiles(tmp_path / "state", "j1")
    files.dir.mkdir(parents=True, mode=0o700)
    os.chown(files.dir, USER_UID, USER_UID)
    return files


def test_a_planted_link_fifo_hard_link_or_foreign_file_is_never_used(folder, tmp_path):
    owner = folder.owner()
    assert owner == (USER_UID, USER_UID)
    victim = tmp_path / "victim"
    victim.write_text("root's secret\n")
    os.chmod(victim, 0o600)
    log = folder.run_file(1, "log")
    os.symlink(victim, log)
    with pytest.raises(OSError):
        open_in_folder(log, os.O_WRONLY | os.O_APPEND, owner)
    assert os.stat(victim).st_uid == 0 and victim.read_text() == "root's secret\n"
    log.unlink()
    os.mkfifo(log)  # would block a plain open for writing until someone reads
    with pytest.raises(OSError):
        open_in_folder(log, os.O_WRONLY | os.O_APPEND, owner)
    with pytest.raises(OSError):
        open_in_folder(log, os.O_RDONLY, owner, create=False)
    log.unlink()
    os.link(victim, log)  # a hard link to root's file (where protected_hardlinks allows it)
    with pytest.raises(OSError):
        open_in_folder(log, os.O_RDONLY, owner, create=False)
    log.unlink()
    log.write_text("x")
    os.chown(log, USER_UID + 1, USER_UID + 1)  # another user's file
    with pytest.raises(OSError):
        open_in_folder(log, os.O_RDONLY, owner, create=False)
    log.unlink()
    fd = open_in_folder(log, os.O_WRONLY | os.O_APPEND, owner)  # the normal case: created
    os.close(fd)
    assert log.is_file() and not log.is_symlink() and (os.stat(log).st_mode & 0o777) == 0o600


def test_a_cancel_never_signals_the_process_a_hand_written_pid_file_names(folder):
    """The run looks alive (its lock held) and its pid file names a root process: no signal."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = folder.run_file(1, "lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        os.chown(lock, USER_UID, USER_UID)
        import fcntl
        fcntl.flock(fd, fcntl.LOCK_EX)  # held: as the run's wrapper holds it
        pid_file = folder.run_file(1, "pid")
        pid_file.write_text(str(victim.pid))
        os.chown(pid_file, USER_UID, USER_UID)
        run = Run(folder, 1)
        assert run.pid() == victim.pid
        assert not run.stop()
        assert victim.poll() is None  # still alive: not signalled
        os.close(fd)
    finally:
        victim.kill()
        victim.wait(timeout=10)


def test_a_client_sends_nothing_to_another_users_process_on_the_services_port(tmp_path):
    """Once the service is gone any local user may bind its port: the client checks that the
    listener runs as the cluster file's owner before it sends (a submit carries the caller's
    environment), and refuses in one line, exit 1."""
    import json
    import socket
    from conftest import VENV_BIN
    got = tmp_path / "got"
    got.touch()
    os.chmod(got, 0o666)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    squatter = subprocess.Popen(  # a Python every user can run (the checkout's is root's)
        ["/usr/bin/python3", "-c",
         "import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1);"
         f"s.bind(('127.0.0.1', {port})); s.listen(); print('up', flush=True)\n"
         "while True:\n c, _ = s.accept(); d = c.recv(65536)\n"
         f" open({str(got)!r}, 'ab').write(d); c.close()"],
        user="nobody", stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "up"
        cluster = tmp_path / "cluster.json"
        cluster.write_text(json.dumps({"url": f"http://127.0.0.1:{port}", "pid": 1,
                                       "user": "root", "state_dir": str(tmp_path)}))
        os.chmod(cluster, 0o644)
        r = subprocess.run([str(VENV_BIN / "hvd-edl-cluster"), "--cluster", str(cluster),
                            "submit", "--np", "1", "--", sys.executable, "-c", "pass"],
                           capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, SECRET_OF_THE_CALLER="hunter2"))
        assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "not the cluster service, nothing sent" in lines[0], r.stderr
        assert b"hunter2" not in got.read_bytes()
    finally:
        squatter.kill()
        squatter.wait(timeout=10)
