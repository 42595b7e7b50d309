"""``hvd-edl-run --autoscale`` over a discovery timetable: each decision with the throughput the
speed model predicted and the throughput then measured.

One job (``examples/train_digits.py`` with ``--step-delay`` seconds of sleeping compute per
step, 0.05 by default, so that the 2-core machine measures scaling rather than CPU contention)
starts with ``--autoscale efficiency:E`` (or ``cost``), host discovery from
``examples/discover_timetable.py --schedule SCHEDULE`` (default ``0:3,70:4,140:2``: 3 slots,
then 4, then 2) for ``--seconds`` seconds.  The harness polls ``hvd-edl-ctl status --json``
every second; a decision's measured throughput is the mean of the telemetry's job samples/s
over the polls after the job reached the decided size (``SETTLE_S`` after the generation
formed) and before the next decision or host change.

Writes benchmarks/results/autoscale.json.

    .venv/bin/python benchmarks/apps/autoscale.py [--objective efficiency:0.5] [--seconds 200]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common.jobs import stop_launcher  # noqa: E402
from launcher.observe.events import read as read_events  # noqa: E402

BIN = Path(sys.executable).parent
RESULTS = ROOT / "benchmarks" / "results"
SETTLE_S = 5.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objective", default="efficiency:0.5",
                   help="--autoscale's value (default efficiency:0.5)")
    p.add_argument("--price-on-demand", type=float, default=3.0)
    p.add_argument("--price-spot", type=float, default=1.0)
    p.add_argument("--revocation-rate", type=float, default=0.5)
    p.add_argument("--schedule", default="0:3,70:4,140:2")
    p.add_argument("--seconds", type=float, default=200.0)
    p.add_argument("--step-delay", type=float, default=0.05)
    p.add_argument("--hold", type=float, default=15.0, help="--autoscale-hold (s)")
    p.add_argument("--out", default=str(RESULTS / "autoscale.json"))
    a = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="autoscale-"))
    job_file, events = tmp / "job.json", tmp / "events.jsonl"
    discovery = (f"{sys.executable} {ROOT / 'examples' / 'discover_timetable.py'} --schedule "
                 f"{a.schedule} --clock {tmp / 'clock'}")
    extra = (["--price-on-demand", str(a.price_on_demand), "--price-spot", str(a.price_spot),
              "--revocation-rate", str(a.revocation_rate)] if a.objective == "cost" else [])
    cmd = [str(BIN / "hvd-edl-run"), "-np", "1", "--min-np", "1", "--max-np", "4",
           "--discovery-interval", "0.5", "--host-discovery-script", discovery,
           "--job-file", str(job_file), "--event-log", str(events),
           "--autoscale", a.objective, *extra, "--autoscale-hold", str(a.hold),
           "--autoscale-profile-seconds", "4",
           sys.executable, str(ROOT / "examples" / "train_digits.py"), "--epochs", "100000",
           "--step-delay", str(a.step_delay), "--stop-file", str(tmp / "stop")]
    out = open(tmp / "launcher.out", "w")
    launcher = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT))
    polls = []
    load_before = os.getloadavg()
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < a.seconds and launcher.poll() is None:
            time.sleep(1.0)
            if not job_file.exists():
                continue
            r = subprocess.run([str(BIN / "hvd-edl-ctl"), "--job", str(job_file), "status",
                                "--json"], capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                continue
            s = json.loads(r.stdout)
            job = (s.get("telemetry") or {}).get("job", {})
            polls.append({"t": round(time.monotonic() - t0, 2), "wall": time.time(),
                          "world_size": s["world_size"], "generation": s["generation"],
                          "since_change_s": s.get("since_change_s"),
                          "usable_slots": s.get("usable_slots"),
                          "hosts": s.get("hosts"), "target_np": s.get("target_np"),
                          "samples_per_s": job.get("samples_per_s"),
                          "autoscale_phase": (s.get("autoscale") or {}).get("phase")})
    finally:
        stop_launcher(launcher, tmp / "stop", out)
    gens, notes = read_events(events)
    notes = [e for e in notes if e.get("event") == "autoscale"]
    decisions = [n for n in notes if n.get("phase") == "decision"]
    rows = []
    for i, d in enumerate(decisions):
        end = decisions[i + 1]["time"] if i + 1 < len(decisions) else float("inf")
        seen = [p for p in polls if d["time"] <= p["wall"] < end and p["world_size"] == d["to"]
                and (p["since_change_s"] or 0) >= SETTLE_S and p["samples_per_s"]]
        hosts = {json.dumps(p["hosts"]) for p in seen}
        if len(hosts) > 1:  # the slots changed under it: keep the first host set's polls
            first = json.dumps(seen[0]["hosts"])
            seen = [p for p in seen if json.dumps(p["hosts"]) == first]
        measured = sum(p["samples_per_s"] for p in seen) / len(seen) if seen else None
        pred = d["predicted_samples_per_s"]
        rows.append({"time_s": round(d["time"] - lines[0]["time"], 1), "from": d["from"],
                     "to": d["to"], "bounds": d["bounds"], "predicted_samples_per_s": pred,
                     "measured_samples_per_s": None if measured is None else round(measured, 2),
                     "error_percent": None if measured is None else
                     round(abs(pred - measured) / measured * 100, 1),
                     "polls": len(seen)})
    doc = {"objective": a.objective, "schedule": a.schedule, "seconds": a.seconds,
           "hold_s": a.hold, "step_delay": a.step_delay, "load_before": load_before,
           "load_after": os.getloadavg(), "decisions": rows, "notes": notes,
           "generations": [{k: g[k] for k in ("generation", "kind", "world_size", "stall_s",
                                              "rolled_back_steps")} for g in gens],
           "launcher_exit": launcher.returncode}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2))
    print(f"{'t s':>6} {'from':>4} {'to':>3} {'slots':>6} {'predicted':>10} {'measured':>9} "
          f"{'err %':>6}")
    for r in rows:
        print(f"{r['time_s']:>6} {r['from']:>4} {r['to']:>3} {str(r['bounds']):>6} "
              f"{r['predicted_samples_per_s']:>10.1f} "
              f"{'-' if r['measured_samples_per_s'] is None else r['measured_samples_per_s']:>9} "
              f"{'-' if r['error_percent'] is None else r['error_percent']:>6}")
    print(f"load {load_before[0]:.1f} -> {doc['load_after'][0]:.1f}; generations "
          f"{[g['world_size'] for g in gens]}; rolled back "
          f"{sum(g['rolled_back_steps'] for g in gens)} steps; launcher exit {launcher.returncode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
