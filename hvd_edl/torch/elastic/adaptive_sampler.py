"""``AdaptiveBatchSampler``: an elastic batch sampler whose global batch may change at every
generation change (Pollux, Qiao et al. OSDI'21; AdaptDL's ``AdaptiveDataLoader``), exactly once.

The global batch is part of the generation: when a generation starts (every ``reset()``: a
switch, a restore, a sync), the sampler takes the batch asked for it (the launcher's assignment,
:attr:`hvd_edl.messages.Assignment.batch`, the same on every member; set through the control
API ``/ctl/batch`` or by ``hvd-edl-run --adapt-batch``), lays it out with
:func:`hvd_edl.adaptive_batch.plan` and repartitions what is left of the epoch with it: the
positions ``[consumed, N)`` are cut into global steps of B positions, each rank's share of a
step into ``accumulation`` micro-batches.  Positions count as consumed only when a whole global
step is recorded (its last micro-batch), so a switch between two micro-batches of a step redoes
that step's micro-batches in the new ring: every sample still counts exactly once (the audit's
ledger records a step's indices when its last micro-batch is recorded).
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional

from hvd_edl import adaptive_batch, runtime
from hvd_edl.adaptive_batch import BatchBounds, BatchPlan
from hvd_edl.torch.elastic.sampler import ElasticBatchSampler
from hvd_edl.torch.gradient_noise import note_batch


class AdaptiveBatchSampler(ElasticBatchSampler):
    """Elastic batch sampler with an adaptive global batch.  A Horovod script opts in by using
    it as its DataLoader's ``batch_sampler`` and wrapping its optimizer in
    :func:`hvd_edl.torch.adaptive_optimizer.AdaptiveOptimizer` (docs/adaptive_batch.md)::

        sampler = hvd.elastic.AdaptiveBatchSampler(train_ds, batch_size=64, max_batch=1024,
                                                   max_local_batch=128)
        loader = DataLoader(train_ds, batch_sampler=sampler)
        optimizer = hvd.AdaptiveOptimizer(hvd.DistributedOptimizer(opt, ...), sampler)

    Each item it yields is one micro-batch of this rank; call ``optimizer.step()`` and
    :meth:`record_batch` after each (the optimizer steps once per global step).

    Args:
        dataset: anything with ``len()``.
        batch_size: B0, the initial global batch (the learning rate is tuned for it).
        min_batch, max_batch: bounds of the global batch (default B0 and 32 x B0).
        max_local_batch: the most samples one rank computes at once (memory); larger shares are
            accumulated over several micro-batches.  None: no bound.
        shuffle, seed, drop_last: as :class:`hvd_edl.torch.elastic.ElasticSampler`.

    ``state_dict()`` adds ``global_batch`` and ``base_batch`` (and the attached optimizer's
    figures: its progress and noise averages) to the elastic sampler's keys.

    Raises:
        ValueError: bounds that do not hold (:class:`hvd_edl.adaptive_batch.BatchBounds`).
    """

    def __init__(self, dataset, batch_size: int, min_batch: Optional[int] = None,
                 max_batch: Optional[int] = None, max_local_batch: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        b0 = int(batch_size)
        self.bounds = BatchBounds(b0, int(min_batch or b0), int(max_batch or 32 * b0),
                                  None if max_local_batch is None else int(max_local_batch))
        self.plan: BatchPlan = adaptive_batch.plan(b0, 1, self.bounds)
        self.resets = 0  # generations seen (the attached optimizer resets its accumulation)
        self.applied_request = 0  # the assignment's batch last applied (0: none)
        self.extra_state: Dict[str, float] = {}  # the attached optimizer's committed figures
        self.on_load = None  # callable(state) of the attached optimizer (restore / sync)
        self._micro = 0      # micro-batches recorded in the current global step
        self.weighted = False  # the script called loss_weight() in the current global step
        super().__init__(dataset, global_batch_size=b0, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)

    # ---- the generation's batch ---------------------------------------------------------------

    def repartition(self, rank: int, world_size: int) -> None:
        """Take the generation's batch (the launcher's request, when there is one and it
        changed), lay it out for ``world_size`` ranks and repartition ``[consumed, N)``."""
        rt = runtime.get()
        asked = getattr(rt.assignment, "batch", 0) if rt is not None and rt.assignment else 0
        batch = self.global_batch_size
        if asked and asked != self.applied_request:
            batch = asked
            self.applied_request = asked
        self.plan = adaptive_batch.plan(batch, int(world_size), self.bounds)
        self.global_batch_size = self.plan.global_batch
        self._micro = 0
        self.weighted = False
        self.resets += 1
        super().repartition(rank, world_size)
        adaptive_batch.publish(self.plan, self.bounds)
        note_batch(self.global_batch_size, self._population())

    def set_batch(self, batch: int) -> None:
        """Use global batch ``batch`` (clamped to the bounds) from the next reset on (for a
        script that chooses its batch itself; every rank must call it alike)."""
        self.global_batch_size = adaptive_batch.clamp(batch, self.bounds, 1)

    # ---- steps and micro-batches --------------------------------------------------------------

    @property
    def accumulation(self) -> int:
        """Micro-batches per global step in this generation."""
        return self.plan.accumulation

    def record_batch(self, batch_idx: int, batch_size: int = 0) -> None:
        """Record one micro-batch done; its global step counts (consumed, the audit's ledger)
        once its last micro-batch is recorded."""
        self._micro += 1
        if self._micro < self.plan.accumulation:
            return
        self._micro = 0
        self.weighted = False
        super().record_batch(batch_idx, batch_size)

    def micro_batches_done(self) -> int:
        """Micro-batches of the current global step recorded so far (0 at a step's start)."""
        return self._micro

    def loss_weight(self, batch_idx: int) -> float:
        """Factor for this rank's mean loss on micro-batch ``batch_idx`` (counted from the last
        reset, as ``enumerate(loader)`` counts) so that the averaged, accumulated gradient is
        the mean over the global batch: ``W * n / B`` (``n`` the micro-batch's samples)."""
        self.weighted = True
        a = self.plan.accumulation
        start = self._base + (batch_idx // a) * self._block
        length = min(self._block, self._end() - start)
        if length <= 0:
            raise IndexError(f"micro-batch {batch_idx} is past the epoch's end")
        _, count, repeat = self._share(start, length)
        if repeat:
            return 0.0
        sizes = _split(count, a)
        return self.world_size * sizes[batch_idx % a] / length

    def __iter__(self) -> Iterator[List[int]]:
        a = self.plan.accumulation
        for step, idx, _ in self._shares():
            note_batch(self.step_length(step), self._population())
            k = 0
            for n in _split(len(idx), a):
                # an epoch's short last step may leave a micro-batch empty: it repeats the
                # share's last sample (loss_weight 0; every rank still runs `a` backward passes)
                yield idx[k:k + n] if n else idx[-1:]
                k += n

    def __len__(self) -> int:
        """Micro-batches from ``consumed`` to the epoch's end."""
        return self._steps() * self.plan.accumulation

    # ---- state --------------------------------------------------------------------------------

    def state_dict(self) -> Dict:
        out = super().state_dict()
        out.update(global_batch=self.global_batch_size, base_batch=self.bounds.base_batch,
                   applied_request=self.applied_request, **self.extra_state)
        return out

    def load_state_dict(self, state: Dict) -> None:
        """Load :meth:`state_dict`'s figures (the batch in force, the optimizer's), then reset."""
        if state.get("global_batch") is not None:
            self.global_batch_size = int(state["global_batch"])
        self.applied_request = int(state.get("applied_request", self.applied_request))
        self.extra_state = {k: v for k, v in state.items() if k.startswith("adaptive_")}
        if self.on_load is not None:
            self.on_load(self.extra_state)
        super().load_state_dict(state)


def _split(count: int, parts: int) -> List[int]:
    """``count`` samples in ``parts`` micro-batches that differ by at most one (empty ones at
    the end when count < parts)."""
    q, r = divmod(count, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]
