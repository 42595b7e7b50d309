"""The live ``typed`` policy decides its jobs without an objective with the program the
simulator's ``hetero_goodput`` solves (:mod:`launcher.cluster.round_program`): a job gaining
more from the fast type gets it first, a running job moves stop-free to a faster type only for
``move_gain`` or more, a lender grows back when a slot frees, and no running job is ever
stopped for an arrival.  Pure: the policy on small snapshots."""
from __future__ import annotations

from launcher.cluster.policies.typed import TypedPolicy
from launcher.cluster.policy import JobView, Snapshot, check_allocation


class _Terms:
    def __init__(self, gpu_type):
        self.gpu_type, self.price, self.spot = gpu_type, 1.0, False


HOSTS = {"f1": _Terms("fast"), "s1": _Terms("slow"), "s2": _Terms("slow")}


def _speed(gain):
    return lambda t, n: (gain if t == "fast" else 1.0) * 100 * n


def _round(pool, *jobs, now=1000.0):
    policy = TypedPolicy()
    snap = Snapshot(now, pool, tuple(jobs), hosts={h: HOSTS[h] for h in pool})
    alloc = policy.allocate(snap)
    check_allocation(snap, alloc)
    return alloc, policy


def test_a_running_job_moves_to_the_faster_type_only_for_a_gain_of_a_quarter_or_more():
    for gain, moves in ((3.0, True), (1.1, False)):
        j = JobView("j1", 1.0, 1, 1, 1, started=True, allocation={"s1": 1},
                    speed_of=_speed(gain))
        alloc, policy = _round({"f1": 1, "s1": 1}, j)
        assert alloc == ({"j1": {"f1": 1}} if moves else {"j1": {"s1": 1}}), (gain, alloc)
        if moves:
            assert "moves stop-free to 1 x fast" in policy.explain("j1")
    # held less than hold_s ago: stays whatever it gains
    j = JobView("j1", 1.0, 1, 1, 1, started=True, allocation={"s1": 1}, speed_of=_speed(3.0),
                last_change_at=995.0)
    assert _round({"f1": 1, "s1": 1}, j)[0] == {"j1": {"s1": 1}}


def test_a_lender_grows_back_and_a_running_job_is_never_stopped_for_an_arrival():
    lender = JobView("j1", 1.0, 2, 1, 2, started=True, allocation={"s1": 1})
    alloc, _ = _round({"s1": 2}, lender)
    assert alloc == {"j1": {"s1": 2}}, alloc                 # the slot it lent came back
    running = JobView("j1", 1.0, 2, 2, 2, started=True, allocation={"s1": 2},
                      speed_of=_speed(1.0))
    arrivals = [JobView(f"j{i}", float(i), 1, 1, 1, speed_of=_speed(3.0)) for i in (2, 3)]
    alloc, _ = _round({"s1": 2, "f1": 1}, running, *arrivals)
    assert alloc["j1"] == {"s1": 2}, alloc                   # kept, not preempted
    assert alloc["j2"] == {"f1": 1} and "j3" not in alloc, alloc  # one fast slot: first come


def test_the_job_gaining_more_from_the_fast_type_gets_it_first():
    a = JobView("a", 1.0, 1, 1, 1, speed_of=_speed(1.5))
    b = JobView("b", 2.0, 1, 1, 1, speed_of=_speed(3.0))
    alloc, _ = _round({"f1": 1, "s1": 1}, a, b)
    assert alloc == {"a": {"s1": 1}, "b": {"f1": 1}}, alloc
