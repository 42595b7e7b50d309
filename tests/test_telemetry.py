"""Telemetry: the worker's step timer, the launcher's windows, the metrics endpoint and
``hvd-edl-ctl status`` / ``top`` on a real elastic job."""
from __future__ import annotations

import math

import pytest

from hvd_edl.telemetry import StepTimer
from launcher.events import GenerationEvent
from launcher.telemetry import COUNTER_KINDS, Telemetry


def test_step_timer_splits_steps_into_compute_and_wait_and_resends_unanswered_beats():
    t = StepTimer()
    t.step_end()                       # no restart yet: the first step is not timed
    assert t.totals == (0, 0.0, 0.0)
    t.restart()
    t.add_wait(10.0)                   # more wait than the step took: capped at the step
    t.step_end()
    steps, compute, wait = t.totals
    assert steps == 1 and compute == 0.0 and 0 < wait < 1.0
    t.add_samples(16)
    mark, sums = t.take()
    assert sums[0] == 1 and sums[3] == 16
    t.step_end()                       # not sent: the next take carries both steps
    mark, sums = t.take()
    assert sums[0] == 2 and sums[3] == 16 and sums[1] + sums[2] > 0
    t.sent(mark)
    assert t.take()[1] == (0, 0.0, 0.0, 0)


def _gen(number, kind, stall_s):
    return GenerationEvent(generation=number, kind=kind, world_size=2, members=[], step=0,
                           stall_s=stall_s, rolled_back_steps=0, time=0.0)


def test_telemetry_windows_means_throughput_and_counters():
    tel = Telemetry(window_s=2.0)
    tel.add_worker("w1", "hostA", 0)
    tel.add_worker("w2", "hostB", 0)
    tel.add_worker("w3", "hostB", 1)    # pending: no rank
    tel.on_members(1, ["w2", "w1"])
    assert math.isnan(tel.worker("w1").step_s)
    # w1: 10 steps/s of 0.1 s (0.07 compute + 0.03 wait), 160 samples/s, beats every 0.5 s
    for k in range(1, 21):
        now = 100.0 + 0.5 * k
        tel.observe("w1", 1, now, 5, 0.35, 0.15, 80)
        tel.observe("w2", 1, now, 5, 0.10, 0.40, 80)
        tel.observe("w3", 0, now, 0, 0.0, 0.0, 0)
    rows = tel.workers()
    assert [r.worker_id for r in rows] == ["w2", "w1", "w3"]
    assert [r.rank for r in rows] == [0, 1, -1]
    w1 = tel.worker("w1")
    assert (w1.host, w1.slot, w1.steps) == ("hostA", 0, 100)
    assert w1.step_s == pytest.approx(0.1) and w1.compute_s == pytest.approx(0.07)
    assert w1.wait_s == pytest.approx(0.03)
    assert w1.steps_per_s == pytest.approx(10.0) and w1.samples_per_s == pytest.approx(160.0)
    assert w1.updated_at == 110.0
    # the window forgets: w1 slows down to 2 steps/s of 0.5 s
    for k in range(1, 9):
        tel.observe("w1", 1, 110.0 + 0.5 * k, 1, 0.45, 0.05, 16)
    w1 = tel.worker("w1")
    assert w1.step_s == pytest.approx(0.5) and w1.steps_per_s == pytest.approx(2.0)
    assert math.isnan(tel.worker("w3").step_s) and tel.worker("w3").steps_per_s == 0.0
    job = tel.job()
    assert job["world_size"] == 2 and job["generation"] == 1
    assert job["samples_per_s"] == pytest.approx(32.0 + 160.0)  # w2's window ends at 110
    # throughput: samples of the beats in (since, until] over the interval
    assert tel.throughput(100.0, 110.0) == pytest.approx(2 * 20 * 80 / 10.0)
    assert tel.throughput(110.0, 114.0) == pytest.approx(8 * 16 / 4.0)
    with pytest.raises(ValueError):
        tel.throughput(200.0, 210.0)
    with pytest.raises(ValueError):
        tel.throughput(110.0, 110.0)
    # counters and stalls
    assert tel.counters() == {k: 0 for k in COUNTER_KINDS}
    tel.count("straggler")
    tel.count("migration", 2)
    with pytest.raises(ValueError):
        tel.count("failure", -1)
    assert tel.counters()["straggler"] == 1 and tel.counters()["migration"] == 2
    tel.on_generation(_gen(1, "start", 0.0))
    tel.on_generation(_gen(2, "scale_out", 0.15))
    assert tel.stalls() == [(2, "scale_out", 0.15)]
    assert tel.job()["last_stall_s"] == 0.15 and tel.job()["changes"] == 1
    tel.forget("w3")
    assert tel.worker("w3") is None and len(tel.workers()) == 2
    # an old sender's beat (no telemetry fields) and garbage are harmless
    tel.observe("w1", 1, 115.0, 0, float("nan"), -1.0, 0)
    assert tel.worker("w1").steps == 108
