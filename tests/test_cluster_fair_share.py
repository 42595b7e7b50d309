"""Fair share between users and the per-user quota (launcher/cluster/fair_share.py), through the
policies and the simulator: one user's ten jobs do not starve another's one, the quota holds,
and with one user every policy decides exactly as without users.  Pure Python, about a second."""
import random

import pytest

from launcher.cluster import reasons
from launcher.cluster.fair_share import attained_band, fair_order, slots_per_user
from launcher.cluster.policies import FAIR_SHARE_POLICIES, make_policy
from launcher.cluster.policy import AllocationError, JobView, Snapshot, check_allocation
from launcher.cluster.simulator import SimJob, simulate


def _step(pl):
    return 0.1 / sum(pl) + 0.01


def _ten_and_one(elastic: bool):
    """alice submits ten 2-slot jobs at 0 s, bob one at 10 s; each is 600 s on 2 slots."""
    kw = dict(min_np=1, max_np=4) if elastic else {}
    jobs = [SimJob(f"a{i}", 0.0, _step, 6000, 2, user="alice", elastic=elastic, **kw)
            for i in range(10)]
    jobs.append(SimJob("b0", 10.0, _step, 6000, 2, user="bob", elastic=elastic, **kw))
    return jobs


@pytest.mark.parametrize("policy", FAIR_SHARE_POLICIES)
def test_ten_jobs_of_one_user_do_not_starve_another_users_one(policy):
    elastic = policy in ("edl", "goodput")
    costs = dict(restart_cost_s=30.0, change_cost_s=30.0)
    fair = simulate(_ten_and_one(elastic), {"h0": 4}, make_policy(policy), **costs)
    unfair = simulate(_ten_and_one(elastic), {"h0": 4}, make_policy(policy, fair_share=False),
                      **costs)
    # bob's job starts right after the jobs of alice's that held the pool when it came: fifo
    # (no preemption) when the first of them ends, third; tiresias and edl at the first round
    # after it arrived, preempting or shrinking one of alice's
    if policy == "fifo":
        assert fair.jobs["b0"].started_at == sorted(j.started_at for j in fair.jobs.values())[2]
    else:
        assert fair.jobs["b0"].started_at == 60.0
    assert fair.jobs["b0"].jct_s < 1000.0
    # without fair share it waits behind alice's jobs (fifo and tiresias: all ten; edl: lent
    # slots and alice's earlier jobs first)
    assert unfair.jobs["b0"].jct_s > 2 * fair.jobs["b0"].jct_s
    assert all(fair.jobs[f"a{i}"].finished_at is not None for i in range(10))


def _view(id, user, at, np=2, **kw):
    return JobView(id=id, submitted_at=at, np=np, min_np=np, max_np=np, user=user, **kw)


def test_fair_order_interleaves_users_by_slots_ahead_then_attained_band():
    jobs = tuple([_view(f"a{i}", "alice", float(i)) for i in range(4)]
                 + [_view("b0", "bob", 10.0), _view("c0", "carol", 20.0, np=4),
                    _view("c1", "carol", 21.0)])
    snap = Snapshot(now=100.0, pool={"h": 8}, jobs=jobs,
                    user_attained_gpu_s={"alice": 3600.0 * 10, "bob": 0.0})
    order = [j.id for j in fair_order(snap, lambda j: (j.submitted_at, j.id), lambda j: j.np)]
    # slots ahead 0: bob and carol (band 0) before alice (10 GPU-h: band 3); then slots ahead 2:
    # alice's second; carol's second has 4 ahead, with alice's third
    assert order == ["b0", "c0", "a0", "a1", "c1", "a2", "a3"]
    assert [attained_band(h * 3600.0) for h in (0, 0.99, 1, 2.99, 3, 7, 15)] == [0, 0, 1, 1, 2, 3, 4]


@pytest.mark.parametrize("policy", FAIR_SHARE_POLICIES)
def test_user_quota_holds(policy):
    rng = random.Random(7)
    jobs = [SimJob(f"j{i}", rng.uniform(0, 1800), _step, rng.uniform(1000, 8000),
                   rng.choice((1, 2, 4)), user=rng.choice(("alice", "alice", "alice", "bob")),
                   **(dict(min_np=1, max_np=8) if policy in ("edl", "goodput") else {}),
                   elastic=policy in ("edl", "goodput")) for i in range(24)]
    users = {j.id: j.user for j in jobs}
    res = simulate(jobs, {"h0": 4, "h1": 4}, make_policy(policy, user_quota=4),
                   restart_cost_s=5.0, change_cost_s=1.0, stop_free=True, timeline=True)
    most = {}
    for _, slots, _ in res.timeline:
        per = {}
        for job_id, n in slots.items():
            per[users[job_id]] = per.get(users[job_id], 0) + n
        for u, n in per.items():
            most[u] = max(most.get(u, 0), n)
    assert most["alice"] == 4 and most["bob"] <= 4
    assert all(r.finished_at is not None for r in res.jobs.values())


def test_check_allocation_refuses_an_allocation_over_the_quota():
    snap = Snapshot(now=0.0, pool={"h": 8}, jobs=(_view("a0", "alice", 0.0, np=4),
                                                  _view("a1", "alice", 1.0, np=2)))
    alloc = {"a0": {"h": 4}, "a1": {"h": 2}}
    check_allocation(snap, alloc)
    assert slots_per_user(snap, alloc) == {"alice": 6}
    with pytest.raises(AllocationError, match="user alice: 6 slots, over the quota of 5"):
        check_allocation(snap, alloc, user_quota=5)
    with pytest.raises(ValueError, match="user quota"):
        make_policy("tiresias", user_quota=0)
    with pytest.raises(ValueError, match="typed keeps no per-user quota"):
        make_policy("typed", user_quota=4)


def _stream(user_of):
    rng = random.Random(3)
    out = []
    for i in range(30):
        np_ = rng.choice((1, 2, 4, 8))
        out.append(SimJob(f"j{i}", rng.uniform(0, 3600), _step, rng.uniform(2000, 40000), np_,
                          min_np=1, max_np=max(np_, 8), priority=rng.choice((0, 0, 1)),
                          user=user_of(i)))
    return out


@pytest.mark.parametrize("policy", FAIR_SHARE_POLICIES)
def test_one_user_decides_as_without_users(policy):
    costs = dict(restart_cost_s=30.0, change_cost_s=0.5, stop_free=True, join_s=4.0)

    def jcts(policy_obj, user_of):
        res = simulate(_stream(user_of), {"h0": 4, "h1": 4, "h2": 2}, policy_obj, **costs)
        return {k: (j.started_at, j.finished_at, j.changes) for k, j in res.jobs.items()}

    base = jcts(make_policy(policy, fair_share=False), lambda i: "")
    assert jcts(make_policy(policy), lambda i: "") == base          # the default user
    assert jcts(make_policy(policy), lambda i: "alice") == base     # one named user
    # and the stream is one where users do change things (the test can fail)
    assert jcts(make_policy(policy), lambda i: ("alice", "bob")[i % 7 == 0]) != base


def test_edl_lends_spare_slots_fair_between_users():
    """alice's three elastic jobs and bob's one on 8 slots: bob's job is lent up to an equal
    share (4 slots), alice's three share the other 4; without fair share bob's gets 2."""
    jobs = tuple(JobView(id=f"a{i}", submitted_at=float(i), np=1, min_np=1, max_np=8,
                         user="alice", throughput=lambda pl: sum(pl) ** 0.9) for i in range(3))
    jobs += (JobView(id="b0", submitted_at=5.0, np=1, min_np=1, max_np=8, user="bob",
                     throughput=lambda pl: sum(pl) ** 0.9),)
    snap = Snapshot(now=100.0, pool={"h0": 4, "h1": 4}, jobs=jobs)
    fair = make_policy("edl").allocate(snap)
    check_allocation(snap, fair)
    assert slots_per_user(snap, fair) == {"alice": 4, "bob": 4}
    unfair = make_policy("edl", fair_share=False).allocate(snap)
    assert slots_per_user(snap, unfair)["bob"] < 4


def test_a_job_held_at_its_users_quota_says_so():
    snap = Snapshot(now=0.0, pool={"h": 8}, jobs=(_view("a0", "alice", 0.0, np=4),
                                                  _view("a1", "alice", 1.0, np=2),
                                                  _view("a2", "alice", 2.0, np=6),
                                                  _view("b0", "bob", 3.0, np=2)))
    policy = make_policy("tiresias", user_quota=5)
    alloc = policy.allocate(snap)
    check_allocation(snap, alloc, policy.user_quota)
    assert slots_per_user(snap, alloc) == {"alice": 4, "bob": 2}
    why = reasons.waiting(snap, alloc, policy, 8)
    assert why == {"a1": "needs 2 slots; its user alice holds 4 of the quota of 5 slots per user",
                   "a2": "needs 6 slots, over the quota of 5 slots per user: never starts under "
                         "this quota"}


@pytest.mark.parametrize("policy", FAIR_SHARE_POLICIES)
def test_serve_no_fair_share_reaches_the_policy(policy):
    """``serve --no-fair-share`` turns fair share off in the policy serve builds (on by
    default), the other policy flags still applied; no service started."""
    from launcher.cluster.cli import build_parser, policy_from_args
    base = ["serve", "-H", "localhost:2", "--state-dir", "/nonexistent", "--policy", policy,
            "--user-quota", "3"]
    on = policy_from_args(build_parser().parse_args(base))
    off = policy_from_args(build_parser().parse_args(base + ["--no-fair-share"]))
    assert (on.fair_share, off.fair_share) == (True, False)
    assert off.user_quota == 3
    # and it decides as make_policy(..., fair_share=False): alice's four jobs, then bob's one
    snap = Snapshot(now=10.0, pool={"h": 2}, jobs=tuple(
        [_view(f"a{i}", "alice", float(i), np=1) for i in range(4)]
        + [_view("b0", "bob", 5.0, np=1)]))
    assert on.allocate(snap).get("b0") and not off.allocate(snap).get("b0")
