"""A larger synthetic model for speed models and autoscaling: an MLP of about ``--params-mb`` MB
of float32 parameters (default 16 MB, 4.2 M parameters) on seeded random data, trained
elastically with Horovod's API (only the import differs from a Horovod script).

    hvd-edl-run -np 2 --min-np 1 --max-np 4 --host-discovery-script ./d.sh \\
        python examples/train_synthetic.py --compute-s 0.15 --stop-file /tmp/stop

Each step computes a real forward and backward pass of a small batch (one thread:
``torch.set_num_threads(1)``) and allreduces every gradient (``--params-mb`` MB a step, the
communication a speed model has to predict), after sleeping ``--compute-s`` seconds, standing
for the accelerator's compute (before the backward pass, so no allreduce hides in it): on a machine with fewer cores than workers (2 cores here, up to 4
workers), real compute of that size would measure CPU contention, not data-parallel scaling,
while a sleeping stand-in keeps each worker's compute what a dedicated device would give.
Training ends at the next epoch boundary once ``--stop-file`` exists (all ranks agree through
one allreduce), or after ``--epochs``.
"""
import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_edl.torch as hvd


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params-mb", type=float, default=16.0,
                   help="model size in MB of float32 parameters (default 16)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank per step")
    p.add_argument("--samples", type=int, default=4096, help="samples per epoch")
    p.add_argument("--epochs", type=int, default=1000)
    p.add_argument("--compute-s", type=float, default=0.15,
                   help="seconds each step sleeps, standing for accelerator compute (default "
                        "0.15)")
    p.add_argument("--commit-every", type=int, default=10, help="steps between state.commit()")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-file", help="end at the next epoch boundary once this file exists")
    return p.parse_args()


IN, OUT = 256, 10


class SyntheticMLP(nn.Module):
    """(N, 256) -> (N, 10) through two hidden layers of width ``h``; ``h`` is chosen so the
    parameters take about ``params_mb`` MB."""

    def __init__(self, params_mb: float):
        super().__init__()
        n = params_mb * (1 << 20) / 4
        # parameters ~ h*h + (IN + OUT + 2) * h: solve for the hidden width
        b = IN + OUT + 2
        h = max(16, int((-b + (b * b + 4 * n) ** 0.5) / 2))
        self.fc1 = nn.Linear(IN, h)
        self.fc2 = nn.Linear(h, h)
        self.fc3 = nn.Linear(h, OUT)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def _agreed_stop(path: str) -> bool:
    flag = torch.tensor([1 if os.path.exists(path) else 0], dtype=torch.int32)
    return bool(hvd.allreduce(flag, op=hvd.Max, name="stop_file")[0] > 0)


def main():
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.samples, IN, generator=g)
    y = torch.randint(0, OUT, (args.samples,), generator=g)
    data = torch.utils.data.TensorDataset(x, y)

    model = SyntheticMLP(args.params_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=args.seed,
                                         batch_size=args.batch_size)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0, step=0)
    if hvd.rank() == 0:
        mb = sum(p.numel() for p in model.parameters()) * 4 / (1 << 20)
        print(f"synthetic MLP: {mb:.1f} MB of parameters", flush=True)

    @hvd.elastic.run
    def train(state):
        while state.epoch < args.epochs:
            for batch_idx, (xb, yb) in enumerate(loader):
                if args.compute_s:  # before the backward pass: no allreduce overlaps it
                    time.sleep(args.compute_s)
                optimizer.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                optimizer.step()
                sampler.record_batch(batch_idx, len(xb))
                state.step += 1
                if state.step % args.commit_every == 0:
                    state.commit()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
            if args.stop_file and _agreed_stop(args.stop_file):
                break

    train(state)


if __name__ == "__main__":
    main()
