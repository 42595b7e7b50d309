"""Straggler mitigation, measured: detection time and throughput before, during and after, against
a same-size job without a straggler, in one run (EDL, arXiv 1909.11985, section 5).

Pairs of jobs (hvd-edl-run, the digits CNN, 2 workers on the hosts ``localhost:2`` and
``127.0.0.1:1``: a job uses localhost's two slots, 127.0.0.1's is free), the two jobs of a pair
at the same time, so that they see the same load; the pairs one after the other:

* ``replace``: the worker on localhost:1 computes 3x slower from ``--slow-after`` seconds after
  its first step (``train_digits.py --slow-worker localhost:1:3:S``), policy replace;
* ``evict``: the same, policy evict (the ring shrinks to 1, then the free slot is filled);
* beside each, ``clean``: no straggler, policy replace (a false positive would show as a note).

Throughput: the job's samples/s from the heartbeats' cumulative step counts (``/ctl/telemetry``,
every 0.5 s, asks the workers nothing; samples = steps x 16 per rank), over

* before: from 5 s after the first step to the slowdown;
* during: from the slowdown to the mitigating generation (the ring's pace is the straggler's);
* after: from 5 s after the last generation to the end of the run;

and for the clean job over the same (wall-clock) intervals.  Detection time: from the
wall-clock time in the worker's "slow-worker: ... from now (T)" line to the time of the
launcher's "straggler" note in the event log.  Goal (issue 16): detection <= 10 s, after >= 0.9
x the clean job.

    .venv/bin/python benchmarks/apps/straggler.py            # about 2-3 minutes
    .venv/bin/python benchmarks/apps/straggler.py --only replace

Writes benchmarks/results/straggler.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent
DIGITS = str(ROOT / "examples" / "train_digits.py")
RESULTS = ROOT / "benchmarks" / "results"
BATCH = 16
SETTLE_S = 5.0

from launcher.serve.control import ControlClient, ControlError  # noqa: E402


class Run:
    """One hvd-edl-run job: its output lines timestamped as they arrive, and a telemetry poll."""

    def __init__(self, tmp: Path, policy: str, slow: Optional[str], step_delay: float):
        self.tmp = tmp
        (tmp / "hosts").write_text("localhost:2\n127.0.0.1:1\n")
        self.job_file = tmp / "job.json"
        self.events = tmp / "events.jsonl"
        cmd = [str(BIN / "hvd-edl-run"), "--event-log", str(self.events), "--job-file",
               str(self.job_file), "-np", "2", "--min-np", "1", "--max-np", "2",
               "--discovery-interval", "0.5", "--host-discovery-script",
               f"cat {tmp / 'hosts'}", "--straggler-policy", policy,
               sys.executable, DIGITS, "--epochs", "100000", "--stop-file", str(tmp / "stop"),
               "--step-delay", str(step_delay)]
        if slow:
            cmd += ["--slow-worker", slow]
        self.lines: List[Tuple[float, str]] = []
        self.samples: List[Tuple[float, int]] = []   # (monotonic, cumulative samples)
        self.steps: Dict[str, int] = {}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=str(ROOT))
        threading.Thread(target=self._read, daemon=True).start()
        self._stop = threading.Event()
        threading.Thread(target=self._poll, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def _poll(self) -> None:
        client = None
        while not self._stop.is_set():
            time.sleep(0.5)
            if client is None:
                if not self.job_file.exists():
                    continue
                try:
                    client = ControlClient(self.job_file, timeout_s=5)
                except ControlError:
                    continue
            try:
                t = client.call("telemetry")
            except ControlError:
                continue
            for w in t["workers"]:
                self.steps[w["worker_id"]] = max(self.steps.get(w["worker_id"], 0), w["steps"])
            self.samples.append((time.monotonic(), BATCH * sum(self.steps.values())))

    def first(self, pattern: str) -> Optional[float]:
        """Arrival time of the first output line matching ``pattern`` (None: none yet)."""
        rx = re.compile(pattern)
        return next((t for t, line in list(self.lines) if rx.search(line)), None)

    def wait(self, pattern: str, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            t = self.first(pattern)
            if t is not None:
                return t
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"no line matching {pattern!r} within {timeout_s} s:\n"
                           + "\n".join(line for _, line in self.lines[-30:]))

    def rate(self, since: float, until: float) -> Optional[float]:
        """Samples/s between two monotonic times (from the polls nearest inside them)."""
        inside = [(t, n) for t, n in self.samples if since <= t <= until]
        if len(inside) < 2 or inside[-1][0] - inside[0][0] < 1.0:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    def finish(self) -> int:
        (self.tmp / "stop").touch()
        try:
            code = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            code = self.proc.wait(timeout=30)
        self._stop.set()
        return code

    def notes(self) -> List[dict]:
        lines = [json.loads(x) for x in self.events.read_text().splitlines() if x]
        return lines


def _first_step(run: Run, timeout_s: float = 120.0) -> float:
    run.wait(r"generation 1 \(start\)", timeout_s)
    deadline = time.monotonic() + 60
    while (not run.samples or run.samples[-1][1] == 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    return run.samples[-1][0]


def run_pair(kind: str, args, tmp_root: Path) -> dict:
    """The straggler job (policy ``kind``) and a clean job (no straggler, policy replace) side by
    side, at the same time (the same load); rates over the same wall-clock intervals."""
    slow = f"localhost:1:{args.factor:g}:{args.slow_after:g}"
    (tmp_root / kind).mkdir()
    (tmp_root / f"clean-{kind}").mkdir()
    run = Run(tmp_root / kind, kind, slow, args.step_delay)
    clean = Run(tmp_root / f"clean-{kind}", "replace", None, args.step_delay)
    try:
        return _measure_pair(kind, args, slow, run, clean)
    finally:
        for r in (run, clean):
            if r.proc.poll() is None:
                r.proc.terminate()
                r.proc.wait(timeout=60)


def _measure_pair(kind: str, args, slow: str, run: Run, clean: Run) -> dict:
    t0 = max(_first_step(run), _first_step(clean))
    t_slow = run.wait(r"slow-worker: .* from now", args.slow_after + 60)
    t_found = run.wait(r"hvd-edl-run: straggler: worker .* compute", 60)
    t_mitigated = run.wait(r"generation \d+ \(replace\)" if kind == "replace" else
                           r"generation \d+ \(scale_in\)", 120)
    # evict: the ring grows back on the free slot (the straggler's rests)
    t_last = t_mitigated if kind == "replace" else \
        run.wait(r"generation \d+ \(scale_out\)", 120)
    end = t_last + SETTLE_S + args.after_s
    while time.monotonic() < end and run.proc.poll() is None:
        time.sleep(0.5)
    codes = (run.finish(), clean.finish())
    intervals = {"before": (max(t0 + SETTLE_S, t_slow - args.slow_after + SETTLE_S), t_slow),
                 "during": (t_slow, t_mitigated),
                 "after": (t_last + SETTLE_S, end)}
    throughput = {}
    for phase, (lo, hi) in intervals.items():
        mine, ref = run.rate(lo, hi), clean.rate(lo, hi)
        throughput[phase] = {"seconds": round(hi - lo, 1),
                             "samples_per_s": mine and round(mine, 1),
                             "clean_samples_per_s": ref and round(ref, 1),
                             "ratio": round(mine / ref, 3) if mine and ref else None}

    def gens(r: Run) -> List[dict]:
        return [{k: e[k] for k in ("generation", "kind", "world_size", "stall_s",
                                   "rolled_back_steps")} for e in r.notes() if "kind" in e]
    # detection from the worker's own clock to the note's (wall clock, one machine): output
    # lines can arrive late here on a loaded machine
    slow_line = next(line for _, line in run.lines if re.search(r"slow-worker: .* from now",
                                                                  line))
    slow_wall = float(re.search(r"from now \(([\d.]+)\)", slow_line).group(1))
    found = next(n for n in run.notes() if n.get("event") == "straggler")
    return {"policy": kind, "slow_worker": slow, "exit_codes": codes,
            "detection_s": round(found["time"] - slow_wall, 2),
            "mitigation_s": round(t_mitigated - t_found, 2),
            "throughput": throughput,
            "straggler_notes": [n for n in run.notes() if n.get("event") == "straggler"],
            "generations": gens(run),
            "clean": {"straggler_notes": [n for n in clean.notes()
                                          if n.get("event") == "straggler"],
                      "generations": gens(clean)}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("replace", "evict"), help="one policy only")
    p.add_argument("--factor", type=float, default=3.0, help="the straggler's slowdown")
    p.add_argument("--slow-after", type=float, default=15.0,
                   help="seconds after its first step the straggler slows down")
    p.add_argument("--after-s", type=float, default=15.0,
                   help="seconds measured after the mitigation settled")
    p.add_argument("--step-delay", type=float, default=0.01,
                   help="train_digits --step-delay (s; stands for a heavier model)")
    p.add_argument("--out", default=str(RESULTS / "straggler.json"))
    a = p.parse_args(argv)
    load_before = os.getloadavg()
    kinds = ["replace", "evict"] if a.only is None else [a.only]
    summary: dict = {}
    with tempfile.TemporaryDirectory(prefix="hvd-edl-straggler-") as tmp:
        for kind in kinds:
            try:
                summary[kind] = run_pair(kind, a, Path(tmp))
            except RuntimeError as e:  # a pair that did not get through: say so, go on
                summary[kind] = {"policy": kind, "error": str(e)[:2000]}
                print(f"{kind}: failed: {str(e)[:300]}", file=sys.stderr)
    summary["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "load_before": [round(x, 2) for x in load_before],
                          "load_after": [round(x, 2) for x in os.getloadavg()]}
    summary["settings"] = {k: getattr(a, k) for k in ("factor", "slow_after", "after_s",
                                                     "step_delay")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(summary, indent=2) + "\n")
    for kind in kinds:
        r = summary[kind]
        if "error" in r:
            continue
        t = r["throughput"]
        print(f"{kind}: detection {r['detection_s']} s, mitigated {r['mitigation_s']} s later; "
              + ", ".join(f"{ph} {t[ph]['samples_per_s']} samples/s ({t[ph]['ratio']} x clean "
                          f"{t[ph]['clean_samples_per_s']})" for ph in ("before", "during",
                                                                       "after"))
              + f"; clean job's straggler notes: {len(r['clean']['straggler_notes'])}")
    print(f"load {summary['machine']}; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
