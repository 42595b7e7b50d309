"""Profiling through elasticity (EDL) and the speed model (CM-DARE): the model's fit and its
leave-one-size-out error on synthetic points; one real job walked through 1, 2 and 3 workers by
``hvd-edl-ctl profile`` and back, stop-free, every sample once."""
import json
import math
import random
import subprocess

import pytest

from conftest import VENV_BIN, long_digits
from hvd_edl import audit
from launcher.apps.speed_model import ProfilePoint, SpeedModel, loso_mape

CTL = str(VENV_BIN / "hvd-edl-ctl")
DIGITS_TRAIN = 1347


def _ring_points(sizes, noise=0.01, seed=0, compute=0.1, contention=0.004, ring=0.05,
                 hop=0.003, batch=16):
    """Points of a job whose step is compute + ring allreduce, with relative noise."""
    rnd = random.Random(seed)
    out = []
    for n in sizes:
        for _ in range(2):
            c = (compute + contention * (n - 1)) * (1 + rnd.gauss(0, noise))
            w = (ring * (n - 1) / n + hop * (n - 1)) * (1 + rnd.gauss(0, noise))
            out.append(ProfilePoint(n, n * batch / (c + w), c + w, c, w))
    return out


def test_speed_model_fits_ring_allreduce_points_and_extrapolates_within_5_percent():
    model = SpeedModel().fit(_ring_points([1, 2, 3, 4]))
    assert model.batch == pytest.approx(16, rel=1e-6)
    truth = _ring_points([8], noise=0.0)[0]
    assert model.samples_per_s(8) == pytest.approx(truth.samples_per_s, rel=0.05)
    assert 0 < model.efficiency(4) < 1 and model.efficiency(1) == pytest.approx(1.0)
    assert model.marginal_efficiency(1) > model.marginal_efficiency(6) > 0
    errors = loso_mape(_ring_points([1, 2, 3, 4]))
    assert sorted(errors) == [1, 2, 3, 4]
    assert max(errors.values()) <= 5.0, errors
    assert loso_mape(_ring_points([1, 2])) == {}  # two sizes: nothing left to hold out


def test_speed_model_without_timings_fits_the_step_time_from_throughput():
    pts = [ProfilePoint(p.world_size, p.samples_per_s, samples_per_step=16)
           for p in _ring_points([1, 2, 3, 4], noise=0.0)]
    model = SpeedModel().fit(pts)
    assert not model.timed
    for p in pts:
        assert model.samples_per_s(p.world_size) == pytest.approx(p.samples_per_s, rel=0.03)
    with pytest.raises(ValueError, match="samples_per_step"):
        SpeedModel().fit([ProfilePoint(1, 10.0)])
    with pytest.raises(ValueError, match="world_size"):
        ProfilePoint.from_dict({"world_size": 0, "samples_per_s": 1})
    assert ProfilePoint.from_dict({"world_size": 2, "samples_per_s": 5.0, "step_s": None,
                                   "extra": 1}).timed() is False
    assert math.isnan(ProfilePoint(1, 1.0).compute_s)


def _ctl(job_file, *args, timeout_s=150):
    return subprocess.run([CTL, "--job", str(job_file), *args], capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.mark.long
def test_profile_walks_1_2_3_workers_stop_free_and_returns_to_2(tmp_path, job_factory,
                                                               monkeypatch):
    ledger = tmp_path / "ledger"
    monkeypatch.setenv(audit.ENV_AUDIT_DIR, str(ledger))
    job_file = tmp_path / "job.json"
    job = job_factory(["-np", "2", "--min-np", "1", "--max-np", "3", "--target-np", "2",
                       "--discovery-interval", "0.2", "--job-file", str(job_file)],
                      long_digits(tmp_path), hosts="localhost:3")
    job.wait_generation(1)
    job.wait_for("the job file", job_file.exists, 30)
    # refused before anything changes: outside the bounds (exit 2), bad usage (exit 2)
    bad = _ctl(job_file, "profile", "--sizes", "1,4", "--seconds", "3")
    assert bad.returncode == 2 and "size 4 is outside [--min-np 1, --max-np 3]" in bad.stderr
    assert _ctl(job_file, "profile", "--sizes", "1,x").returncode == 2

    out = tmp_path / "prof"
    out.mkdir()
    r = _ctl(job_file, "profile", "--sizes", "1,2,3", "--seconds", "3", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr + job.output()[-3000:]
    assert "samples/s" in r.stdout and "efficiency" in r.stdout
    doc = json.loads((out / "profile.json").read_text())
    assert [p["world_size"] for p in doc["points"]] == [1, 2, 3]
    assert all(p["samples_per_s"] > 0 and p["source"] == "telemetry" for p in doc["points"])
    assert doc["points"][0]["efficiency"] == pytest.approx(1.0)
    assert doc["aborted"] is None and doc["returned_to"] == 2
    assert set(doc["model"]["loso_mape_percent"]) == {"1", "2", "3"}
    assert (out / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    status = json.loads(_ctl(job_file, "status", "--json").stdout)
    assert status["world_size"] == 2 and status["target_np"] == 2
    assert status["profile"]["state"] == "done"

    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]
    events = job.events()
    assert [e["world_size"] for e in events] == [2, 1, 2, 3, 2]
    assert all(e["rolled_back_steps"] == 0 for e in events), events
    assert [e["kind"] for e in events[1:]] == ["scale_in", "scale_out", "scale_out", "scale_in"]
    done = [n for n in job.notes("profile") if n.get("phase") == "done"]
    assert len(done) == 1 and [p["world_size"] for p in done[0]["points"]] == [1, 2, 3]
    report = audit.check(ledger, DIGITS_TRAIN)
    assert report.epochs and all(e.complete for e in report.epochs)
    assert (report.repeated, report.missing) == (0, 0), report.to_dict()


def test_profile_output_folder_is_created_and_an_earlier_profile_is_never_overwritten(tmp_path):
    """Issue 30: ``--autoscale`` wrote profile.json / .png into the current folder over the last
    run's, and ``profile --out DIR`` refused a folder not there yet.  Now the folder is created,
    a second profile there takes the next free name, and without an event log the autoscaler
    writes into a folder of its own launcher."""
    import os
    import tempfile
    from launcher.apps import autoscale, profiler

    class _Driver:  # what Profiler._finish reads of launcher.job.driver.Driver
        spec = type("Spec", (), {"max_np": 2, "command": ["python", "train.py"],
                                 "event_log": None})()
        notes = []

        def note(self, kind, text, **fields):
            self.notes.append((kind, text, fields))

    out = profiler.output_folder(str(tmp_path / "new" / "profiles"))   # before: refused
    assert out.is_dir()
    p = profiler.Profiler(_Driver())
    p._state = {"return_to": 2}
    first = p._finish([], out, [1, 2], 1.0, None)   # no points: no plot (matplotlib: slow)
    (out / "profile-2.png").write_text("an earlier plot")
    second = p._finish([], out, [1, 2], 1.0, None)
    assert first["json"] == str(out / "profile.json")
    assert second["json"] == str(out / "profile-3.json")   # profile-2's plot is kept too
    assert json.loads((out / "profile.json").read_text())["sizes"] == [1, 2]
    assert (out / "profile-2.png").read_text() == "an earlier plot"
    assert "profile-3.json" in str(_Driver.notes[-1][2])
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cannot create the output folder"):
        profiler.output_folder(str(tmp_path / "file" / "sub"))
    a = autoscale.Autoscaler(_Driver(), autoscale.Policy("efficiency", efficiency=0.5))
    assert a.out_dir() == os.path.join(tempfile.gettempdir(), f"hvd-edl-{os.getpid()}")
