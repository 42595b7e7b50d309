"""Elastic samplers whose state is three integers: every sample of an epoch used exactly once.

The epoch's order is a seeded bijection of ``range(N)`` (:class:`FeistelPermutation`), so a
sampler never builds a list of indices: after any generation change the remaining positions
``[consumed, N)`` are repartitioned over the new ranks in O(1) (Horovod's ``ElasticSampler``
builds a Python list of every index at each reset, and Horovod skips the re-sync on removal-only
changes, repeating samples: horovod issue 3399).

Step layout ("blocks").  After a reset with ``consumed = c``, global step ``j`` takes the block of
positions ``[c + j*L, c + (j+1)*L)``: ``L = B*W`` for :class:`ElasticSampler` with a per-rank batch
size ``B`` over ``W`` ranks, ``L = G`` for :class:`ElasticBatchSampler` with a fixed global batch
``G``.  A block is split over the ranks in contiguous shares that differ by at most one (``B``
each for a full block of ``B*W``).  Only the epoch's last block may be short; every rank still
gets a share of it, so all ranks run the same number of steps.  If that last block holds fewer
positions than there are ranks, ranks past its end repeat one of its positions (at most ``W-1``
repeats per epoch, counted in :attr:`ElasticSampler.repeated`), or with ``drop_last`` the block
is skipped (:attr:`ElasticSampler.skipped`).

Without a known batch size (Horovod's signature, ``ElasticSampler(dataset)``) positions are
interleaved over the ranks (rank ``r`` reads ``c + r, c + r + W, ...``) and the shorter shares
repeat one position at the epoch's very end; the sampler learns ``B`` from the first
``record_batch`` call and uses blocks from the next reset on.

Audit mode (``HVD_EDL_AUDIT_DIR``, see :mod:`hvd_edl.audit`): each step's yielded indices go to
the ledger when the step is recorded.
"""
from __future__ import annotations

from collections import deque
from typing import Deque, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch.utils.data

from hvd_edl import audit, runtime
from hvd_edl.permutation import FeistelPermutation
from hvd_edl.step_timer import note_samples
from hvd_edl.torch import ops as _ops
from hvd_edl.torch.gradient_noise import note_batch

_CHUNK = 4096  # positions mapped per vectorised call while iterating


class ElasticSampler(torch.utils.data.Sampler):
    """Elastic, exactly-once ``Sampler`` (Horovod's ``ElasticSampler`` interface).

    Args:
        dataset: anything with ``len()`` (N samples).
        shuffle: permute the order each epoch (seeded by ``seed`` and the epoch).
        seed: int.
        drop_last: skip an epoch's final global batch when it has fewer samples than ranks.
        batch_size: per-rank batch size B of the DataLoader using this sampler.  Optional: if
            None it is learnt from the first :meth:`record_batch` and used from the next reset.

    ``state_dict()`` is ``{"epoch", "processed_num", "seed", "consumed", "batch_size"}``
    (``consumed`` = ``processed_num``: positions of this epoch processed by all ranks; Horovod's
    ``{"epoch", "processed_num"}`` loads too).  Call :meth:`record_batch` once after each step
    (each call counts one step, whatever its ``batch_idx``, as in Horovod); the elastic
    state commits, restores and syncs the sampler and calls :meth:`reset` after every
    generation change.  Iterating yields this rank's indices from ``consumed`` to the epoch end.

    Raises:
        ValueError: ``batch_size`` < 1.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 batch_size: Optional[int] = None):
        if batch_size is not None and int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.num_samples_total = len(dataset)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.batch_size = None if batch_size is None else int(batch_size)
        self.name = "sampler"  # set by TorchState to its keyword (for the audit ledger)
        self.epoch = 0
        self.consumed = 0
        self.repeated = 0
        self.skipped = 0
        self.rank = 0
        self.world_size = 1
        self._base = 0
        self._block = 0  # positions per global step since the last reset; 0 = interleaved
        self._local_processed = 0
        self._recorded = 0
        self._perm: Optional[FeistelPermutation] = None
        self._yielded: Deque[Tuple[int, List[int], List[int]]] = deque()  # audit mode
        self.reset()

    # ---- Horovod's interface ------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first sample (the previous one is complete)."""
        ledger = audit.ledger()
        if ledger is not None:
            ledger.write("epoch", epoch=int(epoch), sampler=self.name,
                         skipped=self.num_samples_total - self._end(), **runtime.position())
        self.epoch = int(epoch)
        self.consumed = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record one more processed batch on every rank (Horovod's accounting: each call is one
        step, ``processed_num += batch_size * num_replicas`` in horovod/torch/elastic/sampler.py,
        0.28.1).

        Args:
            batch_idx: ignored, as in Horovod (scripts pass ``enumerate``'s index, a constant,
                a global step counter...: the count of calls since the last reset is what
                counts, so exactly-once holds whatever is passed).
            batch_size: the per-rank batch size; used only while the batch size is unknown
                (``ElasticSampler(dataset)``, interleaved layout: the step is ``batch_size``
                positions per rank, and the size is learnt for the next reset).  In the block
                layout a step is one block of ``L`` positions, so an epoch's short final batch
                is counted right whatever size is passed.
        """
        if self._block:
            self._recorded += 1
            done = self._recorded * self._block
            start = self._base + done - self._block
            share = self._share(start, min(self._block, self._end() - start))[1] \
                if start < self._end() else 0
        else:
            if self.batch_size is None:
                self.batch_size = int(batch_size)
            share = int(batch_size)
            self._local_processed += share
            done = self._local_processed * self.world_size
        note_samples(share)
        self._advance(done)

    def record_indices(self, indices) -> None:
        """Record one more processed step on every rank, this rank's share being ``indices``
        (block layout: one step of the layout, whatever ``len(indices)``; interleaved layout:
        ``len(indices)`` positions per rank)."""
        if self._block:
            self._recorded += 1
            done = self._recorded * self._block
        else:
            self._local_processed += len(indices)
            done = self._local_processed * self.world_size
        note_samples(len(indices))
        self._advance(done)

    @property
    def processed_num(self) -> int:
        """Samples of this epoch processed by all ranks together, as Horovod's
        ``ElasticSampler.processed_num`` (here: positions consumed, the same on every rank)."""
        return self.consumed

    @processed_num.setter
    def processed_num(self, value: int) -> None:
        self.consumed = int(value)

    @property
    def num_replicas(self) -> int:
        """Horovod's name for the world size the sampler is laid out for."""
        return self.world_size

    @property
    def num_samples(self) -> int:
        """Horovod's name for ``len(self)``: indices this rank yields from the last reset."""
        return len(self)

    def state_dict(self) -> Dict[str, int]:
        """``{"epoch", "processed_num", "seed", "consumed", "batch_size"}``: Horovod's two keys
        (``processed_num`` = ``consumed``) and ours."""
        return {"epoch": self.epoch, "processed_num": self.consumed, "seed": self.seed,
                "consumed": self.consumed, "batch_size": self.batch_size}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Load ours or Horovod's ``{"epoch", "processed_num"}`` (the seed and batch size are
        then kept), then reset.

        Raises:
            KeyError: neither ``consumed`` nor ``processed_num`` given, or no ``epoch``.
        """
        self.epoch = int(state["epoch"])
        if state.get("seed") is not None:
            self.seed = int(state["seed"])
        self.consumed = int(state["consumed"] if "consumed" in state else state["processed_num"])
        if state.get("batch_size") is not None:
            self.batch_size = int(state["batch_size"])
        self.reset()

    def reset(self) -> None:
        """Repartition the remaining positions over the current rank and world size (O(1))."""
        try:
            rank, world_size = _ops.rank(), _ops.size()
        except ValueError:  # Horovod not initialised and not under the launcher
            rank, world_size = 0, 1
        self.repartition(rank, world_size)

    def _population(self) -> int:
        """The training set's size when a step's samples are a random draw without replacement
        from it (shuffled: the gradient noise's finite-population term), else 0."""
        return self.num_samples_total if self.shuffle else 0

    def repartition(self, rank: int, world_size: int) -> None:
        """Lay the positions ``[consumed, N)`` out for ``rank`` of ``world_size`` (what
        :meth:`reset` does with Horovod's rank and size; also for simulating ranks in tests)."""
        self.rank, self.world_size = int(rank), int(world_size)
        self._base = self.consumed
        self._block = self._block_length()
        self._local_processed = 0
        self._recorded = 0  # steps recorded since this reset (block layout)
        self._yielded.clear()
        self._perm = (FeistelPermutation(self.num_samples_total,
                                         hash((self.seed, self.epoch)) & ((1 << 62) - 1))
                      if self.shuffle and self.num_samples_total > 0 else None)
        self.repeated = 0
        self.skipped = self.num_samples_total - self._end()
        if self._block:  # the global batch of the steps to come (the gradient noise's unit)
            note_batch(self._block, self._population())

    # ---- layout -------------------------------------------------------------------------------

    def _block_length(self) -> int:
        """Positions per global step (L); 0 for the interleaved layout."""
        return self.batch_size * self.world_size if self.batch_size else 0

    def _end(self) -> int:
        """End of the epoch's positions: N, or with drop_last N minus a final block shorter than
        the number of ranks."""
        n, w = self.num_samples_total, self.world_size
        if not self.drop_last:
            return n
        if not self._block:
            tail = (n - self._base) % w
            return n - tail
        tail = (n - self._base) % self._block
        return n - tail if 0 < tail < w else n

    def _share(self, start: int, length: int) -> Tuple[int, int, bool]:
        """(first position, count, repeated) of this rank's share of a block."""
        w, r = self.world_size, self.rank
        if length < w:  # fewer positions than ranks: ranks past the end repeat one
            return (start + r, 1, False) if r < length else (start + r % length, 1, True)
        q, rem = divmod(length, w)
        return start + r * q + min(r, rem), q + (1 if r < rem else 0), False

    def _blocks(self) -> Iterator[Tuple[int, int, int, bool]]:
        """Yield (global step, first position, count, repeated) of this rank's shares."""
        base, end, block = self._base, self._end(), self._block
        if not block:  # interleaved: one "block" per row of W positions
            w, r = self.world_size, self.rank
            remaining = end - base
            for k in range(-(-remaining // w) if remaining > 0 else 0):
                pos = base + r + k * w
                if pos < end:
                    yield k, pos, 1, False
                else:  # this rank's share is short: repeat one position of the last row
                    yield k, base + k * w + (pos - base) % (remaining - k * w), 1, True
            return
        for j, start in enumerate(range(base, end, block)):
            yield (j, *self._share(start, min(block, end - start)))

    def _steps(self) -> int:
        remaining = max(0, self._end() - self._base)
        return -(-remaining // self._block) if self._block else 0

    def _advance(self, done: int) -> None:
        self.consumed = self._base + min(self._end() - self._base, done)
        ledger = audit.ledger()
        if ledger is None or not self._yielded:
            return
        steps: List[Tuple[int, List[int], List[int]]] = []
        if self._block:
            upto = self._recorded - 1
            while self._yielded and self._yielded[0][0] <= upto:
                steps.append(self._yielded.popleft())
        else:  # interleaved: one row per sample, a step is a batch of them
            rows = self._local_processed
            while self._yielded and self._yielded[0][0] < rows:
                steps.append(self._yielded.popleft())
            steps = [(0, [i for s in steps for i in s[1]], [i for s in steps for i in s[2]])]
        if not any(s[1] or s[2] for s in steps):
            return
        ledger.write("step", epoch=self.epoch, rank=self.rank, size=self.world_size,
                     sampler=self.name, indices=[i for s in steps for i in s[1]],
                     repeats=[i for s in steps for i in s[2]], **runtime.position(True))

    # ---- iteration ----------------------------------------------------------------------------

    def _map(self, positions: np.ndarray) -> np.ndarray:
        return positions if self._perm is None else self._perm(positions)

    def _shares(self) -> Iterator[Tuple[int, List[int], bool]]:
        """(global step, indices, repeated) of this rank's shares, in order.  Positions are
        mapped through the permutation ``_CHUNK`` at a time (one vectorised call for many
        steps, so a step costs no numpy call of its own); audit mode keeps each share until
        its step is recorded."""
        self.repeated = 0
        self._yielded.clear()
        audited = audit.ledger() is not None
        batch: List[Tuple[int, int, int, bool]] = []
        total = 0
        for item in self._blocks():
            batch.append(item)
            total += item[2]
            if total >= _CHUNK:
                yield from self._mapped(batch, audited)
                batch, total = [], 0
        if batch:
            yield from self._mapped(batch, audited)

    def _mapped(self, batch, audited: bool) -> Iterator[Tuple[int, List[int], bool]]:
        positions = np.concatenate([np.arange(first, first + count, dtype=np.uint64)
                                    for _, first, count, _ in batch])
        indices = self._map(positions).tolist()
        k = 0
        for step, _, count, repeat in batch:
            idx = indices[k:k + count]
            k += count
            if repeat:
                self.repeated += count
            if audited:
                self._yielded.append((step, [] if repeat else idx, idx if repeat else []))
            yield step, idx, repeat

    def __iter__(self) -> Iterator[int]:
        for _, idx, _ in self._shares():
            yield from idx

    def __len__(self) -> int:
        """Indices this rank yields from ``consumed`` to the epoch's end."""
        remaining = max(0, self._end() - self._base)
        w = self.world_size
        if not self._block:
            return -(-remaining // w)
        full, tail = divmod(remaining, self._block)
        n = full * self._share(self._base, self._block)[1]
        return n + (self._share(self._base, tail)[1] if tail else 0)


class ElasticBatchSampler(ElasticSampler):
    """Fixed global batch: every step consumes ``global_batch_size`` samples whatever the world
    size, split over the ranks (shares differ by at most one), so an elastic run sees the same
    sequence of global batches as a one-worker run.  Use it as a DataLoader's ``batch_sampler``
    and weight each rank's mean loss by :meth:`loss_weight`, which makes the averaged gradient
    the mean over the whole global batch::

        sampler = hvd.elastic.ElasticBatchSampler(train_ds, global_batch_size=64)
        loader = DataLoader(train_ds, batch_sampler=sampler)
        for batch_idx, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y) * sampler.loss_weight(batch_idx)
            ...; optimizer.step(); sampler.record_batch(batch_idx, len(x))

    Args:
        dataset: anything with ``len()``.
        global_batch_size: G, samples per global step, >= 1.
        shuffle, seed, drop_last: as :class:`ElasticSampler`.

    Iterating yields one list of indices (this rank's share) per global step; ``len()`` is the
    number of steps from ``consumed`` to the epoch's end.

    Raises:
        ValueError: ``global_batch_size`` < 1.
    """

    def __init__(self, dataset, global_batch_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        if int(global_batch_size) < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        self.global_batch_size = int(global_batch_size)
        super().__init__(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)

    def _block_length(self) -> int:
        return self.global_batch_size

    def record_batch(self, batch_idx: int, batch_size: int = 0) -> None:
        """Record one more global step done (each call is one step, as Horovod counts;
        ``batch_idx`` and ``batch_size`` are not used)."""
        super().record_batch(batch_idx, batch_size)

    def loss_weight(self, batch_idx: int) -> float:
        """Factor for this rank's *mean* loss at global step ``batch_idx`` so that Horovod's
        averaging allreduce yields the gradient of the mean loss over the global batch:
        ``W * n_r / n`` (``n_r`` this rank's samples, ``n`` the step's global batch, ``W``
        ranks); 0 for a share that only repeats a sample."""
        start = self._base + batch_idx * self._block
        length = min(self._block, self._end() - start)
        if length <= 0:
            raise IndexError(f"step {batch_idx} is past the epoch's end")
        _, count, repeat = self._share(start, length)
        return 0.0 if repeat else self.world_size * count / length

    def __iter__(self) -> Iterator[List[int]]:
        for step, idx, _ in self._shares():
            # an epoch's short last step counts as short
            note_batch(self.step_length(step), self._population())
            yield idx

    def step_length(self, step: int) -> int:
        """Samples of global step ``step`` (counted from the last reset) over all ranks: the
        global batch, less at an epoch's end."""
        return max(0, min(self._block, self._end() - (self._base + step * self._block)))

    def __len__(self) -> int:
        return self._steps()
