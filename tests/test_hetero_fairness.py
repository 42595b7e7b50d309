"""Finish-time fairness in Sia's heterogeneous cluster (issue 42 s4): Sia's isolated reference
(alone on G / N GPUs of each type, weighted by the types' GPUs) against the stricter best-type
one, on a profile with known rates."""
import math

import pytest

from launcher.cluster.hetero_fairness import (alone_on_s, finish_time_fairness, isolated_best_type_s,
                                              isolated_sia_s)
from launcher.cluster.hetero_sim import Costs, Result, SimJobState


class _PM:
    end = 100.0
    bounds = [0.0, 50.0, 100.0]


class _Prof:
    """Progress per second = GPUs x (1 on a t4, 2 on an rtx, 4 on an a100)."""
    progress = {"app": _PM()}
    speed = {"t4": 1.0, "rtx": 2.0, "a100": 4.0}

    def best(self, app, t, n, e):
        return (n * self.speed[t], 64)


def test_alone_uses_the_largest_allowed_size_up_to_the_share():
    p = _Prof()
    assert alone_on_s(p, "app", "rtx", 8) == pytest.approx(100 / 16)
    assert alone_on_s(p, "app", "rtx", 12) == pytest.approx(100 / 16)     # 12 is not a size: 8
    assert alone_on_s(p, "app", "a100", 16) == pytest.approx(100 / 64)


def test_sia_reference_weights_types_by_their_gpus_and_best_type_is_stricter():
    p = _Prof()
    # 8 jobs: 8 GPUs each; t4 8 (2 nodes) -> 12.5 s, rtx 8 -> 6.25 s, a100 8 -> 3.125 s
    want = (24 * 12.5 + 24 * 6.25 + 16 * 3.125) / 64
    assert isolated_sia_s(p, "app", 8.0) == pytest.approx(want)
    assert isolated_sia_s(p, "app", 8.0, start_s=5.0, wait_s=10.0) == pytest.approx(want + 15.0)
    assert isolated_best_type_s(p, "app", 8.0) == pytest.approx(3.125)
    # half a GPU each (128 jobs): one GPU's time doubled
    assert isolated_sia_s(p, "app", 128.0) == pytest.approx(2 * (24 * 100 + 24 * 50 + 16 * 25) / 64)
    j = SimJobState("j", "app", 30.0, 1, 64, finished=30.0 + 2 * want + 30.0, contention=[8, 8])
    res = Result([j], 0.0, 0.0, 0.0, 0.0, 0)
    # submitted at 30 s: 30 s to its first 60 s round; the start of ``Costs`` (5 s stop-free)
    rho = finish_time_fairness(res, p, Costs("stop_free", 5.0, 0.5, 5.0))
    assert rho == [pytest.approx((2 * want + 30.0) / (want + 35.0))]
    assert math.isclose(finish_time_fairness(res, p, Costs("restart"), definition="best_type")[0],
                        (2 * want + 30.0) / 3.125)
    with pytest.raises(ValueError):
        finish_time_fairness(res, p, Costs("restart"), definition="themis")
