"""A real mixed-type ring (issue 42 s3): one job whose Horovod ring spans a fast and a slow
emulated GPU type, chosen by the ``typed`` policy because the speed model says the mix pays
(:mod:`launcher.cluster.mixed_types`: a ring runs at its slowest type's speed, so 1 fast + 2
slow trains at ``speed(slow, 3)`` against ``speed(fast, 1)`` alone); its measured speed and
time against that prediction, its exactly-once audit.

    .venv/bin/python benchmarks/cluster/mixed_real.py   # as root; ~6 min on 2 cores

The cluster, the emulated GPUs (a worker's step work in one thread under its host's cgroup v1
CPU quota: fast 0.25 CPU, slow 0.125) and the calibration (speeds of 1 and 2 workers per type,
starts for 1, 2 and 4 workers at once) are ``transient_real.py``'s, in the same run.  Then a
service (policy ``typed``) on a pool of one fast host (h1) and both slow ones (h3, h4; spot,
but told no revocation risk: this run measures speed, not revocations), and one job
``--objective time --min-np 1 --max-np 3`` with the calibrated speed profile.  The policy
predicts each configuration (1 x fast alone, 2 x slow, 1 fast + 2 slow, ...) from the profile,
the speed of 3 slow workers extrapolated per worker from 2 (the speed model's rule beyond the
sizes measured); the job runs on what it chose.  Measured: its samples over its first to
last batch (the step log), its time from start to end, the audit.

Written to benchmarks/results/mixed_real.json (``--out``) and printed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import transient_real as tr  # noqa: E402

from hvd_edl import audit  # noqa: E402

HOSTS = ("h1", "h3", "h4")  # one fast, two slow
SAMPLES = tr.DATASET * 24


def inner(a) -> int:
    ctx = json.loads(a.inner)
    tmp = Path(tempfile.mkdtemp(prefix="mixed-real-"))
    prices = tr.write_prices(tmp)
    risk = tmp / "risk.csv"  # no revocations in this run: the prediction is speed and start
    risk.write_text("type,zone,revocations_per_hour,replacement_start_s\nslow,,0,20\n")
    t_cal = time.time()
    profile, start_s, cal = tr.calibrate(tmp, ctx["ssh"], prices, risk, ctx["devices"],
                                         tr.CAL_SAMPLES)
    print(f"calibration ({time.time() - t_cal:.0f} s): {profile}", flush=True)
    profile_path = tmp / "profile.json"
    profile_path.write_text(json.dumps(profile))
    svc = tr.Service(tmp / "mixed", "typed", ctx["ssh"], prices, start_s, risk, ctx["devices"],
                     hosts=HOSTS)
    try:
        jid = svc.submit("mixed", SAMPLES, "--objective", "time", "--samples", str(SAMPLES),
                         "--speed-profile", str(profile_path), "--min-np", "1", "--max-np", "3",
                         "--np", "3")
        final = {j["id"]: j for j in svc.wait_all(900)}[jid]
        events = svc.events()
    finally:
        svc.stop()
        tr.stop_jobs(svc)
    from launcher.cluster import speed as speed_
    from launcher.cluster.mixed_types import ring_speed
    speed_of = speed_.typed_speed(speed_.profile_points(profile))
    c = (final.get("goal") or {}).get("first_choice") or {}
    parts = {p["type"]: p["n"] for p in c.get("parts") or [c]} if c else {}
    st = tr.steps(svc.tmp / "mixed.steps")
    measured = SAMPLES / (st[-1] - st[0]) if len(st) >= 2 else None
    predicted = ring_speed(speed_of, parts) if parts else None
    rep = audit.check(svc.tmp / "audit" / "mixed", tr.DATASET)
    hosts = sorted({h for e in events if e.get("job") == jid and e.get("hosts")
                    for h in e["hosts"]})
    time_s = final["finished_at"] - final["started_at"]
    out = {
        "command": ".venv/bin/python benchmarks/cluster/mixed_real.py (as root)",
        "machine": f"2 cores shared with other sessions (load {os.getloadavg()[0]:.1f} at the "
                   "end); calibrated in the same run",
        "quotas_us": {"period": tr.PERIOD_US, **tr.QUOTA_US},
        "calibration": {"profile": profile, "runs": cal},
        "pool": {h: tr.TYPES[h] for h in HOSTS}, "samples": SAMPLES,
        "state": final["state"], "choice": c, "parts": parts, "hosts_used": hosts,
        "why": next((e.get("reason") for e in events
                     if e.get("job") == jid and e.get("kind") == "start"), None),
        "pred_ring_samples_per_s": round(predicted, 2) if predicted else None,
        "samples_per_s": round(measured, 2) if measured else None,
        "speed_error": round(abs(predicted - measured) / measured, 4)
        if predicted and measured else None,
        "fast_alone_samples_per_s": profile["fast"]["1"],
        "slow_2_samples_per_s": profile["slow"]["2"],
        "pred_time_s": c.get("time_s"), "time_s": round(time_s, 2),
        "time_error": round(abs(c["time_s"] - time_s) / time_s, 4) if c else None,
        "pred_cost_usd": c.get("cost_usd"), "cost_usd": final["cost_usd"],
        "repeated": rep.repeated, "missing": rep.missing, "audit_ok": rep.ok,
        **tr.switches(svc.state / "jobs" / jid)}
    print(json.dumps({k: v for k, v in out.items() if k != "calibration"}, indent=1))
    tr.RESULTS.mkdir(exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"written to {a.out}")
    return 0 if final["state"] == "done" and rep.ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(tr.RESULTS / "mixed_real.json"))
    ap.add_argument("--inner", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    return inner(a) if a.inner else tr.outer(a, __file__)


if __name__ == "__main__":
    sys.exit(main())
