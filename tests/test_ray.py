"""``hvd-edl-run --ray``: a real multi-node Ray cluster on the namespace cluster (a Ray head in
h1's namespace, a Ray node in h2's and, later, h3's; :mod:`ray_cluster`), the launcher on the
head's node (a Ray driver runs on a node of its cluster), real Horovod over Gloo between the
namespaces.  Skipped with the reason where the namespaces or ray are missing.

One cluster for the module (Ray's start-up is the slow part): the bad cases first, then one job
through every membership change Ray can make (a node added, a node drained, a node added again
at the same address under a new node id, a node's processes killed, a node cut off the
network, the Ray head lost), audited exactly-once throughout."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from cluster import Cluster, ClusterUnavailable
from conftest import LAUNCHER, ROOT, Job
from hvd_edl import audit

import ray_cluster

if importlib.util.find_spec("ray") is None:
    pytest.skip("ray is not installed (pip install ray)", allow_module_level=True)

ELASTIC_MAIN = str(ROOT / "tests" / "horovod_style" / "elastic_main.py")
DATASET = 256


@pytest.fixture(scope="module")
def ray_nodes():
    try:
        c = Cluster(hosts=3)
    except ClusterUnavailable as e:
        pytest.skip(f"no namespace cluster: {e}")
    r = ray_cluster.RayCluster(c)
    try:
        # the raylets give up 5 s after the head is lost (Ray's default: 60 s), so the test
        # sees the workers' actors die with them while the workers train on
        fast = {"RAY_gcs_rpc_server_reconnect_timeout_s": "5"}
        r.start("h1", head=True, cpus=1, env=fast, wait=False)
        r.start("h2", cpus=1, env=fast, wait=False)   # it waits for the head
        r.wait_started("h1")
        r.wait_started("h2")
        yield r
    finally:
        r.close()
        c.close()


class RayJob(Job):
    """A :class:`conftest.Job` whose launcher runs on the Ray head's node (h1's namespace)."""

    def __init__(self, r, tmp: Path, launcher_args: List[str], command: List[str],
                 env: dict = None):
        self.tmp = tmp
        self.events_path = tmp / "events.jsonl"
        self.out_path = tmp / "launcher.out"
        args = [LAUNCHER, "--event-log", str(self.events_path), "--job-file",
                str(tmp / "job.json")] + launcher_args
        self.out = open(self.out_path, "w")
        self.proc = r.c.popen(r.head, args + command, stdout=self.out,
                              stderr=subprocess.STDOUT, cwd=str(tmp),
                              env=env if env is not None else dict(os.environ))

    def node_id(self, addr: str) -> str:
        """The id of the newest Ray node at ``addr``, from the launcher's "ray: node" lines."""
        def find():
            ids = [ln.split()[3] for ln in self.output().splitlines()
                   if ln.startswith("hvd-edl-run: ray: node ") and f"({addr})" in ln]
            return ids[-1] if ids else None
        return self.wait_for(f"a Ray node at {addr}", find, 60)

    def generation_after(self, number: int, kind: str, timeout_s: float = 60.0) -> dict:
        return self.wait_for(f"a {kind} generation after {number}", lambda: next(
            (e for e in self.events() if e["generation"] > number and e["kind"] == kind), None),
            timeout_s)


def _run(r, tmp: Path, args: List[str]) -> subprocess.CompletedProcess:
    return subprocess.run(r.c.exec_argv(r.head, [LAUNCHER, *args, sys.executable, "-c", "0"]),
                          capture_output=True, text=True, timeout=90, cwd=str(tmp))


def test_a_gpu_worker_sees_its_reserved_gpu_at_its_local_rank():
    """With ``--gpus-per-worker 1`` Ray gives each actor one GPU; the worker sees the node's GPUs
    with that one at index ``slot``, so ``set_device(hvd.local_rank())`` picks it."""
    from launcher.ray.actor import device_order
    assert device_order(["3"], 4, 1) == "0,3,1,2"
    assert device_order(["0"], 2, 0) == "0,1"
    assert device_order(["0"], 2, 1) == "1,0"
    assert device_order([], 2, 0) is None and device_order(["0", "1"], 2, 0) is None


def test_ray_bad_cases_are_one_line_and_exit_2(ray_nodes, tmp_path):
    """No Ray at the address; no node that can hold one worker: one line each, exit 2,
    nothing started."""
    r = ray_nodes
    nobody = f"{r.c.hosts['h3'].addr}:6379"   # a host of the bridge where no Ray runs
    out = _run(r, tmp_path, ["--ray", nobody, "-np", "1"])
    assert out.returncode == 2, out
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("hvd-edl-run: error")]
    assert len(lines) == 1 and f"--ray {nobody}" in lines[0], out.stderr
    out = _run(r, tmp_path, ["--ray", r.address, "--cpus-per-worker", "64", "-np", "1"])
    assert out.returncode == 2, out
    assert "no node of the Ray cluster" in out.stderr and "64" in out.stderr, out.stderr
    out = _run(r, tmp_path, ["--ray", r.address, "-H", "h2:1", "-np", "1"])
    assert out.returncode == 2 and "--ray takes the hosts" in out.stderr, out.stderr


def test_ray_nodes_drive_the_job_and_every_sample_is_used_once(ray_nodes, tmp_path):
    """Horovod's elastic script, one import changed, on Ray: it starts on the head's node and
    h2's; h3 joins as a Ray node (stop-free scale-out); h3 is drained (``ray drain-node``, a
    spot notice: a graceful leave, nothing rolled back); h2 is cut off the network (found by
    our heartbeats, not Ray's health checks: the survivor trains again within 3 s); a new Ray
    node at h3's address (a new node id) joins; h3's processes are killed (the survivor trains
    again within 3 s); the Ray head is lost (the job goes on with its worker, says so, and its
    worker outlives its actor).  Every sample of every epoch is used exactly once."""
    r = ray_nodes
    ledger = tmp_path / "ledger"
    env = dict(os.environ, **{audit.ENV_AUDIT_DIR: str(ledger)})
    stop = tmp_path / "stop"
    job = RayJob(r, tmp_path, ["--ray", r.address, "--min-np", "1", "--max-np", "4",
                               "--discovery-interval", "0.2"],
                 [sys.executable, ELASTIC_MAIN, "--epochs", "0", "--stop-file", str(stop),
                  "--dataset-size", str(DATASET), "--batch-size", "8", "--step-delay", "0.01",
                  "--batches-per-commit", "2", "--logfile", str(tmp_path / "log.jsonl")],
                 env=env)
    t0 = time.monotonic()
    marks = []

    def mark(what):
        marks.append(f"{what} {time.monotonic() - t0:.1f}")

    try:
        first = job.wait_generation(1, 90)
        mark("start")
        assert first["world_size"] == 2, first

        r.start("h3", cpus=1)                                          # a node added
        mark("h3 up")
        out = job.generation_after(first["generation"], "scale_out")
        assert out["world_size"] == 3, out
        h3 = job.node_id(r.c.hosts["h3"].addr)
        assert any(m.split("@")[1].startswith(h3) for m in out["joined"]), out
        mark("scale-out")

        drained = r.drain("h3", h3)                                    # a node drained
        assert drained.returncode == 0, drained.stderr
        inn = job.generation_after(out["generation"], "scale_in")
        assert inn["world_size"] == 2 and inn["rolled_back_steps"] == 0, inn
        assert "is being drained" in job.output()
        mark("drain")
        r.kill_all("h3")                      # the provider ends the drained node
        # a new node at the same address (a new node id) boots while h2 is cut off
        r.start("h3", cpus=1, wait=False)

        r.c.cut("h2")                                                  # a node cut off
        cut = job.generation_after(inn["generation"], "failure")
        assert cut["world_size"] == 1 and cut["stall_s"] < 3.0, cut
        assert "fell silent" in job.output()
        mark("cut")

        r.wait_started("h3")
        mark("h3 up again")
        # the job's own bounds, not a guess of ours: the actor is placed within --start-timeout
        # (120 s) and its worker dials back within LINK_TIMEOUT_S, or the job says so; on two
        # loaded cores a fresh node's first worker process once took over 60 s
        again = job.generation_after(cut["generation"], "scale_out", 160)
        assert again["world_size"] == 2, again
        assert job.node_id(r.c.hosts["h3"].addr) != h3
        mark("scale-out")

        r.kill_all("h3")                                               # a node's processes killed
        fail = job.generation_after(again["generation"], "failure")
        assert fail["world_size"] == 1 and fail["stall_s"] < 3.0, fail
        mark("kill")

        gcs = r.pid_of(r.head, "gcs_server")                           # the Ray head lost
        os.kill(gcs, 9)
        steps_then = len(audit.read_records(ledger))
        job.wait_for("the head's loss said", lambda: "looks lost; the job goes on with the 1 "
                     "worker" in job.output(), 30)
        raylet = r.pid_of(r.head, "raylet")
        job.wait_for("the head node's raylet to give up", lambda: raylet is None or
                     not Path(f"/proc/{raylet}").exists(), 30)
        job.wait_for("training after the head's loss", lambda: len(
            audit.read_records(ledger)) > steps_then + 20, 30)
        stop.touch()
        mark("head lost")
        assert job.finish(60) == 0, job.output()[-3000:]
        mark("end")
    finally:
        job.stop()
        print("ray timetable (s):", ", ".join(marks))  # also when a step failed
    print(f"ray: scale-out stall {out['stall_s']:.3f} s, drain {inn['stall_s']:.3f} s, "
          f"node killed {fail['stall_s']:.3f} s, node cut off {cut['stall_s']:.3f} s")
    report = audit.check(ledger, DATASET)
    assert report.epochs and all(e.complete for e in report.epochs), report.to_dict()
    assert (report.repeated, report.missing) == (0, 0), report.to_dict()
