"""Stall of hvd_edl's switch, measured through hvd-edl-run on this machine.

Scenarios (each repeated --reps times, interleaved A B C A B C so machine noise spreads evenly):
  scale_out_delay0  2 -> 3 workers, the joiner builds its model at once
  scale_out_delay8  2 -> 3 workers, the joiner takes 8 s to build (--build-delay 8)
  scale_in          3 -> 2 workers, a slot leaves the discovery output

Prints median and min-max of the event log's stall_s (and rolled_back_steps) per scenario and
writes them to benchmarks/results/switch.json.

    .venv/bin/python benchmarks/switch.py --reps 3
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = str(Path(sys.executable).parent / "hvd-edl-run")


def run_once(start: int, end: int, build_delay: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hosts, events, stop = tmp / "hosts", tmp / "events.jsonl", tmp / "stop"
        hosts.write_text(f"localhost:{start}\n")
        cmd = [LAUNCHER, "-np", str(start), "--min-np", "1", "--max-np", "4",
               "--discovery-interval", "0.2", "--event-log", str(events),
               "--host-discovery-script", f"cat {hosts}",
               sys.executable, str(ROOT / "examples" / "train_digits.py"), "--epochs", "500",
               "--step-delay", "0.01", "--build-delay", str(build_delay),
               "--stop-file", str(stop)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                cwd=str(ROOT))

        def gen(n):
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                if events.exists():
                    for line in events.read_text().splitlines():
                        ev = json.loads(line)
                        if ev["generation"] == n:
                            return ev
                time.sleep(0.05)
            raise RuntimeError(f"generation {n} never formed")

        try:
            gen(1)
            time.sleep(2.0)  # let the ring reach steady state before the change
            tmp_hosts = hosts.with_suffix(".new")
            tmp_hosts.write_text(f"localhost:{end}\n")
            os.replace(tmp_hosts, hosts)
            ev = gen(2)
            stop.touch()
            proc.wait(timeout=120)
            return ev
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    scenarios = {"scale_out_delay0": (2, 3, 0.0), "scale_out_delay8": (2, 3, 8.0),
                 "scale_in": (3, 2, 0.0)}
    results = {k: [] for k in scenarios}
    for rep in range(a.reps):
        for name, (start, end, delay) in scenarios.items():
            ev = run_once(start, end, delay)
            results[name].append(ev)
            print(f"rep {rep} {name}: kind {ev['kind']} stall_s {ev['stall_s']:.3f} "
                  f"rolled_back_steps {ev['rolled_back_steps']}", flush=True)
    summary = {}
    for name, evs in results.items():
        stalls = [e["stall_s"] for e in evs]
        summary[name] = {"stall_s_median": statistics.median(stalls), "stall_s_min": min(stalls),
                         "stall_s_max": max(stalls), "stall_s": stalls,
                         "rolled_back_steps": [e["rolled_back_steps"] for e in evs]}
        print(f"{name:18s} stall median {summary[name]['stall_s_median']:.3f} s "
              f"(min {min(stalls):.3f}, max {max(stalls):.3f}, n={len(stalls)})")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "switch.json").write_text(json.dumps({"repetitions": a.reps, **summary}, indent=2))


if __name__ == "__main__":
    main()
