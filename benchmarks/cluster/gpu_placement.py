"""Every worker of every job on its own GPU, through a scenario an operator's pool sees: jobs
growing, shrinking (stop-free) and growing again, and the service killed (-9) in the middle of a
shrink and restarted; printed as a table of every worker (job, host, GPU, from - to) and the
check, by sampling every live worker's own environment every 0.1 s, that no GPU was ever
selected by two live workers (issue 39's "must show").

    .venv/bin/python benchmarks/cluster/gpu_placement.py        # about 1-2 minutes, 2 cores

``hvd-edl-cluster serve --policy edl --hold 2 --assume-gpus -H localhost:4`` (4 GPUs named
0-3: this machine has none; what is checked is what each real worker process starts with and
what ``torch.cuda.set_device(hvd.local_rank())`` selects from it).  j1 (``--min-np 1 --max-np
4``) is lent the 4 GPUs; j2 (``--np 2``) arrives, j1 gives back two GPUs by a stop-free
scale-in and the service is killed right after writing that shrink, then restarted (its leavers
linger 2 s in their teardown, as a process freeing GPU memory does); once j2 is done j1 is lent
them again; j3 (``--np 1``) takes one back; then j1 is stopped.  The training scripts are
tests/horovod_style/ledger_main.py (Horovod's API, audited exactly-once).

Written to benchmarks/results/gpu_placement.json (``--out``).
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
from benchmarks.common.cluster_service import Serve, wait_for  # noqa: E402
from benchmarks.common.gpu_sampler import GpuSampler  # noqa: E402

LEDGER = str(ROOT / "tests" / "horovod_style" / "ledger_main.py")
CLI = [sys.executable, "-m", "launcher.cluster.cli"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_placement.json"),
                    help="where the table and the check go (default benchmarks/results/"
                         "gpu_placement.json)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpu-placement-"))
    marker = f"gpu-placement-{os.getpid()}"
    os.environ["HVD_EDL_TEST_MARKER"] = marker
    svc = Serve(tmp, "edl", {"hosts": {"localhost": 4}})
    svc.extra = ["--hold", "2", "--assume-gpus"]
    svc.start()
    t0 = time.monotonic()
    sampler = GpuSampler(marker)

    def submit(*args: str) -> str:
        r = subprocess.run(CLI + ["--cluster", str(svc.cluster), "submit", "--env",
                                  f"HVD_EDL_TEST_MARKER={marker}", *args], capture_output=True,
                           text=True, timeout=60, cwd=str(ROOT))
        if r.returncode != 0:
            raise RuntimeError(f"submit: {r.stderr.strip()}")
        return r.stdout.strip().splitlines()[-1]

    def ledger(name: str, samples: int, epochs: int = 1, *extra: str):
        return ["--", sys.executable, LEDGER, "--dataset-size", str(samples), "--batch-size",
                "8", "--epochs", str(epochs), "--step-delay", "0.03", "--done-log",
                str(tmp / f"{name}.done"), "--linger-s", "2", *extra]

    def jobs():
        return {j["id"]: j for j in svc.call("status")["jobs"]}

    def events(job, kind):
        path = svc.state / "events.jsonl"
        return [e for e in map(json.loads, path.read_text().splitlines())
                if e.get("job") == job and e.get("kind") == kind]

    notes = []
    try:
        j1 = submit("--name", "j1", "--min-np", "1", "--max-np", "4",
                    *ledger("j1", 256, 1000, "--stop-file", str(tmp / "stop1")))
        wait_for("j1 on 4 GPUs", lambda: len(jobs()[j1]["workers"]) == 4, 120)
        notes.append((time.monotonic() - t0, "j1 trains on 4 GPUs"))
        j2 = submit("--name", "j2", "--np", "2", *ledger("j2", 192))
        wait_for("j1's shrink", lambda: events(j1, "shrink"), 120)
        svc.proc.kill()
        svc.proc.wait(10)
        notes.append((time.monotonic() - t0, "service killed (-9) right after j1's shrink"))
        svc.start()
        notes.append((time.monotonic() - t0, "service restarted"))
        wait_for("j2 done", lambda: jobs()[j2]["state"] == "done", 120)
        wait_for("j1 lent 4 again", lambda: len(jobs()[j1]["workers"]) == 4, 120)
        notes.append((time.monotonic() - t0, "j2 done, j1 back on 4"))
        j3 = submit("--name", "j3", "--np", "1", *ledger("j3", 64))
        wait_for("j3 done", lambda: jobs()[j3]["state"] == "done", 120)
        (tmp / "stop1").touch()
        wait_for("j1 done", lambda: jobs()[j1]["state"] == "done", 120)
        notes.append((time.monotonic() - t0, "j3 done, j1 stopped"))
        states = {j: jobs()[j]["state"] for j in (j1, j2, j3)}
    finally:
        sampler.stop()
        svc.stop()
        os.environ.pop("HVD_EDL_TEST_MARKER", None)
    launcher_job = {}
    for (launcher, worker), (gpu, first, last) in sampler.seen.items():
        launcher_job.setdefault(launcher, len(launcher_job) + 1)
    rows = sorted(({"job": f"run of launcher {launcher}", "launcher": launcher, "worker": worker,
                    "host": "localhost", "gpu": gpu, "from_s": round(first - t0, 1),
                    "to_s": round(last - t0, 1)}
                   for (launcher, worker), (gpu, first, last) in sampler.seen.items()),
                  key=lambda r: (r["from_s"], r["launcher"]))
    by_launcher = {}
    for r in rows:
        by_launcher.setdefault(r["launcher"], len(by_launcher) + 1)
    names = {1: "j1", 2: "j2", 3: "j3"}
    for r in rows:
        r["job"] = names.get(by_launcher[r["launcher"]], f"job{by_launcher[r['launcher']]}")
    shared = sampler.shared_gpus()
    print(f"{'job':<5}{'worker':<8}{'host':<11}{'GPU':>4}{'from s':>9}{'to s':>8}")
    for r in rows:
        print(f"{r['job']:<5}{r['worker']:<8}{r['host']:<11}{r['gpu']:>4}{r['from_s']:>9}"
              f"{r['to_s']:>8}")
    for at, what in notes:
        print(f"  {at:6.1f} s  {what}")
    verdict = "no GPU ever selected by two live workers" if not shared else \
        f"{len(shared)} samples with a GPU used twice"
    print(f"{len(sampler.samples)} samples of every worker's environment, every 0.1 s: "
          f"{verdict}; jobs {states}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"rows": rows, "notes": notes, "samples": len(
        sampler.samples), "shared": shared[:20], "states": states,
        "command": "benchmarks/cluster/gpu_placement.py"}, indent=1))
    return 0 if not shared and all(s == "done" for s in states.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
