"""Exactly-once data and world-size-independent training through hvd-edl-run, checked from the
audit ledger (``HVD_EDL_AUDIT_DIR``) of real workers under real membership changes and kills."""
import pytest
import signal

import torch

from conftest import digits, long_digits, summary
from hvd_edl import audit

DIGITS_TRAIN = 1347  # training samples of the digits job (75 % of 1,797)


def _kinds(job):
    return [e["kind"] for e in job.events()]


def _generation_epochs(ledger_dir):
    """Epoch each generation resumed in, from the ledger's sync lines: {gen: epoch}."""
    return {r["gen"]: r["epoch"] for r in audit.read_records(ledger_dir) if r["kind"] == "sync"}


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
