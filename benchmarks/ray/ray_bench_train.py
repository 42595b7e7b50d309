"""The training that benchmarks/ray/ray_vs_raytrain.py runs under both systems: the same model (an
MLP, 64 -> 512 -> 512 -> 10, 0.3 M parameters), the same batch (64 samples per worker, drawn from
a seeded generator by global step and rank), SGD, a state commit / checkpoint every
``COMMIT_EVERY`` steps; every step appends one JSON line ``{"t", "pid", "step", "size"}`` (unix
seconds, the process, the global step reached, the world size) to the step log.

Run as a script it is the hvd_edl side: a Horovod elastic script with one import changed
(``import hvd_edl.torch as hvd``), under ``hvd-edl-run --ray``:

    hvd-edl-run --ray HEAD:6379 --min-np 2 --max-np 3 \\
        .venv/bin/python benchmarks/ray/ray_bench_train.py \\
        --step-log steps.jsonl --stop-file stop

The Ray Train side imports :func:`make_model`, :func:`batch` and :class:`StepLog` from here."""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

COMMIT_EVERY = 10
BATCH = 64


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 10))


def batch(step: int, rank: int):
    """The ``rank``'s batch of global step ``step``: ``(x [BATCH, 64], y [BATCH])``."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(BATCH, 64, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


class StepLog:
    """Appends one line per step to ``path`` with a single ``write(2)``."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def step(self, step: int, size: int) -> None:
        os.write(self.fd, (json.dumps({"t": round(time.time(), 4), "pid": os.getpid(),
                                       "step": step, "size": size}) + "\n").encode())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--step-log", required=True)
    p.add_argument("--stop-file", required=True)
    args = p.parse_args()

    import hvd_edl.torch as hvd   # instead of: import horovod.torch as hvd
    hvd.init()
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0)
    log = StepLog(args.step_log)

    @hvd.elastic.run
    def train(state):
        while True:
            x, y = batch(state.step, hvd.rank())
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            state.step += 1
            log.step(state.step, hvd.size())
            if state.step % COMMIT_EVERY == 0:
                state.commit()
                flag = torch.tensor([1.0 if os.path.exists(args.stop_file) else 0.0])
                if hvd.allreduce(flag, op=hvd.Max, name="stop").item() > 0:
                    return

    train(state)


if __name__ == "__main__":
    main()
