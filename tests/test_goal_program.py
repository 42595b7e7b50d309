"""Jobs with an objective in the round's program (:mod:`launcher.cluster.goal_program`, issue
42): a job whose chosen type is busy waits for it when waiting is predicted to finish sooner
(``time``) or cheaper within its deadline (``cost``), and takes what is free otherwise; it mixes
types where the mixed ring pays; a start is predicted at the number of workers starting at once.
Pure: the policy on small snapshots."""
from __future__ import annotations

import math

from launcher.cluster import top
from launcher.cluster.choice import Goal, Offer
from launcher.cluster.goal_program import config_prediction, free_after, goal_values
from launcher.cluster.policies.typed import TypedPolicy
from launcher.cluster.policy import JobView, Snapshot, check_allocation

NOW = 1e9


class _Terms:
    def __init__(self, gpu_type, price, spot=False):
        self.gpu_type, self.price, self.spot = gpu_type, price, spot
        self.revocations_per_h, self.startup_s = 0.0, 20.0


HOSTS = {"f1": _Terms("fast", 3.0), "f2": _Terms("fast", 3.0),
         "s1": _Terms("slow", 1.0, True), "s2": _Terms("slow", 1.0, True)}


def _speed(fast, slow):
    return lambda t, n: {"fast": fast, "slow": slow}[t] * n


def _goal(objective, samples, done=0.0, **kw):
    return dict(Goal(objective, samples, **kw).as_dict(), done_samples=done)


def _round(pool, *jobs, start_s=0.0):
    policy = TypedPolicy(start_s=start_s, switch_s=0.5)
    snap = Snapshot(NOW, pool, tuple(jobs), hosts={h: HOSTS[h] for h in pool})
    alloc = policy.allocate(snap)
    check_allocation(snap, alloc)
    return alloc, policy


def _running_on(host, left_s, speed=100.0):
    """A job with an objective on ``host`` whose remaining samples take ``left_s`` seconds."""
    return JobView("r", 0.0, 1, 1, 1, started=True, allocation={host: 1},
                   goal=_goal("time", 10 * speed * left_s, done=9 * speed * left_s),
                   speed_of=lambda t, n: speed * n, last_change_at=NOW - 100)


def test_a_time_job_waits_for_its_busy_type_only_when_that_finishes_sooner():
    # 2000 samples: 20 s on fast (100/s), 100 s on slow (20/s); fast is busy
    for left_s, waits in ((10.0, True), (500.0, False)):
        j = JobView("j", 1.0, 1, 1, 1, goal=_goal("time", 2000), speed_of=_speed(100, 20))
        alloc, policy = _round({"f1": 1, "s1": 1}, _running_on("f1", left_s), j)
        if waits:  # 10 s + 20 s < 100 s: waits, and says what for
            assert "j" not in alloc, alloc
            c = policy.choices["j"]
            assert (c.gpu_type, c.n) == ("fast", 1) and math.isclose(c.wait_s, 10.0)
            assert math.isclose(c.time_s, 30.0)
            assert "waits 10 s for 1 x fast" in policy.explain("j")
            assert top._config(c.as_dict()) == "waits 10 s for 1 x fast"
        else:      # 500 s + 20 s > 100 s: takes the free slow slot now
            assert alloc["j"] == {"s1": 1}, alloc
            assert policy.choices["j"].gpu_type == "slow" and not policy.choices["j"].wait_s


def test_a_cost_job_waits_for_the_cheaper_type_only_within_its_deadline():
    # cheap slow (spot, $1/GPU-h) busy for 20 s; fast ($3) free; 2000 samples: slow 100 s
    # ($0.028), fast 50 s ($0.042); waiting: 20 + 100 = 120 s, two thirds of the cost
    for deadline_s, waits in ((300.0, True), (60.0, False)):
        j = JobView("j", 1.0, 1, 1, 1, speed_of=_speed(40, 20),
                    goal=_goal("cost", 2000, deadline_at=NOW + deadline_s))
        alloc, policy = _round({"f1": 1, "s1": 1}, _running_on("s1", 20.0), j)
        if waits:
            assert "j" not in alloc and policy.choices["j"].gpu_type == "slow", alloc
            assert policy.choices["j"].fits and math.isclose(policy.choices["j"].time_s, 120)
        else:  # 120 s misses the 60 s deadline: the fast slot now (50 s)
            assert alloc["j"] == {"f1": 1} and policy.choices["j"].fits, alloc


def test_an_objective_job_mixes_types_where_the_ring_pays():
    # 1 fast + 1 slow free; time, no budget.  slow at 70/s: the ring of two runs at 140 > 100
    # (one fast alone): mixed; at 40/s: 80 < 100, one fast alone
    for slow, mixed in ((70.0, True), (40.0, False)):
        j = JobView("j", 1.0, 2, 1, 2, goal=_goal("time", 14_000), speed_of=_speed(100, slow))
        alloc, policy = _round({"f1": 1, "s1": 1}, j)
        c = policy.choices["j"]
        if mixed:
            assert alloc["j"] == {"f1": 1, "s1": 1}, alloc
            assert c.n == 2 and c.label == "1 x fast + 1 x slow spot"
            assert math.isclose(c.time_s, 14_000 / 140)
            assert math.isclose(c.cost_usd, (3.0 + 1.0) * c.time_s / 3600)
            assert top._config(c.as_dict()) == "1 x fast + 1 x slow spot"
        else:
            assert alloc["j"] == {"f1": 1} and c.label == "1 x fast", alloc


def test_a_start_is_predicted_at_the_workers_starting_at_once():
    # the job's start: 5 s for one worker alone, 9 s for two at once, 20 s for four
    start = {"fast": {"1": 5.0, "2": 9.0, "4": 20.0}, "slow": {"1": 5.0, "2": 9.0, "4": 20.0}}
    jobs = [JobView(f"j{i}", float(i), 1, 1, 1, speed_of=_speed(100, 100),
                    goal=dict(_goal("time", 1000), start_s=start)) for i in (1, 2)]
    alloc, policy = _round({"f1": 1, "s1": 1}, *jobs)
    assert set(alloc) == {"j1", "j2"}
    assert [math.isclose(policy.choices[j].time_s, 10 + 9) for j in ("j1", "j2")] == [True] * 2
    alone, policy = _round({"f1": 1, "s1": 1}, jobs[0])
    assert math.isclose(policy.choices["j1"].time_s, 10 + 5)
    # a job still starting (no sample yet, changed 2 s ago) counts: 1 + 1 at once
    busy = JobView("b", 0.0, 1, 1, 1, started=True, allocation={"f1": 1}, last_change_at=NOW - 2,
                   speed_of=_speed(100, 100), goal=dict(_goal("time", 1000), start_s=start))
    _, policy = _round({"f1": 1, "s1": 1}, busy, jobs[0])
    assert math.isclose(policy.choices["j1"].time_s, 10 + 9)
    # the pure pieces: a mixed ring's price and speed; slots freeing in order
    offers = {("fast", False): Offer("fast", 1, 3.0), ("slow", True): Offer("slow", 1, 1.0)}
    p = config_prediction(1000, _speed(100, 50), {("fast", False): 1, ("slow", True): 2}, offers,
                          start=start, starting=1)
    assert p.n == 3 and math.isclose(p.time_s, 1000 / 150 + 20.0)
    assert free_after(2, 1, [(30.0, 1), (10.0, 1)]) == 10.0 and free_after(3, 0, [(5, 1)]) is None


def test_a_config_outside_the_limit_is_taken_only_when_the_ones_within_it_are_not_free():
    g = Goal("time", 1000, budget_usd=1.0)
    offers = {("fast", False): Offer("fast", 1, 3.0), ("slow", True): Offer("slow", 1, 1.0)}
    preds = [config_prediction(1000, _speed(100, 20), {k: 1}, offers) for k in offers]
    vals, best = goal_values(g, NOW, preds, [])
    # both within $1: the value is 1 / T (10 s, 50 s)
    assert best.gpu_type == "fast" and math.isclose(vals[0], 5 * vals[1], rel_tol=1e-4)
    tight = Goal("time", 1000, budget_usd=0.01)  # fast $0.0083 fits, slow $0.0139 does not
    vals, best = goal_values(tight, NOW, preds, [])
    assert best.gpu_type == "fast" and vals[1] < 1e-2 * vals[0]


def test_a_running_objective_job_moves_in_the_program_only_for_a_quarter_or_more():
    # running on slow with 3000 of 4000 samples left; fast free.  fast 3x: 10 s + its start
    # (5 s) against 30 s where it is: moves; fast 1.2x: 25 + 5 s against 30 s: stays
    for gain, moves in ((3.0, True), (1.2, False)):
        j = JobView("j", 1.0, 1, 1, 1, started=True, allocation={"s1": 1},
                    last_change_at=NOW - 100, speed_of=_speed(100 * gain, 100),
                    goal=_goal("time", 4000, done=1000))
        alloc, policy = _round({"f1": 1, "s1": 1}, j, start_s=5.0)
        c = policy.choices["j"]
        if moves:
            assert alloc["j"] == {"f1": 1} and c.gpu_type == "fast", alloc
            assert "moves (" in policy.explain("j") and math.isclose(c.time_s, 15.0)
        else:
            assert alloc["j"] == {"s1": 1} and c.gpu_type == "slow", alloc
            assert c.why.startswith("stays on 1 x slow spot") and math.isclose(c.time_s, 30.0)


def test_a_wait_for_busy_slots_is_bounded_when_they_never_free():
    """A running job's end is a prediction: one that reports no progress (stalled) is predicted
    to end 10 s from now in every round.  The job waiting for its fast slot waits that 10 s plus
    WAIT_SLACK_S, then takes the free slow one (breaker i8: it waited hours beside an idle
    slot)."""
    from launcher.cluster.policies.typed import WAIT_SLACK_S
    policy = TypedPolicy(start_s=0.0, switch_s=0.5)
    j = JobView("j", 1.0, 1, 1, 1, goal=_goal("time", 2000), speed_of=_speed(100, 20))
    for dt, waits in ((0.0, True), (30.0, True), (10.0 + WAIT_SLACK_S + 1.0, False)):
        stalled = JobView("r", 0.0, 1, 1, 1, started=True, allocation={"f1": 1},
                          goal=_goal("time", 10 * 100 * 10, done=9 * 100 * 10),
                          speed_of=lambda t, n: 100 * n, last_change_at=NOW + dt - 100)
        snap = Snapshot(NOW + dt, {"f1": 1, "s1": 1}, (stalled, j),
                        hosts={h: HOSTS[h] for h in ("f1", "s1")})
        alloc = policy.allocate(snap)
        check_allocation(snap, alloc)
        assert ("j" not in alloc) == waits, (dt, alloc, policy.explain("j"))
    assert alloc["j"] == {"s1": 1} and policy.choices["j"].gpu_type == "slow"


def test_one_jobs_speed_that_is_no_number_does_not_fail_the_round():
    """A job's speed model answering NaN (breaker i8: the program's solver refused the whole
    round, every job's, with a ValueError): that job gets nothing from it, the others are
    placed."""
    j = JobView("j", 1.0, 1, 1, 1, goal=_goal("time", 2000), speed_of=lambda t, n: float("nan"))
    k = JobView("k", 2.0, 1, 1, 1, goal=_goal("time", 2000), speed_of=_speed(100, 20))
    alloc, _ = _round({"f1": 1, "s1": 1}, j, k)
    assert alloc.get("k") == {"f1": 1} and "j" not in alloc, alloc


def test_a_job_that_stays_names_only_another_place_as_best_elsewhere():
    """The newcomer's report: ``stays on 2 x a100 on demand (best elsewhere: 2 x a100 on
    demand, ...)``.  "Elsewhere" is another placement, or none is named."""
    for pool, speed in (({"s1": 2}, _speed(100, 100)), ({"f1": 1, "s1": 2}, _speed(120, 100))):
        j = JobView("j", 1.0, 1, 1, 1, started=True, allocation={"s1": 1},
                    last_change_at=NOW - 100, speed_of=speed,
                    goal=_goal("time", 4000, done=1000))
        _, policy = _round(pool, j, start_s=5.0)
        why = policy.choices["j"].why
        assert why == "stays on 1 x slow spot (no better placement elsewhere)", why
