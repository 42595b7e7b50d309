"""The benchmark workload: the digits CNN of ``examples/train_digits.py`` under three systems.
Part of the benchmarks' library: not a benchmark, the training script that the job harness
(``benchmarks/common/jobs.py``, ``WorkloadJob``) starts under each launcher, e.g.::

    hvd-edl-run -np 2 --host-discovery-script D .venv/bin/python benchmarks/common/workload.py \
        --system hvd_edl --timeline-dir T --stop-file S

    --system hvd_edl           import hvd_edl.torch as hvd     (run by hvd-edl-run)
    --system horovod_elastic   import horovod.torch as hvd     (horovodrun --host-discovery-script)
    --system static            import horovod.torch as hvd     (horovodrun -np N, no elastic loop)

Same model, data, batch size, optimizer and commit interval as the main job; the elastic systems
use their own ``hvd.elastic.ElasticSampler`` and ``TorchState``, static Horovod a
``DistributedSampler``.  Every optimizer step appends one JSON line to
``<timeline-dir>/timeline-<pid>.jsonl``: ``{"t": unix end time, "dt": step seconds, "rank",
"size", "step"}`` (``step`` is the committed-and-restored step counter), flushed at once so a
``kill -9`` loses nothing already written.

``--model-mb M`` adds about M MB of frozen float32 parameters: they are part of the model's
state (committed, synced to joiners at every switch) but get no gradient, so the per-step
allreduce stays the digits CNN's.  ``--joiner-build-delay-file F``: a process started after
training began (a timeline file already exists) sleeps the seconds written in F (read at its
start) before entering the elastic loop, standing for a joiner whose model takes that long to
build; the harness changes F between scale-outs.  Training ends at the next
epoch boundary once ``--stop-file`` exists (all ranks agree through one allreduce).
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_digits import DigitsCNN, load_data  # noqa: E402  - the main job's model and data


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", required=True, choices=["hvd_edl", "horovod_elastic", "static"])
    p.add_argument("--timeline-dir", required=True)
    p.add_argument("--epochs", type=int, default=100000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--commit-every", type=int, default=10)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--joiner-build-delay-file")
    p.add_argument("--model-mb", type=float, default=0.0)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class BenchModel(DigitsCNN):
    """The digits CNN plus ``model_mb`` MB of frozen parameters (state, not gradients)."""

    def __init__(self, model_mb: float):
        super().__init__()
        n = int(model_mb * (1 << 20) / 4)
        if n > 0:
            self.ballast = nn.Parameter(torch.randn(n) * 0.01, requires_grad=False)


class Timeline:
    """Per-process step records, one flushed JSON line each."""

    def __init__(self, directory: str):
        self.dir = Path(directory)
        self.f = None

    def joiner(self) -> bool:
        return any(self.dir.glob("timeline-*.jsonl"))

    def record(self, t_start: float, rank: int, size: int, step: int) -> None:
        if self.f is None:
            self.f = open(self.dir / f"timeline-{os.getpid()}.jsonl", "a", buffering=1)
        t = time.time()
        self.f.write(f'{{"t": {t:.6f}, "dt": {t - t_start:.6f}, "rank": {rank}, '
                     f'"size": {size}, "step": {step}}}\n')


def main():
    args = parse_args()
    if args.system == "hvd_edl":
        import hvd_edl.torch as hvd
    else:
        import horovod.torch as hvd
    timeline = Timeline(args.timeline_dir)
    build_delay = 0.0
    if timeline.joiner() and args.joiner_build_delay_file:
        with open(args.joiner_build_delay_file) as f:
            build_delay = float(f.read().strip() or 0)
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train_ds, _ = load_data(args.seed)
    model = BenchModel(args.model_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    B = args.batch_size

    def stop_agreed() -> bool:
        flag = torch.tensor([1 if os.path.exists(args.stop_file) else 0], dtype=torch.int32)
        return bool(hvd.allreduce(flag, op=hvd.Max, name="stop_file")[0] > 0)

    def train_epoch(loader, sampler, state):
        for batch_idx, (x, y) in enumerate(loader):
            t0 = time.time()
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            if args.step_delay:
                time.sleep(args.step_delay)
            state.step += 1
            timeline.record(t0, hvd.rank(), hvd.size(), state.step)
            if sampler is not None:
                sampler.record_batch(batch_idx, B)
                if state.step % args.commit_every == 0:
                    state.commit()

    if args.system == "static":
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        sampler = torch.utils.data.distributed.DistributedSampler(
            train_ds, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed)
        loader = torch.utils.data.DataLoader(train_ds, batch_size=B, sampler=sampler)

        class Counter:
            step = 0
        counter = Counter()
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            train_epoch(loader, None, counter)
            if stop_agreed():
                break
        return

    if args.system == "hvd_edl":
        sampler = hvd.elastic.ElasticSampler(train_ds, shuffle=True, seed=args.seed, batch_size=B)
    else:
        sampler = hvd.elastic.ElasticSampler(train_ds, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(train_ds, batch_size=B, sampler=sampler)
    if build_delay:
        time.sleep(build_delay)
    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0, step=0)

    @hvd.elastic.run
    def train(state):
        while state.epoch < args.epochs:
            train_epoch(loader, sampler, state)
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
            if stop_agreed():
                break

    train(state)


if __name__ == "__main__":
    main()
