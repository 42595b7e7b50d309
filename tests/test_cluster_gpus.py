"""Every job of the cluster service on its own GPUs (``serve --assume-gpus``: each slot of this
CPU machine's pool stands for GPU 0..3).  A sampler reads every live worker process's own
environment (``/proc/PID/environ``: ``CUDA_VISIBLE_DEVICES`` and ``HOROVOD_LOCAL_RANK``) all
through the run and finds the GPU ``torch.cuda.set_device(hvd.local_rank())`` selects in it;
the invariant checked at every sample: no GPU is selected by two live workers, of one job or of
two, also while a shrinking job's leavers finish."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

from test_cluster_service import assert_exactly_once, ledger, service, wait_for  # noqa: F401

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks.common.gpu_sampler import GpuSampler  # noqa: E402

pytestmark = pytest.mark.xdist_group("cluster-gpus")


def ring_size(state: Path, job: str) -> int:
    """The world size of the job's newest generation (its first run's event log), 0 before."""
    path = state / "jobs" / job / "run1.events.jsonl"
    sizes = [json.loads(x)["world_size"] for x in path.read_text().splitlines()
             if '"generation"' in x] if path.exists() else []
    return sizes[-1] if sizes else 0


def _j1_on_four(svc, tmp: Path, marker: str, audit_dir: Path, linger_s: float) -> str:
    """j1 (1 to 4 GPUs, training until ``tmp/stop1``, its processes lingering ``linger_s`` in
    their teardown) lent all 4 GPUs, with its ring of 4 trained; returns its id."""
    j1 = svc.submit("--env", f"HVD_EDL_TEST_MARKER={marker}", "--min-np", "1",
                    "--max-np", "4", *ledger(tmp, "j1", 256, epochs=1000, delay=0.03),
                    "--linger-s", str(linger_s), "--stop-file", str(tmp / "stop1"),
                    audit_dir=audit_dir)
    svc.wait_jobs(lambda j: j[j1]["world_size"] == 4, "j1 on 4 GPUs")
    wait_for("j1 training on 4", lambda: ring_size(svc.state, j1) == 4, 90, svc.job_logs)
    return j1


def _both_done_once_j2_runs(svc, tmp: Path, j2: str) -> dict:
    """j1 trains on until j2 runs, then to its epoch's end; the jobs once both are done.
    j2 starts once j1's leavers have exited (their teardown, 4 s of linger, at their own
    priority): 7-10 s after the shrink beside 4 CPU burners at load 19; 90 s bounds it at
    several times a loaded machine's worst (a niced teardown once took 38.8 s there)."""
    wait_for("j2 started", lambda: svc.events(j2, "run"), 90,
             lambda: json.dumps(svc.events()[-12:]) + svc.output() + svc.job_logs())
    (tmp / "stop1").touch()
    return svc.wait_jobs(lambda j: all(x["state"] == "done" for x in j.values()),
                         "both done", timeout_s=150)


def test_two_jobs_on_one_host_never_share_a_gpu_through_a_shrink(service, tmp_path):
    """edl on a 4-GPU host: j1 grows to GPUs 0-3; j2 arrives, j1 gives back its last two
    (a stop-free shrink: its workers on GPUs 0 and 1 keep them), j2 starts on GPUs 2 and 3 once
    j1's leavers have exited (they linger 4 s in their teardown, as a process releasing a GPU's
    memory does).  No sample ever shows one GPU selected by two live workers; both
    jobs finish exactly once."""
    marker = f"gpus-{os.getpid()}-{time.monotonic_ns()}"
    os.environ["HVD_EDL_TEST_MARKER"] = marker  # the service's jobs inherit it (the sampler's key)
    sampler = None
    try:
        svc = service("--policy", "edl", "--hold", "2", "--assume-gpus", "-H", "localhost:4")
        sampler = GpuSampler(marker)
        a1, a2 = tmp_path / "a1", tmp_path / "a2"
        j1 = _j1_on_four(svc, tmp_path, marker, a1, linger_s=4)
        shown = wait_for("status showing j1's 4 workers", lambda: (lambda w: w if len(w) == 4
                         else None)(svc.jobs()[j1]["workers"]), 30)
        assert sorted((w["host"], w["slot"], w["gpu"]) for w in shown) == \
            [("localhost", i, str(i)) for i in range(4)], shown
        assert svc.jobs()[j1]["gpus"] == {"localhost": ["0", "1", "2", "3"]}
        j2 = svc.submit("--env", f"HVD_EDL_TEST_MARKER={marker}", "--np", "2",
                        *ledger(tmp_path, "j2", 96), audit_dir=a2)
        jobs = _both_done_once_j2_runs(svc, tmp_path, j2)
    finally:
        os.environ.pop("HVD_EDL_TEST_MARKER", None)
        if sampler is not None:
            sampler.stop()
    assert sampler.shared_gpus() == [], sampler.shared_gpus()[:5]
    by_run: Dict[str, List[str]] = {}
    for (run, worker), row in sampler.runs.items():
        by_run.setdefault(run, []).append(row[1])
    seen = {run.rsplit("/", 2)[-2]: sorted(g) for run, g in by_run.items()}
    why = (seen, sampler.runs, sampler.unreadable[:5], svc.job_logs()[-6000:])
    assert seen == {j1: ["0", "1", "2", "3"],  # j1: all four, then 0, 1
                    j2: ["2", "3"]}, why       # j2: the two given back
    released = svc.events(j1, "released")
    assert released, svc.events(j1)
    assert jobs[j1]["runs"] == 1 and jobs[j2]["runs"] == 1, jobs
    assert_exactly_once(a1, 256)
    assert_exactly_once(a2, 96)
    print(f"j1's leavers' slots released {released[0]['released_s']:.1f} s after its shrink")


def test_a_service_killed_mid_shrink_still_holds_the_leavers_gpus(service, tmp_path):
    """The service is killed (-9) right after it wrote j1's shrink, before j1's leavers exited:
    the restarted service re-adopts j1 and still holds the GPUs it gave back (``held.json``)
    until its telemetry shows those workers gone, so j2 never starts on a GPU a leaver uses."""
    marker = f"gpus-{os.getpid()}-{time.monotonic_ns()}"
    os.environ["HVD_EDL_TEST_MARKER"] = marker
    sampler = None
    try:
        svc = service("--policy", "edl", "--hold", "2", "--assume-gpus", "-H", "localhost:4")
        sampler = GpuSampler(marker, period_s=0.05)
        a1, a2 = tmp_path / "a1", tmp_path / "a2"
        j1 = _j1_on_four(svc, tmp_path, marker, a1, linger_s=6)
        j2 = svc.submit("--env", f"HVD_EDL_TEST_MARKER={marker}", "--np", "2",
                        *ledger(tmp_path, "j2", 96), audit_dir=a2)
        wait_for("j1's shrink written", lambda: svc.events(j1, "shrink"), 60, svc.output)
        svc.kill9()
        held = json.loads((svc.state / "held" / f"{j1}.json").read_text())
        svc.start()
        jobs = _both_done_once_j2_runs(svc, tmp_path, j2)
    finally:
        os.environ.pop("HVD_EDL_TEST_MARKER", None)
        if sampler is not None:
            sampler.stop()
    assert sorted(held["held"]["localhost"]) == ["0", "1", "2", "3"], held  # leavers' GPUs kept
    assert held["lists"]["localhost"] == ["0", "1"], held
    assert sampler.shared_gpus() == [], sampler.shared_gpus()[:5]
    assert svc.events(j1, "adopt"), svc.events(j1)
    assert jobs[j1]["runs"] == 1 and jobs[j2]["runs"] == 1, jobs
    assert_exactly_once(a1, 256)
    assert_exactly_once(a2, 96)
