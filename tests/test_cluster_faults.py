"""The cluster service under faults (issue 39, section 3), with real processes: slots (GPUs,
``serve --assume-gpus``) never used by two jobs' live processes, sampled from outside
(``/proc/PID/environ``, :class:`benchmarks.common.gpu_sampler.GpuSampler`)."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Set

import psutil
import pytest

from test_cluster_service import ledger, service, wait_for  # noqa: F401

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks.common.gpu_sampler import GpuSampler, environ  # noqa: E402

pytestmark = pytest.mark.xdist_group("cluster-faults")

RUN_ENV = "HVD_EDL_CLUSTER_RUN"  # launcher.cluster.runs.MARKER_ENV


class RunSampler:
    """Every ``period_s``: the cluster runs (their ``HVD_EDL_CLUSTER_RUN``) of the live processes
    that carry ``HVD_EDL_TEST_MARKER=marker`` and a worker id (workers and what they started)."""

    def __init__(self, marker: str, period_s: float = 0.05):
        self.marker = marker
        self.samples: List[tuple] = []  # (monotonic, {run marker: pids})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
        self._thread.start()

    def _run(self, period_s: float) -> None:
        while not self._stop.is_set():
            runs: Dict[str, Set[int]] = {}
            for pid in psutil.pids():
                env = environ(pid)
                if env and env.get("HVD_EDL_TEST_MARKER") == self.marker \
                        and "HVD_EDL_WORKER_ID" in env:
                    runs.setdefault(env.get(RUN_ENV, "?"), set()).add(pid)
            self.samples.append((time.monotonic(), runs))
            self._stop.wait(period_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def ring_size(state: Path, job: str) -> int:
    path = state / "jobs" / job / "run1.events.jsonl"
    sizes = [json.loads(x)["world_size"] for x in path.read_text().splitlines()
             if '"generation"' in x] if path.exists() else []
    return sizes[-1] if sizes else 0


def test_a_killed_launchers_orphans_keep_its_slots_until_they_are_gone(service, tmp_path):
    """fifo on 2 GPUs: j1 holds both, j2 waits.  ``kill -9`` of j1's ``hvd-edl-run``: its
    workers die at once (PR_SET_PDEATHSIG), but each had started a helper process (as a data
    loader's worker) that lives 3 s longer, on the worker's GPU.  j2 starts only once they are
    gone: no sample shows j1's and j2's processes alive together (before the fix j2 started
    within about 1 s, beside them)."""
    marker = f"faults-{os.getpid()}-{time.monotonic_ns()}"
    os.environ["HVD_EDL_TEST_MARKER"] = marker
    gpus = runs = None
    try:
        svc = service("--policy", "fifo", "--assume-gpus", "-H", "localhost:2")
        gpus, runs = GpuSampler(marker, period_s=0.05), RunSampler(marker)
        j1 = svc.submit("--env", f"HVD_EDL_TEST_MARKER={marker}", "--np", "2",
                        *ledger(tmp_path, "j1", 256, epochs=1000, delay=0.03),
                        "--child-linger-s", "3")
        wait_for("j1 training on 2", lambda: ring_size(svc.state, j1) == 2, 90, svc.job_logs)
        j2 = svc.submit("--env", f"HVD_EDL_TEST_MARKER={marker}", "--np", "2",
                        *ledger(tmp_path, "j2", 32))
        launcher = json.loads((svc.state / "jobs" / j1 / "job.json").read_text())["pid"]
        os.kill(launcher, signal.SIGKILL)
        killed = time.monotonic()
        jobs = svc.wait_jobs(lambda j: j[j2]["state"] == "done", "j2 done", timeout_s=90)
    finally:
        os.environ.pop("HVD_EDL_TEST_MARKER", None)
        for s in (gpus, runs):
            if s is not None:
                s.stop()
    run1 = str(svc.state / "jobs" / j1 / "run1")
    run2 = str(svc.state / "jobs" / j2 / "run1")
    orphans = [t for t, r in runs.samples if t > killed + 0.5 and run1 in r]
    assert orphans, "j1's helpers were never seen after its launcher's kill"  # the window exists
    both = [(round(t - killed, 2), {k: sorted(v) for k, v in r.items()})
            for t, r in runs.samples if run1 in r and run2 in r]
    assert both == [], both[:5]
    # a worker's helper uses its worker's GPU (one job): two runs on one GPU is the fault
    run_of = {pid: run for _, r in runs.samples for run, pids in r.items() for pid in pids}
    shared = [(g, users) for g, users in gpus.shared_gpus()
              if len({run_of.get(pid, pid) for pid, _, _ in users}) > 1]
    assert shared == [], shared[:5]
    assert jobs[j1]["state"] == "failed", jobs[j1]
    held = svc.events(j1, "orphans")
    assert held and "still alive" in held[0]["reason"], svc.events(j1)
    started = [t for t, r in runs.samples if run2 in r][0]
    print(f"j1's orphans last seen {max(orphans) - killed:.2f} s after the kill; j2's first "
          f"process {started - killed:.2f} s after it")
