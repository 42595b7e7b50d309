"""Checkpoints another local user plants (issue 26, item 1): real files written by a real other
user (``nobody``, uid 65534, from a forked child that drops root), real ``hvd-edl-run`` jobs.

The planted checkpoint is what the issue reproduced: a pickle whose loading runs ``id >
MARKER``, and a sidecar with its true size and SHA-256 (the planter writes both).  Before the
fix the job's rank 0 unpickled it as root.  Now: a directory others can write (and not sticky)
or another user owns is refused at start; in a sticky one (``/tmp``'s mode) or with
``--trust-checkpoint-dir``, the planted file is refused by name (its sidecar has no HMAC under
the user's key, or a wrong one) and never unpickled; even a correctly signed checkpoint is read
with ``weights_only=True``, so a pickle in it runs nothing.

Needs root (to act as ``nobody``); the end-to-end test starts one single-worker job (about 10 s),
the others only launches refused before any worker starts or in-process checks.
"""
import hashlib
import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import digits
from hvd_edl import checkpoint
from launcher import spawn
from launcher.job.checkpoint_dir import CheckpointDir
from test_checkpoint import _digits_snapshot, _launch

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root to write files as another user (nobody)")


@pytest.fixture(autouse=True)
def checkpoint_key(tmp_path_factory, monkeypatch):
    """One checkpoint key for this session's tests and the jobs they start (not ~/.hvd_edl)."""
    monkeypatch.setenv(checkpoint.ENV_KEY_FILE,
                       str(tmp_path_factory.getbasetemp() / "checkpoint.key"))
    monkeypatch.delenv(checkpoint.ENV_KEY, raising=False)


@pytest.fixture
def shared():
    """Make directories under /tmp that ``nobody`` can reach (pytest's tmp_path is 0700),
    with a given mode; removed afterwards."""
    made = []

    def make(mode: int) -> Path:
        d = Path(tempfile.mkdtemp(prefix="hvd-edl-shared-", dir="/tmp"))
        made.append(d)
        os.chmod(d, mode)
        return d

    yield make
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


class _Payload:
    """Unpickling this runs a shell command (what the planted checkpoint carries)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _as_nobody(write) -> None:
    """Run ``write()`` in a forked child that has dropped to uid/gid 65534 (nobody)."""
    pid = os.fork()
    if pid == 0:  # the child: only os calls, then _exit
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            write()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child acting as nobody failed"


def _plant(directory: Path, marker: Path, steps: int, forge: bool = False) -> Path:
    """As nobody: a checkpoint whose pickle runs ``id > marker``, with a sidecar of its true
    size and SHA-256 (and, ``forge``, an HMAC made up without the key)."""
    raw = pickle.dumps(_Payload(f"id > {marker}"), protocol=2)
    name = checkpoint.file_name(steps, 1_700_000_000_000 + steps)
    meta = {"file": name, "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest(),
            "steps": steps, "generation": 1, "world_size": 1, "time": 0.0, "request": 0}
    if forge:
        meta["hmac"] = hashlib.sha256(b"no key" + raw).hexdigest()
    side = json.dumps(meta).encode()

    def write():
        for path, data in ((directory / name, raw),
                           (checkpoint.sidecar_of(directory / name), side)):
            fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, data)
            os.close(fd)

    _as_nobody(write)
    assert os.stat(directory / name).st_uid == NOBODY
    return directory / name


@needs_root
def test_a_checkpoint_planted_by_another_user_is_refused_by_name_and_runs_nothing(
        tmp_path, job_factory, shared):
    """A sticky directory others can add files to (accepted, like /tmp): nobody plants two
    checkpoints newer than ours, one with a true SHA-256 and no HMAC, one with a made-up HMAC.
    The launcher names each and skips it, rank 0 resumes from ours, nothing of theirs is
    unpickled (the marker never appears), and the checkpoints rank 0 writes are signed with
    the key the launcher gave it."""
    ck = shared(0o1777)
    marker = tmp_path / "marker"
    good = checkpoint.write(ck, _digits_snapshot(10))
    planted = _plant(ck, marker, 999)
    forged = _plant(ck, marker, 998, forge=True)
    job = job_factory(["-np", "1", "--checkpoint-dir", str(ck), "--checkpoint-every", "0.2"],
                      digits(tmp_path, "--epochs", "1", "--train-size", "320", "--step-delay",
                             "0.02"))
    code = job.finish()
    out = job.output()
    assert not marker.exists(), f"the planted pickle ran: {marker.read_text()}\n{out[-3000:]}"
    assert code == 0, out[-3000:]
    assert f"checkpoint {planted}: refused: its sidecar carries no HMAC" in out, out[-3000:]
    assert f"checkpoint {forged}: refused: its HMAC does not match this user's checkpoint " \
           f"key" in out, out[-3000:]
    ev = job.events()[0]
    assert Path(ev["restored_from"]) == good and ev["restored_step"] == 10, ev
    mine = [p for p in checkpoint.complete(ck) if p not in (planted, forged)]
    assert len(mine) >= 2 and checkpoint.verify(mine[0])["steps"] > 10  # signed by rank 0
    assert planted.exists() and forged.exists()  # another user's files: not ours to delete


@needs_root
def test_directories_others_can_write_or_own_are_refused_at_start_in_one_line(tmp_path, shared):
    """A 0777 directory (with a planted checkpoint), one owned by nobody, one under a folder
    others can write, a lock planted as a symbolic link: exit 2 with one line each, no worker
    started, nothing unpickled.  ``--trust-checkpoint-dir`` accepts the 0777 directory but
    still refuses the planted checkpoint by name (exit 1, not from scratch)."""
    marker = tmp_path / "marker"
    open_dir = shared(0o777)
    planted = _plant(open_dir, marker, 999)

    def refused(directory, *extra):
        r = _launch(["-np", "1", "--checkpoint-dir", str(directory), *extra], tmp_path)
        errors = [line for line in r.stderr.splitlines() if "error" in line]
        assert r.returncode == 2 and len(errors) == 1, r.stdout + r.stderr
        assert "worker w1 started" not in r.stdout
        return errors[0]

    line = refused(open_dir)
    assert f"--checkpoint-dir {open_dir} is writable by others (mode 0777) and not sticky: " \
           f"another user could plant a checkpoint" in line and "--trust-checkpoint-dir" in line

    theirs = shared(0o755)
    os.chown(theirs, NOBODY, NOBODY)
    assert f"--checkpoint-dir {theirs} is owned by uid {NOBODY}, not by this user" \
        in refused(theirs)

    group = shared(0o775)
    assert "is writable by its group (mode 0775) and not sticky" in refused(group)

    below = open_dir / "job1"
    line = refused(below)
    assert f"--checkpoint-dir {below}: the folder above it {open_dir} is writable by others" \
        in line

    lock_dir = shared(0o1777)
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    _as_nobody(lambda: os.symlink(precious, lock_dir / checkpoint.LOCK_NAME))
    line = refused(lock_dir)
    assert f"its lock {checkpoint.LOCK_NAME} cannot be used: it is a symbolic link" in line
    assert precious.read_text() == "keep me"

    r = _launch(["-np", "1", "--checkpoint-dir", str(open_dir), "--trust-checkpoint-dir"],
                tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"checkpoint {planted}: refused: its sidecar carries no HMAC" in r.stderr
    assert "no good checkpoint in --checkpoint-dir" in r.stderr
    assert "worker w1 started" not in r.stdout and not marker.exists()


def test_only_tensors_and_plain_values_are_unpickled_even_from_a_signed_checkpoint(tmp_path):
    """Whoever holds the key (or a bug) could still sign a pickle: load() reads with
    weights_only=True and refuses it by name, running nothing; ``trust`` refuses to sign it;
    a symbolic link is refused though its sidecar is signed; a state holding a value that is
    not plain (a numpy scalar) is refused at write time, not at resume."""
    import numpy as np
    key = checkpoint.read_key_file()
    marker = tmp_path / "marker"
    raw = pickle.dumps(_Payload(f"id > {marker}"), protocol=2)
    path = tmp_path / checkpoint.file_name(5, 1_700_000_000_005)
    path.write_bytes(raw)
    meta = {"file": path.name, "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest(),
            "steps": 5}
    checkpoint.sidecar_of(path).write_text(json.dumps(dict(meta, hmac=key.mac(meta))))
    with pytest.raises(checkpoint.CheckpointError,
                       match=rf"checkpoint {path}: cannot be loaded with "
                             rf"torch.load\(weights_only=True\)"):
        checkpoint.load(path)
    with pytest.raises(checkpoint.CheckpointError, match="weights_only=True"):
        checkpoint.trust(path)
    assert not marker.exists()

    good = checkpoint.write(tmp_path, _digits_snapshot(7))
    link = tmp_path / checkpoint.file_name(8, 1_700_000_000_008)
    link.symlink_to(good)
    side = dict(checkpoint.read_sidecar(good), file=link.name)
    checkpoint.sidecar_of(link).write_text(json.dumps(dict(side, hmac=key.mac(side))))
    with pytest.raises(checkpoint.CheckpointError,
                       match=rf"checkpoint {link}: refused: it is a symbolic link"):
        checkpoint.load(link)
    assert checkpoint.load(good)["steps"] == 7

    snap = _digits_snapshot(9)
    snap["scalars"]["best"] = np.float64(0.5)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"the checkpoint\['scalars'\]\['best'\] is a numpy.float64"):
        checkpoint.write(tmp_path, snap)
    assert not list(tmp_path.glob("ckpt-000000000009-*"))


def test_an_unsigned_checkpoint_from_before_is_refused_until_its_owner_trusts_it(tmp_path):
    """A checkpoint written before checkpoints were signed (its sidecar has no HMAC): the launch
    fails (exit 1) naming it, saying why and what to do; ``python -m hvd_edl.checkpoint trust
    PATH`` signs it (after checking its SHA-256 and that it loads without running code), and
    then it is resumed from."""
    ck = tmp_path / "ck"
    ck.mkdir()
    old = checkpoint.write(ck, _digits_snapshot(4))
    side = checkpoint.sidecar_of(old)
    side.write_text(json.dumps({k: v for k, v in json.loads(side.read_text()).items()
                                if k != "hmac"}))
    r = _launch(["-np", "1", "--checkpoint-dir", str(ck)], tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"checkpoint {old}: refused: its sidecar carries no HMAC (written before hvd_edl " \
           f"authenticated checkpoints, or not by hvd_edl); nothing in it was loaded. If you " \
           f"wrote it and trust it: python -m hvd_edl.checkpoint trust {old}; else remove it" \
           in r.stderr, r.stderr
    t = subprocess.run([sys.executable, "-m", "hvd_edl.checkpoint", "trust", str(old)],
                       capture_output=True, text=True, timeout=60)
    assert t.returncode == 0 and f"signed {old} (step 4)" in t.stdout, t.stdout + t.stderr
    assert checkpoint.load(old)["steps"] == 4
    d = CheckpointDir(str(ck))
    d.acquire()
    try:
        assert [p for p, _ in d.restore_candidates()] == [old]
    finally:
        d.release()


def test_the_key_is_the_users_alone_and_reaches_workers_in_their_environment(tmp_path,
                                                                             monkeypatch):
    """Created once under ~/.hvd_edl with mode 0600 (its folder 0700); a key file others can
    read stops the launch (exit 2, one line); the launcher hands the key to workers in their
    environment (for remote ones: in what ssh's stdin carries, not on the command line)."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in (checkpoint.ENV_KEY_FILE,
                                                          checkpoint.ENV_KEY)}
    env["HOME"] = str(home)
    r = subprocess.run([sys.executable, "-c", "from hvd_edl import checkpoint; "
                        "print(checkpoint.read_key_file().source)"], capture_output=True,
                       text=True, timeout=60, env=env)
    key_path = home / ".hvd_edl" / "checkpoint.key"
    assert r.returncode == 0 and r.stdout.strip() == str(key_path), r.stdout + r.stderr
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_path.parent.stat().st_mode) == 0o700
    assert len(key_path.read_text().strip()) == 64

    loose = tmp_path / "loose.key"
    loose.write_text("x" * 64)
    os.chmod(loose, 0o644)
    monkeypatch.setenv(checkpoint.ENV_KEY_FILE, str(loose))
    r = _launch(["-np", "1", "--checkpoint-dir", str(tmp_path / "ck")], tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"checkpoint key {loose} has mode 0644: others may read it; chmod 600 {loose}" \
        in r.stderr and "worker w1 started" not in r.stdout
    monkeypatch.setenv(checkpoint.ENV_KEY_FILE, str(key_path))

    d = CheckpointDir(str(tmp_path / "ck"))
    d.acquire()
    try:
        worker_env = d.worker_env()
    finally:
        d.release()
    assert worker_env[checkpoint.ENV_KEY] == key_path.read_text().strip()
    spec = spawn.WorkerSpec(["python", "train.py"], worker_env, str(tmp_path))
    assert spawn.remote_environment(spec, {})[checkpoint.ENV_KEY] == worker_env[checkpoint.ENV_KEY]
    assert worker_env[checkpoint.ENV_KEY] not in " ".join(spec.command + [spawn.BOOTSTRAP])
    monkeypatch.setenv(checkpoint.ENV_KEY, worker_env[checkpoint.ENV_KEY])
    monkeypatch.setenv(checkpoint.ENV_KEY_FILE, str(tmp_path / "absent.key"))  # env wins
    assert checkpoint.job_key().secret == key_path.read_text().strip().encode()
