"""Exactly-once data and world-size-independent training through hvd-edl-run, checked from the
audit ledger (``HVD_EDL_AUDIT_DIR``) of real workers under real membership changes and kills."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import signal

import torch

from conftest import ROOT, digits, long_digits, summary
from hvd_edl import audit

DIGITS_TRAIN = 1347  # training samples of the digits job (75 % of 1,797)


def _kinds(job):
    return [e["kind"] for e in job.events()]


def _generation_epochs(ledger_dir):
    """Epoch each generation resumed in, from the ledger's sync lines: {gen: epoch}."""
    return {r["gen"]: r["epoch"] for r in audit.read_records(ledger_dir) if r["kind"] == "sync"}


@pytest.mark.long
def test_scale_out_scale_in_and_kill_in_one_epoch_use_each_sample_once(tmp_path, job_factory,
                                                                       monkeypatch):
    ledger = tmp_path / "ledger"
    monkeypatch.setenv(audit.ENV_AUDIT_DIR, str(ledger))
    # 16 copies of the training set: an epoch long enough for three membership changes;
    # 21,552 samples do not divide by 2 x 16 or 3 x 16
    job = job_factory(["-np", "2", "--min-np", "1", "--max-np", "3", "--discovery-interval", "0.2"],
                      long_digits(tmp_path, "--repeat-data", "16", "--step-delay", "0.03"),
                      hosts="localhost:2")
    job.wait_generation(1)
    job.set_hosts("localhost:3")
    assert job.wait_generation(2)["kind"] == "scale_out"
    job.set_hosts("localhost:2")
    assert job.wait_generation(3)["kind"] == "scale_in"
    job.kill_worker("w1", signal.SIGKILL)  # the oldest worker: rank 0
    assert job.wait_generation(4)["kind"] == "failure"
    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]
    assert _kinds(job) == ["start", "scale_out", "scale_in", "failure"]

    n = DIGITS_TRAIN * 16
    assert set(_generation_epochs(ledger).values()) == {0}, "all changes inside epoch 0"
    report = audit.check(ledger, n)
    epoch0 = report.epochs[0]
    assert epoch0.complete and epoch0.distinct == n
    assert (report.repeated, report.missing) == (0, 0), report.to_dict()
    assert epoch0.declared_repeats == 0  # the final global batch (8 samples) >= world size


def test_tiny_final_batch_repeats_are_declared_and_nothing_is_missing(tmp_path, job_factory,
                                                                     monkeypatch):
    ledger = tmp_path / "ledger"
    monkeypatch.setenv(audit.ENV_AUDIT_DIR, str(ledger))
    # 1,281 = 40 x (2 x 16) + 1: each epoch ends with a global batch of 1 sample for 2 ranks
    job = job_factory(["-np", "2"], digits(tmp_path, "--train-size", "1281", "--epochs", "3"))
    assert job.finish() == 0, job.output()[-3000:]
    report = audit.check(ledger, 1281)
    assert [e.epoch for e in report.epochs] == [0, 1, 2]
    assert all(e.complete and e.declared_repeats == 1 for e in report.epochs)
    assert (report.repeated, report.missing) == (0, 0), report.to_dict()


@pytest.mark.long
def test_fixed_global_batch_matches_one_worker_across_three_changes(tmp_path, job_factory):
    """2 -> 3 -> 2 -> 3 workers with a fixed global batch of 48 end within 1e-4 (max abs
    difference / max abs value) of one worker running the same epochs."""
    elastic = tmp_path / "elastic.pt"
    job = job_factory(["-np", "2", "--min-np", "1", "--max-np", "3", "--discovery-interval", "0.2"],
                      long_digits(tmp_path, "--global-batch-size", "48", "--step-delay", "0.3",
                                  "--save-params", str(elastic)),
                      hosts="localhost:2")
    job.wait_generation(1)
    job.set_hosts("localhost:3")
    job.wait_generation(2)
    job.set_hosts("localhost:2")
    job.wait_generation(3)
    job.set_hosts("localhost:3")
    job.wait_generation(4)
    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]
    assert _kinds(job) == ["start", "scale_out", "scale_in", "scale_out"]
    epochs = summary(tmp_path)["epochs"]

    single = tmp_path / "single.pt"
    one = job_factory(["-np", "1"], digits(tmp_path, "--global-batch-size", "48", "--epochs",
                                           str(epochs), "--save-params", str(single)))
    assert one.finish() == 0, one.output()[-3000:]
    a, b = torch.load(elastic), torch.load(single)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    scale = max(b[k].abs().max().item() for k in b)
    print(f"fixed global batch: {epochs} epochs, max |diff| {diff:.3g}, max |param| "
          f"{scale:.3g}, relative {diff / scale:.3g}")
    assert diff / scale <= 1e-4


# ---- the audit's verdict on a job that did not finish its epoch ---------------------------------

_LEDGER_WRITER = textwrap.dedent("""
    import sys
    import torch
    from hvd_edl.torch.elastic import ElasticSampler
    n, batch, epochs, stop_after, close_at_start = map(int, sys.argv[1:])
    sampler = ElasticSampler(list(range(n)), shuffle=True, seed=3, batch_size=batch)
    loader = torch.utils.data.DataLoader(list(range(n)), batch_size=batch, sampler=sampler)
    steps = 0
    for epoch in range(epochs):
        if close_at_start:           # the torch idiom: set_epoch(e) before epoch e
            sampler.set_epoch(epoch)
        for i, _ in enumerate(loader):
            sampler.record_batch(i, batch)
            steps += 1
            if steps == stop_after:  # the job fails here, halfway through an epoch
                sys.exit(0)
        if not close_at_start:       # Horovod's elastic idiom: set_epoch(e + 1) after epoch e
            sampler.set_epoch(epoch + 1)
""")


def _ledger(tmp_path, n=40, batch=8, epochs=2, stop_after=0, close_at_start=False):
    """A real sampler's audit ledger (``HVD_EDL_AUDIT_DIR``) in a process of its own."""
    ledger = tmp_path / "ledger"
    env = dict(os.environ, **{audit.ENV_AUDIT_DIR: str(ledger)})
    subprocess.run([sys.executable, "-c", _LEDGER_WRITER, str(n), str(batch), str(epochs),
                    str(stop_after), str(int(close_at_start))], env=env, check=True,
                   cwd=str(ROOT), timeout=120)
    return ledger


def _audit_cli(ledger, n, *flags):
    return subprocess.run([sys.executable, "-m", "hvd_edl.audit", str(ledger), "--dataset-size",
                           str(n), *flags], capture_output=True, text=True, cwd=str(ROOT),
                          timeout=60)


def test_audit_of_a_job_that_stopped_mid_epoch_fails_unless_allowed(tmp_path):
    """A job that ended halfway through epoch 1 (40 samples, batches of 8, 7 steps: epoch 0 and
    2 batches of epoch 1).  Before: ``missing - (incomplete)`` and then ``audit: repeated 0,
    missing 0: OK``, exit 0.  Now exit 1 naming the incomplete epoch; ``--allow-incomplete``
    passes it (exit 0), and still fails repeats."""
    ledger = _ledger(tmp_path, stop_after=7)
    r = _audit_cli(ledger, 40)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "sampler epoch 1: 16 distinct of 40, repeated 0, missing - (incomplete)" in r.stdout
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("audit: repeated 0, missing 0, incomplete epochs 1: FAILED: "
                           "sampler epoch 1 incomplete"), last
    assert "--allow-incomplete" in last

    allowed = _audit_cli(ledger, 40, "--allow-incomplete")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert allowed.stdout.strip().endswith("OK (sampler epoch 1 incomplete, allowed)")
    assert audit.check(ledger, 40).ok is False and audit.check(ledger, 40, True).ok is True

    # a repeat is not excused by --allow-incomplete
    (ledger / "extra.jsonl").write_text(
        '{"kind": "step", "gen": 0, "step": 99, "epoch": 1, "rank": 1, "size": 1, '
        '"sampler": "sampler", "indices": [%d]}\n' % audit.read_records(ledger)[-1]["indices"][0])
    again = _audit_cli(ledger, 40, "--allow-incomplete")
    assert again.returncode == 1 and "FAILED: 1 repeated, 0 missing" in again.stdout


def test_audit_of_finished_jobs_passes_with_either_set_epoch_idiom(tmp_path):
    """Every epoch closed by ``set_epoch(e + 1)``, or only used in full (``set_epoch(e)`` at the
    start of each epoch never closes the last one): exit 0.  A ledger with no step: exit 1."""
    for close_at_start in (False, True):
        ledger = _ledger(tmp_path / str(close_at_start), epochs=2, close_at_start=close_at_start)
        r = _audit_cli(ledger, 40)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.strip().splitlines()[-1] == \
            "audit: repeated 0, missing 0, incomplete epochs 0: OK"
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _audit_cli(empty, 40)
    assert r.returncode == 1 and "FAILED: no step recorded" in r.stdout
    assert _audit_cli(empty, 0).returncode == 2   # a usage error


def test_a_run_resumed_by_a_new_launcher_supersedes_the_old_runs_later_steps(tmp_path):
    """A job stopped after its checkpoint at step 2 and resumed by a new launcher (a cluster
    service's preemption): the new run numbers its generations from 1 again, and its ``sync``
    at step 2 still supersedes the old run's step 3, written in its generation 2 (generations
    ordered by ``(run, gen)``, the launcher's start first): no repeat, no miss."""
    from hvd_edl import audit
    lines = []

    def rec(kind, run, gen, step, **kw):
        lines.append(json.dumps({"kind": kind, "run": run, "gen": gen, "step": step,
                                 "epoch": 0, "sampler": "s", **kw}))
    rec("sync", 100.0, 1, 0)
    for step in (1, 2):
        rec("step", 100.0, 1, step, rank=0, size=1, indices=[2 * step - 2, 2 * step - 1])
    rec("sync", 100.0, 2, 2)  # a scale change: generation 2
    rec("step", 100.0, 2, 3, rank=0, size=1, indices=[4, 5])  # after the checkpoint: lost
    rec("sync", 200.0, 1, 2)  # the new launcher's first generation, from the checkpoint
    for step in (3, 4):
        rec("step", 200.0, 1, step, rank=0, size=1, indices=[2 * step - 2, 2 * step - 1])
    (tmp_path / "w1.jsonl").write_text("\n".join(lines) + "\n")
    report = audit.check(tmp_path, 8)
    assert report.ok and report.repeated == 0 and report.missing == 0, report.verdict()
    # without the runs told apart (the old ledger), the old run's generation 2 reads as the
    # later one and drops the new run's steps: the epoch reads as 6 of its 8 samples
    (tmp_path / "w1.jsonl").write_text("".join(
        json.dumps({k: v for k, v in json.loads(x).items() if k != "run"}) + "\n"
        for x in lines))
    old = audit.check(tmp_path, 8)
    assert not old.ok and old.epochs[0].distinct == 6, old.verdict()
