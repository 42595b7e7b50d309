"""hvd_edl: elastic Horovod for PyTorch.

Change one import in a Horovod script (``import hvd_edl.torch as hvd``) and run it with
``hvd-edl-run``.  Scripts that keep ``import horovod.torch as hvd`` call :func:`init` instead of
``hvd.init()``: it makes ``horovod.torch``'s ``init``, ``rank``, ``size`` and ``elastic`` names the
elastic ones.
"""
__version__ = "0.1.0"


def init(*args, **kwargs):
    """Elastic ``hvd.init()`` for scripts that keep ``import horovod.torch as hvd``.

    Points ``horovod.torch.{init, rank, size, local_rank, ..., elastic.run, elastic.TorchState,
    elastic.ElasticSampler, DistributedOptimizer}`` at hvd_edl's versions, then calls
    :func:`hvd_edl.torch.init`.  Arguments are Horovod's (``comm``, ``process_sets``).
    """
    import horovod.torch as _hvd
    import horovod.torch.elastic as _hvd_elastic
    from hvd_edl import torch as edl
    from hvd_edl.torch import elastic as edl_elastic
    for name in edl.ELASTIC_NAMES:
        setattr(_hvd, name, getattr(edl, name))
    for name in ("run", "TorchState", "ElasticSampler", "ElasticBatchSampler", "ObjectState",
                 "State"):
        setattr(_hvd_elastic, name, getattr(edl_elastic, name))
    return edl.init(*args, **kwargs)
