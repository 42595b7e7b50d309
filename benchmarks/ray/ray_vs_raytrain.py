"""hvd_edl on Ray against Ray Train v2's elastic training, side by side on one Ray cluster of
the namespace cluster (tests/ray_cluster.py: a head in h1's namespace, a node in h2's, a third in
h3's that comes and goes; 1 CPU each), the same model and batch (benchmarks/ray/ray_bench_train.py:
an MLP of 0.3 M parameters, 64 samples per worker, a commit / checkpoint every 10 steps), Gloo.

    sudo .venv/bin/python benchmarks/ray/ray_vs_raytrain.py            # about 10 minutes on 2 cores
    .venv/bin/python benchmarks/ray/ray_vs_raytrain.py --only hvd_edl --window 10

Per system, two runs, each a fresh job:

* static: 2 workers, fixed (``--min-np 2 --max-np 2``; Ray Train ``num_workers=2``): steps/s over
  ``--window`` seconds once training runs; run once before and once after the elastic run, and
  the elastic rate is compared with their mean (this machine's speed drifts by 5-10 % over the
  minutes between runs: Ray Train's elastic run once measured 1.10x its static one);
* elastic (2..3 workers; Ray Train ``ScalingConfig(num_workers=(2, 3))`` with
  ``elastic_resize_monitor_interval_s=5``, its default is 60): steps/s over the same window at
  2 workers; then a Ray node added on h3: the time from the node's start to the first step at 3
  workers, and the longest window without a step; then every process of h3 killed: the longest
  window without a step and the steps lost (the last step reached before the kill minus the step
  training resumed from).

Ray Train is configured as its docs recommend for elastic runs: rank 0 reports a checkpoint
(model and optimizer state, ``Checkpoint.from_directory``) with every ``ray.train.report`` (every
10 steps, the same cadence as hvd_edl's commits), every rank reports, ``FailureConfig
(max_failures=-1)``, the training function resumes from ``ray.train.get_checkpoint()``.

Also tried: Horovod's own ``horovod.ray`` elastic executor against Ray's current release (what
happens is recorded, with the error line).

Prints a side-by-side table, writes benchmarks/results/ray_vs_raytrain.json.  Every wait is
bounded (``--bound`` seconds); a system that does not recover in time is recorded as such.
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
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent  # benchmarks/ray: ray_bench_train (Ray Train's side too)
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))
RESULTS = ROOT / "benchmarks" / "results" / "ray_vs_raytrain.json"
LAUNCHER = str(Path(sys.executable).parent / "hvd-edl-run")
TRAIN = str(HERE / "ray_bench_train.py")


# ---- the step log ------------------------------------------------------------------------------

def read_steps(path: Path) -> List[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return sorted(out, key=lambda r: r["t"])


def wait_steps(path: Path, pred, bound_s: float, what: str) -> Optional[dict]:
    """The first step record (after the log grew) for which ``pred`` holds, within
    ``bound_s`` seconds; None when none came."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        hit = next((r for r in read_steps(path) if pred(r)), None)
        if hit is not None:
            return hit
        time.sleep(0.2)
    print(f"  {what}: not within {bound_s:g} s", flush=True)
    return None


def rate(steps: List[dict], t0: float, t1: float) -> Optional[float]:
    """Global steps per second within [t0, t1]."""
    inside = [r for r in steps if t0 <= r["t"] <= t1]
    if len(inside) < 2:
        return None
    return (max(r["step"] for r in inside) - min(r["step"] for r in inside)) / (
        inside[-1]["t"] - inside[0]["t"])


def longest_gap(steps: List[dict], t0: float, t1: float) -> Optional[float]:
    """The longest window in which no worker finished a step (seconds), among the steps within
    [t0, t1] and the last one before ``t0`` (a pause that began before ``t0`` counts whole)."""
    before = [r["t"] for r in steps if r["t"] < t0]
    times = before[-1:] + [r["t"] for r in steps if t0 <= r["t"] <= t1]
    if len(times) < 2:
        return None
    return max(b - a for a, b in zip(times, times[1:]))


# ---- the two systems -------------------------------------------------------------------------

class Run:
    """One job on the Ray cluster: ``hvd-edl-run --ray`` or a Ray Train driver, launched on the
    head's node; ``stop()`` ends it through the stop file (bounded), then by signal."""

    def __init__(self, system: str, r, work: Path, min_np: int, max_np: int):
        self.system, self.r, self.work = system, r, work
        work.mkdir(parents=True, exist_ok=True)
        self.steps = work / "steps.jsonl"
        self.stop_file = work / "stop"
        self.out = open(work / "out.log", "w")
        if system == "hvd_edl":
            argv = [LAUNCHER, "--ray", r.address, "--min-np", str(min_np), "--max-np",
                    str(max_np), "--discovery-interval", "0.5", "--event-log",
                    str(work / "events.jsonl"), "--job-file", str(work / "job.json"),
                    sys.executable, TRAIN, "--step-log", str(self.steps), "--stop-file",
                    str(self.stop_file)]
        else:
            argv = [sys.executable, __file__, "--raytrain-driver", "--address", r.address,
                    "--min-np", str(min_np), "--max-np", str(max_np), "--step-log",
                    str(self.steps), "--stop-file", str(self.stop_file), "--storage",
                    str(work / "storage")]
        self.proc = r.c.popen(r.head, argv, stdout=self.out, stderr=subprocess.STDOUT,
                              cwd=str(ROOT), start_new_session=True)

    def stop(self, bound_s: float = 90.0) -> int:
        self.stop_file.touch()
        try:
            return self.proc.wait(timeout=bound_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                return self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                return self.proc.wait()
        finally:
            self.out.close()


def measure_static(system: str, r, work: Path, window_s: float, bound_s: float) -> dict:
    run = Run(system, r, work / f"{system}-static", 2, 2)
    first = wait_steps(run.steps, lambda s: s["size"] == 2, bound_s, f"{system} static start")
    out: Dict[str, object] = {"started": first is not None}
    if first is not None:
        t0 = time.time() + 3.0   # past the first steps' warm-up
        time.sleep(3.0 + window_s)
        out["steps_per_s"] = rate(read_steps(run.steps), t0, t0 + window_s)
    out["exit_code"] = run.stop()
    return out


def measure_elastic(system: str, r, work: Path, window_s: float, bound_s: float) -> dict:
    run = Run(system, r, work / f"{system}-elastic", 2, 3)
    out: Dict[str, object] = {}
    try:
        first = wait_steps(run.steps, lambda s: s["size"] == 2, bound_s, f"{system} start")
        out["started"] = first is not None
        if first is None:
            return out
        t0 = time.time() + 3.0
        time.sleep(3.0 + window_s)
        out["steps_per_s_at_2"] = rate(read_steps(run.steps), t0, t0 + window_s)

        r.start("h3", cpus=1)                                    # a node added
        t_up = time.time()
        three = wait_steps(run.steps, lambda s: s["size"] == 3 and s["t"] > t_up, bound_s,
                           f"{system}: a worker on the new node")
        if three is not None:
            out["add_new_worker_trains_after_s"] = round(three["t"] - t_up, 3)
            time.sleep(3.0)
            out["add_longest_pause_s"] = longest_gap(read_steps(run.steps), t_up,
                                                     three["t"] + 2.0)
            time.sleep(max(0.0, window_s / 2 - 3.0))
        before = read_steps(run.steps)
        t_kill = time.time()
        r.kill_all("h3")                                         # a node killed
        last_step = max((s["step"] for s in before), default=0)
        after = wait_steps(run.steps, lambda s: s["t"] > t_kill + 0.5 and s["size"] == 2,
                           bound_s, f"{system}: training after the node's kill")
        if after is not None:
            time.sleep(3.0)
            steps = read_steps(run.steps)
            out["kill_longest_pause_s"] = longest_gap(steps, t_kill - 1.0, after["t"] + 2.0)
            resumed = min(s["step"] for s in steps if s["t"] > t_kill + 0.5 and s["size"] == 2)
            out["kill_steps_lost"] = max(0, last_step - (resumed - 1))
        else:
            out["kill_recovered"] = False
    finally:
        out["exit_code"] = run.stop()
        if "h3" in r.procs:
            r.kill_all("h3")
    return out


# ---- Ray Train's side (runs as its own driver on the head's node) -------------------------------

def raytrain_driver(a) -> int:
    """``TorchTrainer`` over the same model and batch; elastic when ``min_np < max_np``."""
    import ray
    import ray.train
    from ray.train import (CheckpointConfig, FailureConfig, RunConfig, ScalingConfig)
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=a.address, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": str(HERE), "GLOO_SOCKET_IFNAME": "edl0"}})

    def train_func(config):
        import tempfile

        import torch
        import torch.distributed as dist

        import ray.train
        import ray.train.torch
        from ray_bench_train import COMMIT_EVERY, StepLog, batch, make_model

        ctx = ray.train.get_context()
        rank, size = ctx.get_world_rank(), ctx.get_world_size()
        model = ray.train.torch.prepare_model(make_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        step = 0
        ckpt = ray.train.get_checkpoint()
        if ckpt is not None:
            with ckpt.as_directory() as d:
                saved = torch.load(os.path.join(d, "state.pt"))
            model.module.load_state_dict(saved["model"]) if hasattr(model, "module") else \
                model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            step = saved["step"]
        log = StepLog(config["step_log"])
        while True:
            x, y = batch(step, rank)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            step += 1
            log.step(step, size)
            if step % COMMIT_EVERY == 0:
                flag = torch.tensor([1.0 if os.path.exists(config["stop_file"]) else 0.0])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if rank == 0:
                    with tempfile.TemporaryDirectory() as d:
                        inner = model.module if hasattr(model, "module") else model
                        torch.save({"model": inner.state_dict(),
                                    "optimizer": optimizer.state_dict(), "step": step},
                                   os.path.join(d, "state.pt"))
                        ray.train.report({"step": step},
                                         checkpoint=ray.train.Checkpoint.from_directory(d))
                else:
                    ray.train.report({"step": step})
                if flag.item() > 0:
                    return

    workers = a.min_np if a.min_np == a.max_np else (a.min_np, a.max_np)
    scaling = ScalingConfig(num_workers=workers, use_gpu=False,
                            resources_per_worker={"CPU": 1},
                            **({} if a.min_np == a.max_np else
                               {"elastic_resize_monitor_interval_s": 5.0}))
    trainer = TorchTrainer(
        train_func, train_loop_config={"step_log": a.step_log, "stop_file": a.stop_file},
        scaling_config=scaling, torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(storage_path=a.storage, name="bench",
                             failure_config=FailureConfig(max_failures=-1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    trainer.fit()
    return 0


# ---- horovod.ray ---------------------------------------------------------------------------------

HOROVOD_RAY_PROBE = r"""
import sys, time
try:
    import ray
    from horovod.ray import ElasticRayExecutor
except Exception as e:
    print("IMPORT-ERROR", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    sys.exit(3)
ray.init(address=sys.argv[1], logging_level="ERROR")
def train():
    import horovod.torch as hvd, torch
    hvd.init()
    t = hvd.allreduce(torch.ones(1))
    return float(t)
try:
    settings = ElasticRayExecutor.create_settings(min_num_proc=1, max_num_proc=2,
                                                  verbose=False)
    ex = ElasticRayExecutor(settings, cpus_per_slot=1, override_discovery=True)
    ex.start()
    print("RESULT", ex.run(train))
except Exception as e:
    import traceback; traceback.print_exc()
    print("RUN-ERROR", type(e).__name__, (str(e).splitlines() or [""])[0][:300])
    sys.exit(4)
"""


def try_horovod_ray(r, work: Path, bound_s: float) -> dict:
    """Horovod's ``horovod.ray`` elastic executor against this Ray: what happens."""
    import ray
    work.mkdir(parents=True, exist_ok=True)
    try:
        # in a UTS namespace named for the head's host: horovod.ray resolves
        # gethostbyname(gethostname()) for its driver's address
        out = subprocess.run(r.c.exec_argv(r.head, [
            "unshare", "--uts", "sh", "-c", f'hostname {r.head} && exec "$@"', "sh",
            sys.executable, "-c", HOROVOD_RAY_PROBE, r.address]),
                             capture_output=True, text=True, timeout=bound_s, cwd=str(ROOT))
        text, code = out.stdout + out.stderr, out.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(
            errors="replace") if isinstance(e.stdout, bytes) else str(e.stdout or "")
        code = None
    (work / "horovod_ray.log").write_text(text or "")
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    said = next((ln for ln in lines if ln.startswith(("IMPORT-ERROR", "RUN-ERROR", "RESULT"))),
                lines[-1] if lines else "(no output)")
    return {"ray": ray.__version__, "exit_code": code, "line": said[:400],
            "ran": said.startswith("RESULT"),
            "timed_out": code is None}


# ---- main ----------------------------------------------------------------------------------------

def table(res: dict) -> str:
    h, t = res.get("hvd_edl", {}), res.get("ray_train", {})

    def f(v, unit=""):
        return "-" if v is None else (f"{v:.3f}{unit}" if isinstance(v, float) else f"{v}{unit}")

    rows = [("steady steps/s, static 2 workers", "static", "steps_per_s"),
            ("steady steps/s, elastic at 2", "elastic", "steps_per_s_at_2"),
            ("throughput elastic / static", "ratio", "throughput_vs_static"),
            ("node added: new worker trains after (s)", "elastic",
             "add_new_worker_trains_after_s"),
            ("node added: longest pause (s)", "elastic", "add_longest_pause_s"),
            ("node killed: longest pause (s)", "elastic", "kill_longest_pause_s"),
            ("node killed: steps lost", "elastic", "kill_steps_lost")]
    out = [f"| {'what':<42} | {'hvd_edl on Ray':>15} | {'Ray Train v2':>15} |",
           f"| {'-' * 42} | {'-' * 15} | {'-' * 15} |"]
    for label, where, key in rows:
        out.append(f"| {label:<42} | {f(h.get(where, {}).get(key)):>15} | "
                   f"{f(t.get(where, {}).get(key)):>15} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("hvd_edl", "ray_train", "horovod_ray"), action="append")
    p.add_argument("--window", type=float, default=15.0, help="seconds of steady training")
    p.add_argument("--bound", type=float, default=150.0, help="seconds any wait may take")
    p.add_argument("--raytrain-driver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--address")
    p.add_argument("--min-np", type=int, default=2)
    p.add_argument("--max-np", type=int, default=3)
    p.add_argument("--step-log")
    p.add_argument("--stop-file")
    p.add_argument("--storage")
    a = p.parse_args()
    if a.raytrain_driver:
        return raytrain_driver(a)

    from cluster import Cluster
    from ray_cluster import RayCluster
    systems = a.only or ["hvd_edl", "ray_train", "horovod_ray"]
    res: Dict[str, dict] = {}
    if RESULTS.exists():  # --only keeps the other systems' figures
        try:
            res = json.loads(RESULTS.read_text())
        except ValueError:
            res = {}
    work = Path(tempfile.mkdtemp(prefix="ray_vs_raytrain-"))  # kept: step logs, outputs
    print(f"step logs and outputs in {work}", flush=True)
    with Cluster(hosts=3) as c:
        r = RayCluster(c)
        try:
            r.start("h1", head=True, cpus=1, wait=False)
            r.start("h2", cpus=1, wait=False)
            r.wait_started("h1")
            r.wait_started("h2")
            for system in systems:
                print(f"{system} ...", flush=True)
                if system == "horovod_ray":
                    res["horovod_ray"] = try_horovod_ray(r, work / "horovod_ray", a.bound)
                    print(f"  horovod.ray: {res['horovod_ray']['line']}", flush=True)
                    continue
                # static runs before and after the elastic one: the ratio is to their mean,
                # so a drift of this noisy machine's speed over the minutes cancels
                static = measure_static(system, r, work / "before", a.window, a.bound)
                elastic = measure_elastic(system, r, work, a.window, a.bound)
                after = measure_static(system, r, work / "after", a.window, a.bound)
                static["steps_per_s_before"] = static.get("steps_per_s")
                static["steps_per_s_after"] = after.get("steps_per_s")
                rates = [v for v in (static["steps_per_s_before"], after.get("steps_per_s"))
                         if v]
                static["steps_per_s"] = sum(rates) / len(rates) if rates else None
                static["exit_code_after"] = after.get("exit_code")
                ratio = None
                if static.get("steps_per_s") and elastic.get("steps_per_s_at_2"):
                    ratio = round(elastic["steps_per_s_at_2"] / static["steps_per_s"], 3)
                res[system] = {"static": static, "elastic": elastic,
                               "ratio": {"throughput_vs_static": ratio}}
                print(f"  {json.dumps(res[system])}", flush=True)
        finally:
            r.close()
    h, t = res.get("hvd_edl", {}).get("elastic", {}), res.get("ray_train", {}).get("elastic", {})
    goals = {}
    for key in ("add_longest_pause_s", "kill_longest_pause_s"):
        if h.get(key) is not None and t.get(key):
            goals[key.replace("_longest_pause_s", "_pause_ratio")] = round(h[key] / t[key], 4)
    goals["pause_goal_met"] = bool(goals) and all(v <= 0.05 for k, v in goals.items()
                                                  if k.endswith("ratio"))
    tr = res.get("hvd_edl", {}).get("ratio", {}).get("throughput_vs_static")
    goals["throughput_goal_met"] = tr is not None and tr >= 0.95
    res["goals"] = goals
    res["command"] = "sudo .venv/bin/python benchmarks/ray/ray_vs_raytrain.py " + " ".join(
        sys.argv[1:])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2) + "\n")
    print(table(res))
    print(f"goals: {json.dumps(goals)}")
    if "horovod_ray" in res:
        print(f"horovod.ray (ray {res['horovod_ray']['ray']}): {res['horovod_ray']['line']}")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
