"""Every worker on its own GPU, named by the host line (``host gpus=5,3``, docs/gpus.md): the
worker in slot i starts with ``CUDA_VISIBLE_DEVICES`` listing the line's GPUs in slot order, so
index i -- its local rank, what a Horovod script passes to ``torch.cuda.set_device`` -- is its
own GPU; a line that moves a slot to another GPU replaces that slot's worker stop-free, and
Horovod's ``host:slots`` lines keep today's behaviour.  On this CPU machine the GPUs are names:
what is checked is the environment each real worker process starts with and what
``set_device(hvd.local_rank())`` would select from it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import LAUNCHER, ROOT
from launcher.discovery import FixedHosts
from launcher.discovery.hosts import HostLine, HostSpecError, parse_host_specs

SCRIPT = ROOT / "tests" / "horovod_style" / "elastic_main.py"


def _records(env_file: Path):
    return [json.loads(x) for x in env_file.read_text().splitlines()] if env_file.exists() else []


def selected_gpu(record: dict) -> str:
    """What ``torch.cuda.set_device(hvd.local_rank())`` selects: the local rank's entry of the
    worker's ``CUDA_VISIBLE_DEVICES``."""
    return record["CUDA_VISIBLE_DEVICES"].split(",")[int(record["HOROVOD_LOCAL_RANK"])]


# ---- the host line ---------------------------------------------------------------------------

def test_host_lines_name_gpus_and_keep_horovods_forms():
    specs = parse_host_specs("a:2\nb slots=3\nc slots = 1\nd gpus=2,3\n"
                             "[::1] gpus=GPU-5c1b2e4a-0000-1111-2222-333344445555,MIG-1\n")
    assert {h: e.slots for h, e in specs.items()} == {"a": 2, "b": 3, "c": 1, "d": 2, "::1": 2}
    assert specs["d"].gpus == ("2", "3") and specs["a"].gpus is None
    assert specs["d"].format() == "d:2 gpus=2,3"
    assert parse_host_specs("e:2 ends=1796547271.5")["e"].ends == 1796547271.5
    assert parse_host_specs(HostLine("::1", 2, ("0", "1")).format())["::1"].gpus == ("0", "1")
    hosts = FixedHosts.from_lines("x gpus=4,1\ny:1\n")
    assert hosts.find_available_hosts_and_slots() == {"x": 2, "y": 1}
    assert hosts.gpus == {"x": ("4", "1")}


@pytest.mark.parametrize("line, says", [
    ("a gpus=1,1", "GPU 1 is listed twice"),
    ("a:3 gpus=1,2", "3 slots but 2 GPUs"),
    ("a gpus=x", "neither a GPU index"),
    ("a gpus=", "gpus= needs 1 to"),
    ("a spot=yes", "unknown attribute 'spot=yes'"),
    ("a ends=soon", "ends= needs the end's unix time"),
    ("a 2", "unknown host syntax"),
    ("a:2 slots=2", "slots given twice"),
])
def test_a_bad_host_line_is_one_clear_error(line, says):
    with pytest.raises(HostSpecError, match=says):
        parse_host_specs(line)


# ---- real jobs -------------------------------------------------------------------------------

def test_each_worker_of_a_hostfile_with_gpus_selects_its_own(tmp_path):
    """``--hostfile`` with ``localhost gpus=5,3``: slot 0's worker selects GPU 5, slot 1's GPU 3,
    both from ``CUDA_VISIBLE_DEVICES=5,3``; the launcher's own ``CUDA_VISIBLE_DEVICES`` is not
    what they get."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost gpus=5,3\n")
    env_file = tmp_path / "env.jsonl"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    run = subprocess.run([LAUNCHER, "-np", "2", "--hostfile", str(hostfile), sys.executable,
                          str(SCRIPT), "--logfile", str(tmp_path / "log"), "--epochs", "1",
                          "--env-file", str(env_file)],
                         capture_output=True, text=True, timeout=120, env=env, cwd=str(ROOT))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    spawned = {r["HOROVOD_LOCAL_RANK"]: r for r in _records(env_file) if r["when"] == "spawn"}
    assert {k: (r["CUDA_VISIBLE_DEVICES"], selected_gpu(r)) for k, r in spawned.items()} == \
        {"0": ("5,3", "5"), "1": ("5,3", "3")}
    assert "started on localhost slot 1 (GPU 3)" in run.stdout


def test_a_line_that_moves_a_slot_to_another_gpu_replaces_its_worker(tmp_path, job_factory):
    """Discovery goes from ``gpus=5,3`` to ``gpus=5,7``: the worker on GPU 3 leaves stop-free
    (nothing rolled back), a new one starts in its slot with ``CUDA_VISIBLE_DEVICES=5,7`` and
    selects GPU 7; the worker on GPU 5 stays."""
    env_file = tmp_path / "env.jsonl"
    job = job_factory(["-np", "2", "--min-np", "1", "--max-np", "2", "--discovery-interval",
                       "0.2"],
                      [sys.executable, str(SCRIPT), "--logfile", str(tmp_path / "log"),
                       "--epochs", "0", "--stop-file", str(tmp_path / "stop"),
                       "--step-delay", "0.02", "--env-file", str(env_file)],
                      hosts="localhost gpus=5,3")
    first = job.wait_generation(1)
    assert first["world_size"] == 2
    job.set_hosts("localhost gpus=5,7")
    ev = job.wait_for("the worker on GPU 3 replaced", lambda: next(
        (e for e in job.events() if e["generation"] > 1 and e["world_size"] == 2
         and e.get("joined")), None), 90)
    assert ev["rolled_back_steps"] == 0
    (tmp_path / "stop").touch()
    assert job.finish() == 0, job.output()[-3000:]
    spawned = [r for r in _records(env_file) if r["when"] == "spawn"]
    assert sorted((r["HOROVOD_LOCAL_RANK"], r["CUDA_VISIBLE_DEVICES"], selected_gpu(r))
                  for r in spawned) == [("0", "5,3", "5"), ("1", "5,3", "3"), ("1", "5,7", "7")]
    assert "slot 1 of host localhost is now on GPU 7, not 3" in job.output()
    events = job.events()
    assert all(e["rolled_back_steps"] == 0 for e in events)


def test_a_cpu_host_is_asked_for_its_gpus_once_not_at_every_pool_change():
    """The service asks a new host's nvidia-smi (over ssh: up to 10 s each); a host without
    GPUs is remembered, asked again only after PROBE_AGAIN_S or when it left and came back."""
    from launcher.cluster.gpus import PROBE_AGAIN_S, pool_gpus
    asked = []

    def prober(host):
        asked.append(host)
        return ("0", "1") if host == "gpu" else None

    cpu, known = {}, {}
    for t in (0.0, 1.0, 2.0):  # three pool changes
        known = pool_gpus({"gpu": 2, "cpu": 4}, {}, False, known, prober, cpu, now=t)
    assert asked == ["gpu", "cpu"] and known == {"gpu": ("0", "1")}
    pool_gpus({"gpu": 2, "cpu": 4}, {}, False, known, prober, cpu, now=PROBE_AGAIN_S + 1)
    assert asked == ["gpu", "cpu", "cpu"]  # asked again after a while
    pool_gpus({"gpu": 2}, {}, False, known, prober, cpu, now=PROBE_AGAIN_S + 2)
    pool_gpus({"gpu": 2, "cpu": 4}, {}, False, known, prober, cpu, now=PROBE_AGAIN_S + 3)
    assert asked == ["gpu", "cpu", "cpu", "cpu"]  # left the pool and came back: asked at once
