"""Transient pools: one elastic job on Bamboo's AWS spot availability traces (p3, g4dn) replayed
as hosts that come and go: JCT, throughput and cost on on-demand only, spot only and mixed hosts,
hvd_edl's stop-free changes (notices used) against checkpoint-restart per change.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/cluster/transient_pools.py

Job: ResNet-50 on ImageNet (Sia's ``imagenet`` profiles: T4 = ``aws`` for g4dn.xlarge, V100 for
p3.2xlarge = the T4 curve scaled by ``azure``'s one-GPU speed, see :func:`throughput`; one GPU per
host; local batch 128; 90 epochs, as Sia and Pollux train it, = 115.3 M samples), from
time 0, the trace repeating past its end (:mod:`launcher.cluster.transient_sim`).  Costs: ours
from this repository's measured figures (scheduler_sim.measured_switch_costs: the largest switch
stall, the slowest fresh launch as a joiner's build); checkpoint-restart: Sia's measured restart
for imagenet (250 s) at every change, no work lost (the 2-minute notice writes the checkpoint).
Prices: p3 3.06 / 0.91 $ per hour on demand / spot (Bamboo's simulator, prices.csv); g4dn
0.526 $ on demand (AWS us-east-1 list price, not in prices.csv) and spot at p3's spot/on-demand
ratio (an assumption, printed).  Bamboo reports 3.7x the throughput of checkpointing on p3 (its
pipeline-redundancy system, a different job and restart): printed beside our ratio.

GCE preemptible pools (:mod:`launcher.cluster.gce_lifetimes`): the measured 2019 lifetimes of
1-GPU preemptible VMs per GPU type and zone (as many hosts as the zone had VMs: 10-19), a
revoked or 24-hour-old VM replaced after CM-DARE's measured preemptible start-up for its type
(K80 83 s, P100 91 s; V100, not measured, takes P100's), GCE's 30 s notice (no work lost either
way: ours leaves at a commit, checkpoint-restart writes its checkpoint within it: CM-DARE
measured 3-7 s).  The same ResNet-50 job; a K80's or P100's speed is the V100's scaled by
CM-DARE's measured one-GPU speed of the type over the V100's (the mean over its four models,
``cm-dare/speed_data_base``).  Prices: GCE's GPU list prices per GPU-hour in 2019 (K80 0.45 /
0.135, P100 1.46 / 0.43, V100 2.48 / 0.74 on demand / preemptible; not in the traces, the VM's
CPUs and memory not counted; the traces' own K80 VM rates, 0.723 / 0.256, have the same ratio
within 15 %).  On-demand = the pool's time-weighted mean host count, never revoked.

Writes ``benchmarks/results/transient_pools.json`` (``table``: Bamboo's pools, ``gce``: GCE's).
"""
from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "cluster"))

from launcher.cluster.hetero_sim import SIA_RESTART_S                      # noqa: E402
from launcher.cluster.transient_sim import (ChangeCost, availability,      # noqa: E402
                                            mean_hosts, profile_throughput, run)
from launcher.cluster.type_profiles import sia_dir, transient_dir         # noqa: E402

WORK = 90 * 1_281_167.0
LOCAL_BSZ = 128
P3_OD, P3_SPOT = 3.06, 0.91
G4_OD = 0.526
G4_SPOT = round(G4_OD * P3_SPOT / P3_OD, 4)
POOLS = {"p3": ("p3-trace.csv", "-azure", P3_OD, P3_SPOT),
         "g4dn": ("g4dn-trace.csv", "-aws", G4_OD, G4_SPOT)}
BAMBOO_P3_RATIO = 3.7
GCE_PRICES = {"k80": (0.45, 0.135), "p100": (1.46, 0.43), "v100": (2.48, 0.74)}
GCE_POOLS = [("k80", "us-central1-c"), ("k80", "us-east1-c"), ("p100", "us-west1-b"),
             ("v100", "asia-east1-c")]
GCE_HORIZON_S = 14 * 86400.0


def throughput(folder: str, profile: str, n: int) -> float:
    """Samples/s of the job on ``n`` one-GPU hosts: the t4 profile's curve over one-GPU nodes
    (``aws``, measured up to 16 nodes), scaled by the type's one-GPU speed over the t4's (Sia's
    8-GPU V100 profile extrapolates badly to one-GPU nodes: 447 samples/s on 4 hosts, below 2);
    the best of any m <= n hosts (an elastic job leaves a host idle that would slow it)."""
    ratio = profile_throughput(folder, profile, LOCAL_BSZ, 1) / profile_throughput(
        folder, "-aws", LOCAL_BSZ, 1)
    return ratio * max((profile_throughput(folder, "-aws", LOCAL_BSZ, m) for m in range(1, n + 1)),
                       default=0.0)


def cm_dare_speed_ratio(gpu: str) -> float:
    """CM-DARE's one-GPU speed of ``gpu`` over the V100's: the mean over its four models
    (``speed_data_base/<model><gpu>/data.csv``, mean of ``Value``, steps/s)."""
    import csv
    from statistics import mean
    base = transient_dir() / "cm-dare" / "speed_data_base"
    ratios = []
    for model in ("res15", "res32", "shakesmall", "shakebig"):
        speed = {}
        for g in (gpu, "v100"):
            with open(base / f"{model}{g}" / "data.csv", newline="") as f:
                speed[g] = mean(float(r["Value"]) for r in csv.DictReader(f)
                                if r["Value"] and float(r["Value"]) > 0)
        ratios.append(speed[gpu] / speed["v100"])
    return sum(ratios) / len(ratios)


def gce_pools(folder: str, ours: ChangeCost, ckpt: ChangeCost) -> dict:
    """The GCE preemptible pools (module docstring): per pool its hosts, revocations and the
    rows on-demand / preemptible / mixed, ours against checkpoint-restart."""
    from launcher.cluster import gce_lifetimes
    tdl = transient_dir() / "transient-deep-learning" / "lifetime" / "lifetime_2019_tidy.csv"
    startup = gce_lifetimes.preemptible_startup_s(transient_dir() / "cm-dare" / "startup_time")
    out = {}
    for gpu, zone in GCE_POOLS:
        lives = gce_lifetimes.lifetimes_h(tdl, gpu, zone)
        start_s = startup.get(gpu, startup["p100"])
        avail = gce_lifetimes.availability(lives, start_s, GCE_HORIZON_S, seed=0)
        ratio = 1.0 if gpu == "v100" else cm_dare_speed_ratio(gpu)
        v100 = functools.partial(throughput, folder, "-azure")
        thr = (lambda n, r=ratio, f=v100: r * f(n))
        od, spot = GCE_PRICES[gpu]
        fleet = max(1, round(mean_hosts(avail)))
        drops = sum(1 for a, b in zip(avail, avail[1:]) if b[1] < a[1])
        rows = {}
        for mix, kw in (("on_demand", dict(use_spot=False, on_demand=fleet)),
                        ("spot", dict(use_spot=True, on_demand=0)),
                        ("mixed", dict(use_spot=True, on_demand=fleet // 2))):
            for mode, cost in (("ours_stop_free", ours), ("checkpoint_restart", ckpt)):
                o = run(avail, thr, WORK, cost, spot, od_price=od, limit_s=GCE_HORIZON_S, **kw)
                rows[f"{mix}/{mode}"] = {"jct_s": round(o.jct_s, 1), "cost_usd":
                                         round(o.cost_usd, 2), "changes": o.changes}
                print(f"{gpu + '/' + zone:<20}{mix:<11}{o.changes:>8}{mode:>20}"
                      f"{o.jct_s / 3600 if math.isfinite(o.jct_s) else math.inf:>8.2f}"
                      f"{o.cost_usd:>9.2f}")
        r = rows
        out[f"{gpu}/{zone}"] = {
            "hosts": len(lives), "revoked_before_24h_measured": sum(x < 23.9 for x in lives),
            "replacement_start_s": round(start_s, 1), "speed_over_v100": round(ratio, 3),
            "prices": {"on_demand": od, "preemptible": spot}, "fleet_on_demand": fleet,
            "host_losses_in_14_days": drops, "rows": rows,
            "spot_jct_ckpt_over_ours": round(r["spot/checkpoint_restart"]["jct_s"]
                                             / r["spot/ours_stop_free"]["jct_s"], 3)}
    return out


def main() -> int:
    from scheduler_sim import measured_switch_costs
    sw = measured_switch_costs()
    ours = ChangeCost("stop_free", switch_s=sw["change_cost_s"], join_s=sw["join_s"])
    ckpt = ChangeCost("checkpoint_restart", restart_s=float(SIA_RESTART_S["imagenet"]))
    folder = str(sia_dir() / "traces" / "imagenet")
    out = {"work_samples": WORK, "costs": {"ours": ours.__dict__, "checkpoint_restart":
                                           ckpt.__dict__}, "prices": {}, "table": {}}
    print(f"{'pool':<6}{'hosts':<11}{'changes':>8}{'mode':>20}{'JCT h':>8}{'samples/s':>11}"
          f"{'cost $':>9}")
    for pool, (fname, profile, od, spot) in POOLS.items():
        avail = availability(transient_dir() / "bamboo" / "traces" / fname)
        fleet = max(1, round(mean_hosts(avail)))
        thr = functools.partial(throughput, folder, profile)
        out["prices"][pool] = {"on_demand": od, "spot": spot}
        rows = {}
        for mix, kw in (("on_demand", dict(use_spot=False, on_demand=fleet)),
                        ("spot", dict(use_spot=True, on_demand=0)),
                        ("mixed", dict(use_spot=True, on_demand=fleet // 2))):
            for mode, cost in (("ours_stop_free", ours), ("checkpoint_restart", ckpt)):
                o = run(avail, thr, WORK, cost, spot, od_price=od, **kw)
                rows[f"{mix}/{mode}"] = {"jct_s": round(o.jct_s, 1), "samples_per_s":
                                         round(o.samples_per_s, 1), "cost_usd":
                                         round(o.cost_usd, 2), "changes": o.changes}
                print(f"{pool:<6}{mix:<11}{o.changes:>8}{mode:>20}"
                      f"{o.jct_s / 3600 if math.isfinite(o.jct_s) else math.inf:>8.2f}"
                      f"{o.samples_per_s:>11.1f}{o.cost_usd:>9.2f}")
        s = rows["spot/ours_stop_free"]["samples_per_s"] / rows["spot/checkpoint_restart"][
            "samples_per_s"]
        out["table"][pool] = {"fleet_on_demand": fleet, "rows": rows,
                              "spot_throughput_ours_over_checkpoint": round(s, 3)}
        print(f"{pool}: spot throughput ours / checkpoint-restart = {s:.2f}x "
              f"(Bamboo on p3: {BAMBOO_P3_RATIO}x over checkpointing); on-demand fleet = "
              f"{fleet} hosts (the trace's mean)")
    out["bamboo_p3_ratio_published"] = BAMBOO_P3_RATIO
    print(f"\nGCE preemptible pools (2019 lifetimes; replacements after CM-DARE's start-up)")
    print(f"{'pool':<20}{'hosts':<11}{'changes':>8}{'mode':>20}{'JCT h':>8}{'cost $':>9}")
    out["gce"] = gce_pools(folder, ours, ckpt)
    res = ROOT / "benchmarks" / "results"
    (res / "transient_pools.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
