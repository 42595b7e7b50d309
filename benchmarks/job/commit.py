"""Commit cost per MB of state: ``state.commit()`` of hvd_edl's TorchState (a copy to host memory)
against Horovod 0.28.1's ``horovod.torch.elastic.TorchState`` (deep copies), in one process.

State = a model of about 1, 10 and 100 MB of float32 parameters plus SGD momentum buffers of the
same size (so the state is twice the model).  Median of ``--reps`` commits with min and max.

    .venv/bin/python benchmarks/job/commit.py          # writes benchmarks/results/commit.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def make_model(megabytes: float) -> torch.nn.Module:
    """Linear layers of 1024-wide rows holding about ``megabytes`` MB of float32 parameters."""
    rows = max(1, int(megabytes * 2 ** 20 / 4 / 1024))
    layers = [torch.nn.Linear(1024, 1024, bias=False) for _ in range(rows // 1024)]
    if rows % 1024:
        layers.append(torch.nn.Linear(1024, rows % 1024, bias=False))
    return torch.nn.Sequential(*layers)


def state_megabytes(model, optimizer) -> float:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in optimizer.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return n / 2 ** 20


def measure(impl: str, megabytes: float, reps: int) -> dict:
    import horovod.torch as hvd
    model = make_model(megabytes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():  # one step so the momentum buffers exist
        p.grad = torch.zeros_like(p)
    optimizer.step()
    if impl == "hvd_edl":
        from hvd_edl.torch.elastic import TorchState
    else:
        from horovod.torch.elastic import TorchState
    hvd.init()
    state = TorchState(model, optimizer, epoch=0)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        state.commit()
        times.append(time.perf_counter() - t)
    mb = state_megabytes(model, optimizer)
    med = statistics.median(times)
    return {"impl": impl, "model_mb": megabytes, "state_mb": round(mb, 2), "runs": reps,
            "median_s": med, "min_s": min(times), "max_s": max(times),
            "ms_per_mb": med * 1e3 / mb}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,10,100", help="model MB (default %(default)s)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS / "commit.json"))
    a = p.parse_args()
    if a.reps < 1:
        p.error("--reps must be >= 1")
    torch.set_num_threads(1)
    rows = []
    for mb in (float(x) for x in a.sizes.split(",")):
        for impl in ("hvd_edl", "horovod"):
            r = measure(impl, mb, a.reps)
            rows.append(r)
            print(f"{impl:8s} state {r['state_mb']:7.1f} MB: commit {r['median_s'] * 1e3:8.2f} ms "
                  f"median (min {r['min_s'] * 1e3:.2f}, max {r['max_s'] * 1e3:.2f}), "
                  f"{r['ms_per_mb']:.3f} ms/MB", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "benchmark": "TorchState.commit()", "results": rows,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "cuda": torch.cuda.is_available()}}, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
