"""Horovod's elastic unit checks (test/single/test_torch_elastic.py in Horovod 0.28.1), in our
words, against ``import hvd_edl.torch as hvd``: ``TorchState`` sync / restore / commit of a
model and scalars, and ``ElasticSampler``'s processed-sample accounting across ``record_batch``,
``commit``, ``restore``, ``sync`` and ``set_epoch`` with the number of batches after a
repartition.  Horovod runs them in one process; this script also runs under ``hvd-edl-run``
with several workers, where Horovod's formula ``processed_num += batch_size * num_replicas``
gives the expected counts.  Prints ``ok`` and exits 0 when every check holds.
"""
import copy

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import hvd_edl.torch as hvd


def check_elastic_state():
    v = 1.0 if hvd.rank() == 0 else 2.0
    model1 = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model1.load_state_dict({"0.weight": torch.tensor([[v, v], [v, v]]),
                            "0.bias": torch.tensor([v, v])})
    model2 = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model2.load_state_dict({"0.weight": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
                            "0.bias": torch.tensor([0.0, 0.0])})
    optimizer = torch.optim.SGD(model1.parameters(), lr=0.001 * hvd.size())
    state = hvd.elastic.TorchState(model1, optimizer, batch=20 + hvd.rank(),
                                   epoch=10 + hvd.rank())
    state.sync()
    model1_weights = [w.clone() for w in model1.state_dict().values()]
    model2_weights = [w.clone() for w in model2.state_dict().values()]
    for w in state.model.state_dict().values():  # rank 0's values everywhere
        np.testing.assert_allclose(w, np.ones_like(w))
    assert (state.batch, state.epoch) == (20, 10)

    model1.load_state_dict(model2.state_dict())  # change, then restore: back to the sync
    state.batch, state.epoch = 21, 11
    state.restore()
    for w1, w2 in zip(model1.state_dict().values(), model1_weights):
        np.testing.assert_allclose(w1, w2)
    assert (state.batch, state.epoch) == (20, 10)

    model1.load_state_dict(model2.state_dict())  # change, commit, restore: the change stays
    state.batch, state.epoch = 21, 11
    state.commit()
    state.restore()
    for w1, w2 in zip(model1.state_dict().values(), model2_weights):
        np.testing.assert_allclose(w1, w2)
    assert (state.batch, state.epoch) == (21, 11)


class ListDataset(Dataset):
    def __init__(self, data):
        self.data = data

    def __getitem__(self, idx):
        return self.data[idx]

    def __len__(self):
        return len(self.data)


def check_elastic_sampler():
    batch_size, per_worker, w = 2, 8, hvd.size()
    dataset = ListDataset(list(range(per_worker * w)))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    state = hvd.elastic.TorchState(sampler=sampler)
    state.sync()
    assert (state.sampler.epoch, state.sampler.processed_num) == (0, 0)

    total = 0
    for epoch in range(2):  # normal use
        sampler.set_epoch(epoch)
        for batch_idx, _ in enumerate(loader):
            sampler.record_batch(batch_idx, batch_size)
            assert sampler.processed_num == batch_size * w * (batch_idx + 1)
            total += 1
    assert total == per_worker // batch_size * 2

    total = 0  # no set_epoch: the processed count stays and the loader repeats the epoch
    for _ in loader:
        assert sampler.processed_num == len(sampler) * w
        total += 1
    assert total == per_worker // batch_size

    sampler.set_epoch(2)  # a partial epoch, committed
    assert sampler.processed_num == 0
    sampler.record_batch(0, batch_size)
    sampler.record_batch(1, batch_size)
    assert sampler.processed_num == 2 * batch_size * w
    committed = copy.copy(sampler.processed_num)
    state.commit()

    sampler.record_batch(2, batch_size)  # more, then restored away
    sampler.record_batch(3, batch_size)
    assert sampler.processed_num == 4 * batch_size * w
    state.restore()
    assert sampler.processed_num == committed == 2 * batch_size * w

    sampler.record_batch(2, batch_size)  # sync repartitions what is left
    assert sampler.processed_num == 3 * batch_size * w
    state.commit()
    state.sync()
    assert sampler.processed_num == 3 * batch_size * w
    assert len(sampler) == batch_size
    assert sum(1 for _ in loader) == 1

    sampler.set_epoch(3)  # the next epoch starts over
    assert len(sampler) == per_worker
    assert sum(1 for _ in loader) == per_worker // batch_size

    # Horovod's state_dict keys load into ours (a checkpoint written by a Horovod job)
    sampler.load_state_dict({"epoch": 4, "processed_num": 2 * batch_size * w})
    assert (sampler.epoch, sampler.processed_num, len(sampler)) == (4, 2 * batch_size * w,
                                                                    per_worker - 2 * batch_size)


if __name__ == "__main__":
    hvd.init()
    check_elastic_state()
    check_elastic_sampler()
    print("ok", hvd.rank(), hvd.size(), flush=True)
