"""Finish-time fairness (Themis, NSDI 2020) of a simulated schedule, against hand-computed values."""
import pytest

from launcher.cluster.fairness import contention, finish_time_fairness
from launcher.cluster.policies import make_policy
from launcher.cluster.simulator import SimJob, simulate


def test_contention_is_the_time_average_of_jobs_in_the_system():
    line = [(0.0, {"a": 2}, 0), (60.0, {"a": 1, "b": 1}, 1), (120.0, {"b": 2}, 0)]
    assert contention(line, 0.0, 120.0) == pytest.approx((60 * 1 + 60 * 3) / 120)
    assert contention(line, 500.0, 600.0) == 1.0               # no round: alone


def test_two_equal_jobs_fifo_the_second_waits_its_share():
    # two jobs of 100 steps at 1 s per step on 1 or 2 slots: each alone on half the pool (1
    # slot) takes 10 s + 100 s; fifo runs a on both slots (as asked), then b
    def st(pl):
        return 2.0 / (1 + sum(pl))                              # 1 s at 1 slot, 0.67 s at 2
    jobs = [SimJob("a", 0.0, st, 100, 2, 1, 2), SimJob("b", 0.0, st, 100, 2, 1, 2)]
    res = simulate(jobs, {"h": 2}, make_policy("fifo"), restart_cost_s=10.0, timeline=True)
    f = finish_time_fairness(res, jobs, 2, 2, 10.0)
    # a: 10 + 66.7 = 76.7 s; b waits for round 120: 120 + 10 + 66.7; N = 2 throughout each life
    assert f["rho"]["a"] == pytest.approx((10 + 200 / 3) / 110)
    assert f["rho"]["b"] == pytest.approx((130 + 200 / 3) / 110)
    assert f["worst"] == f["rho"]["b"] and f["median"] == pytest.approx(
        (f["rho"]["a"] + f["rho"]["b"]) / 2)
    with pytest.raises(ValueError):
        finish_time_fairness(simulate(jobs, {"h": 2}, make_policy("fifo")), jobs, 2, 2, 10.0)
