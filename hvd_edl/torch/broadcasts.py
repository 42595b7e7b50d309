"""The broadcasts of parameters, optimizer state and objects (Horovod's
``horovod/torch/functions.py``): nothing before an elastic worker joined (the elastic state's
``sync()`` hands it rank 0's), and ``broadcast_object`` in one collective for small objects.
Re-exported by :mod:`hvd_edl.torch`.
"""
from __future__ import annotations

import torch
import horovod.torch as _hvd

from hvd_edl import runtime as _runtime
from hvd_edl.torch.ops import ensure_joined


def _before_elastic_join() -> bool:
    """True in an elastic job before this worker joined a ring: then ``hvd.elastic.run``'s
    ``state.sync()`` will hand it rank 0's state, and a broadcast of the script's own would
    run in the new worker alone (the members do not run the script's top level again) and wait
    for them forever."""
    rt = _runtime.get()
    return rt is not None and rt.elastic and not rt.joined


def broadcast_parameters(params, root_rank):
    """``horovod.torch.broadcast_parameters``; in an elastic job, before the worker joined a
    ring (the top of a Horovod script, "broadcast the initial weights"), it does nothing:
    ``hvd.elastic.run`` syncs the model from rank 0 when the worker joins (Horovod's elastic
    docs: the state's ``sync()`` does this)."""
    if _before_elastic_join():
        return None
    ensure_joined()
    return _hvd.broadcast_parameters(params, root_rank)


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """``horovod.torch.broadcast_optimizer_state``; like :func:`broadcast_parameters`, nothing
    before an elastic worker joined (the elastic state syncs the optimizer)."""
    if _before_elastic_join():
        return None
    ensure_joined()
    return _hvd.broadcast_optimizer_state(optimizer, root_rank, model=model)


BROADCAST_HEAD_BYTES = 64 << 10
"""Bytes of ``broadcast_object``'s first broadcast: an int64 size and the first bytes of the
pickle.  An object whose pickle fits (most: headers, samplers, scalars) costs one collective;
a larger one a second broadcast of the rest."""


def broadcast_object(obj, root_rank=0, name=None, process_set=_hvd.global_process_set):
    """``horovod.torch.broadcast_object`` (same signature and result): pickles ``obj`` on
    ``root_rank`` and returns it unpickled on every rank.

    Horovod 0.28.1 sends two broadcasts (an int32 size, then a byte tensor built with
    ``torch.ByteTensor(bytearray(...))``, which walks the buffer in Python: about 0.3 s per MB
    here).  This version sends one broadcast of :data:`BROADCAST_HEAD_BYTES` (an int64 size and
    the pickle's first bytes) and, only for a pickle that does not fit, a second one of the
    rest, wrapped with ``torch.frombuffer`` (one copy).  A collective right after a switch costs
    tens of milliseconds at 16 ranks on 2 cores (Horovod's negotiation and Gloo's ring hops), so
    the state sync's header saves one of them.

    Raises:
        HorovodInternalError: a member failed during the broadcasts.
    """
    import cloudpickle
    if _before_elastic_join():  # as broadcast_parameters: the elastic state syncs later
        return obj
    ensure_joined()
    if name is None:
        name = type(obj).__name__
    room = BROADCAST_HEAD_BYTES - 8
    head = torch.zeros(BROADCAST_HEAD_BYTES, dtype=torch.uint8)
    if _hvd.rank() == root_rank:
        data = cloudpickle.dumps(obj)
        head[:8].view(torch.int64)[0] = len(data)
        first = min(len(data), room)
        head[8:8 + first] = torch.frombuffer(bytearray(data[:first]), dtype=torch.uint8)
        _hvd.broadcast_(head, root_rank, name + ".h", process_set)
        if len(data) > room:
            rest = torch.frombuffer(bytearray(data[room:]), dtype=torch.uint8)
            _hvd.broadcast_(rest, root_rank, name + ".t", process_set)
        return obj
    _hvd.broadcast_(head, root_rank, name + ".h", process_set)
    n = int(head[:8].view(torch.int64)[0])
    if n <= room:
        return cloudpickle.loads(head[8:8 + n].numpy().data)
    rest = torch.empty(n - room, dtype=torch.uint8)
    _hvd.broadcast_(rest, root_rank, name + ".t", process_set)
    return cloudpickle.loads(head[8:].numpy().tobytes() + rest.numpy().tobytes())
