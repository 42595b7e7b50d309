"""Durable commits (``--checkpoint-dir``): real ``hvd-edl-run`` jobs of the digits example, real
``kill -9`` of every worker and of the launcher, real files; exactly-once data checked from the
audit ledger.

How the audit tells the steps redone after a resume from the ones it would call repeats: a ring
that resumes from a checkpoint at step ``S`` writes a ``sync`` record at step ``S`` (its
``rt.steps`` after loading), so :func:`hvd_edl.audit.committed` supersedes every record of the
earlier generations after step ``S``: those steps were lost with the workers and redone.  A
second job (the launcher killed and the command run again) numbers its generations from 1
again, so its ledger is merged after the first job's with its generations offset
(:func:`_merged_ledger`).

Slow: each of the first four tests starts one or two multi-process jobs (about 10-30 s each on
two cores).  Every test here uses one checkpoint key for the session
(``HVD_EDL_CHECKPOINT_KEY_FILE`` in a temporary folder), which the jobs it starts inherit.
"""
import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import filelock
import psutil
import pytest
import torch

from conftest import DIGITS, LAUNCHER, VENV_BIN, Job, digits, long_digits, summary
from hvd_edl import audit, checkpoint

CTL = str(VENV_BIN / "hvd-edl-ctl")
DIGITS_TRAIN = 1347
MiB = 1 << 20


@pytest.fixture(autouse=True)
def checkpoint_key(tmp_path_factory, monkeypatch):
    """One checkpoint key for this session's tests and the jobs they start (not ~/.hvd_edl)."""
    monkeypatch.setenv(checkpoint.ENV_KEY_FILE,
                       str(tmp_path_factory.getbasetemp() / "checkpoint.key"))
    monkeypatch.delenv(checkpoint.ENV_KEY, raising=False)


def _merged_ledger(out: Path, *runs: Path) -> Path:
    """One ledger directory of several jobs' ledgers, in job order: the k-th job's generations
    are offset by 1000 k (each job numbers its own from 1)."""
    out.mkdir()
    for k, run in enumerate(runs):
        for path in sorted(run.glob("*.jsonl")):
            with open(out / f"run{k}-{path.name}", "w") as f:
                for r in _records(path):
                    r["gen"] += 1000 * k
                    f.write(json.dumps(r) + "\n")
    return out


def _records(path: Path):
    for line in path.read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


def _members(ev):
    return [m.split("@")[0] for m in ev["members"]]


def _restored(job, after: int = 0):
    return job.wait_for("a generation resumed from a checkpoint", lambda: next(
        (e for e in job.events() if e["generation"] > after and e.get("restored_from")), None),
        120)


def _steps_after(ledger: Path, step: int) -> set:
    return {(r["gen"], r["step"]) for r in audit.read_records(ledger)
            if r["kind"] == "step" and r["step"] > step}


def test_every_worker_killed_at_once_resumes_from_the_forced_checkpoint(tmp_path, job_factory,
                                                                       monkeypatch):
    """``hvd-edl-ctl checkpoint`` forces one (the interval is an hour) and prints its path; both
    workers are then killed at once: the replacements resume from exactly that checkpoint
    (not from the initial state), and every sample of every epoch is used once, counting the
    steps after the checkpoint as redone.  Then every host goes: the job ends after
    ``--elastic-timeout`` with a message naming the checkpoint."""
    ledger = tmp_path / "ledger"
    monkeypatch.setenv(audit.ENV_AUDIT_DIR, str(ledger))
    ck = tmp_path / "ck"
    job_file = tmp_path / "job.json"
    job = job_factory(["-np", "2", "--min-np", "1", "--max-np", "2", "--discovery-interval", "0.2",
                       "--job-file", str(job_file), "--checkpoint-dir", str(ck),
                       "--checkpoint-every", "3600", "--elastic-timeout", "3"],
                      long_digits(tmp_path, "--repeat-data", "2"), hosts="localhost:4")
    job.wait_generation(1)
    job.wait_for("a progress line", lambda: "sample/s]" in job.output(), 60)
    r = subprocess.run([CTL, "--job", str(job_file), "checkpoint", "--wait", "60"],
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"checkpoint (\S+) \(step (\d+)\)", r.stdout)
    path, step = m.group(1), int(m.group(2))
    assert step > 0 and Path(path).parent == ck.resolve()
    st = subprocess.run([CTL, "--job", str(job_file), "status"], capture_output=True, text=True,
                        timeout=60)
    assert f"checkpoint: {path} (step {step}, " in st.stdout, st.stdout + st.stderr
    data = checkpoint.load(path)  # verified; plain torch.load gives the same dict
    assert data["steps"] == step and data["world_size"] == 2
    assert torch.load(path, weights_only=True)["scalars"] == data["scalars"]
    assert set(data["model"]) == {"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                                  "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}

    pids = [job.wait_for(f"pid of {w}", lambda w=w: job.worker_pid(w), 30) for w in ("w1", "w2")]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    ev = _restored(job, after=1)
    assert not {"w1", "w2"} & set(_members(ev)) and ev["kind"] == "failure", ev
    assert Path(ev["restored_from"]) == Path(path) and ev["restored_step"] == step, ev
    assert not ev["state_lost"] and ev["step"] == step
    out = job.output()
    assert f"resumed from checkpoint {path} (step {step})" in out and "STATE LOST" not in out
    job.wait_for("a step of the resumed ring", lambda: any(
        r["kind"] == "step" and r["gen"] == ev["generation"]
        for r in audit.read_records(ledger)), 60)

    # then the hosts offer only the two slots resting after the kills, and every worker dies:
    # after --elastic-timeout the job ends, naming the checkpoint the same command resumes from
    job.set_hosts("localhost:2")
    for p in psutil.Process(job.proc.pid).children():
        try:
            p.kill()
        except psutil.NoSuchProcess:  # a worker told to leave may have exited meanwhile
            pass
    assert job.finish(timeout_s=90) == 1, job.output()[-3000:]
    # the resumed ring may have written a newer one (its interval, at or after that step)
    last = re.search(r"the last checkpoint is (\S+) \(step (\d+)\): run the same command again",
                     job.output())
    assert last is not None and int(last.group(2)) >= step, job.output()[-3000:]
    assert os.path.exists(last.group(1))

    syncs = [r for r in audit.read_records(ledger) if r["kind"] == "sync"
             and r["gen"] == ev["generation"]]
    assert syncs and all(r["step"] == step for r in syncs)
    redone = _steps_after(ledger, step) - {(g, s) for g, s in _steps_after(ledger, step)
                                           if g >= ev["generation"]}
    report = audit.check(ledger, DIGITS_TRAIN * 2)
    # the launcher knows the members' steps from their heartbeats (every 0.3 s): killed without
    # notice, they may have done a few more steps since their last beat
    rolled = sum(e.rolled_back_steps for e in report.epochs)
    assert len(redone) - 20 <= rolled <= len(redone), (rolled, len(redone))
    assert report.epochs and all(e.complete for e in report.epochs[:-1])  # the last: cut off
    assert (report.repeated, report.missing) == (0, 0), report.to_dict()


@pytest.mark.long
def test_launcher_killed_and_rerun_resumes_at_another_world_size(tmp_path, job_factory,
                                                                monkeypatch):
    """A 2-worker job writing a checkpoint every second; its launcher is killed with
    ``kill -9`` (its workers die with it); the same command at 3 workers resumes from the newest
    checkpoint, having lost at most about one interval of work, and finishes with every sample
    of every epoch used once."""
    ck = tmp_path / "ck"
    ledgers = [tmp_path / "ledger1", tmp_path / "ledger2"]
    monkeypatch.setenv(audit.ENV_AUDIT_DIR, str(ledgers[0]))
    every_s = 1.0

    def launcher_args(np_):
        return ["-np", np_, "--checkpoint-dir", str(ck), "--checkpoint-every", f"{every_s:g}"]

    command = ["--epochs", "3", "--step-delay", "0.01"]
    job1 = job_factory(launcher_args("2"), digits(tmp_path, *command))
    job1.wait_generation(1)
    job1.wait_for("a checkpoint after epoch 1 began", lambda: any(
        checkpoint.read_sidecar(p)["steps"] > 50 for p in checkpoint.complete(ck)), 120)
    workers = psutil.Process(job1.proc.pid).children()
    os.kill(job1.proc.pid, signal.SIGKILL)
    killed_at = time.time()
    job1.proc.wait(10)
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, f"workers outlived their launcher: {alive}"
    newest = checkpoint.complete(ck)[0]
    meta = checkpoint.read_sidecar(newest)
    assert killed_at - meta["time"] <= every_s + 4.0, "more than an interval of work lost"

    monkeypatch.setenv(audit.ENV_AUDIT_DIR, str(ledgers[1]))
    run2 = tmp_path / "run2"
    run2.mkdir()
    job2 = Job(run2, launcher_args("3"), digits(run2, *command))
    try:
        ev = job2.wait_generation(1)
        assert Path(ev["restored_from"]) == newest.resolve() and ev["world_size"] == 3, ev
        assert ev["restored_step"] == meta["steps"]
        assert job2.finish() == 0, job2.output()[-3000:]
    finally:
        job2.stop()
    s = summary(run2)
    assert s["world_size"] == 3 and s["epochs"] == 3 and s["param_spread"] == 0.0

    merged = _merged_ledger(tmp_path / "merged", *ledgers)
    report = audit.check(merged, DIGITS_TRAIN)
    assert [e.epoch for e in report.epochs] == [0, 1, 2] and all(e.complete
                                                                    for e in report.epochs)
    # the first job's steps after the checkpoint are the ones superseded, nothing else
    assert sum(e.rolled_back_steps for e in report.epochs) == len(_steps_after(ledgers[0],
                                                                               meta["steps"]))
    assert (report.repeated, report.missing) == (0, 0), report.to_dict()


def _digits_snapshot(steps: int, model=None) -> dict:
    """A checkpoint of the digits example's state at ``steps`` (or of another ``model``)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_digits", DIGITS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = model if model is not None else mod.DigitsCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    return {"format": checkpoint.FORMAT, "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "samplers": {"train_sampler": {"epoch": 0, "processed_num": 0, "seed": 0,
                                           "consumed": 0, "batch_size": 16}},
            "scalars": {"epoch": 0, "step": steps}, "steps": steps, "generation": 1,
            "world_size": 1, "time": time.time()}


def test_truncated_and_corrupted_checkpoints_are_named_and_the_previous_good_one_used(
        tmp_path, job_factory):
    ck = tmp_path / "ck"
    ck.mkdir()
    good = checkpoint.write(ck, _digits_snapshot(10))
    corrupt = checkpoint.write(ck, _digits_snapshot(20))
    truncated = checkpoint.write(ck, _digits_snapshot(30))
    raw = bytearray(corrupt.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(raw))
    with open(truncated, "r+b") as f:
        f.truncate(1000)
    job = job_factory(["-np", "1", "--checkpoint-dir", str(ck)],
                      digits(tmp_path, "--epochs", "1", "--train-size", "320"))
    assert job.finish() == 0, job.output()[-3000:]
    out = job.output()
    assert f"checkpoint {truncated}: truncated or changed: 1000 bytes" in out
    assert f"checkpoint {corrupt}: wrong checksum" in out
    ev = job.events()[0]
    assert Path(ev["restored_from"]) == good and ev["restored_step"] == 10, ev
    assert summary(tmp_path)["steps"] == 10 + 20  # 320 samples, 16 a step, after step 10


def test_a_checkpoint_of_another_model_ends_the_job_with_one_clear_error(tmp_path, job_factory):
    """Every rank ends with the same error naming the file and the mismatch; no generation is
    formed again (no crash loop), even with free slots for replacements."""
    ck = tmp_path / "ck"
    ck.mkdir()
    other = checkpoint.write(ck, _digits_snapshot(5, model=torch.nn.Linear(64, 10)))
    job = job_factory(["-np", "2", "--min-np", "1", "--max-np", "2", "--checkpoint-dir",
                       str(ck)], digits(tmp_path, "--epochs", "1"), hosts="localhost:4")
    code = job.finish()
    out = job.output()
    assert code == 1, out[-3000:]
    assert f"checkpoint {other} does not fit this job's model or optimizer" in out, out[-3000:]
    assert [e["generation"] for e in job.events()] == [1]
    assert "hvd-edl-run: error: rank" in out and "CheckpointError" in out


def _launch(args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([LAUNCHER, *args, sys.executable, "-c", "pass"], capture_output=True,
                          text=True, timeout=60, cwd=str(cwd))


def test_refused_directories_and_only_bad_checkpoints_fail_at_start_with_one_line(tmp_path):
    """A directory another job holds, one that cannot be created or written, and one whose only
    checkpoint is bad: one clear line each, and no worker is started."""
    ck = tmp_path / "ck"
    ck.mkdir()
    with filelock.FileLock(str(ck / checkpoint.LOCK_NAME)):
        r = _launch(["-np", "1", "--checkpoint-dir", str(ck)], tmp_path)
    assert r.returncode == 2 and "is in use by another job" in r.stderr, r.stderr
    assert "worker w1 started" not in r.stdout

    (tmp_path / "file").write_text("")
    r = _launch(["-np", "1", "--checkpoint-dir", str(tmp_path / "file" / "ck")], tmp_path)
    assert r.returncode == 2 and "is not writable" in r.stderr, r.stderr

    bad = checkpoint.write(ck, {"format": checkpoint.FORMAT, "steps": 7, "model": {}})
    bad.write_bytes(bad.read_bytes()[:-10])
    r = _launch(["-np", "1", "--checkpoint-dir", str(ck)], tmp_path)
    assert r.returncode == 1, r.stderr
    assert f"checkpoint {bad}: truncated" in r.stderr
    assert "no good checkpoint in --checkpoint-dir" in r.stderr and "not starting from scratch" \
        in r.stderr
    assert "worker w1 started" not in r.stdout


def test_a_full_disk_during_a_write_loses_nothing_written(tmp_path):
    """A write that runs out of space (here: a file size limit, EFBIG like ENOSPC) raises
    OSError, leaves no partial file, and the earlier checkpoint stays good."""
    ck = tmp_path / "ck"
    ck.mkdir()
    first = checkpoint.write(ck, {"format": checkpoint.FORMAT, "steps": 1,
                                  "model": {"w": torch.zeros(10)}})
    script = (
        "import resource, signal, sys, torch\n"
        "from hvd_edl import checkpoint\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))\n"
        "try:\n"
        f"    checkpoint.write({str(ck)!r}, {{'format': checkpoint.FORMAT, 'steps': 2,\n"
        "                     'model': {'w': torch.zeros(1_000_000)}})\n"
        "except OSError as e:\n"
        "    print('OSError', e.errno)\n"
        "    sys.exit(0)\n"
        "sys.exit(1)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "OSError" in r.stdout, r.stdout + r.stderr
    assert sorted(p.name for p in ck.iterdir()) == sorted([first.name,
                                                          checkpoint.sidecar_of(first).name])
    checkpoint.verify(first)


def test_a_commit_during_a_write_never_changes_what_is_written(tmp_path, monkeypatch):
    """In one process (rank 0 of a stand-in runtime): a commit made while the writer still
    reads the previous commit's buffers copies into a second set, so the checkpoint holds the
    state of its own commit; once the write is done, commits reuse their buffers again, and
    the next write's commits reuse the first write's buffers (two sets, allocated once).
    Without ``HVD_EDL_CHECKPOINT_DIR`` there is no writer at all."""
    import threading
    from types import SimpleNamespace

    from hvd_edl import runtime
    from hvd_edl.torch.elastic import TorchState

    monkeypatch.delenv(checkpoint.ENV_DIR, raising=False)
    monkeypatch.setattr(checkpoint, "_writer", None)
    assert checkpoint.writer() is None

    gate = threading.Event()
    real_write = checkpoint.write

    def slow_write(directory, snapshot, request=0, key=None):
        assert gate.wait(30)
        return real_write(directory, snapshot, request, key)

    monkeypatch.setattr(checkpoint, "write", slow_write)
    monkeypatch.setenv(checkpoint.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(checkpoint.ENV_EVERY_S, "3600")
    rt = SimpleNamespace(assignment=SimpleNamespace(rank=0, size=1, restore_paths=[]),
                         generation=1, steps=5, checkpoint_request=1, elastic=False,
                         joined=False, progress=None)
    monkeypatch.setattr(runtime, "_runtime", rt)

    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(1.0)
    state = TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1), epoch=3)
    writer = checkpoint.writer()
    assert writer.busy() and writer.holds(state._saved_model)  # the request: handed over
    held = state._saved_model["weight"]
    with torch.no_grad():
        model.weight.fill_(2.0)
    rt.steps = 6
    state.commit()  # during the write
    assert state._saved_model["weight"] is not held and float(held[0, 0]) == 1.0
    gate.set()
    assert writer.wait(30) and writer.written is not None
    data = checkpoint.load(writer.written)
    assert data["steps"] == 5 and data["scalars"] == {"epoch": 3}
    assert torch.equal(data["model"]["weight"], torch.ones(4, 4))
    ptr = state._saved_model["weight"].data_ptr()
    state.commit()  # no write in flight: the buffers are reused
    assert state._saved_model["weight"].data_ptr() == ptr
    gate.clear()
    rt.checkpoint_request = 2
    state.commit()  # hands these buffers to a second write
    assert writer.busy() and writer.holds(state._saved_model)
    state.commit()  # into the second set: the first write's buffers, no allocation
    assert state._saved_model["weight"].data_ptr() == held.data_ptr() != ptr
    gate.set()
    assert writer.wait(30)


@pytest.fixture
def small_disk(tmp_path):
    """A real 3.5 MiB filesystem (tmpfs): room for three 1 MiB checkpoints, not four."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a 3.5 MiB tmpfs (a real full disk, ENOSPC)")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3584k,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def _fill(directory: Path) -> Path:
    """Write zeros to ``directory/filler`` until the filesystem says ENOSPC."""
    path = directory / "filler"
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    return path


def test_rotation_makes_room_first_and_says_when_checkpoints_stop_and_resume(
        small_disk, monkeypatch, caplog):
    """On a filesystem with room for 3 checkpoints and --checkpoint-keep 3, every write
    succeeds (room is made before writing, so 3 + 1 never needs to fit); when the disk is full
    for another reason, one line says checkpoints stopped and which is kept (the newest good
    one, still good), repeated failures say nothing more, and once space is freed the next
    commit is written and a line says they resumed.  A writer started afresh (a resumed job)
    on a directory already full of checkpoints writes too.  Real files, real ENOSPC."""
    from hvd_edl import runtime
    rt = SimpleNamespace(assignment=SimpleNamespace(rank=0, size=1, restore_paths=[]),
                         generation=1, checkpoint_request=0)
    monkeypatch.setattr(runtime, "_runtime", rt)
    monkeypatch.setattr(checkpoint, "_restored_path", [None])
    caplog.set_level(logging.INFO, logger="hvd_edl.checkpoint")

    def commit(w, steps):
        committed = {"model": {"w": torch.zeros(MiB // 4)}, "optimizer": None, "samplers": {},
                     "scalars": {"epoch": 0}, "steps": steps}
        state = SimpleNamespace(committed_snapshot=lambda: committed)
        rt.checkpoint_request += 1
        assert w.offer(state)
        assert w.wait(30)
        return w.written is not None and checkpoint.read_sidecar(w.written)["steps"] == steps

    w = checkpoint.CheckpointWriter(str(small_disk), every_s=3600, keep=3)
    for steps in range(1, 7):
        assert commit(w, steps), f"checkpoint {steps} not written:\n{caplog.text}"
        assert len(checkpoint.complete(small_disk)) == min(steps, 3)
    assert "stopped" not in caplog.text

    # the disk fills up for another reason: even with only the newest one left, no room
    checkpoint.prune(small_disk, 1)
    newest = checkpoint.complete(small_disk)[0]
    filler = _fill(small_disk)
    caplog.clear()
    assert not commit(w, 7) and not commit(w, 8)
    stopped = [r.getMessage() for r in caplog.records if "checkpoints stopped" in r.getMessage()]
    assert len(stopped) == 1 and "step 7" in stopped[0] and "No space left" in stopped[0] \
        and f"kept: {newest} (step 6)" in stopped[0], caplog.text
    assert checkpoint.complete(small_disk) == [newest] and w.failures == 2
    checkpoint.verify(newest)

    filler.unlink()  # space freed: the next commit is written
    caplog.clear()
    assert commit(w, 9), caplog.text
    assert f"checkpoints resumed: {w.written} (step 9) written after 2 failed writes" \
        in caplog.text and w.failures == 0
    assert commit(w, 10) and commit(w, 11) and len(checkpoint.complete(small_disk)) == 3

    # a job resumed from the newest (a new rank 0, a new writer) on the full directory
    monkeypatch.setattr(checkpoint, "_restored_path", [checkpoint.complete(small_disk)[0]])
    w2 = checkpoint.CheckpointWriter(str(small_disk), every_s=3600, keep=3)
    assert commit(w2, 12), caplog.text
    assert [checkpoint.read_sidecar(p)["steps"] for p in checkpoint.complete(small_disk)] \
        == [12, 11, 10]


def test_ctrl_c_of_a_job_with_checkpoints_names_the_newest_and_how_to_resume(tmp_path,
                                                                              job_factory):
    """Issue 30: Ctrl-C of a --checkpoint-dir job said nothing of its checkpoints.  Now its
    last line names the newest one (path, step) and how to resume from it."""
    from conftest import long_digits
    ck = tmp_path / "ck"
    job = job_factory(["-np", "1", "--checkpoint-dir", str(ck), "--checkpoint-every", "0.5"],
                      long_digits(tmp_path))
    job.wait_for("a checkpoint", lambda: checkpoint.complete(ck), 90)
    job.proc.send_signal(signal.SIGINT)
    assert job.proc.wait(60) == 128 + signal.SIGINT
    newest = checkpoint.complete(ck)[0]
    step = checkpoint.read_sidecar(newest)["steps"]
    assert f"hvd-edl-run: the last checkpoint is {newest} (step {step}): run the same command " \
        f"again (same --checkpoint-dir) to resume from it" in job.output(), job.output()[-2000:]
