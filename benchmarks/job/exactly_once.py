"""Exactly-once data under one membership schedule, Horovod Elastic's sampler against ours.

The same training script (benchmarks/job/exactly_once_worker.py, Horovod's ``ElasticSampler``
signature, one long epoch) runs under ``horovodrun --gloo`` with Horovod 0.28.1's sampler and
under ``hvd-edl-run`` with hvd_edl's; both follow the same schedule inside the epoch, driven by
the steps seen in the ledger:

    2 workers -> scale-out to 3 -> graceful scale-in to 2 -> kill -9 of rank 1 -> to the end

and are audited by the same checker (hvd_edl.audit): repeated and missing indices in the
committed progress of the epoch.  Both launchers get ``--blacklist-cooldown-range 1 2`` so a
killed worker's host (the only one here) may come back.

    .venv/bin/python benchmarks/job/exactly_once.py   # writes benchmarks/results/exactly_once.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from hvd_edl import audit  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BIN = Path(sys.executable).parent
WORKER = ROOT / "benchmarks" / "job" / "exactly_once_worker.py"
DIGITS_TRAIN = 1347


def _steps(ledger: Path):
    return [r for r in audit.read_records(ledger) if r["kind"] == "step"]


def _wait(what: str, pred, proc, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"job ended (rc {proc.returncode}) before {what}")
        time.sleep(0.2)
    raise TimeoutError(f"no {what} within {timeout_s:.0f} s")


def run_schedule(system: str, work: Path, repeat: int, step_delay: float,
                 timeout_s: float) -> dict:
    """Run the schedule under ``system`` ("hvd_edl" or "horovod"); returns the audit figures,
    the phases reached and whether the job finished."""
    ledger = work / "ledger"
    ledger.mkdir(parents=True)
    hosts = work / "hosts"
    hosts.write_text("localhost:2\n")
    discover = work / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    common = ["-np", "2", "--min-np", "1", "--max-np", "3", "--host-discovery-script",
              str(discover), "--blacklist-cooldown-range", "1", "2"]
    # without --network-interface, horovodrun 0.28.1's elastic mode waits forever here for its
    # interface check
    launcher = ([str(BIN / "horovodrun"), "--gloo", "--network-interface", "lo"]
                if system == "horovod"
                else [str(BIN / "hvd-edl-run"), "--discovery-interval", "0.2"])
    cmd = launcher + common + [sys.executable, str(WORKER), "--system", system, "--ledger",
                               str(ledger), "--repeat-data", str(repeat),
                               "--step-delay", str(step_delay)]
    env = {k: v for k, v in os.environ.items() if k != audit.ENV_AUDIT_DIR}
    out = open(work / "launcher.out", "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT), env=env,
                            start_new_session=True)
    phases, t0 = [], time.monotonic()

    def sizes_after(step):
        return {r["size"] for r in _steps(ledger) if r["step"] > step}

    def max_step():
        return max((r["step"] for r in _steps(ledger)), default=0)

    try:
        _wait("20 steps at 2 workers", lambda: max_step() >= 20, proc, 120)
        for size, phase in ((3, "scale_out"), (2, "scale_in")):
            hosts.write_text(f"localhost:{size}\n")
            at = max_step()
            _wait(f"a step at {size} workers", lambda: size in sizes_after(at), proc, 120)
            phases.append(phase)
            at = max_step() + 10
            _wait("10 more steps", lambda: max_step() >= at, proc, 60)
        victim = max((r for r in _steps(ledger) if r["rank"] == 1),
                     key=lambda r: (r["gen"], r["step"]))
        pid = victim["pid"]
        at = max_step()
        os.kill(pid, signal.SIGKILL)
        phases.append("kill")
        _wait("a step after the kill", lambda: sizes_after(at) and any(
            r["step"] > at for r in _steps(ledger) if r["gen"] > victim["gen"]), proc, 180)
        phases.append("recovered")
        rc = proc.wait(timeout=timeout_s)
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
        phases.append(f"stopped: {e}")
        rc = proc.poll()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for child in psutil.process_iter(["cmdline"]):  # stray workers of this run
            if str(ledger) in " ".join(child.info["cmdline"] or []):
                child.kill()
        out.close()
    report = audit.check(ledger, DIGITS_TRAIN * repeat)
    epoch0 = next((e for e in report.epochs if e.epoch == 0), None)
    return {"system": system, "phases": phases, "finished": rc == 0, "returncode": rc,
            "wall_s": round(time.monotonic() - t0, 1), "dataset_size": DIGITS_TRAIN * repeat,
            "epoch_complete": bool(epoch0 and epoch0.complete),
            "repeated": epoch0.repeated if epoch0 else None,
            "missing": epoch0.missing if epoch0 and epoch0.complete else None,
            "distinct": epoch0.distinct if epoch0 else 0,
            "rolled_back_steps": epoch0.rolled_back_steps if epoch0 else None,
            "log_tail": (work / "launcher.out").read_text()[-1500:] if rc != 0 else ""}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat-data", type=int, default=20,
                   help="copies of the training set in the epoch (default 20: 26,940 samples)")
    p.add_argument("--step-delay", type=float, default=0.03)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--systems", default="horovod,hvd_edl")
    p.add_argument("--out", default=str(RESULTS / "exactly_once.json"))
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hvd_edl_exactly_once_") as tmp:
        for system in a.systems.split(","):
            r = run_schedule(system, Path(tmp) / system, a.repeat_data, a.step_delay, a.timeout)
            rows.append(r)
            print(f"{system:8s}: phases {', '.join(r['phases'])}; finished {r['finished']}; "
                  f"epoch complete {r['epoch_complete']}; repeated {r['repeated']}, missing "
                  f"{r['missing']} of {r['dataset_size']}; rolled-back steps "
                  f"{r['rolled_back_steps']}; {r['wall_s']} s", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"benchmark": "exactly-once under scale-out, scale-in, "
                                       "kill -9 in one epoch", "results": rows}, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
