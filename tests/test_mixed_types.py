"""Mixed GPU types within one job (issue 42, section 3): a synchronous ring steps at its slowest
worker, so adding slower workers pays only if ``(n + m) * v_slow > n * v_fast`` (with the sync
cost the speed model carries); the ``typed`` policy mixes only then, and says so in the job's
reason (what ``status`` shows).  Pure: the rule, then small streams through the policy."""
from __future__ import annotations

from launcher.cluster.mixed_types import mixed_pays, ring_speed
from launcher.cluster.policies.typed import TypedPolicy
from launcher.cluster.policy import JobView, Snapshot, check_allocation


class _Terms:
    def __init__(self, gpu_type):
        self.gpu_type, self.price, self.spot = gpu_type, 1.0, False


def _linear(fast, slow, sync=0.0):
    """samples/s: ``v * n`` per type, less ``sync`` per worker beyond the first."""
    return lambda t, n: {"fast": fast, "slow": slow}[t] * n * (1 - sync) ** (n - 1)


def test_the_rule_is_n_plus_m_times_the_slow_speed_against_n_times_the_fast():
    assert ring_speed(_linear(2.0, 1.0), {"fast": 1, "slow": 1}) == 2.0  # 2 x the slow
    assert not mixed_pays(_linear(2.0, 1.0), "fast", 1, "slow", 1)   # 2 x 1 = 1 x 2: no gain
    assert mixed_pays(_linear(2.0, 1.5), "fast", 1, "slow", 1)       # 2 x 1.5 > 1 x 2
    assert not mixed_pays(_linear(3.0, 1.0), "fast", 2, "slow", 2)   # 4 x 1 < 2 x 3
    assert mixed_pays(_linear(3.0, 1.0), "slow", 2, "fast", 2) is False  # either way round


def test_a_sync_cost_can_make_a_mix_that_pays_on_speeds_alone_not_pay():
    assert mixed_pays(_linear(2.0, 1.5), "fast", 2, "slow", 1)       # 3 x 1.5 = 4.5 > 4
    assert not mixed_pays(_linear(2.0, 1.5, sync=0.15), "fast", 2, "slow", 1)


def _stream(slow_speed, np_=2):
    hosts = {"f": _Terms("fast"), "s": _Terms("slow")}
    speed = _linear(2.0, slow_speed)
    job = JobView("j1", 1.0, np_, 1, np_, speed_of=speed)
    snap = Snapshot(100.0, {"f": 1, "s": 1}, (job,), hosts=hosts)
    policy = TypedPolicy()
    alloc = policy.allocate(snap)
    check_allocation(snap, alloc)
    return alloc, policy.explain("j1")


def test_typed_mixes_types_in_one_job_only_where_the_rule_says_it_pays():
    # one fast and one slow slot free, a job of up to 2 workers
    alloc, why = _stream(slow_speed=1.5)  # 2 x 1.5 = 3 > 2: both slots, and the reason says
    assert alloc == {"j1": {"f": 1, "s": 1}}, alloc
    assert "mixed types pay (3 samples/s, the faster part alone 2)" in why, why
    alloc, why = _stream(slow_speed=0.8)  # 2 x 0.8 = 1.6 < 2: the fast slot alone
    assert alloc == {"j1": {"f": 1}}, alloc
    assert "mixed" not in why, why


def test_status_shows_why_a_running_job_mixes_types():
    from launcher.cluster.top import frame_lines
    _, why = _stream(slow_speed=1.5)
    row = {"id": "j1", "name": "train.py", "user": "u", "state": "running", "world_size": 2,
           "allocated": 2, "np": 2, "min_np": 1, "max_np": 2, "submitted_at": 0.0,
           "started_at": 0.0, "exit_code": None, "finished_at": None, "reason": why}
    status = {"policy": "typed", "slots": {"total": 2, "used": 2, "free": 0, "lent": 0},
              "queue": [], "pool": {"f": 1, "s": 1}, "holders": {"f": [["j1", 1]],
                                                                 "s": [["j1", 1]]},
              "jobs": [row]}
    lines = frame_lines(status)
    assert any("1 x fast + 1 x slow: mixed types pay" in x for x in lines), lines
