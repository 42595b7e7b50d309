"""A training script whose compute per step is known (test_straggler.py): each step spins the
CPU for a fixed amount of work and sleeps ``--sleep`` seconds, then a one-layer model's backward
and optimizer step, then as much work again (what a script does after its step: logging,
metrics); it commits after every step.  Every 10 steps each rank writes the mean of
the last 50 steps' own compute (everything but ``optimizer.step()`` and ``commit()``, timed
with ``time.perf_counter``) to ``DIR/compute.<worker id>.json``: the truth the launcher's
telemetry is checked against."""
import argparse
import json
import os
import time
from collections import deque

import torch

import hvd_edl.torch as hvd


def spin(n: int) -> int:
    x = 0
    for i in range(n):
        x = (x + i * i) % 1000003
    return x


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--spin", type=int, default=10000, help="loop iterations per step")
    p.add_argument("--sleep", type=float, default=0.015, help="seconds slept per step")
    a = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, batch=0)
    path = os.path.join(a.out, f"compute.{os.environ.get('HVD_EDL_WORKER_ID', 'x')}.json")
    recent = deque(maxlen=50)

    @hvd.elastic.run
    def train(state):
        while True:
            t0 = time.perf_counter()
            spin(a.spin)
            time.sleep(a.sleep)
            opt.zero_grad()
            model(torch.ones(4, 8)).pow(2).mean().backward()
            own = time.perf_counter() - t0
            opt.step()
            t1 = time.perf_counter()  # work after the step (logging, metrics): compute too
            spin(a.spin)
            time.sleep(a.sleep)
            recent.append(own + time.perf_counter() - t1)
            state.batch += 1
            state.commit()
            if state.batch % 10 == 0 and len(recent) == recent.maxlen:
                tmp = path + ".tmp"
                with open(tmp, "w") as f:
                    json.dump({"compute_s": sum(recent) / len(recent), "at": time.time()}, f)
                os.replace(tmp, path)

    train(state)


if __name__ == "__main__":
    main()
