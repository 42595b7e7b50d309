"""The elastic samplers, their permutation and the audit checker, in one process (no ring):
ranks are simulated with ``repartition(rank, world_size)``."""
import json

import numpy as np
import pytest
import torch

from hvd_edl import audit
from hvd_edl.permutation import TABLE_MAX_DOMAIN, FeistelPermutation
from hvd_edl.torch.elastic import ElasticBatchSampler, ElasticSampler


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 1347])
def test_feistel_is_a_bijection(n):
    out = FeistelPermutation(n, seed=11)(np.arange(n))
    assert sorted(out.tolist()) == list(range(n))


def test_feistel_depends_on_the_seed():
    a = FeistelPermutation(1000, 1)(np.arange(1000))
    b = FeistelPermutation(1000, 2)(np.arange(1000))
    assert (a != b).any()


@pytest.mark.parametrize("n", [1, 5, 700, 1347, 40000, (1 << 16) + 1])
def test_feistel_table_gives_the_walks_values(n):
    """A call mapping much of a small domain follows the tabulated encryption; the values must
    be those of the cycle walk over the cipher itself."""
    perm = FeistelPermutation(n, seed=5)
    got = perm(np.arange(n))
    assert (perm._table is not None) == (perm._domain <= TABLE_MAX_DOMAIN)
    expected = perm._encrypt(np.arange(n, dtype=np.uint64))
    while (expected >= n).any():
        expected[expected >= n] = perm._encrypt(expected[expected >= n])
    assert (got == expected).all()


def _dataset(n):
    return torch.utils.data.TensorDataset(torch.arange(n))


def _ranks(make, world, state):
    """One sampler per simulated rank, all loaded with ``state`` and laid out for ``world``."""
    out = []
    for rank in range(world):
        s = make()
        s.load_state_dict(state)
        s.repartition(rank, world)
        out.append(s)
    return out


def _batches(s, per_rank_batch):
    """This rank's steps as lists of indices (a DataLoader's grouping)."""
    if isinstance(s, ElasticBatchSampler):
        return list(iter(s))
    idx = list(iter(s))
    return [idx[i:i + per_rank_batch] for i in range(0, len(idx), per_rank_batch)]


def _simulate(make, n, per_rank_batch, worlds, steps_per_generation=2):
    """Run an epoch over a sequence of world sizes: two steps per generation, then the last one
    to the end.  Returns (indices used, declared repeats); asserts equal step counts."""
    used, repeats, state = [], 0, make().state_dict()
    for i, world in enumerate(worlds):
        ranks = _ranks(make, world, state)
        per_rank = [_batches(s, per_rank_batch) for s in ranks]
        steps = {len(b) for b in per_rank}
        assert len(steps) == 1, f"ranks would run different step counts: {steps}"
        lengths = {len(s) if isinstance(s, ElasticBatchSampler) else -(-len(s) // per_rank_batch)
                   for s in ranks}
        assert lengths == steps, "len() must match what iterating yields"
        last = i == len(worlds) - 1
        take = max(steps) if last else min(steps_per_generation, max(steps))
        for step in range(take):
            for s, b in zip(ranks, per_rank):
                used.extend(b[step])
        for s in ranks:
            for _ in range(take):  # Horovod's accounting: one call per step, batch_idx unused
                s.record_batch(0, per_rank_batch)
            repeats += s.repeated if last else 0
        consumed = {s.consumed for s in ranks}
        assert len(consumed) == 1
        state = ranks[0].state_dict()
    return used, repeats


@pytest.mark.parametrize("n, batch, worlds", [(100, 4, [2, 3, 1]), (1347, 16, [3, 2, 4]),
                                              (37, 5, [4, 1, 3]), (1281, 16, [1, 2, 3, 2])])
def test_per_rank_batches_cover_the_epoch_exactly_once(n, batch, worlds):
    make = lambda: ElasticSampler(_dataset(n), shuffle=True, seed=5, batch_size=batch)  # noqa: E731
    used, repeats = _simulate(make, n, batch, worlds)
    # repeats only where the final global batch is smaller than the world size
    assert repeats <= worlds[-1] - 1
    assert len(used) - repeats == n
    assert sorted(set(used)) == list(range(n))


@pytest.mark.parametrize("n, global_batch, worlds", [(1347, 48, [1, 2, 3, 2]),
                                                     (100, 7, [3, 4, 2]), (10, 4, [4, 2])])
def test_global_batches_cover_the_epoch_exactly_once(n, global_batch, worlds):
    make = lambda: ElasticBatchSampler(_dataset(n), global_batch_size=global_batch, seed=3)  # noqa: E731
    used, repeats = _simulate(make, n, global_batch, worlds)
    assert len(used) - repeats == n
    assert sorted(set(used)) == list(range(n))


def test_global_batches_do_not_depend_on_the_world_size():
    n, g = 200, 12
    one = _batches(_ranks(lambda: ElasticBatchSampler(_dataset(n), g), 1,
                          ElasticBatchSampler(_dataset(n), g).state_dict())[0], g)
    three = [_batches(s, g) for s in _ranks(lambda: ElasticBatchSampler(_dataset(n), g), 3,
                                            ElasticBatchSampler(_dataset(n), g).state_dict())]
    assert [sorted(sum((r[j] for r in three), [])) for j in range(len(one))] == \
        [sorted(b) for b in one]
    weights = [ElasticBatchSampler(_dataset(n), g) for _ in range(3)]
    for r, s in enumerate(weights):
        s.repartition(r, 3)
    last = len(one) - 1  # 200 = 16*12 + 8: shares 3/3/2 of 8
    assert sum(s.loss_weight(last) for s in weights) == pytest.approx(3.0)
    assert [s.loss_weight(last) for s in weights] == pytest.approx([9 / 8, 9 / 8, 6 / 8])


def test_tiny_final_batch_repeats_at_most_world_minus_one():
    # 33 samples, 2 ranks of 16: the final global batch holds 1 sample for 2 ranks
    make = lambda: ElasticSampler(_dataset(33), seed=1, batch_size=16)  # noqa: E731
    ranks = _ranks(make, 2, make().state_dict())
    per_rank = [_batches(s, 16) for s in ranks]
    assert [len(b) for b in per_rank] == [2, 2] and [len(b[1]) for b in per_rank] == [1, 1]
    assert sum(s.repeated for s in ranks) == 1
    dropped = _ranks(lambda: ElasticSampler(_dataset(33), seed=1, batch_size=16,
                                            drop_last=True), 2, make().state_dict())
    assert [len(_batches(s, 16)) for s in dropped] == [1, 1]
    assert dropped[0].skipped == 1


def test_interleaved_layout_learns_the_batch_size():
    s = ElasticSampler(_dataset(50), seed=2)
    assert s.state_dict()["batch_size"] is None
    next(iter(s))
    s.record_batch(0, 4)
    assert s.state_dict()["batch_size"] == 4 and s.consumed == 4


def test_state_is_a_few_integers_and_reset_is_o1():
    s = ElasticSampler(_dataset(10), batch_size=2)
    big = ElasticSampler(range(10 ** 9), batch_size=32)  # no list of 10^9 indices is built
    assert set(big.state_dict()) == {"epoch", "processed_num", "seed", "consumed", "batch_size"}
    assert len(next(iter(torch.utils.data.BatchSampler(big, 32, False)))) == 32
    assert len(json.dumps(big.state_dict())) < 100 and s.state_dict()["consumed"] == 0


def test_checker_keeps_committed_progress_only(tmp_path):
    """Generation 2 resumed from step 1: its step 2 supersedes generation 1's step 2 (rolled
    back); a missing index and a repeated one are both counted."""
    lines = [
        {"kind": "sync", "gen": 1, "step": 0, "epoch": 0},
        {"kind": "step", "gen": 1, "step": 1, "epoch": 0, "rank": 0, "size": 1,
         "sampler": "s", "indices": [0, 1]},
        {"kind": "step", "gen": 1, "step": 2, "epoch": 0, "rank": 0, "size": 1,
         "sampler": "s", "indices": [2, 3]},
        {"kind": "sync", "gen": 2, "step": 1, "epoch": 0},
        {"kind": "step", "gen": 2, "step": 2, "epoch": 0, "rank": 0, "size": 1,
         "sampler": "s", "indices": [2, 3]},
        {"kind": "step", "gen": 2, "step": 3, "epoch": 0, "rank": 0, "size": 1,
         "sampler": "s", "indices": [4, 4]},
        {"kind": "epoch", "gen": 2, "step": 3, "epoch": 1, "sampler": "s"},
    ]
    (tmp_path / "w0.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{\"torn")
    report = audit.check(tmp_path, dataset_size=6)
    (e,) = report.epochs
    assert (e.complete, e.repeated, e.missing, e.rolled_back_steps) == (True, 1, 1, 1)
    assert not report.ok
    assert audit.main([str(tmp_path), "--dataset-size", "6"]) == 1
