"""The elastic sampler and its permutation, in one process (no ring needed)."""
import numpy as np
import pytest
import torch

from hvd_edl.permutation import FeistelPermutation
from hvd_edl.sampler import ElasticSampler


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 1347])
def test_feistel_is_a_bijection(n):
    out = FeistelPermutation(n, seed=11)(np.arange(n))
    assert sorted(out.tolist()) == list(range(n))


def test_feistel_depends_on_the_seed():
    a = FeistelPermutation(1000, 1)(np.arange(1000))
    b = FeistelPermutation(1000, 2)(np.arange(1000))
    assert (a != b).any()


def _run_ranks(n, batch, world, consumed, epoch=0):
    """Indices each simulated rank would read, resuming from ``consumed``."""
    ds = torch.utils.data.TensorDataset(torch.arange(n))
    per_rank = []
    for rank in range(world):
        s = ElasticSampler(ds, shuffle=True, seed=5, batch_size=batch)
        s.load_state_dict({"epoch": epoch, "seed": 5, "consumed": consumed})
        s.rank, s.world_size = rank, world
        s._base = consumed
        per_rank.append(list(iter(s)))
    return per_rank


@pytest.mark.parametrize("n, batch, worlds", [(100, 4, [2, 3, 1]), (1347, 16, [3, 2, 4]),
                                              (37, 5, [4, 1, 3])])
def test_repartition_covers_the_epoch_exactly_once(n, batch, worlds):
    seen, consumed = [], 0
    for i, world in enumerate(worlds):
        per_rank = _run_ranks(n, batch, world, consumed)
        steps = {len(range(0, len(r), batch)) for r in per_rank}
        assert len(steps) == 1, "every rank must run the same number of steps"
        take = 2 if i < len(worlds) - 1 else None  # two steps per generation, then to the end
        for step in range(take if take is not None else max(steps)):
            for r in per_rank:
                seen.extend(r[step * batch:(step + 1) * batch])
            consumed = min(n, consumed + batch * world)
    assert sorted(seen) == list(range(n))
