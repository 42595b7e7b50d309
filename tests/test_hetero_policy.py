"""The heterogeneity-aware goodput policy (issue 42 s4) on a tiny stream: a job gaining 3x from an
a100 over a t4 gets an a100 before jobs gaining 1.5x; the default (Sia's objective) shares GPUs
between a short and a long job where the sum of 1 / T gives the short one all of them; moves
only when they pay their stall (``remaining``); the packing keeps partial allocations on one
node."""
from launcher.cluster.hetero_sim import Alloc, Costs, SimJobState, pack, placement, sizes
from launcher.cluster.policies.hetero_goodput import choose, hetero_goodput_policy


class _PM:
    end = 1000.0
    bounds = [0.0, 1000.0]

    def epoch(self, progress):
        return 0


class _Prof:
    """Progress per second 1.0 on a t4 / rtx and ``gain`` on an a100, one GPU only."""

    def __init__(self, gains):
        self.gains = gains
        self.progress = {app: _PM() for app in gains}

    def best(self, app, t, n, e):
        if n != 1:
            return (0.0, 0)
        return (self.gains[app] if t == "a100" else 1.0, 64)


def _jobs(n_slow):
    jobs = [SimJobState("fast", "fast", 0.0, 1, 64)]
    jobs += [SimJobState(f"slow{i}", "slow", 0.0, 1, 64) for i in range(n_slow)]
    return jobs


def test_a100_goes_to_the_larger_gain_first():
    prof = _Prof({"fast": 3.0, "slow": 1.5})
    want = choose(_jobs(16), prof, Costs("stop_free", 5.0, 0.5, 5.0))   # 17 jobs, 16 a100s
    assert want["fast"] == ("a100", 1)
    on_a100 = [k for k, v in want.items() if v[0] == "a100"]
    assert len(on_a100) == 16 and len(want) == 17
    # the one slow job left off the a100s runs on a t4 or an rtx
    assert sum(1 for v in want.values() if v[0] != "a100") == 1


def test_move_only_when_it_pays_its_stall():
    prof = _Prof({"fast": 1.02, "slow": 1.0})
    j = SimJobState("fast", "fast", 0.0, 1, 64, progress=999.0, alloc=Alloc("t4", 1, -1))
    rem = {"objective": "remaining"}
    # 1 unit left: an a100 saves 0.02 s, less than a 50 s restart or a 0.5 s switch: stays
    assert choose([j], prof, Costs("restart"), **rem)["fast"] == ("t4", 1)
    assert choose([j], prof, Costs("stop_free", 5.0, 0.5, 5.0), **rem)["fast"] == ("t4", 1)
    j.progress = 0.0          # 1000 units left: 20 s saved pays a 0.5 s switch, not 50 s
    assert choose([j], prof, Costs("stop_free", 5.0, 0.5, 5.0), **rem)["fast"] == ("a100", 1)
    assert choose([j], prof, Costs("restart"), **rem)["fast"] == ("t4", 1)


def test_pack_partial_on_one_node_whole_nodes_above():
    assert placement("t4", 3) == (3,) and placement("rtx", 16) == (8, 8)
    assert sizes("a100") == [1, 2, 3, 4, 5, 6, 7, 8, 16]
    got = pack([("a", Alloc("a100", 16)), ("b", Alloc("a100", 1))])
    assert list(got) == ["a"]                      # no room left on the two a100 nodes
    got = pack([("a", Alloc("t4", 3)), ("b", Alloc("t4", 3)), ("c", Alloc("t4", 20))])
    assert list(got) == ["a", "b"]                 # 20 = 5 whole nodes: only 4 left whole
    pol = hetero_goodput_policy(Costs("restart"))
    out = pol(0.0, _jobs(2), _Prof({"fast": 3.0, "slow": 1.5}))
    assert {k: v.gpu_type for k, v in out.items()}["fast"] == "a100"


def test_sia_objective_also_gives_the_a100_to_the_larger_gain():
    prof = _Prof({"fast": 3.0, "slow": 1.5})
    want = choose(_jobs(16), prof, Costs("stop_free", 5.0, 0.5, 5.0), objective="sia")
    assert want["fast"] == ("a100", 1) and len(want) == 17
    assert sum(1 for v in want.values() if v[0] == "a100") == 16


def test_fairness_weight_predicts_ftf_and_favours_the_job_behind():
    from launcher.cluster.policies.hetero_goodput import predicted_ftf
    prof = _Prof({"a": 1.0, "b": 1.0})
    late = SimJobState("late", "a", 0.0, 1, 64)             # waited 1000 s, nothing done
    new = SimJobState("new", "b", 1000.0, 1, 64, progress=500.0)
    # isolated rate 1 per s on every type: (1000 s * 1 + 1000 left) / 1000 total = 2
    assert abs(predicted_ftf(late, prof, 1000.0, 2) - 2.0) < 1e-9
    assert abs(predicted_ftf(new, prof, 1000.0, 2) - 0.5) < 1e-9
    jobs = [late, new] + [SimJobState(f"f{i}", "b", 1000.0, 1, 64, progress=500.0)
                          for i in range(63)]                # 65 jobs, 64 one-GPU slots
    c = Costs("stop_free", 5.0, 0.5, 5.0)
    rem = {"objective": "remaining", "now": 1000.0}
    assert "late" not in choose(jobs, prof, c, **rem)        # SRPT: the longest left waits
    assert "late" in choose(jobs, prof, c, ftf_weight=2.0, **rem)


class _ScalingPM(_PM):
    def __init__(self, end):
        self.end, self.bounds = end, [0.0, end]


class _ScalingProf:
    """a100s only, progress per second ``sqrt(n)`` on ``n`` GPUs (sublinear, as data-parallel
    training scales); ``ends`` the progress each application needs."""

    def __init__(self, ends):
        self.progress = {app: _ScalingPM(end) for app, end in ends.items()}

    def best(self, app, t, n, e):
        return (n ** 0.5, 64) if t == "a100" else (0.0, 0)


def test_default_shares_gpus_between_a_short_and_a_long_job():
    prof = _ScalingProf({"short": 10.0, "long": 10000.0})
    jobs = [SimJobState("short", "short", 0.0, 1, 64), SimJobState("long", "long", 0.0, 1, 64)]
    c = Costs("stop_free", 5.0, 0.5, 5.0)
    # Sia's objective (the default): each job's speedup over its least, concave (p = -0.5):
    # 8 + 8 a100s (2 x (1.1 - 8^-0.25)) beats 16 for the short job alone (1.1 - 16^-0.25)
    assert choose(jobs, prof, c) == {"short": ("a100", 8), "long": ("a100", 8)}
    # the sum of 1 / T: the short job's 16 (1 / 7.5 s) beats 8 each (1 / 8.5 s + 1 / 3,541 s)
    assert choose(jobs, prof, c, objective="remaining") == {"short": ("a100", 16)}


def test_bad_policy_options_are_one_line_errors():
    import pytest
    for kw in ({"objective": "fastest"}, {"ftf_weight": -1.0}, {"p": 0.5},
               {"ftf_weight": 2.0, "objective": "sia"}):
        with pytest.raises(ValueError):
            hetero_goodput_policy(Costs("restart"), **kw)
