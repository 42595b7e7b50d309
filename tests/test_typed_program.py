"""The live ``typed`` policy decides its jobs without an objective with the program the
simulator's ``hetero_goodput`` solves (:mod:`launcher.cluster.round_program`), valued by the
same function (Sia's objective by default: the same choices on random rounds): a job gaining
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


# ---- Sia's objective, shared with the simulator (issue 42, round 6) ----------------------------

SIA_LAYOUT = {"t4": (6, 4), "rtx": (3, 8), "a100": (2, 8)}   # hetero_sim.CLUSTER's


def _sia_hosts():
    hosts, pool = {}, {}
    for t, (nodes, per) in SIA_LAYOUT.items():
        for k in range(nodes):
            hosts[f"{t}-{k}"], pool[f"{t}-{k}"] = _Terms(t), per
    return hosts, pool


def _live_round(jobs, objective="sia", pool=None, hosts=None, now=1000.0):
    if pool is None:
        hosts, pool = _sia_hosts()
    policy = TypedPolicy(objective=objective)
    snap = Snapshot(now, pool, tuple(jobs), hosts=hosts)
    alloc = policy.allocate(snap)
    check_allocation(snap, alloc)
    return {j: (hosts[next(iter(a))].gpu_type, sum(a.values())) for j, a in alloc.items()}


def test_the_live_policy_chooses_as_the_simulators_on_random_rounds():
    """Jobs without an objective, waiting, on Sia's cluster: the live ``typed`` (default, Sia's
    objective) and the simulator's ``hetero_goodput.choose`` (default, Sia's) give every job the
    same (type, GPUs).  Sizes 1-4 (the live jobs' --np 4; the simulator's profile has no goodput
    above), speeds concave in n with type gains large enough that no mixed ring pays."""
    import random
    from launcher.cluster.hetero_sim import Costs, SimJobState
    from launcher.cluster.policies.hetero_goodput import choose
    from launcher.cluster.round_program import sia_values

    class PM:
        end, bounds = 1000.0, [0.0, 1000.0]

        def epoch(self, progress):
            return 0

    for seed in range(4):
        rng = random.Random(seed)
        speeds = {}
        for i in range(24):   # 24 jobs x up to 4 GPUs on 64: contended
            rtx = rng.uniform(2.1, 3.0)
            gain = {"t4": 1.0, "rtx": rtx, "a100": rtx * rng.uniform(2.1, 3.0)}
            speeds[f"j{i:02d}"] = (gain, rng.uniform(0.3, 0.9))

        def speed_of(name):
            gain, e = speeds[name]
            return lambda t, n: gain[t] * 100 * n ** e if 1 <= n <= 4 else 0.0

        class Prof:
            progress = {name: PM() for name in speeds}

            def best(self, app, t, n, e):
                return (speed_of(app)(t, n), 64)

        sim = choose([SimJobState(n, n, 0.0, 1, 64) for n in speeds], Prof(),
                     Costs("stop_free", 5.0, 0.5, 5.0))
        live = _live_round([JobView(n, float(i), 4, 1, 4, speed_of=speed_of(n))
                            for i, n in enumerate(speeds)])
        if live != sim:  # Sia rounds A to 2 decimals: equal objectives are as good
            def total(got):
                out = 0.0
                for name, (t, n) in got.items():
                    cfg = [(t2, n2) for t2 in SIA_LAYOUT for n2 in range(1, 5)]
                    row, _ = sia_values([speed_of(name)(*c) for c in cfg])
                    out += row[cfg.index((t, n))]
                return out
            assert abs(total(live) - total(sim)) < 1e-6, (seed, live, sim)
        assert len(live) == len(sim) and sum(n for _, n in live.values()) == \
            sum(n for _, n in sim.values()), (seed, live, sim)


def test_the_live_policy_splits_sixteen_a100s_between_a_short_and_a_long_job():
    """test_hetero_policy's split example, live: two a100 hosts of 8, speed sqrt(n) (a live
    job's remaining work is unknown: short and long look alike).  Sia's objective (the default)
    gives each 8.  Where the jobs differ in how they scale (one linear, one nearly flat), the
    old ``remaining`` (still selectable) gives the linear one all 16 and the other waits; Sia's
    concave speedups still run both."""
    hosts = {"a": _Terms("a100"), "b": _Terms("a100")}
    pool = {"a": 8, "b": 8}
    jobs = [JobView(n, float(i), 16, 1, 16, speed_of=lambda t, n: n ** 0.5)
            for i, n in enumerate(("short", "long"))]
    assert _live_round(jobs, pool=pool, hosts=hosts) == {"short": ("a100", 8),
                                                         "long": ("a100", 8)}
    jobs = [JobView("linear", 0.0, 16, 1, 16, speed_of=lambda t, n: float(n)),
            JobView("flat", 1.0, 16, 1, 16, speed_of=lambda t, n: n ** 0.05)]
    assert _live_round(jobs, pool=pool, hosts=hosts, objective="remaining") == {
        "linear": ("a100", 16)}
    got = _live_round(jobs, pool=pool, hosts=hosts)
    assert got["linear"] == ("a100", 8) and got["flat"][1] >= 7, got  # 7 and 8: equal A


def test_typed_objective_is_validated_in_one_line(tmp_path, capsys):
    import pytest
    from launcher.cluster.cli import main
    state = tmp_path / "state"
    rc = main(["serve", "-H", "localhost:1", "--state-dir", str(state), "--policy", "typed",
               "--objective", "fastest"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "sia, remaining" in err, (rc, err)
    assert not state.exists()                                 # refused before anything is made
    from launcher.cluster.policies import make_policy
    assert TypedPolicy().objective == "sia"
    assert make_policy("typed").objective == "sia"          # serve's default --objective jct
    assert make_policy("typed", "remaining").objective == "remaining"
    for bad in ("fastest", "throughput"):
        with pytest.raises(ValueError, match="sia, remaining"):
            make_policy("typed", bad)
        with pytest.raises(ValueError):
            TypedPolicy(objective=bad)
