"""``hvd.elastic`` for PyTorch: ``run``, ``TorchState``, ``ElasticSampler`` with Horovod's
signatures (``horovod.torch.elastic``), on hvd_edl's generation protocol."""
from __future__ import annotations

import horovod.torch as _hvd

from hvd_edl.elastic_state import ObjectState, State, run_fn
from hvd_edl.torch.elastic.sampler import ElasticBatchSampler, ElasticSampler
from hvd_edl.torch.elastic.adaptive_sampler import AdaptiveBatchSampler
from hvd_edl.torch.elastic.state import TorchState

__all__ = ["run", "TorchState", "ObjectState", "State", "ElasticSampler", "ElasticBatchSampler",
           "AdaptiveBatchSampler"]


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
