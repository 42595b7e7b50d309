"""Measures a cluster job's start, submit to its first training step, with the service's kept
zygotes (the default: launcher/cluster/kept_zygotes.py, docs/zygote.md) and without
(``HVD_EDL_ZYGOTE_KEEP=0`` in serve's environment: each job's launcher starts its own zygote),
side by side: rounds alternate the two ways; each round is one ``hvd-edl-cluster serve`` on
``localhost:2`` (fifo) running ``--jobs`` small elastic jobs of 2 workers one after another.
A job's first step is the time its rank 0 wrote at the end of its first step; submit is taken
just before ``hvd-edl-cluster submit`` runs.  Job 1 of a round pays the zygote's import either
way; the later jobs show the difference.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/cluster/kept_zygote_start.py [--rounds 2] [--jobs 3]

Writes benchmarks/results/kept_zygote_start.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common.cluster_service import wait_for  # noqa: E402

CLI = [sys.executable, "-m", "launcher.cluster.cli"]
JOB = """\
import sys, time
import torch
import hvd_edl.torch as hvd
hvd.init()
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, opt, step=0)


@hvd.elastic.run
def train(state):
    while state.step < 5:
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        if state.step == 0 and hvd.rank() == 0:
            with open(sys.argv[1], "w") as f:
                f.write(repr(time.time()))
        state.step += 1
        state.commit()


train(state)
"""
WAYS = {"kept": None, "own": "0"}   # serve's HVD_EDL_ZYGOTE_KEEP


def _state(cluster: Path, job: str) -> str:
    from launcher.cluster import cluster_file
    from launcher.cluster.server import ClusterClient
    jobs = ClusterClient(cluster_file.read(cluster), timeout_s=10).call("status")["jobs"]
    return next((j["state"] for j in jobs if j["id"] == job), "")


def one_round(way: str, jobs: int) -> list:
    """Submit-to-first-step seconds of ``jobs`` jobs run one after another under one service."""
    with tempfile.TemporaryDirectory(prefix=f"kept-start-{way}-") as tmp:
        tmp = Path(tmp)
        (tmp / "job.py").write_text(JOB)
        env = {k: v for k, v in os.environ.items()
               if k not in ("HVD_EDL_ZYGOTE_KEEP", "HVD_EDL_ZYGOTE_DIR")}
        serve_env = dict(env, **({"HVD_EDL_ZYGOTE_KEEP": WAYS[way]} if WAYS[way] else {}))
        cluster = tmp / "cluster.json"
        serve = subprocess.Popen(CLI + ["serve", "-H", "localhost:2", "--policy", "fifo",
                                        "--state-dir", str(tmp / "state"), "--cluster-file",
                                        str(cluster)], env=serve_env, cwd=str(ROOT),
                                 stdout=open(tmp / "serve.log", "w"), stderr=subprocess.STDOUT)
        out = []
        try:
            wait_for("the service", lambda: cluster.exists(), 60)
            for n in range(jobs):
                first = tmp / f"first{n}"
                t0 = time.time()
                r = subprocess.run(CLI + ["--cluster", str(cluster), "submit", "--np", "2",
                                          "--", sys.executable, str(tmp / "job.py"), str(first)],
                                   env=env, cwd=str(tmp), capture_output=True, text=True,
                                   timeout=60)
                if r.returncode != 0:
                    raise RuntimeError(r.stderr)
                job = r.stdout.strip().splitlines()[-1]
                wait_for(f"job {n}'s first step", lambda: first.exists() and first.read_text(),
                         300, 0.05)
                out.append(round(float(first.read_text()) - t0, 2))
                wait_for(f"job {n} done", lambda: _state(cluster, job) == "done", 300, 0.3)
        finally:
            serve.terminate()
            serve.wait(60)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                        "kept_zygote_start.json"))
    a = p.parse_args(argv)
    results = {w: [] for w in WAYS}
    for i in range(a.rounds):
        for way in (("kept", "own") if i % 2 == 0 else ("own", "kept")):
            load = os.getloadavg()[0]
            secs = one_round(way, a.jobs)
            results[way].append({"submit_to_first_step_s": secs, "load_at_start": round(load, 1)})
            print(f"round {i} {way}: {secs} (load {load:.1f})", flush=True)
    summary = {w: {"job1_median_s": statistics.median(r["submit_to_first_step_s"][0]
                                                      for r in rs),
                   "later_jobs_median_s": statistics.median(
                       x for r in rs for x in r["submit_to_first_step_s"][1:])}
               for w, rs in results.items()}
    doc = {"what": "cluster job start, submit to first step, with the service's kept zygotes "
                   "and without (benchmarks/cluster/kept_zygote_start.py)",
           "command": f"python benchmarks/cluster/kept_zygote_start.py --rounds {a.rounds} "
                      f"--jobs {a.jobs}",
           "rounds": results, "summary": summary}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
