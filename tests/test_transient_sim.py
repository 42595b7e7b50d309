"""Transient pools (issue 42 s4): a spot trace replayed as hosts; stop-free changes lose less time
than checkpoint-restart per change; on-demand hosts cost their price."""
import math

import pytest

from launcher.cluster.transient_sim import ChangeCost, availability, mean_hosts, run


def test_trace_parsing_and_replay(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("0,add,a\n0,add,b\n3600000,remove,b\n7200000,add,c\n10800000,remove,a\n")
    av = availability(p)
    assert av == [(0.0, 2), (3600.0, 1), (7200.0, 2), (10800.0, 1)]
    assert math.isclose(mean_hosts(av), (2 + 1 + 2) / 3)
    thr = lambda n: 10.0 * n                                  # noqa: E731
    work = 10.0 * (2 * 3600 + 3600 + 2 * 3600)                # all of the first period
    sf = run(av, thr, work, ChangeCost("stop_free", switch_s=1.0, join_s=5.0), spot_price=1.0)
    cr = run(av, thr, work, ChangeCost("checkpoint_restart", restart_s=300.0), spot_price=1.0)
    assert sf.changes == cr.changes == 2
    # stop-free: 1 s stall on 1 host, 5 s of joining on the old host then 1 s stall on 2:
    # 10 + 50 + 20 samples short, made up at 20/s after the trace's period
    assert math.isclose(sf.jct_s, 10800 + 80 / 20.0)
    # checkpoint-restart: 300 s on 1 host, then 300 s on 2: 9,000 samples short
    assert math.isclose(cr.jct_s, 10800 + 9000 / 20.0)
    od = run(av, thr, work, ChangeCost("stop_free"), spot_price=1.0, on_demand=2, od_price=3.0,
             use_spot=False)
    assert od.changes == 0
    assert math.isclose(od.jct_s, work / 20.0) and math.isclose(od.cost_usd, 6.0 * od.jct_s / 3600)


def test_gce_lifetimes_make_a_pool_that_only_loses_hosts_and_gets_replacements(tmp_path):
    from launcher.cluster.gce_lifetimes import availability as gce, lifetimes_h
    table = tmp_path / "lifetime.csv"
    table.write_text("gpu,vm_name,zone,stress,start,terminate,lifetime_h,revoked_before_24h\n"
                     "K80,a,z1,1,,,1.0,1\nK80,b,z1,1,,,24.1,0\nP100,c,z1,1,,,2.0,1\n")
    lives = lifetimes_h(table, "k80", "z1")
    assert lives == [1.0, 24.1]
    with pytest.raises(ValueError, match="no v100 VM in z1"):
        lifetimes_h(table, "v100", "z1")
    steps = gce(lives, 90.0, 2 * 3600.0, seed=1)
    # both VMs up at 0; the first revoked at 1 h, its replacement up 90 s later; the horizon
    assert steps[:3] == [(0.0, 2), (3600.0, 1), (3690.0, 2)]
    assert steps[-1][0] == 2 * 3600.0 and all(0 <= n <= 2 for _, n in steps)
    # the same seed, the same pool; losses and replacements alternate per host
    assert gce(lives, 90.0, 2 * 86400.0, seed=3) == gce(lives, 90.0, 2 * 86400.0, seed=3)
    with pytest.raises(ValueError):
        gce([], 90.0, 3600.0)
