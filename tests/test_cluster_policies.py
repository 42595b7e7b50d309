"""The scheduling policies (fifo, tiresias, edl) and the discrete-event simulator.

Pure functions of a snapshot: no processes here; the live service's tests run them for real.
"""
import random

import pytest

from launcher.cluster.policies import make_policy
from launcher.cluster.policies.edl import EdlPolicy
from launcher.cluster.policies.tiresias import TiresiasPolicy
from launcher.cluster.policy import (JobView, Policy, Snapshot, check_allocation, fill_hosts,
                                     placement_of)
from launcher.cluster.simulator import SimJob, pool_of, simulate

H = 3600.0


def job(id, np=1, lo=None, hi=None, at=0.0, alloc=None, attained=0.0, changed=0.0, tp=None,
        started=None):
    alloc = dict(alloc or {})
    return JobView(id=id, submitted_at=at, np=np, min_np=np if lo is None else lo,
                   max_np=np if hi is None else hi, allocation=alloc, attained_gpu_s=attained,
                   started=bool(alloc) if started is None else started, last_change_at=changed,
                   throughput=tp)


def sizes(alloc):
    return {k: sum(v.values()) for k, v in alloc.items() if v}


# -- make_policy -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,objective", [
    ("lifo", "jct"), ("", "jct"), ("edl", "speed"), ("edl", "efficiency"), ("edl", "efficiency:0"),
    ("edl", "efficiency:1.5"), ("edl", "efficiency:x"), ("edl", "jct:1"), ("fifo", "nope")])
def test_make_policy_rejects_bad_input_in_one_line(name, objective):
    with pytest.raises(ValueError) as e:
        make_policy(name, objective)
    assert "\n" not in str(e.value) and str(e.value)


def test_make_policy_builds_each_policy():
    assert [make_policy(n).name for n in ("fifo", "tiresias", "edl")] == ["fifo", "tiresias", "edl"]
    p = make_policy("edl", "efficiency:0.5")
    assert (p.objective, p.efficiency) == ("efficiency", 0.5)
    assert make_policy("edl", "throughput").objective == "throughput"


# -- bounds on random snapshots --------------------------------------------------------------------
def _random_snapshot(rng):
    pool = {f"h{i}": rng.randint(1, 4) for i in range(rng.randint(1, 5))}
    free = dict(pool)
    jobs = []
    for i in range(rng.randint(0, 8)):
        lo = rng.randint(1, 4)
        np = rng.randint(lo, lo + 3)
        hi = rng.randint(np, np + 4)
        alloc = {}
        if rng.random() < 0.5:
            want = np if rng.random() < 0.5 else rng.randint(lo, hi)
            alloc = fill_hosts(free, want) or {}
        curve = rng.choice([None, lambda pl: sum(pl) ** 0.7, lambda pl: sum(pl) / len(pl)])
        jobs.append(job(f"j{i}", np, lo, hi, at=float(i), alloc=alloc,
                        attained=rng.choice([0.0, 20 * H]), changed=rng.choice([0.0, 950.0]),
                        tp=curve, started=bool(alloc) or rng.random() < 0.3))
    return Snapshot(now=1000.0, pool=pool, jobs=tuple(jobs), change_cost_s=rng.choice([0.5, 30.0]))


@pytest.mark.parametrize("name,objective", [("fifo", "jct"), ("tiresias", "jct"), ("edl", "jct"),
                                            ("edl", "throughput"), ("edl", "efficiency:0.3")])
def test_every_policy_keeps_the_bounds_on_random_snapshots(name, objective):
    rng = random.Random(28)
    pol = make_policy(name, objective)
    for _ in range(300):
        snap = _random_snapshot(rng)
        alloc = pol.allocate(snap)
        check_allocation(snap, alloc)                    # no slot twice, min/max, pool hosts
        assert alloc == pol.allocate(snap)               # deterministic
        if name != "edl":                                # static: exactly the requested size
            for j in snap.jobs:
                assert sizes(alloc).get(j.id, j.np) == j.np


# -- fifo ------------------------------------------------------------------------------------------
def test_fifo_blocks_behind_the_head_of_the_queue():
    snap = Snapshot(now=10.0, pool={"a": 2, "b": 2}, jobs=(
        job("running", 3, alloc={"a": 2, "b": 1}), job("head", 2, at=1.0), job("small", 1, at=2.0)))
    assert sizes(make_policy("fifo").allocate(snap)) == {"running": 3}   # "small" would fit
    snap = Snapshot(now=20.0, pool={"a": 2, "b": 2}, jobs=snap.jobs[1:])
    assert sizes(make_policy("fifo").allocate(snap)) == {"head": 2, "small": 1}


# -- tiresias --------------------------------------------------------------------------------------
def test_tiresias_preempts_the_job_with_most_attained_service_and_resumes_it():
    pool = {"a": 4}
    old = job("old", 2, at=0.0, alloc={"a": 2}, attained=20 * H)       # demoted to queue 1
    older = job("older", 2, at=-1.0, alloc={"a": 2}, attained=30 * H)  # queue 1, earlier
    new = job("new", 2, at=5.0)                                         # queue 0
    got = TiresiasPolicy().allocate(Snapshot(now=10.0, pool=pool, jobs=(older, old, new)))
    assert sizes(got) == {"older": 2, "new": 2}      # within a queue: submission order
    suspended = job("old", 2, at=0.0, attained=20 * H, started=True)
    got = TiresiasPolicy().allocate(Snapshot(now=70.0, pool=pool, jobs=(suspended,)))
    assert sizes(got) == {"old": 2}                  # resumes once its slots are free


def test_tiresias_starvation_guard_promotes_a_long_waiting_job():
    waiting = job("waiting", 2, at=0.0, attained=20 * H, started=True, changed=0.0)
    fresh = job("fresh", 2, at=5.0)
    snap = Snapshot(now=1000.0, pool={"a": 2}, jobs=(waiting, fresh))
    assert sizes(TiresiasPolicy().allocate(snap)) == {"fresh": 2}      # Pollux: guard off
    snap = Snapshot(now=20 * H + 1000.0, pool={"a": 2}, jobs=(waiting, fresh))
    assert sizes(TiresiasPolicy(starvation_factor=1.0).allocate(snap)) == {"waiting": 2}


# -- edl -------------------------------------------------------------------------------------------
def linear(pl):
    return 100.0 * sum(pl)


def test_edl_lends_the_spare_and_reclaims_it_for_an_arrival_at_once():
    pool = {"a": 4, "b": 4}
    a = job("a", 2, 1, 8, tp=linear)
    got = EdlPolicy().allocate(Snapshot(now=0.0, pool=pool, jobs=(a,), change_cost_s=0.5))
    assert sizes(got) == {"a": 8}                                      # all of the idle pool lent
    a = job("a", 2, 1, 8, alloc=got["a"], changed=0.0, tp=linear)
    b = job("b", 4, 4, 8, at=10.0, tp=linear)
    got = EdlPolicy().allocate(Snapshot(now=10.0, pool=pool, jobs=(a, b), change_cost_s=0.5))
    check_allocation(Snapshot(now=10.0, pool=pool, jobs=(a, b)), got)
    assert sizes(got)["b"] >= 4 and sizes(got)["a"] >= 1               # a in hold, still reclaimed
    assert len(got["b"]) == 1                                          # compact: one host


def test_edl_suspends_below_min_rather_than_shrinking_past_it():
    pool = {"a": 4}
    a = job("a", 4, 3, 4, alloc={"a": 4}, attained=20 * H, tp=linear)
    b = job("b", 2, 2, 2, at=10.0, tp=linear)
    got = EdlPolicy().allocate(Snapshot(now=10.0, pool=pool, jobs=(a, b), change_cost_s=0.5))
    assert sizes(got) == {"b": 2}                                      # a: suspended, not at 2


def test_edl_hold_time_keeps_a_recent_size():
    pool = {"a": 4}
    a = job("a", 1, 1, 4, alloc={"a": 3}, changed=100.0, tp=linear)
    b = job("b", 1, 1, 4, alloc={"a": 1}, changed=100.0, tp=linear)
    pol = EdlPolicy(hold_s=300.0)
    snap = Snapshot(now=200.0, pool=pool, jobs=(a, b), change_cost_s=0.5)
    assert sizes(pol.allocate(snap)) == {"a": 3, "b": 1}               # within the hold: kept
    snap = Snapshot(now=500.0, pool=pool, jobs=(a, b), change_cost_s=0.5)
    assert sizes(pol.allocate(snap)) == {"a": 2, "b": 2}  # after it: b's 2nd slot adds +100 %
    assert sizes(EdlPolicy("throughput", hold_s=300.0).allocate(snap)) == {"a": 3, "b": 1}


def test_edl_starts_a_queued_job_that_fits_the_free_slots_while_running_jobs_are_held():
    """The hold keeps a running job from being resized twice; it never keeps waiting work off
    free slots (issue 39: free slots idle behind the hold while a job that fits waited).  The
    arrival starts in the round it is seen, on the free host, without touching the held jobs."""
    pool = {"a": 4, "b": 4}
    pol = EdlPolicy(hold_s=300.0)
    a = job("a", 2, 1, 8, alloc={"a": 4}, changed=190.0, tp=linear)    # grew 10 s ago: held
    b = job("b", 2, 2, 4, at=150.0, tp=linear)
    got = pol.allocate(Snapshot(now=200.0, pool=pool, jobs=(a, b), change_cost_s=0.5))
    assert got["a"] == {"a": 4} and got["b"] == {"b": 4}               # b on the free host
    c = job("c", 1, 1, 1, at=160.0)                                    # a static job fits too
    got = pol.allocate(Snapshot(now=200.0, pool=pool, jobs=(a, b, c), change_cost_s=0.5))
    assert got["a"] == {"a": 4} and sizes(got)["c"] == 1 and sizes(got)["b"] >= 2
    rng = random.Random(39)                  # no round leaves idle slots a waiting job fits
    for _ in range(300):
        snap = _random_snapshot(rng)
        for p in (pol, EdlPolicy(), EdlPolicy("throughput", hold_s=2.0)):
            got = sizes(p.allocate(snap))
            idle = sum(snap.pool.values()) - sum(got.values())
            assert not [j.id for j in snap.jobs if j.id not in got and j.min_np <= idle], snap


def test_edl_does_not_oscillate_in_a_simulation():
    # two elastic jobs sharing 8 slots; each resize is costed; the allocation settles
    def curve(pl):
        return 1.0 / (0.1 + 1.0 / sum(pl) + 0.05 * (len(pl) - 1))
    jobs = [SimJob("a", 0.0, curve, 20000, 2, 1, 8), SimJob("b", 100.0, curve, 20000, 2, 1, 8)]
    res = simulate(jobs, {"h0": 4, "h1": 4}, EdlPolicy(), restart_cost_s=5.0, change_cost_s=0.5,
                   stop_free=True, join_s=2.0, timeline=True)
    assert res.jobs["a"].changes <= 4 and res.jobs["b"].changes <= 3
    sizes_seen = [tuple(sorted(t[1].items())) for t in res.timeline]
    flips = sum(1 for x, y, z in zip(sizes_seen, sizes_seen[1:], sizes_seen[2:]) if x == z != y)
    assert flips == 0


def test_edl_efficiency_refuses_a_worker_that_adds_too_little():
    curve = {1: 100.0, 2: 150.0, 3: 160.0, 4: 165.0}

    def tp(pl):
        return curve[sum(pl)]
    snap = Snapshot(now=0.0, pool={"a": 4}, jobs=(job("j", 1, 1, 4, tp=tp),), change_cost_s=0.5)
    assert sizes(EdlPolicy("efficiency", 0.6).allocate(snap)) == {"j": 1}   # 2nd adds 0.5
    assert sizes(EdlPolicy("efficiency", 0.4).allocate(snap)) == {"j": 2}   # 3rd adds 0.1
    assert sizes(EdlPolicy("jct").allocate(snap)) == {"j": 4}


def test_edl_makes_no_change_that_does_not_pay_back_its_cost():
    def tp(pl):
        return 100.0 + sum(pl)                      # +1 % per slot
    a = job("a", 1, 1, 4, alloc={"a": 1}, changed=0.0, tp=tp)
    snap = Snapshot(now=1000.0, pool={"a": 4}, jobs=(a,), change_cost_s=30.0)
    assert sizes(EdlPolicy().allocate(snap)) == {"a": 1}                   # 30 s for +1 %: no
    snap = Snapshot(now=1000.0, pool={"a": 4}, jobs=(a,), change_cost_s=0.1)
    assert sizes(EdlPolicy().allocate(snap)) == {"a": 4}


# -- the simulator, against hand-computed results ---------------------------------------------------
def test_simulator_fifo_two_jobs_exact_jcts():
    jobs = [SimJob("a", 0.0, lambda pl: 1.0, 100, 2), SimJob("b", 0.0, lambda pl: 1.0, 50, 2)]
    res = simulate(jobs, {"h": 2}, make_policy("fifo"), restart_cost_s=10.0)
    # a: round 0, 10 s start, 100 steps -> 110; b: next round 120, +10, +50 -> 180
    assert (res.jobs["a"].jct_s, res.jobs["b"].jct_s) == (110.0, 180.0)
    assert res.avg_jct_s == 145.0 and res.makespan_s == 180.0
    assert res.utilisation == pytest.approx((2 * 110 + 2 * 60) / (2 * 180))
    res = simulate(jobs, {"h": 2}, make_policy("fifo"), restart_cost_s=10.0, event_rounds=True)
    assert res.jobs["b"].jct_s == 170.0                                # starts at a's end


def test_simulator_end_s_holds_the_slots_past_the_last_step():
    jobs = [SimJob("a", 0.0, lambda pl: 1.0, 100, 2), SimJob("b", 0.0, lambda pl: 1.0, 50, 2)]
    res = simulate(jobs, {"h": 2}, make_policy("fifo"), restart_cost_s=10.0, end_s=4.0,
                   event_rounds=True)
    # a: 10 s start, 100 steps, 4 s end -> 114; b starts then: +10, +50, +4 -> 178
    assert (res.jobs["a"].jct_s, res.jobs["b"].jct_s) == (114.0, 178.0)
    assert res.jobs["a"].gpu_s == pytest.approx(2 * 114.0)


@pytest.mark.parametrize("a_steps,stop_s,a_jct,b_jct,preempted", [
    (100, 0.0, 140.0, 20.0, 1),   # preempted at b's arrival (25 s), the slot b's at once
    (100, 5.0, 140.0, 25.0, 1),   # it trains on to 30 s holding its slot; b starts then
    (18, 5.0, 28.0, 23.0, 0)])    # it finishes within the stop (28 s): done, not suspended
def test_simulator_stop_s_a_preempted_job_trains_on_and_holds_its_slots(a_steps, stop_s, a_jct,
                                                                        b_jct, preempted):
    from launcher.cluster.policies.tiresias import TiresiasPolicy
    jobs = [SimJob("a", 0.0, lambda pl: 1.0, a_steps, 1), SimJob("b", 25.0, lambda pl: 1.0, 10, 1)]
    res = simulate(jobs, {"h": 1}, TiresiasPolicy((20.0,)), restart_cost_s=10.0,
                   stop_s=stop_s, event_rounds=True, round_s=1000.0)
    assert (res.jobs["a"].jct_s, res.jobs["b"].jct_s) == (a_jct, b_jct)
    assert res.jobs["a"].preemptions == preempted


class Scripted(Policy):
    """Allocations given by time (a test double for the cost model, not for a policy)."""
    name = "scripted"

    def __init__(self, plan):
        self.plan = plan

    def allocate(self, snap):
        at = max(t for t in self.plan if t <= snap.now)
        return self.plan[at]


@pytest.mark.parametrize("stop_free,expected", [(True, 138.5), (False, 165.0)])
def test_simulator_costs_a_grow_as_a_stop_free_switch_or_a_restart(stop_free, expected):
    j = SimJob("j", 0.0, lambda pl: 1.0 / sum(pl), 200, 1, 1, 2)
    plan = {0.0: {"j": {"h": 1}}, 60.0: {"j": {"h": 2}}}
    res = simulate([j], {"h": 2}, Scripted(plan), restart_cost_s=10.0,
                   change_cost_s=1.0 if stop_free else 30.0, stop_free=stop_free, join_s=5.0)
    # 0-10 start; 10-60: 50 steps.  stop-free: 60-65 joiner builds (5 more), 65-66 stall,
    # then 2/s for 145 -> 138.5.  restart: 60-90 stall, then 2/s for 150 -> 165.
    assert res.jobs["j"].jct_s == pytest.approx(expected)


def test_simulator_costs_a_shrink_as_the_switch_stall():
    j = SimJob("j", 0.0, lambda pl: 1.0 / sum(pl), 200, 2, 1, 2)
    plan = {0.0: {"j": {"h": 2}}, 60.0: {"j": {"h": 1}}}
    res = simulate([j], {"h": 2}, Scripted(plan), restart_cost_s=10.0, change_cost_s=1.0,
                   stop_free=True, join_s=5.0)
    # 0-10 start; 10-60: 100 steps; 60-61 stall; 1/s for 100 -> 161
    assert res.jobs["j"].jct_s == pytest.approx(161.0)


def test_simulator_refuses_a_job_no_policy_can_run():
    with pytest.raises(RuntimeError, match="runs none"):
        simulate([SimJob("big", 0.0, lambda pl: 1.0, 10, 8)], pool_of(1, 4), make_policy("tiresias"))


def test_placement_of_and_pool_of():
    assert placement_of({"a": 1, "b": 3}) == (3, 1)
    assert pool_of(2, 4) == {"n000": 4, "n001": 4}


# -- the published setting ----------------------------------------------------------------------------
def test_tiresias_lands_on_the_published_figure_of_a_workload():
    workload = pytest.importorskip("launcher.cluster.workload")
    try:
        workload.traces_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    res = simulate(workload.sim_jobs(workload.load_workload("0.5", 3)), pool_of(16, 4),
                   make_policy("tiresias"))
    pub = workload.published("tiresias", "0.5")["avgs"]["workload-3"]
    assert abs(res.avg_jct_s / pub - 1) < 0.10
