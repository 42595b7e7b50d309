"""The cluster service's telemetry input (launcher/cluster/telemetry.py): a job's answer that
holds a number that is not finite (an infinite or NaN speed: JSON's ``Infinity``/``NaN``) is
refused as a measurement in one logged line, the job unharmed (breaker i8: an infinite speed
went into the job's speed points, which every policy reads)."""
from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace

from launcher.cluster import speed as speed_
from launcher.cluster import telemetry


class _Store:
    """The service's store as take() uses it: one job's speed points."""

    def __init__(self):
        self.row = SimpleNamespace(ended=False, speed={})

    def job(self, job_id):
        return self.row

    def update(self, job_id, speed):
        self.row.speed = speed


def _service():
    return SimpleNamespace(store=_Store(), telemetry={}, written={}, host_terms={},
                           goodput={}, post=lambda fn: fn(),
                           events=SimpleNamespace(note=lambda *a, **k: None),
                           reach=SimpleNamespace(rest_left=lambda: []),
                           type_of=lambda hosts: None)


def _answer(text):
    # what the control API's JSON gives: Python's json reads Infinity and NaN
    return json.loads('{"job": {"world_size": 2, "generation": 3, "samples_per_s": %s,'
                      ' "step_s": 0.5}, "workers": [{"host": "h", "rank": 0}]}' % text)


def test_a_non_finite_speed_is_refused_in_one_logged_line_and_the_job_runs_on(caplog):
    svc = _service()
    key = ("job-1", 1)
    steady = {"job-1": (3, time.monotonic() - speed_.STEADY_S - 1)}   # steady at generation 3
    rings, refused = {}, {}
    with caplog.at_level(logging.WARNING, logger=telemetry.__name__):
        for bad in ("Infinity", "NaN", "Infinity"):
            telemetry.take(svc, steady, rings, refused, key, _answer(bad), time.monotonic())
    assert svc.store.row.speed == {}   # no point from it: the policies never see it
    asked, kept = svc.telemetry["job-1"]
    assert kept["job"]["samples_per_s"] is None and kept["workers"] == [{"host": "h", "rank": 0}]
    assert rings[key] == 2   # its ring size is still taken
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["job job-1: telemetry refused: answer.job.samples_per_s is not a finite "
                     "number"], lines   # once per run and value, not once a second
    telemetry.take(svc, steady, rings, refused, key, _answer("40.0"), time.monotonic())
    assert svc.store.row.speed["2"]["samples_per_s"] == 40.0   # the job unharmed


def test_finite_replaces_what_is_not_a_finite_number_and_names_the_first():
    value = {"a": [1, 2.5, float("-inf")], "b": {"c": float("nan")}, "d": "x", "e": True}
    assert telemetry.finite(value) == ({"a": [1, 2.5, None], "b": {"c": None}, "d": "x",
                                        "e": True}, "answer.a[2]")
    assert telemetry.finite({"a": 1.0}) == ({"a": 1.0}, None)
