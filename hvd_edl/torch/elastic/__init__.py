"""``hvd.elastic`` for PyTorch: ``run``, ``TorchState``, ``ElasticSampler`` with Horovod's
signatures (``horovod.torch.elastic``), on hvd_edl's generation protocol."""
from __future__ import annotations

import copy
from typing import Any, Dict

import torch

import horovod.torch as _hvd

import hvd_edl.torch as _edl

from hvd_edl import audit, checkpoint
from hvd_edl.sampler import ElasticBatchSampler, ElasticSampler
from hvd_edl.state import ObjectState, State, run_fn

__all__ = ["run", "TorchState", "ObjectState", "State", "ElasticSampler", "ElasticBatchSampler"]


def run(func):
    """Decorator for the elastic training function ``func(state, *args, **kwargs)``.

    Joins the ring on entry (a new worker reports ready only here, after building its model),
    syncs ``state`` from rank 0, and re-enters ``func`` after every generation change: on a
    failure after ``state.restore()``, on an agreed switch with the state as it is.  A worker
    scaled in leaves with ``SystemExit(0)`` at the step boundary.
    """
    return run_fn(func, _reset)


def _reset():
    _hvd.shutdown()
    _hvd.init()


def _to_host(obj: Any, into: Any, pending: list, copies: list) -> Any:
    """Copy ``obj`` (nested dicts/lists of tensors and plain values) to host memory, reusing the
    buffers of the previous copy ``into`` where shapes and dtypes match (no allocation and no
    page faults at steady state).  CUDA tensors go to pinned buffers with asynchronous copies;
    ``pending`` collects their devices so the caller synchronises once.  Host-to-host copies
    into reused buffers are not made here but appended to ``copies`` as ``(buffer, source)``
    for the caller to make in one :func:`_copy_all`."""
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        if (isinstance(into, torch.Tensor) and into.device.type == "cpu"
                and into.shape == src.shape and into.dtype == src.dtype
                and (not src.is_cuda or into.is_pinned())):  # CUDA: into pinned memory only
            buf = into
        elif src.is_cuda:
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        else:
            return src.to("cpu", copy=True)
        if src.is_cuda:
            buf.copy_(src, non_blocking=True)
            pending.append(src.device)
        else:
            copies.append((buf, src))
        return buf
    if isinstance(obj, dict):
        prev = into if isinstance(into, dict) else {}
        return {k: _to_host(v, prev.get(k), pending, copies) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        prev = into if isinstance(into, (list, tuple)) and len(into) == len(obj) else [None] * len(obj)
        return type(obj)(_to_host(v, p, pending, copies) for v, p in zip(obj, prev))
    return copy.deepcopy(obj)


_foreach_copy = getattr(torch, "_foreach_copy_", None)


def _copy_all(copies: list) -> None:
    """Make the host-to-host ``(buffer, source)`` copies ``_to_host`` deferred, in one
    ``torch._foreach_copy_`` call where this torch has it (one dispatch instead of one per
    tensor; ``TorchState.save`` of the digits CNN with SGD momentum, 2,000 saves in one
    process: 0.103 ms with per-tensor copies, 0.091 ms with this)."""
    if not copies:
        return
    if _foreach_copy is not None:
        _foreach_copy([b for b, _ in copies], [s for _, s in copies])
    else:
        for b, s in copies:
            b.copy_(s)


def _note_progress(samplers: Dict[str, ElasticSampler]) -> None:
    """Tell the runtime the first sampler's epoch and samples since epoch 0 (what ``hvd-edl-ctl
    status`` shows; a few attribute reads per commit)."""
    from hvd_edl import runtime
    rt = runtime.get()
    if rt is not None and samplers:
        s = next(iter(samplers.values()))
        rt.progress = (s.epoch, s.epoch * s.num_samples_total + s.consumed)


def _clone(obj: Any) -> Any:
    """Deep copy of a host-memory commit, so that loading it never aliases the saved buffers
    (``Optimizer.load_state_dict`` keeps tensors that already have the right device and dtype)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return copy.deepcopy(obj)


def _held_by_nobody(obj: Any) -> bool:
    return False


class TorchState(ObjectState):
    """Elastic state of a PyTorch job (Horovod's ``TorchState(model, optimizer, **kwargs)``).

    Args:
        model: ``torch.nn.Module`` or None.
        optimizer: ``torch.optim.Optimizer`` (e.g. the DistributedOptimizer) or None.
        **kwargs: ``ElasticSampler`` objects (tracked by their state_dict) and any picklable
            scalars (``epoch=0, batch=0``), exposed as attributes.

    ``commit()`` copies model and optimizer state to host memory (Horovod deep-copies CUDA
    tensors on the GPU), into the buffers of the previous commit (pinned for CUDA tensors); ``sync()`` sends model, optimizer, scalars, samplers and the step count
    from rank 0 in one ``broadcast_object`` (two collectives: size and payload), then resets every
    sampler to the new rank and world size.
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        scalars = {k: v for k, v in kwargs.items() if k not in samplers}
        self.model = model
        self.optimizer = optimizer
        self._samplers: Dict[str, ElasticSampler] = samplers
        for k, v in samplers.items():
            v.name = k
            object.__setattr__(self, k, v)
        super().__init__(bcast_object=_edl.broadcast_object, get_rank=_hvd.rank, **scalars)
        self._saved_model = None
        self._saved_optimizer = None
        self._saved_samplers: Dict[str, Dict] = {}
        self._spare_model = self._spare_optimizer = None  # the second set (checkpoints only)
        self.save()

    def save(self) -> None:
        super().save()
        pending: list = []
        copies: list = []
        # --checkpoint-dir: while a background write reads the last commit's buffers, this
        # commit copies into a second set, kept for the next time (see hvd_edl.checkpoint);
        # without it, writer is None and nothing else changes
        writer = checkpoint.writer()
        held = writer.holds if writer is not None else _held_by_nobody
        if self.model is not None:
            into = self._saved_model
            if held(into):
                into, self._spare_model = self._spare_model, into
            self._saved_model = _to_host(self.model.state_dict(), into, pending, copies)
        if self.optimizer is not None:
            into = self._saved_optimizer
            if held(into):
                into, self._spare_optimizer = self._spare_optimizer, into
            self._saved_optimizer = _to_host(self.optimizer.state_dict(), into, pending, copies)
        _copy_all(copies)
        for device in set(pending):  # the asynchronous device-to-host copies are done here
            torch.cuda.synchronize(device)
        self._saved_samplers = {k: s.state_dict() for k, s in self._samplers.items()}
        _note_progress(self._samplers)
        if writer is not None:
            writer.offer(self)  # rank 0, when a checkpoint is due: hands this commit over

    def restore(self) -> None:
        super().restore()
        if self.model is not None and self._saved_model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None and self._saved_optimizer is not None:
            self.optimizer.load_state_dict(_clone(self._saved_optimizer))
        for k, s in self._samplers.items():
            if k in self._saved_samplers:
                s.load_state_dict(self._saved_samplers[k])

    def sync(self) -> None:
        from hvd_edl import runtime
        rt = runtime.get()
        payload = None
        if _hvd.rank() == 0:
            # a generation without any holder of the state: rank 0 loads the newest good
            # checkpoint the launcher named, then broadcasts it like any state
            error = checkpoint.restore_into(self)
            payload = {
                "model": self.model.state_dict() if self.model is not None else None,
                "optimizer": (self.optimizer.state_dict()
                              if self.optimizer is not None else None),
                "scalars": {k: getattr(self, k) for k in self._saved_state},
                "samplers": {k: s.state_dict() for k, s in self._samplers.items()},
                "steps": rt.steps if rt is not None else 0,
            }
            if error is not None:  # every rank ends with the same clear error
                payload = {"checkpoint_error": error}
        payload = _edl.broadcast_object(payload, root_rank=0, name="hvd_edl.sync")
        if payload.get("checkpoint_error"):
            raise checkpoint.CheckpointError(payload["checkpoint_error"])
        if _hvd.rank() != 0:
            if self.model is not None:
                self.model.load_state_dict(payload["model"])
            if self.optimizer is not None:
                self.optimizer.load_state_dict(payload["optimizer"])
            self._saved_state = payload["scalars"]
            self._set_attrs()
            if rt is not None:
                rt.steps = payload["steps"]
        for k, s in self._samplers.items():
            s.load_state_dict(payload["samplers"][k])  # also resets to the new rank/size
        self.save()

    def audit_resume(self) -> None:
        ledger = audit.ledger()
        if ledger is None:
            return
        if not self._samplers:
            super().audit_resume()
        for k, s in self._samplers.items():
            ledger.write("sync", sampler=k, epoch=s.epoch, consumed=s.consumed,
                         **audit.position())

    def reset(self) -> None:
        for s in self._samplers.values():
            s.reset()

    def __setattr__(self, name, value):
        samplers = self.__dict__.get("_samplers")
        if samplers is not None and isinstance(value, ElasticSampler):
            value.name = name
            samplers[name] = value
        super().__setattr__(name, value)
