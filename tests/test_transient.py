"""Transient servers of several GPU types (issue 42): host lines with a type, a price and
``spot``; the price and revocation-risk tables; the choice of type and number for a deadline
and for a budget (CM-DARE's); the ``typed`` policy; and, with a real service and a real job
(ledger over Gloo, audited exactly-once), a move off a spot host on its notice with no work
lost, and bad input (an unknown type, a negative price, a deadline already past: one line,
exit 2)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from launcher.cluster.choice import Goal, Offer, choose, predict
from launcher.cluster.policies.typed import TypedPolicy
from launcher.cluster.policy import JobView, Snapshot, check_allocation
from launcher.discovery.hosts import HostSpecError, parse_host_specs
from launcher.discovery.prices import (DEFAULT_RATE_PER_H, RiskTable, TableError, host_terms,
                                       read_prices)
from test_cluster_service import (CLI, ROOT, assert_exactly_once, ledger, service,  # noqa: F401
                                  wait_for)


# ---- host lines and tables ----------------------------------------------------------------------

def test_host_lines_give_type_price_zone_and_spot():
    lines = parse_host_specs("a:2 type=T4 price=0.35 spot zone=us-central1-c\n"
                             "b gpus=0,1 type=a100\n[::1]:1 price=0\n")
    a, b, c = lines["a"], lines["b"], lines["::1"]
    assert (a.slots, a.gpu_type, a.price, a.spot, a.zone) == (2, "t4", 0.35, True,
                                                              "us-central1-c")
    assert (b.slots, b.gpu_type, b.price, b.spot) == (2, "a100", None, False)
    assert (c.price, c.gpu_type) == (0.0, None)
    again = parse_host_specs("\n".join(x.format() for x in lines.values()))
    assert again == lines  # format() round-trips every attribute
    for bad, says in [("a price=-1", "price= needs a price"), ("a price=abc", "price="),
                      ("a price=inf", "price="), ("a type=t4!", "type= needs a GPU type"),
                      ("a spot spot", "spot given twice"), ("a sport", "unknown host syntax"),
                      ("a type=t4 type=v100", "type= given twice")]:
        with pytest.raises(HostSpecError, match=says):
            parse_host_specs(bad)


def test_price_table_fills_lines_without_a_price_and_refuses_negative_prices(tmp_path):
    table = tmp_path / "prices.csv"
    table.write_text("type,on_demand,spot,tflops\nt4,0.35,0.11,8.1\na100,2.93,,19.5\n")
    prices = read_prices(str(table))
    terms = host_terms(parse_host_specs("a type=t4 spot\nb type=t4\nc type=a100 spot\n"
                                        "d type=t4 price=0.2 spot"), prices)
    # a100 has no spot price: its spot host is unpriced (told by serve), never the on-demand's
    assert [terms[h].price for h in "abcd"] == [0.11, 0.35, None, 0.2]
    assert terms["b"].revocations_per_h == 0 and terms["a"].revocations_per_h > 0
    assert terms["a"].startup_s > terms["b"].startup_s  # CM-DARE: preemptible VMs start later
    for text, says in [("type,on_demand,spot\nt4,-0.1,0.1\n", "on_demand needs a price"),
                       ("type,on_demand,spot\nt4,,\n", "neither"),
                       ("type,on_demand\nt4,1\n", "missing spot"),
                       ("type,on_demand,spot\nt4,1,1\nT4,1,1\n", "listed twice")]:
        table.write_text(text)
        with pytest.raises(TableError, match=says):
            read_prices(str(table))


def test_revocation_risk_defaults_to_gce_lifetimes_and_takes_the_operators_table(tmp_path):
    risk = RiskTable()
    # transient-deep-learning 2019: K80 20 revocations in 1245.3 VM-hours; a zone with 14 in
    # 195.5; a zone where none was seen takes the type's rate; an unknown type all VMs' rate
    assert math.isclose(risk.rate_per_h("k80"), 20 / 1245.3)
    assert math.isclose(risk.rate_per_h("k80", "us-central1-c"), 14 / 195.5)
    assert math.isclose(risk.rate_per_h("k80", "us-east1-c"), 20 / 1245.3)
    assert risk.rate_per_h("t4") == DEFAULT_RATE_PER_H
    table = tmp_path / "risk.csv"
    table.write_text("type,zone,revocations_per_hour\nt4,,0.5\nt4,eu-1,2\n*,,0.1\n")
    mine = RiskTable.read(str(table))
    assert (mine.rate_per_h("t4"), mine.rate_per_h("t4", "eu-1"), mine.rate_per_h("k80")) == \
        (0.5, 2.0, 0.1)
    table.write_text("type,zone,revocations_per_hour\nt4,,-1\n")
    with pytest.raises(TableError, match="revocations_per_hour needs a number >= 0"):
        RiskTable.read(str(table))
    # a replacement host's start-up where the operator knows it (else CM-DARE's VM start-up)
    table.write_text("type,zone,revocations_per_hour,replacement_start_s\nt4,,0.5,20\n"
                     "t4,eu-1,2,\nk80,,1,\n")
    terms = host_terms(parse_host_specs("a type=t4 spot zone=eu-1\nb type=k80 spot\n"
                                        "c type=t4"), None, RiskTable.read(str(table)))
    assert (terms["a"].startup_s, terms["b"].startup_s, terms["c"].startup_s) == (20, 87, 72)
    table.write_text("type,zone,revocations_per_hour,replacement_start_s\nt4,,0.5,-3\n")
    with pytest.raises(TableError, match="replacement_start_s needs seconds >= 0"):
        RiskTable.read(str(table))


# ---- the choice ---------------------------------------------------------------------------------

FAST, SLOW = {1: 100.0, 2: 190.0, 3: 270.0, 4: 340.0}, {1: 50.0, 2: 98.0, 3: 144.0, 4: 188.0}
OFFERS = [Offer("fast", 4, 2.0), Offer("slow", 4, 0.6, revocations_per_h=0.5, startup_s=60,
                                       spot=True)]


def _speed(t, n):
    return (FAST if t == "fast" else SLOW).get(n)


def test_choice_for_a_budget_is_the_soonest_that_fits_it():
    now, work = 1e9, 360_000.0
    free = choose(Goal("time", work), work, _speed, OFFERS, now, 1, 4)
    assert (free.gpu_type, free.n, free.fits) == ("fast", 4, True)  # no budget: soonest
    assert math.isclose(free.time_s, work / 340) and math.isclose(free.cost_usd,
                                                                  2.0 * 4 * free.time_s / 3600)
    budget = 2.15  # 4 x fast costs $2.35: over; what is soonest within $2.15?
    got = choose(Goal("time", work, budget_usd=budget), work, _speed, OFFERS, now, 1, 4)
    assert got.fits and got.cost_usd <= budget and (got.gpu_type, got.n) == ("fast", 2)
    every = [predict(work, lambda k, t=o.gpu_type: _speed(t, k), n, o) for o in OFFERS
             for n in range(1, 5)]
    assert got.time_s == min(p.time_s for p in every if p.cost_usd <= budget)
    # spot: revocations add (commit + switch + start-up short a host) each, expected count
    spot = predict(work, lambda k: _speed("slow", k), 4, OFFERS[1], commit_s=2, switch_s=0.5)
    t0 = work / 188
    loss = 2 + 0.5 + 60 * (1 - 144 / 188)
    assert math.isclose(spot.time_s, t0 / (1 - 0.5 * 4 * loss / 3600))
    assert math.isclose(spot.revocations, 0.5 * 4 * spot.time_s / 3600)
    # the replacement's stall is the host's start-up plus the job's own worker start on it,
    # less the notice (the replacement starts while the revoked host still trains)
    joins = predict(work, lambda k: _speed("slow", k), 4, OFFERS[1], commit_s=2, switch_s=0.5,
                    start_s=30)
    loss = 2 + 0.5 + (60 + 30) * (1 - 144 / 188)
    assert math.isclose(joins.time_s, 30 + t0 / (1 - 0.5 * 4 * loss / 3600))
    noticed = predict(work, lambda k: _speed("slow", k), 4, OFFERS[1], commit_s=2,
                      switch_s=0.5, start_s=30, join_s=10, notice_s=30)
    loss = 0.5 + (60 + 10 - 30) * (1 - 144 / 188)  # no work lost with a notice
    assert math.isclose(noticed.time_s, 30 + t0 / (1 - 0.5 * 4 * loss / 3600))
    # one worker: a revocation without notice loses all its work (half on average), with one
    # nothing
    one = predict(work, lambda k: _speed("slow", k), 1, OFFERS[1], commit_s=2, switch_s=0.5)
    t1 = work / 50
    assert math.isclose(one.time_s, t1 / (1 - 0.5 * (t1 / 2 + 0.5 + 60) / 3600))
    one_noticed = predict(work, lambda k: _speed("slow", k), 1, OFFERS[1], switch_s=0.5,
                          notice=True)
    assert math.isclose(one_noticed.time_s, t1 / (1 - 0.5 * (0.5 + 60) / 3600))
    tight = choose(Goal("time", work, budget_usd=0.01), work, _speed, OFFERS, now, 1, 4)
    assert not tight.fits and "no choice fits the $0.01 budget" in tight.why


def test_choice_for_a_deadline_is_the_cheapest_that_meets_it():
    now, work = 1e9, 360_000.0
    cheap = choose(Goal("cost", work), work, _speed, OFFERS, now, 1, 4)
    assert (cheap.gpu_type, cheap.fits) == ("slow", True)  # no deadline: the cheapest
    got = choose(Goal("cost", work, deadline_at=now + 1500), work, _speed, OFFERS, now, 1, 4)
    assert got.fits and got.time_s <= 1500 and got.cost_usd >= cheap.cost_usd
    every = [predict(work, lambda k, t=o.gpu_type: _speed(t, k), n, o) for o in OFFERS
             for n in range(1, 5)]
    assert got.cost_usd == min(p.cost_usd for p in every if p.time_s <= 1500)
    # a job's start per type counts: 2000 s to start on slow leaves only fast in the deadline
    slow_start = choose(Goal("cost", work, deadline_at=now + 1500), work, _speed, OFFERS, now,
                        1, 4, start_s={"slow": 2000.0, "*": 0.0})
    assert slow_start.gpu_type == "fast" and slow_start.time_s <= 1500
    # ... and per size (two workers' imports share the hosts' CPUs): 1 x fast starts in 10 s,
    # 2 x fast in 400 s; a size not given takes the nearest's
    from launcher.cluster import speed as speed_
    from launcher.cluster.choice import start_of
    per_size = {"fast": {"start_s": {"1": 10, "2": 400}, "1": 100}}
    assert speed_.profile_points(per_size) and speed_.start_costs(per_size) == \
        {"fast": {"1": 10.0, "2": 400.0}}
    start = dict(speed_.start_costs(per_size), **{"*": 0.0})
    assert [start_of(start, "fast", n) for n in (1, 2, 3)] == [10.0, 400.0, 400.0]
    assert start_of(start, "slow", 2) == 0.0 and start_of(7, "x", 3) == 7.0
    fast_only = [OFFERS[0]]
    two = choose(Goal("time", work, budget_usd=None), work, _speed, fast_only, now, 2, 2,
                 start_s=start)
    assert math.isclose(two.time_s, work / 190 + 400)
    for bad in ({"1": -1}, {"0": 5}, {}, "soon"):
        with pytest.raises(ValueError, match="start_s"):
            speed_.profile_points({"fast": {"1": 100, "start_s": bad}})
    late = choose(Goal("cost", work, deadline_at=now + 100), work, _speed, OFFERS, now, 1, 4)
    assert not late.fits and late.gpu_type == "fast" and late.n == 4  # the soonest


# ---- the policy ---------------------------------------------------------------------------------

class _Terms:
    def __init__(self, t, price, spot=False):
        self.gpu_type, self.price, self.spot = t, price, spot
        self.revocations_per_h, self.startup_s = (0.2 if spot else 0.0), 30.0


def test_typed_policy_places_objectives_by_choice_and_others_by_gain_per_type():
    hosts = {"f1": _Terms("fast", 2.0), "s1": _Terms("slow", 0.6, True),
             "s2": _Terms("slow", 0.6, True)}
    pool = {"f1": 2, "s1": 2, "s2": 2}
    goal = Goal("cost", 360_000, deadline_at=1e9 + 5000).as_dict()
    jobs = (JobView("j1", 1.0, 2, 1, 4, goal=goal, speed_of=_speed),
            JobView("j2", 2.0, 2, 2, 2, speed_of=lambda t, n: {"fast": 150, "slow": 100}[t] * n),
            JobView("j3", 3.0, 2, 2, 2, speed_of=lambda t, n: {"fast": 300, "slow": 100}[t] * n))
    policy = TypedPolicy()
    snap = Snapshot(1e9, pool, jobs, hosts=hosts)
    alloc = policy.allocate(snap)
    check_allocation(snap, alloc)
    choice = policy.choices["j1"]
    assert choice.fits and choice.gpu_type == "slow" and set(alloc["j1"]) <= {"s1", "s2"}
    assert "cheapest" in policy.explain("j1")
    assert alloc["j3"] == {"f1": 2}  # gains 3x from fast: gets it before j2 (1.5x)
    assert set(alloc["j2"]) <= {"s1", "s2"}
    # s1 revoked under j1 (it ran there): j1 is placed again in the same round, first (its
    # deadline needs the fast slot now), before a job that arrived meanwhile
    j1 = JobView("j1", 1.0, 2, 1, 2, goal=goal, speed_of=_speed, started=True)
    j4 = JobView("j4", 4.0, 1, 1, 1, goal=goal, speed_of=_speed)
    snap = Snapshot(1e9, {"f1": 1, "s2": 1}, (j4, j1), hosts=hosts)
    alloc = policy.allocate(snap)
    check_allocation(snap, alloc)
    assert alloc["j1"] == {"f1": 1} and policy.choices["j1"].fits, alloc
    assert alloc["j4"] == {"s2": 1}, alloc
    # the same in the service (a notice: the host leaves the pool, the job's allocation empties
    # and the same round places it again): a 'move', stop-free, not a preemption; the real run
    # of it is test_a_notice_moves_the_job_off_its_spot_host_with_no_work_lost below and, for
    # edl, test_cluster_drain (make test)


# ---- real: a move on a notice, bad input ------------------------------------------------------

def _status(svc) -> dict:
    from launcher.cluster import cluster_file
    from launcher.cluster.server import ClusterClient
    return ClusterClient(cluster_file.read(svc.cluster)).call("status")


def _typed_pool(tmp_path):
    pool = tmp_path / "pool"
    pool.write_text("localhost:2 type=fast price=1.0\n127.0.0.1:2 type=slow price=0.2 spot\n")
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"fast": {"1": 200, "2": 390}, "slow": {"1": 100,
                                                                          "2": 195}}))
    return pool, profile


def test_bad_input_is_one_line_exit_2(service, tmp_path):
    pool, profile = _typed_pool(tmp_path)
    bad_pool = tmp_path / "bad"
    bad_pool.write_text("localhost:2 type=fast price=-1\n")
    r = subprocess.run(CLI + ["serve", "--state-dir", str(tmp_path / "s0"), "--hostfile",
                              str(bad_pool)], capture_output=True, text=True, timeout=60,
                       cwd=str(ROOT))
    assert r.returncode == 2 and "price= needs a price" in r.stderr and \
        len(r.stderr.strip().splitlines()) == 1, r.stderr
    svc = service("--policy", "typed", "--hostfile", str(pool))
    job = ["--", sys.executable, str(ROOT / "tests" / "horovod_style" / "ledger_main.py")]
    for args, says in [(["--objective", "cost", "--samples", "100", "--deadline", "-5"],
                        "--deadline -5 is already past"),
                       (["--objective", "time", "--samples", "100", "--types", "v100"],
                        "unknown GPU type 'v100'"),
                       (["--objective", "time", "--samples", "100", "--budget", "-2"],
                        "--budget needs a positive number")]:
        r = svc.cli("submit", *args, *job)
        assert r.returncode == 2 and says in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert svc.jobs() == {}  # nothing queued by a refused submit
    # the same on hvd-edl-run --autoscale time|cost (a typed --hostfile)
    bad_profile = tmp_path / "bad_profile.json"
    bad_profile.write_text(json.dumps({"v100": {"1": 10}}))
    run = [sys.executable, "-m", "launcher.cli", "--min-np", "1", "--max-np", "2"]
    for args, says in [(["--hostfile", str(pool), "--autoscale", "cost", "--samples", "100",
                         "--speed-profile", str(profile), "--deadline", "-1"],
                        "--deadline -1 is already past"),
                       (["--hostfile", str(pool), "--autoscale", "time", "--samples", "100",
                         "--speed-profile", str(bad_profile)], "unknown GPU type 'v100'"),
                       (["--hostfile", str(bad_pool), "--autoscale", "time", "--samples",
                         "100"], "price= needs a price")]:
        r = subprocess.run(run + args + ["--", sys.executable, "-c", "pass"],
                           capture_output=True, text=True, timeout=60, cwd=str(ROOT))
        assert r.returncode == 2 and says in r.stderr, (args, r.stderr)
        assert r.stderr.strip().splitlines()[-1].startswith("hvd-edl-run: error:"), r.stderr


@pytest.mark.long  # make test: test_make_before_break's notice on a full pool (the harder case)
def test_a_notice_moves_the_job_off_its_spot_host_with_no_work_lost(service, tmp_path):
    pool, profile = _typed_pool(tmp_path)
    svc = service("--policy", "typed", "--host-discovery-script", f"cat {pool}",
                  "--discovery-interval", "0.2", "--round", "1")
    a1 = tmp_path / "a1"
    j1 = svc.submit("--objective", "cost", "--samples", "4096", "--speed-profile",
                    str(profile), "--min-np", "1", "--max-np", "2",
                    *ledger(tmp_path, "j1", 256, 1000, delay=0.03), "--stop-file",
                    str(tmp_path / "stop1"), audit_dir=a1)
    jobs = svc.wait_jobs(lambda j: j[j1]["state"] == "running" and j[j1]["world_size"] >= 1,
                         f"{j1} training")
    assert set(jobs[j1]["allocation"]) == {"127.0.0.1"}, jobs[j1]  # cheapest: the spot type
    choice = jobs[j1]["goal"]["choice"]
    assert (choice["type"], choice["spot"], choice["fits"]) == ("slow", True, True), choice
    from launcher.cluster.top import frame_lines  # what `status` prints (in process: cheaper)
    shown = "\n".join(frame_lines(_status(svc)))
    assert "cost: 1 x slow spot, pred" in shown and "spent $" in shown, shown
    # the notice: 127.0.0.1 ends in 90 s (a line's ends=, as the GCE / AWS scripts print it;
    # AWS gives 120 s): the replacement's start on 2 loaded cores takes 5-35 s
    pool.write_text(f"localhost:2 type=fast price=1.0\n127.0.0.1:2 type=slow price=0.2 spot "
                    f"ends={time.time() + 90:.1f}\n")
    drained = wait_for("127.0.0.1 drained", lambda: [e for e in svc.events()
                                                     if e["kind"] == "drained"], 90, svc.output)
    assert drained[0]["spare_s"] > 0, drained  # left before the deadline
    log = (svc.state / "jobs" / j1 / "run1.log").read_text()
    assert log.index("(joined: w2@localhost") < log.index("(left: w1@127.0.0.1"), log[-2000:]
    jobs = svc.wait_jobs(lambda j: j[j1]["world_size"] >= 1 and
                         set(j[j1]["allocation"]) == {"localhost"}, f"{j1} on localhost")
    assert jobs[j1]["goal"]["choice"]["type"] == "fast", jobs[j1]["goal"]
    shown = "\n".join(frame_lines(_status(svc)))  # text shows the move's choice, as --json
    assert "cost: 1 x fast, pred" in shown and "(first 1 x slow spot, pred" in shown, shown
    (tmp_path / "stop1").touch()
    jobs = svc.wait_jobs(lambda j: j[j1]["state"] == "done", f"{j1} done")
    assert jobs[j1]["runs"] == 1 and jobs[j1]["cost_usd"] > 0, jobs[j1]  # moved, not restarted
    gens = [json.loads(x) for x in (svc.state / "jobs" / j1 / "run1.events.jsonl")
            .read_text().splitlines() if '"generation"' in x]
    assert all(g.get("rolled_back_steps", 0) == 0 for g in gens), gens
    assert_exactly_once(a1, 256)
