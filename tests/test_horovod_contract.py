"""What a Horovod script can observe stays Horovod's (issue 13): the elastic unit checks of
Horovod's own suite, the ``HOROVOD_*`` environment horovodrun gives before a script starts, and
exactly-once data for scripts that count ``record_batch`` calls the way Horovod does (whatever
``batch_idx`` they pass)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import LAUNCHER, ROOT
from hvd_edl import audit

HOROVOD_STYLE = ROOT / "tests" / "horovod_style"


def test_horovods_elastic_unit_checks_hold_in_one_process_and_under_the_launcher(tmp_path):
    script = str(HOROVOD_STYLE / "unit_main.py")
    env = dict(os.environ, HVD_EDL_QUIET="1")
    alone = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120,
                           cwd=str(tmp_path), env=env)
    assert alone.returncode == 0 and "ok 0 1" in alone.stdout, alone.stdout + alone.stderr
    two = subprocess.run([LAUNCHER, "-np", "2", sys.executable, script], capture_output=True,
                         text=True, timeout=120, cwd=str(tmp_path))
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "ok 0 2" in two.stdout and "ok 1 2" in two.stdout


def _env_records(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_horovod_environment_is_set_at_spawn_and_updated_at_join_and_after_a_shrink(
        tmp_path, job_factory):
    """HOROVOD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE/CROSS_RANK/CROSS_SIZE/HOSTNAME are readable before
    ``hvd.init()`` (scripts pin a GPU or name files with them); a joiner on a second host sees
    its provisional rank at spawn and the ring's figures once it joined.  After a scale-in (a
    removal-only generation: no state sync) the survivor's ``HOROVOD_*`` show the smaller ring,
    as after a scale-out (issue 39: ``HOROVOD_SIZE`` stayed stale).  The host of rank 0 leaves,
    so the survivor is renumbered and the cross figures change too.  (``/proc/PID/environ``
    read from outside always shows the environment a process started with; what the script
    sees is ``os.environ``.)

    The script also broadcasts its initial weights at the top level (``hvd.broadcast_parameters``,
    ``hvd.broadcast_optimizer_state``, ``--broadcast-at-start``): the joiner runs that code alone
    while the members train.  Before joining an elastic ring those broadcasts do nothing
    (``state.sync()`` hands the joiner rank 0's state); before, the joiner waited in its
    broadcast for the members forever and the job hung at the scale-out.  One job walks the
    three (before: three jobs, 9 worker starts)."""
    env_file = tmp_path / "env.jsonl"
    job = job_factory(["-np", "2", "--min-np", "1", "--max-np", "3", "--discovery-interval",
                       "0.2"],
                      [sys.executable, str(HOROVOD_STYLE / "elastic_main.py"), "--logfile",
                       str(tmp_path / "log"), "--env-file", str(env_file), "--epochs", "0",
                       "--stop-file", str(tmp_path / "stop"), "--step-delay", "0.02",
                       "--batches-per-epoch", "20", "--broadcast-at-start"],
                      hosts="localhost:2")
    job.wait_generation(1)
    job.set_hosts("localhost:2\n127.0.0.1:1")
    assert job.wait_generation(2)["world_size"] == 3
    job.wait_for("the joiner's joined record", lambda: any(
        r["when"] == "joined" and r["HOROVOD_SIZE"] == "3" and r["HOROVOD_HOSTNAME"] ==
        "127.0.0.1" for r in _env_records(env_file)), 60)
    job.wait_for("the ring of 3 training", lambda: any(
        json.loads(x)["size"] == 3 for x in (tmp_path / "log").read_text().splitlines())
        if (tmp_path / "log").exists() else False, 90)
    job.set_hosts("127.0.0.1:1")  # rank 0's host leaves
    assert job.wait_generation(3)["kind"] == "scale_in"
    job.wait_for("the survivor's record of the ring of 1", lambda: any(
        r["when"] == "joined" and r["HOROVOD_SIZE"] == "1" for r in _env_records(env_file)), 60)
    (tmp_path / "stop").touch()
    assert job.finish() == 0, job.output()[-3000:]
    # Horovod's init reads HOROVOD_RANK/SIZE: a stale pair breaks the ring of 1, and the failure
    # generation after it would set them again and hide the staleness
    assert [g["kind"] for g in job.events()] == ["start", "scale_out", "scale_in"], job.events()
    by_pid = {}
    for r in _env_records(env_file):
        by_pid.setdefault(r["pid"], {}).setdefault(r["when"], r)
    keys = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
            "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME")
    spawn = sorted((tuple(w["spawn"][k] for k in keys) for w in by_pid.values()))
    assert spawn == [("0", "2", "0", "2", "0", "1", "localhost"),
                     ("1", "2", "1", "2", "0", "1", "localhost"),
                     ("2", "3", "0", "1", "1", "2", "127.0.0.1")], spawn
    for w in by_pid.values():
        assert w["init"] == {**w["spawn"], "when": "init"}  # init() changes nothing before a join
    joined = sorted(tuple(r[k] for k in keys) for r in _env_records(env_file)
                    if r["when"] == "joined" and r["HOROVOD_SIZE"] == "3")
    assert joined[-3:] == [("0", "3", "0", "2", "0", "2", "localhost"),
                           ("1", "3", "1", "2", "0", "1", "localhost"),
                           ("2", "3", "0", "1", "1", "2", "127.0.0.1")], joined
    records = {}
    for r in _env_records(env_file):
        records.setdefault(r["pid"], []).append(r)
    survivors = [rs for rs in records.values()
                 if any(r["when"] == "joined" and r["HOROVOD_SIZE"] == "1" for r in rs)]
    assert len(survivors) == 1, records
    assert tuple(survivors[0][-1][k] for k in keys) == \
        ("0", "1", "0", "1", "0", "1", "127.0.0.1"), survivors  # was rank 2, cross rank 1 of 2


DATASET = 4501  # neither 2 nor 3 divides it; the changes below take about a third of its epoch


@pytest.mark.parametrize("record_index", ["zero", pytest.param("global", marks=pytest.mark.long)])
def test_horovod_counting_of_record_batch_keeps_exactly_once(tmp_path, job_factory, monkeypatch,
                                                             record_index):
    """A Horovod-style script calls ``record_batch(0, B)`` (or with a step counter kept across
    resets) after each step: each call is one more batch, as in Horovod.  Through a scale-out,
    a scale-in and a kill -9 of rank 0 in one epoch, the audit finds every sample of the epoch
    used exactly once in the committed progress.  (Before: taken as an absolute batch index,
    ``0`` rewound the epoch at every reset; 360 and 2,672 samples used twice.)"""
    ledger = tmp_path / "ledger"
    monkeypatch.setenv(audit.ENV_AUDIT_DIR, str(ledger))
    job = job_factory(["-np", "2", "--min-np", "1", "--max-np", "3", "--discovery-interval",
                       "0.2"],
                      [sys.executable, str(HOROVOD_STYLE / "elastic_main.py"), "--logfile",
                       str(tmp_path / "log"), "--dataset-size", str(DATASET), "--batch-size",
                       "8", "--batches-per-commit", "2", "--record-index", record_index,
                       "--epochs", "0", "--stop-file", str(tmp_path / "stop"),
                       "--step-delay", "0.02"],
                      hosts="localhost:2")
    job.wait_generation(1)
    job.set_hosts("localhost:3")
    assert job.wait_generation(2)["kind"] == "scale_out"
    job.set_hosts("localhost:2")
    assert job.wait_generation(3)["kind"] == "scale_in"
    job.kill_worker("w1", signal.SIGKILL)  # rank 0
    assert job.wait_generation(4)["kind"] == "failure"
    (tmp_path / "stop").touch()
    assert job.finish() == 0, job.output()[-3000:]
    syncs = {r["gen"]: r["epoch"] for r in audit.read_records(ledger) if r["kind"] == "sync"}
    report = audit.check(ledger, DATASET)
    assert (report.repeated, report.missing) == (0, 0), report.to_dict()
    epoch0 = report.epochs[0]
    assert epoch0.complete and epoch0.distinct == DATASET
    print(f"record_batch({record_index}): generations resumed in epochs {syncs}; "
          f"{len(report.epochs)} epochs audited, 0 repeated, 0 missing")


def test_broadcast_object_hands_rank_0s_object_to_every_rank(tmp_path):
    """``hvd.broadcast_object`` (one broadcast for a pickle that fits the first, two otherwise):
    under the launcher every rank ends with rank 0's objects, at the sizes around the first
    broadcast's room and beyond; alone, the object comes back as it was."""
    script = str(HOROVOD_STYLE / "broadcast_object_main.py")
    two = subprocess.run([LAUNCHER, "-np", "2", sys.executable, script], capture_output=True,
                         text=True, timeout=120, cwd=str(tmp_path))
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    lines = {}
    for line in two.stdout.splitlines():  # "[rank]<stdout>:name digest"
        if "<stdout>:" in line:
            rank, text = line.split("<stdout>:", 1)
            lines.setdefault(rank, []).append(text.split())
    assert len(lines) == 2, two.stdout[-3000:]
    a, b = lines.values()
    assert a[-1][0] == b[-1][0] == "done" and len(a) == len(b) == 6
    assert a[:-1] == b[:-1]  # every object: the same digest on both ranks (rank 0's)
    env = dict(os.environ, HVD_EDL_QUIET="1")
    alone = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120,
                           cwd=str(tmp_path), env=env)
    assert alone.returncode == 0 and "done 0 1" in alone.stdout, alone.stdout + alone.stderr
