"""An elastic sampler whose state is three integers: every sample of an epoch used exactly once.

The epoch's order is a seeded bijection of ``range(N)`` (:class:`FeistelPermutation`), so the
sampler never builds a list of indices: after any generation change the remaining positions
``[consumed, N)`` are repartitioned over the new ranks in O(1).

Layout with ``batch_size=B`` (exactly-once mode): global step ``j`` after a reset takes the block
of positions ``[c + j*B*W, c + (j+1)*B*W)`` (W = world size, c = consumed at the reset) and splits
it over the ranks, rank ``r`` taking a contiguous share; only the epoch's last block may be short,
and then it is split as evenly as possible (shares differ by at most one), so every rank runs the
same number of steps.  If the last block holds fewer positions than there are ranks, ranks without
one repeat one of the block (at most W-1 repeats; with ``drop_last`` the block is skipped
instead); :attr:`ElasticSampler.repeated` counts them.

Without ``batch_size`` (Horovod's signature) positions are interleaved over the ranks and each
rank's share is padded to the same length, like Horovod's sampler; exactly-once then holds except
for that padding.
"""
from __future__ import annotations

from typing import Dict, Iterator, Optional

import numpy as np
import torch.utils.data

from hvd_edl.permutation import FeistelPermutation

_CHUNK = 4096  # positions mapped per vectorised call while iterating


class ElasticSampler(torch.utils.data.Sampler):
    """Elastic, exactly-once ``Sampler`` (Horovod's ``ElasticSampler`` interface).

    Args:
        dataset: anything with ``len()`` (N samples).
        shuffle: permute the order each epoch (seeded by ``seed`` and the epoch).
        seed: int.
        drop_last: skip an epoch's final global batch when it has fewer samples than ranks.
        batch_size: per-rank batch size B of the DataLoader using this sampler; enables the
            exactly-once step layout above.  None keeps Horovod's padded layout.

    ``state_dict()`` is ``{"epoch", "seed", "consumed"}`` (consumed: positions of this epoch in
    committed progress).  Call :meth:`record_batch` after each step; the elastic state commits,
    restores and syncs the sampler, and calls :meth:`reset` after every generation change.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 batch_size: Optional[int] = None):
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.num_samples_total = len(dataset)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.batch_size = batch_size
        self.epoch = 0
        self.consumed = 0
        self.repeated = 0
        self.skipped = 0
        self.rank = 0
        self.world_size = 1
        self._base = 0
        self._local_processed = 0
        self._perm: Optional[FeistelPermutation] = None
        self.reset()

    # ---- Horovod's interface ------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first sample."""
        self.epoch = int(epoch)
        self.consumed = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record that the ``batch_idx``-th batch (0-based, counted since the last reset) of
        ``batch_size`` samples per rank was processed by every rank."""
        remaining = self._end() - self._base
        if self.batch_size is not None:
            done = (batch_idx + 1) * self.batch_size * self.world_size
        else:
            self._local_processed = (batch_idx + 1) * batch_size
            done = self._local_processed * self.world_size
        self.consumed = self._base + min(remaining, done)

    def record_indices(self, indices) -> None:
        """Record ``len(indices)`` more samples processed by this rank (and so by every rank)."""
        self._local_processed += len(indices)
        remaining = self._end() - self._base
        self.consumed = self._base + min(remaining, self._local_processed * self.world_size)

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "seed": self.seed, "consumed": self.consumed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.seed = int(state["seed"])
        self.consumed = int(state["consumed"])
        self.reset()

    def reset(self) -> None:
        """Repartition the remaining positions over the current rank and world size (O(1))."""
        from hvd_edl import torch as hvd
        try:
            self.rank, self.world_size = hvd.rank(), hvd.size()
        except ValueError:  # Horovod not initialised and not under the launcher
            self.rank, self.world_size = 0, 1
        self._base = self.consumed
        self._local_processed = 0
        self._perm = (FeistelPermutation(self.num_samples_total,
                                         hash((self.seed, self.epoch)) & ((1 << 62) - 1))
                      if self.shuffle and self.num_samples_total > 0 else None)
        self.repeated = 0
        self.skipped = 0

    # ---- iteration ----------------------------------------------------------------------------

    def _end(self) -> int:
        """End of the epoch's positions after drop_last trimming (see :meth:`_blocks`)."""
        n, w = self.num_samples_total, self.world_size
        if self.batch_size is None or not self.drop_last:
            return n
        step = self.batch_size * w
        tail = (n - self._base) % step
        return n - tail if 0 < tail < w else n

    def _local_ranges(self):
        """Yield (start, stop, repeat) position ranges this rank reads, in order."""
        w, r, base, end = self.world_size, self.rank, self._base, self._end()
        if self.batch_size is None:
            remaining = end - base
            per_rank = -(-remaining // w) if remaining > 0 else 0
            for k in range(per_rank):
                pos = base + r + k * w
                if pos < end:
                    yield pos, pos + 1, False
                else:  # pad this rank's share, like Horovod's sampler
                    pad = base + (pos - base) % remaining
                    yield pad, pad + 1, True
            return
        step = self.batch_size * w
        for start in range(base, end, step):
            length = min(step, end - start)
            if length == step:
                yield start + r * self.batch_size, start + (r + 1) * self.batch_size, False
                continue
            q, rem = divmod(length, w)
            if q == 0:  # fewer positions than ranks: ranks past the end repeat one
                if r < length:
                    yield start + r, start + r + 1, False
                else:
                    yield start + r % length, start + r % length + 1, True
                continue
            lo = start + r * q + min(r, rem)
            yield lo, lo + q + (1 if r < rem else 0), False

    def _map(self, positions: np.ndarray) -> np.ndarray:
        return positions if self._perm is None else self._perm(positions)

    def __iter__(self) -> Iterator[int]:
        self.repeated = 0
        for start, stop, repeat in self._local_ranges():
            self.repeated += int(repeat) * (stop - start)
            for lo in range(start, stop, _CHUNK):
                chunk = np.arange(lo, min(stop, lo + _CHUNK), dtype=np.uint64)
                yield from (int(i) for i in self._map(chunk))

    def __len__(self) -> int:
        w, end, base = self.world_size, self._end(), self._base
        remaining = max(0, end - base)
        if self.batch_size is None:
            return -(-remaining // w)
        step = self.batch_size * w
        full, tail = divmod(remaining, step)
        return full * self.batch_size + (-(-tail // w) if tail else 0)
