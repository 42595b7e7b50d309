"""Drop-in for ``horovod.torch``: every public Horovod name, with an elastic ``init``.

``import hvd_edl.torch as hvd`` instead of ``import horovod.torch as hvd``.  Differences, all
invisible to a Horovod script outside ``hvd-edl-run``:

* :func:`init` registers with the launcher's coordinator.  In an elastic job it returns at once
  with :func:`local_rank` known (pin the device, build the model); the process joins a ring when
  it enters :func:`hvd_edl.torch.elastic.run` or calls its first collective.  In a static job
  (no host discovery) it joins at once, as ``horovod.torch.init`` does.
* :func:`rank` / :func:`size` before joining return provisional figures (the rank and size the
  process would have if the next generation formed now); after joining, Horovod's.
* :func:`local_rank` is the process's slot on its host for its whole life, so a device pinned
  with it stays right across generations.
* :class:`DistributedOptimizer` counts optimizer steps (``step``), which the elastic state commits,
  restores and reports to the launcher's event log, and times them: compute and wait seconds
  (its ``synchronize`` and the blocking collectives below; :mod:`hvd_edl.step_timer`), and
  measures the gradient noise scale (:mod:`hvd_edl.torch.gradient_noise`).
* :func:`AdaptiveOptimizer` with ``hvd.elastic.AdaptiveBatchSampler``: an opt-in adaptive
  global batch with AdaScale (docs/adaptive_batch.md).
"""
from __future__ import annotations

from horovod.torch import *  # noqa: F401,F403 - the drop-in: every public Horovod name

from hvd_edl.torch.ops import *  # noqa: F401,F403 - init, ranks, collectives (ops.__all__)
from hvd_edl.torch.broadcasts import (  # noqa: F401
    BROADCAST_HEAD_BYTES, broadcast_object, broadcast_optimizer_state, broadcast_parameters)
from hvd_edl.torch.distributed_optimizer import DistributedOptimizer  # noqa: F401
from hvd_edl.torch.adaptive_optimizer import AdaptiveOptimizer  # noqa: F401
# hvd.elastic.run / TorchState / ElasticSampler: ours, not the horovod.torch.elastic the star
# import brought in
import hvd_edl.torch.elastic as elastic  # noqa: F401

# Names whose elastic versions above replace Horovod's (also patched into horovod.torch by
# hvd_edl.init()).
ELASTIC_NAMES = ("init", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
                 "is_initialized", "DistributedOptimizer", "broadcast_parameters",
                 "broadcast_optimizer_state", "broadcast_object")
