"""A job's ``--types`` holds from its first start: while its speed is unknown the ``typed``
policy measures it on an allowed type (it waits when none is free), and never moves it to a
type outside its list.  Pure: the policy on small snapshots (the newcomer's report: ``--types
t4`` started on the a100 host "to measure it")."""
from __future__ import annotations

from launcher.cluster.choice import Goal
from launcher.cluster.policies.typed import TypedPolicy
from launcher.cluster.policy import JobView, Snapshot, check_allocation


class _Terms:
    def __init__(self, gpu_type, price):
        self.gpu_type, self.price, self.spot = gpu_type, price, False


HOSTS = {"a1": _Terms("a100", 2.93), "t1": _Terms("t4", 0.35)}


def _round(pool, job):
    policy = TypedPolicy()
    snap = Snapshot(1e9, pool, (job,), hosts={h: HOSTS[h] for h in pool})
    alloc = policy.allocate(snap)
    check_allocation(snap, alloc)
    return alloc, policy


def _goal(types):
    return Goal("cost", 15360, deadline_at=1e9 + 600, types=tuple(types)).as_dict()


def test_a_job_of_unknown_speed_is_measured_only_on_its_allowed_types():
    # a100 has more free slots: without --types the job would measure there
    pool = {"a1": 2, "t1": 1}
    for types, host, name in ((("t4",), "t1", "t4"), (("a100",), "a1", "a100")):
        alloc, policy = _round(pool, JobView("j1", 1.0, 1, 1, 1, goal=_goal(types)))
        assert alloc == {"j1": {host: 1}}, (types, alloc)
        assert f"1 x {name} on demand to measure it" in policy.explain("j1")
    # no slot of its type free: it waits, and says for what
    alloc, policy = _round({"a1": 2}, JobView("j1", 1.0, 1, 1, 1, goal=_goal(("t4",))))
    assert alloc == {}, alloc
    assert "waits for slots of one type among t4" in policy.explain("j1")


def test_a_running_job_is_never_moved_outside_its_types():
    speed = lambda t, n: (1000.0 if t == "a100" else 10.0) * n  # a100 100x faster
    j = JobView("j1", 1.0, 1, 1, 1, started=True, allocation={"t1": 1}, goal=_goal(("t4",)),
                speed_of=speed)
    alloc, _ = _round({"a1": 1, "t1": 1}, j)
    assert alloc == {"j1": {"t1": 1}}, alloc


def test_a_revoked_job_is_given_room_only_on_its_types():
    # j1 (--types t4) revoked; the only free slot is an a100's, and a donor could lend one
    # a100 slot or one t4 slot: j1 gets the t4 slot, never the a100 ones
    hosts = dict(HOSTS, a2=_Terms("a100", 2.93))
    donor = JobView("d", 0.5, 2, 1, 2, started=True, allocation={"t1": 1, "a2": 1})
    j1 = JobView("j1", 1.0, 1, 1, 1, started=True, displaced=1, goal=_goal(("t4",)))
    policy = TypedPolicy()
    snap = Snapshot(1e9, {"a1": 1, "a2": 1, "t1": 1}, (donor, j1), hosts=hosts)
    alloc = policy.allocate(snap)
    check_allocation(snap, alloc)
    assert alloc["j1"] == {"t1": 1} and "t1" not in alloc["d"], alloc


def test_a_waiting_reason_counts_only_slots_of_the_jobs_types():
    """The newcomer's report: ``needs 2 slots, 2 free`` beside ``waits 12 s for 2 x a100``
    (the free slots were t4's), and ``suspended to its checkpoint: needs 1 slot, 2 free`` for
    a ``--types t4`` job.  A waiting reason counts the slots of the job's types only."""
    from launcher.cluster import reasons
    pool = {"a1": 2, "t1": 2}
    busy = JobView("b", 0.5, 2, 2, 2, started=True, allocation={"a1": 2})
    wants_a100 = JobView("j1", 1.0, 2, 2, 2, goal=_goal(("a100",)))
    snap = Snapshot(1e9, pool, (busy, wants_a100), hosts={h: HOSTS[h] for h in pool})
    why = reasons.waiting(snap, {"b": {"a1": 2}}, TypedPolicy(), 4)
    assert why["j1"].startswith("needs 2 slots of a100, 0 free;"), why
    suspended = JobView("j2", 1.0, 1, 1, 1, started=True, goal=_goal(("t4",)))
    snap = Snapshot(1e9, pool, (suspended,), hosts={h: HOSTS[h] for h in pool})
    why = reasons.waiting(snap, {}, TypedPolicy(), 4)["j2"]
    assert why.startswith("suspended to its checkpoint: needs 1 slot of t4, 2 free;"), why
    why = reasons.waiting(Snapshot(1e9, {"a1": 2}, (suspended,), hosts=HOSTS), {},
                          TypedPolicy(), 2)["j2"]
    assert why.startswith("suspended to its checkpoint: needs 1 slot of t4, the whole pool "
                          "has 0"), why
