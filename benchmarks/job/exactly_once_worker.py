"""Training script for benchmarks/job/exactly_once.py (not a benchmark of its own): the digits
CNN with Horovod's elastic API and Horovod's ``ElasticSampler`` signature, under either system
(only the import differs); exactly_once.py runs it as ``horovodrun --gloo ... python
benchmarks/job/exactly_once_worker.py --system horovod --ledger DIR`` and ``hvd-edl-run ...
--system hvd_edl``.

It writes its own ledger (hvd_edl.audit's format) from the indices that reach the model, so both
systems are audited by the same code: every batch carries its dataset indices.  A generation is
keyed by rank 0's clock, broadcast when the training function is (re-)entered after a sync.

    --system horovod   import horovod.torch as hvd       (run by horovodrun --gloo)
    --system hvd_edl   import hvd_edl.torch as hvd       (run by hvd-edl-run)
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_digits import DigitsCNN, load_data  # noqa: E402

from hvd_edl.audit import Ledger  # noqa: E402


class Indexed(torch.utils.data.Dataset):
    """(x, y, index) for every sample of ``ds``."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        x, y = self.ds[i]
        return x, y, i


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=["horovod", "hvd_edl"], required=True)
    p.add_argument("--ledger", required=True, help="directory for this worker's ledger")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeat-data", type=int, default=20)
    p.add_argument("--step-delay", type=float, default=0.03)
    p.add_argument("--commit-every", type=int, default=10)
    a = p.parse_args()
    if a.system == "horovod":
        import horovod.torch as hvd
    else:
        import hvd_edl.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train_ds, _ = load_data(0, None, a.repeat_data)
    data = Indexed(train_ds)
    ledger = Ledger(Path(a.ledger) / f"pid{os.getpid()}.jsonl")

    model = DigitsCNN()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05,
                                                         momentum=0.9),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=a.batch_size, sampler=sampler)
    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0, step=0)

    @hvd.elastic.run
    def train(state):
        gen = hvd.broadcast_object(time.time(), root_rank=0, name="ledger_generation")
        ledger.write("sync", gen=gen, step=state.step, epoch=state.epoch, sampler="train")
        while state.epoch < a.epochs:
            for batch_idx, (x, y, idx) in enumerate(loader):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                sampler.record_batch(batch_idx, a.batch_size)
                state.step += 1
                ledger.write("step", gen=gen, step=state.step, epoch=state.epoch,
                             rank=hvd.rank(), size=hvd.size(), sampler="train",
                             indices=idx.tolist(), pid=os.getpid())
                if a.step_delay:
                    time.sleep(a.step_delay)
                if state.step % a.commit_every == 0:
                    state.commit()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            ledger.write("epoch", gen=gen, step=state.step, epoch=state.epoch, sampler="train")
            state.commit()

    train(state)


if __name__ == "__main__":
    main()
