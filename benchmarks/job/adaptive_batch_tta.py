"""Time to accuracy with an adaptive batch: the digits job (examples/train_digits.py, its CNNs)
trained to a fixed test accuracy while its allocation changes 1 -> 4 -> 2 workers, three ways side
by side in one run (the three jobs at once, so that they share the machine's load; repeated
``--repeats`` times, one model after the other):

* ``fixed``: global batch 32 (ElasticBatchSampler), SGD lr 0.02 momentum 0.9, under
  ``hvd-edl-run``; the allocation by ``/ctl/scale`` (``hvd-edl-ctl scale``) at the schedule's
  seconds;
* ``adaptive``: the same script opted in (AdaptiveBatchSampler + AdaptiveOptimizer, AdaScale,
  batch 32-512, at most ``--max-local-batch`` per rank at once) under ``hvd-edl-run
  --adapt-batch``: the job's own goodput model picks its batch
  (launcher/apps/batch_goodput.py); the allocation as ``fixed``'s;
* ``service``: the same opted-in script submitted to a real ``hvd-edl-cluster serve --policy
  goodput -H localhost:4 --round 1`` (its own state folder): the service chooses the allocation
  and the batch (launcher/cluster/policies/goodput.py, learning the job's goodput from its
  telemetry, launcher/cluster/job_goodput.py) and passes the batch through the job's public
  ``/ctl/batch``.  The allocation changes by other jobs' arrival and departure, at the same
  seconds as the other ways' ``scale``: a 3-slot job holds the pool when the job is submitted
  (it starts on the 1 slot left), is cancelled at the schedule's second step (the service lends
  the job all 4), and a 2-slot job is submitted at the third (the service takes 2 back).  Those
  two jobs sleep (examples/train_digits.py --step-delay 1 on 96 samples): they add only their
  start-up's load.

    .venv/bin/python benchmarks/job/adaptive_batch_tta.py [--models large,wide]
        [--ways fixed,adaptive,service] [--schedule 1:0,4:10,2:60] [--repeats 3]
        [--out benchmarks/results/adaptive_batch_tta.json]

Wall time to target: from the job's first generation (the launch's start-up, 15-50 s of importing
torch on the loaded cores, is no part of the comparison; from the launch is in the JSON too) to
the end of the first epoch whose test accuracy (the whole test split, rank 0) reaches the target;
with it the steps and samples to target (what the machine's load does not move).  Each epoch
passes over the training split 2 (large) or 4 (small) times (``--repeat-data``).  Writes the
JSON (every repeat, the medians, each way's time over the fixed batch's in the same repeat) and a
PNG beside it (first repeat: accuracy, global batch with the world size, noise scale against
time).  The machine is 2 shared, loaded cores: the three jobs run at once (up to
4 + 4 + 4 workers on the 2 cores: each slows the others, alike), so that a change of the other
sessions' load falls on all three.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MAX_EPOCHS = 20
TARGET = {"small": 0.98, "large": 0.975}  # --targets
REPEAT_DATA = {"small": 4, "large": 2}    # passes over the training split per epoch: the small
                                          # CNN learns in ~12 passes, which at 2 a epoch it made
                                          # before the allocation first changed
GO = threading.Event()  # set when the service way submits its job (its 3-slot job runs): the
                        # other ways launch then, so that the three run side by side
SETTLE_S = 6.0    # a generation this old gives steady telemetry (launcher/apps/batch_goodput.py)
MAX_LOCAL = 256   # --max-local-batch: the memory bound per rank (no accumulation below it)
FILLER = ["--model", "small", "--train-size", "96", "--epochs", "100000", "--step-delay", "1"]


def _script(model: str, way: str, log: Path) -> list:
    script = [sys.executable, str(ROOT / "examples" / "train_digits.py"), "--model", model,
              "--epochs", str(MAX_EPOCHS), "--global-batch-size", "32",
              "--repeat-data", str(REPEAT_DATA.get(model, 2)), "--target-accuracy",
              str(TARGET[model]), "--accuracy-log", str(log), "--commit-every", "4"]
    if way in ("adaptive", "service"):
        script += ["--adaptive-batch", "--max-batch", "512", "--max-local-batch", str(MAX_LOCAL)]
    return script


def _trace_point(client, t0: float) -> dict:
    """World size, batch and noise scale now (the job's ``/ctl/telemetry``)."""
    tel = client.call("telemetry")
    plan, noise = tel.get("adaptive_batch") or {}, tel.get("gradient_noise") or {}
    job = tel["job"]
    step = None if job.get("compute_s") is None else job["compute_s"] + (job.get("wait_s") or 0)
    return {"s": round(time.time() - t0, 2), "world_size": job["world_size"],
            "generation": job.get("generation"),
            "batch": plan.get("batch") or 32,  # fixed: 32
            "step_s": step,  # mean optimizer step, the telemetry's 5 s window
            "noise_scale": noise.get("noise_scale_samples"),
            "sqr": noise.get("sqr"), "var": noise.get("var")}


def _formed(events: Path) -> bool:
    return events.exists() and '"generation"' in events.read_text()


def run(model: str, way: str, schedule, folder: Path) -> dict:
    """``fixed`` or ``adaptive``: one ``hvd-edl-run``, scaled by ``/ctl/scale``."""
    from launcher.serve.control import ControlClient, ControlError
    hosts = folder / "hosts"
    hosts.write_text("localhost:4\n")
    job_file, log = folder / "job.json", folder / "accuracy.jsonl"
    events = folder / "events.jsonl"
    launcher = [str(Path(sys.executable).parent / "hvd-edl-run"), "--job-file", str(job_file),
                "--event-log", str(events), "-np", "1", "--min-np", "1", "--max-np", "4",
                "--target-np", str(schedule[0][0]), "--host-discovery-script", f"cat {hosts}",
                "--discovery-interval", "0.5"]
    if way == "adaptive":
        launcher.append("--adapt-batch")
    GO.wait(300)
    t0 = time.time()
    out = open(folder / "out.txt", "w")
    proc = subprocess.Popen(launcher + _script(model, way, log),
                            env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=out, stderr=subprocess.STDOUT)
    client, formed, trace, changes = None, None, [], []
    steps = list(schedule[1:])
    try:
        while proc.poll() is None:
            time.sleep(0.5)   # a polling period, not a synchronisation
            if client is None and job_file.exists():
                try:
                    client = ControlClient(job_file, timeout_s=20)
                except ControlError:
                    continue
            if client is None:
                continue
            if formed is None:
                if _formed(events):
                    formed = time.time()
                    print(f"  {model}/{way}: generation 1 at {formed - t0:.1f} s", flush=True)
                continue
            try:
                if steps and time.time() - formed >= steps[0][1]:
                    size = steps.pop(0)[0]
                    client.call("scale", np=size)
                    changes.append({"s": round(time.time() - t0, 2), "scale": size})
                trace.append(_trace_point(client, t0))
            except ControlError:
                pass  # the job ended meanwhile
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
        out.close()
    decisions = []
    if events.exists():
        for line in events.read_text().splitlines():
            e = json.loads(line)
            if e.get("kind") == "adapt_batch" or e.get("event") == "adapt_batch":
                decisions.append(e)
    return _result(model, rc, t0, formed, log, trace, changes, decisions)


class _Cluster:
    """One service's public API, as ``hvd-edl-cluster`` calls it."""

    def __init__(self, folder: Path):
        self.folder, self.cluster = folder, folder / "cluster.json"
        self.env = dict(os.environ, PYTHONPATH=str(ROOT))

    def api(self, route: str, **args) -> dict:
        """The service's API in this process, as ``hvd-edl-cluster`` calls it (a command's
        Python start takes 5-25 s on the loaded cores: the operator's actions during the run
        go this way, on time)."""
        from launcher.cluster import cluster_file
        from launcher.cluster.server import ClusterClient, ClusterRefused
        from launcher.cluster.service import BUSY_NOT_DONE
        deadline = time.monotonic() + 120
        while True:
            try:
                return ClusterClient(cluster_file.read(self.cluster)).call(route, **args)
            except ClusterRefused as e:   # withdrawn while the loop was busy: safe to retry
                if str(e) != BUSY_NOT_DONE or time.monotonic() > deadline:
                    raise
            time.sleep(0.5)

    def submit_now(self, name: str, n: int, argv: list, lo=None, hi=None) -> str:
        """``hvd-edl-cluster submit --name NAME --np N --min-np LO --max-np HI -- ARGV``
        (LO and HI: N when not given)."""
        from launcher.cluster.exec_input import NAME
        environ = {k: v for k, v in self.env.items() if NAME.fullmatch(k)}
        return self.api("submit", argv=argv, cwd=str(ROOT), env={}, environ=environ,
                        name=name, np=n, min_np=lo or n, max_np=hi or n, priority=0,
                        checkpoint_dir=None)["id"]

    def jobs(self) -> dict:
        return {j["id"]: j for j in self.api("status")["jobs"]}

    def wait(self, what: str, pred, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = pred(self.jobs())
            if got:
                return got
            time.sleep(0.5)
        raise TimeoutError(f"service: {what} not within {timeout_s:.0f} s")


def run_service(model: str, schedule, folder: Path) -> dict:
    """``service``: a real ``hvd-edl-cluster serve --policy goodput`` on localhost:4 (the
    module's docstring); the allocation changes by other jobs' arrival and departure."""
    from launcher.cluster.runs import JobFiles
    from launcher.serve.control import ControlClient, ControlError
    sizes = [n for n, _ in schedule]
    if sizes[:3] != [1, 4, 2] or len(sizes) != 3:
        raise ValueError("the service way's other jobs make the schedule 1 -> 4 -> 2 only")
    c = _Cluster(folder)
    state = folder / "state"
    out = open(folder / "serve.log", "w")
    serve = subprocess.Popen([sys.executable, "-m", "launcher.cluster.cli", "serve",
                              "--state-dir", str(state), "--cluster-file", str(c.cluster),
                              "--policy", "goodput", "-H", "localhost:4", "--round", "1",
                              "--hold", "2"], stdout=out, stderr=subprocess.STDOUT,
                             env=c.env, cwd=str(ROOT))
    log = folder / "accuracy.jsonl"
    filler = [sys.executable, str(ROOT / "examples" / "train_digits.py"), *FILLER]
    formed, trace, changes, job, rc = None, [], [], None, None
    try:
        deadline = time.monotonic() + 60
        while not c.cluster.exists():
            if serve.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("serve did not start: " + (folder / "serve.log").read_text())
            time.sleep(0.2)
        holder = c.submit_now("holder", 3, filler)
        c.wait("the 3-slot job running", lambda j: j[holder]["allocated"] == 3, 120)
        GO.set()
        t0 = time.time()
        job = c.submit_now(f"{model}-adaptive", 1, _script(model, "service", log), 1, 4)
        files = JobFiles(state, job)
        events = files.run_file(1, "events.jsonl")
        client, steps, arrival = None, list(schedule[1:]), None
        while True:
            time.sleep(0.5)   # a polling period, not a synchronisation
            jobs = c.jobs()
            if jobs[job]["state"] in ("done", "failed", "cancelled"):
                break
            if client is None and files.job_file.exists():
                try:
                    client = ControlClient(files.job_file, timeout_s=20)
                except ControlError:
                    continue
            if client is None:
                continue
            if formed is None:
                if _formed(events):
                    formed = time.time()
                    print(f"  {model}/service: generation 1 at {formed - t0:.1f} s", flush=True)
                continue
            if steps and time.time() - formed >= steps[0][1]:
                size = steps.pop(0)[0]
                if size == 4:     # the holder departs: the service lends its slots
                    c.api("cancel", job=holder)
                    changes.append({"s": round(time.time() - t0, 2), "cancel": "holder"})
                else:             # a 2-slot job arrives: the service takes 2 back
                    arrival = c.submit_now("arrival", 2, filler)
                    changes.append({"s": round(time.time() - t0, 2), "submit": "arrival"})
            try:
                trace.append(_trace_point(client, t0))
            except ControlError:
                pass
        rc = jobs[job].get("exit_code")
        decisions = [e for e in (json.loads(x) for x in
                                 (state / "events.jsonl").read_text().splitlines())
                     if e.get("job") == job and e.get("kind") in ("batch", "grow", "shrink",
                                                                   "start", "run")]
        for e in decisions:
            e["s"] = round(e["at"] - t0, 2) if isinstance(e.get("at"), (int, float)) else None
        for other in (holder, arrival):
            if other and c.jobs()[other]["state"] not in ("done", "failed", "cancelled"):
                c.api("cancel", job=other)
    finally:
        serve.terminate()
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
        out.close()
        from launcher.cluster.runs import Run
        for pid_file in state.glob("jobs/*/run*.pid"):   # the jobs outlive the service
            Run(JobFiles(state, pid_file.parent.name), int(pid_file.stem[3:])).stop()
    return _result(model, rc, t0, formed, log, trace, changes, decisions)


def _train_samples(model: str) -> int:
    sys.path.insert(0, str(ROOT / "examples"))
    from train_digits import load_data
    return len(load_data(0, None, REPEAT_DATA.get(model, 2))[0])


def _result(model, rc, t0, formed, log: Path, trace, changes, decisions) -> dict:
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    hit = next((x for x in lines if x["accuracy"] >= TARGET[model]), None)
    per_epoch = _train_samples(model)
    return {"rc": rc, "target": TARGET[model],
            "wall_s_to_target": round(hit["t"] - t0, 2) if hit else None,
            "wall_s_to_target_from_generation1": round(hit["t"] - formed, 2)
            if hit and formed else None,
            "epochs_to_target": hit["epoch"] if hit else None,
            "samples_to_target": hit["epoch"] * per_epoch if hit else None,
            "progress_to_target": (hit.get("progress") or hit["step"]) if hit else None,
            "final_accuracy": lines[-1]["accuracy"] if lines else None,
            "epochs": lines[-1]["epoch"] if lines else None,
            "steps": lines[-1]["step"] if lines else None,
            "generation1_s": round(formed - t0, 2) if formed else None,
            "timeline": [{"s": round(x["t"] - t0, 2), "epoch": x["epoch"],
                          "accuracy": x["accuracy"], "world_size": x["world_size"],
                          "batch": x["batch"], "step_s": x.get("step_s"),
                          "noise_scale": (x["noise"] or {}).get("noise_scale_samples"),
                          "lr_factor": x.get("lr_factor"), "progress": x.get("progress")}
                         for x in lines],
            "changes": changes, "decisions": decisions, "trace": trace}


def where_time_goes(r: dict, base_batch: int = 32) -> dict:
    """From one way's trace, up to its target: seconds at each world size, and per (world size,
    batch), from looks at least :data:`SETTLE_S` into their generation, the median measured step
    seconds and goodput (``B0 x gain / step``, the gain from the
    noise figures of the same look; :func:`hvd_edl.gradient_noise.gain`), with, for a batch a
    chooser asked for, the goodput its model predicted (``--adapt-batch``'s decisions)."""
    from hvd_edl.gradient_noise import gain
    end = r.get("wall_s_to_target") or float("inf")
    tr = [x for x in r.get("trace", []) if x["s"] <= end]
    sizes, configs = {}, {}
    for a, b in zip(tr, tr[1:]):
        sizes[a["world_size"]] = sizes.get(a["world_size"], 0.0) + b["s"] - a["s"]
    since, gen = None, None
    for x in tr:
        if x.get("generation") != gen:
            since, gen = x["s"], x.get("generation")
        if x["s"] - since < SETTLE_S:
            continue   # the telemetry's window still holds the previous generation's steps
        if x.get("step_s") and x.get("sqr") is not None and x.get("var") is not None:
            g = base_batch * gain(x["sqr"], x["var"], x["batch"], base_batch) / x["step_s"]
            configs.setdefault((x["world_size"], x["batch"]), []).append((x["step_s"], g))
    predicted = {}
    for d in r.get("decisions", []):
        if d.get("event") == "adapt_batch":
            predicted[(d["world_size"], d["to"])] = d.get("goodput")
    return {"seconds_at_size": {str(k): round(v, 1) for k, v in sorted(sizes.items())},
            "configs": [{"world_size": k[0], "batch": k[1], "looks": len(v),
                         "step_s": round(_median([a for a, _ in v]), 4),
                         "measured_goodput": round(_median([b for _, b in v]), 1),
                         "predicted_goodput": predicted.get(k)}
                        for k, v in sorted(configs.items())]}


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else
                                (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="small,large")
    p.add_argument("--ways", default="fixed,adaptive,service")
    p.add_argument("--schedule", default="1:0,4:10,2:60",
                   help="WORKERS:SECONDS after generation 1, comma-separated")
    p.add_argument("--targets", default="small:0.98,large:0.975",
                   help="MODEL:ACCURACY, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-epochs", type=int, default=20, help="end a way that has not reached "
                   "its target after this many epochs")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                        "adaptive_batch_tta.json"))
    p.add_argument("--summarise", metavar="JSON", help="print where the time went in a results "
                   "file and plot it again; run nothing")
    a = p.parse_args(argv)
    if a.summarise:
        result = json.loads(Path(a.summarise).read_text())
        for model, reps in result["models"].items():
            for i, rep in enumerate(reps):
                for way, r in rep.items():
                    if "error" not in r:
                        r["where_time_goes"] = where_time_goes(r)
                        print(model, i + 1, way, json.dumps(r["where_time_goes"]))
        Path(a.summarise).write_text(json.dumps(result, indent=1))
        _plot(result, Path(a.summarise).with_suffix(".png"))
        return 0
    TARGET.update({m: float(t) for m, t in (x.split(":") for x in a.targets.split(","))})
    global MAX_EPOCHS
    MAX_EPOCHS = a.max_epochs
    schedule = [(int(n), float(s)) for n, s in (x.split(":") for x in a.schedule.split(","))]
    result = {"what": "time to accuracy, digits CNNs, allocation " + a.schedule,
              "machine": "2 shared CPU cores, loaded; the three ways run at once (side by side)",
              "command": "benchmarks/job/adaptive_batch_tta.py " + " ".join(argv or sys.argv[1:]),
              "models": {}, "median": {}}
    ways = a.ways.split(",")
    for model in a.models.split(","):
        reps = result["models"][model] = []
        for rep in range(a.repeats):
            got = {}
            GO.clear()
            if "service" not in ways:
                GO.set()
            with tempfile.TemporaryDirectory() as tmp:
                print(f"{model} repeat {rep + 1}: {', '.join(ways)} side by side ...", flush=True)
                threads = []
                for way in ways:
                    folder = Path(tmp) / way
                    folder.mkdir()

                    def one(way=way, folder=folder):
                        try:
                            got[way] = (run_service(model, schedule, folder) if way == "service"
                                        else run(model, way, schedule, folder))
                        except Exception as e:  # noqa: BLE001 - one way's failure is reported
                            GO.set()
                            got[way] = {"error": f"{type(e).__name__}: {e}"}
                            print(f"  {model}/{way}: {got[way]['error']}", flush=True)
                    threads.append(threading.Thread(target=one))
                    threads[-1].start()
                for t in threads:
                    t.join()
            reps.append(got)
            for way in ways:
                r = got[way]
                if "error" in r:
                    continue
                print(f"{model} #{rep + 1} {way}: rc {r['rc']}, to {r['target']:.3f} in "
                      f"{r['wall_s_to_target_from_generation1']} s from generation 1, "
                      f"{r['epochs_to_target']} epochs ({r['samples_to_target']} samples), "
                      f"final accuracy {r['final_accuracy']}, batches "
                      f"{sorted({x['batch'] for x in r['trace']})}", flush=True)
            Path(a.out).write_text(json.dumps(result, indent=1))   # kept as it goes
        result["median"][model] = {
            way: {k: _median([r[way].get(k) for r in reps if way in r])
                  for k in ("wall_s_to_target_from_generation1", "samples_to_target",
                            "epochs_to_target", "final_accuracy")} for way in ways}
        if "fixed" in ways:   # side by side: each repeat's time over its fixed batch's
            for way in ways:
                xs = [r[way]["wall_s_to_target_from_generation1"]
                      / r["fixed"]["wall_s_to_target_from_generation1"] for r in reps
                      if all((r.get(w) or {}).get("wall_s_to_target_from_generation1")
                             for w in (way, "fixed"))]
                result.setdefault("wall_ratio_to_fixed", {}).setdefault(model, {})[way] = {
                    "per_repeat": [round(x, 3) for x in sorted(xs)],
                    "median": None if not xs else round(_median(xs), 3)}
        print(f"{model} medians: {json.dumps(result['median'][model])}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    _plot(result, Path(a.out).with_suffix(".png"))
    print(f"wrote {a.out}")
    return 0


COLOURS = {"fixed": "tab:orange", "adaptive": "tab:green", "service": "tab:blue"}


def _plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(result["models"])
    fig, axes = plt.subplots(len(models), 3, figsize=(14, 3.4 * len(models)), squeeze=False)
    for row, m in zip(axes, models):
        for way, r in result["models"][m][0].items():
            if "error" in r:
                continue
            tl = r["timeline"]
            s = [x["s"] for x in tl]
            c = COLOURS.get(way)
            row[0].plot(s, [x["accuracy"] for x in tl], "o-", ms=3, label=way, color=c)
            tr = r.get("trace") or tl
            ts = [x["s"] for x in tr]
            row[1].step(ts, [x["batch"] for x in tr], where="post", label=f"{way}: batch",
                        color=c)
            row[1].step(ts, [8 * x["world_size"] for x in tr], where="post", ls=":", color=c,
                        label=f"{way}: 8 x workers")
            row[2].plot(ts, [x["noise_scale"] for x in tr], "-", label=way, color=c)
        row[0].axhline(TARGET[m], color="grey", ls=":")
        row[0].set_ylabel(f"{m}: test accuracy")
        row[1].set_ylabel("global batch; 8 x world size")
        row[2].set_ylabel("noise scale (samples)")
        for ax in row:
            ax.set_xlabel("s since launch")
            ax.legend(fontsize=7)
    fig.suptitle(result["what"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
