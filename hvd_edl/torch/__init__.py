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
  (its ``synchronize`` and the blocking collectives below; :mod:`hvd_edl.step_timer`).
"""
from __future__ import annotations

import contextlib
import functools

import torch
from horovod.torch import *  # noqa: F401,F403 - the drop-in: every public Horovod name
import horovod.torch as _hvd
from horovod.torch import mpi_ops as _mpi_ops

from hvd_edl import runtime as _runtime
from hvd_edl.step_timer import timed_wait as _timed_wait

# Names the elastic versions below replace (also patched into horovod.torch by hvd_edl.init()).
ELASTIC_NAMES = ("init", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
                 "is_initialized", "DistributedOptimizer", "broadcast_parameters",
                 "broadcast_optimizer_state", "broadcast_object")

_COLLECTIVES = [n for n in dir(_hvd) if not n.startswith("_") and n.split("_")[0] in (
    "allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "grouped", "barrier",
    "join", "sparse")]


def init(comm=None, process_sets=None):
    """Start this worker (Horovod's ``init`` signature).

    Under ``hvd-edl-run``: register with the coordinator; static jobs join the ring at once,
    elastic jobs return at once (the join happens in ``hvd.elastic.run``).  Elsewhere: exactly
    ``horovod.torch.init``; run with no launcher at all (plain ``python``, no ``horovodrun`` or
    ``mpirun``), it says once on stderr that it trains alone at size 1 (``HVD_EDL_QUIET=1``
    silences it).  On a CUDA machine the CUDA context of the slot's device is created
    here, before joining, so the switch never waits for it.

    Raises:
        hvd_edl.client.CoordinatorUnreachable: the launcher did not answer.
    """
    rt = _runtime.start()
    if rt is None:
        _say_no_launcher(comm)
        return _hvd.init(comm=comm, process_sets=process_sets)
    _prebuild_cuda_context(rt.local_rank)
    if not rt.elastic:
        rt.join()
    return None


ENV_QUIET = "HVD_EDL_QUIET"
# set by horovodrun, mpirun (Open MPI, MPICH / Hydra, PMIx) and Slurm: another launcher runs us
_LAUNCHER_ENV = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
_said_no_launcher = False


def _say_no_launcher(comm) -> None:
    """One stderr line, once per process, when no launcher started this process."""
    global _said_no_launcher
    import os
    import sys
    if _said_no_launcher or comm is not None or os.environ.get(ENV_QUIET, "") not in ("", "0") \
            or any(k in os.environ for k in _LAUNCHER_ENV):
        return
    _said_no_launcher = True
    print("hvd_edl: not started by hvd-edl-run: training alone at size 1, not elastic (start "
          "it with hvd-edl-run -np N ...; HVD_EDL_QUIET=1 hides this line)", file=sys.stderr,
          flush=True)


def _prebuild_cuda_context(local_rank: int) -> None:
    """Pin this process to GPU ``local_rank % device_count`` (``torch.cuda.set_device``) and
    create its CUDA context now, while the ring trains, not at the switch (about 0.3-1 s per
    process).  ``local_rank`` is the slot, stable for the process's life, so the device stays
    the same in every generation; Horovod's GPU operations run on the tensors' device.  Nothing
    on a machine without CUDA.  More processes than GPUs on a host share devices: NCCL refuses two
    ranks of one communicator on one device ("Duplicate GPU detected") unless each process has
    its own ``NCCL_HOSTID`` (benchmarks/gpu_check.sh does that on a 1-GPU machine)."""
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        count = torch.cuda.device_count()
        device = local_rank % count
        if local_rank >= count:
            import logging
            logging.getLogger(__name__).warning(
                "slot %d shares cuda:%d (%d GPUs on this host)", local_rank, device, count)
        torch.cuda.set_device(device)
        torch.zeros(1, device=f"cuda:{device}")  # forces context creation now, not at the switch


def _ensure_joined() -> None:
    rt = _runtime.get()
    if rt is not None and not rt.joined:
        rt.join()


def is_initialized() -> bool:
    """True once this process is a member of a ring (Horovod initialised)."""
    return _hvd.is_initialized()


def rank() -> int:
    """Rank in the current generation; before joining, the provisional rank."""
    rt = _runtime.get()
    if rt is not None and not rt.joined:
        return rt.provisional_rank
    return _hvd.rank()


def size() -> int:
    """World size of the current generation; before joining, the provisional size."""
    rt = _runtime.get()
    if rt is not None and not rt.joined:
        return rt.provisional_size
    return _hvd.size()


def local_rank() -> int:
    """This process's slot on its host (stable for its life: use it to pick the device)."""
    rt = _runtime.get()
    if rt is not None:
        return rt.local_rank
    return _hvd.local_rank()


def local_size() -> int:
    """Members of the current generation on this host (1 before joining)."""
    rt = _runtime.get()
    if rt is not None and not rt.joined:
        return 1
    return _hvd.local_size()


def cross_rank() -> int:
    """Index of this host among the current generation's hosts (0 before joining)."""
    rt = _runtime.get()
    if rt is not None and not rt.joined:
        return 0
    return _hvd.cross_rank()


def cross_size() -> int:
    """Number of hosts in the current generation (1 before joining)."""
    rt = _runtime.get()
    if rt is not None and not rt.joined:
        return 1
    return _hvd.cross_size()


def _joining(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _ensure_joined()
        return fn(*args, **kwargs)
    return wrapper


for _name in _COLLECTIVES:
    # blocking collectives count as the step's wait (hvd_edl.step_timer); *_async return at once
    _fn = getattr(_hvd, _name)
    globals()[_name] = _joining(_fn if "async" in _name else _timed_wait(_fn))
synchronize = _timed_wait(_hvd.synchronize)


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
    _ensure_joined()
    return _hvd.broadcast_parameters(params, root_rank)


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """``horovod.torch.broadcast_optimizer_state``; like :func:`broadcast_parameters`, nothing
    before an elastic worker joined (the elastic state syncs the optimizer)."""
    if _before_elastic_join():
        return None
    _ensure_joined()
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
    _ensure_joined()
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


def DistributedOptimizer(optimizer, *args, **kwargs):  # noqa: N802 - Horovod's name
    """``horovod.torch.DistributedOptimizer`` (same arguments) whose ``step()`` is counted.

    The count (optimizer steps, an int) is part of every elastic state's commit; the launcher's
    event log reports step boundaries and rolled-back steps with it.  In an elastic job the
    gradient hooks are always registered, also before the worker joined a ring and at world
    size 1 (Horovod registers them only when ``size() > 1`` or under its own elastic driver), so
    the optimizer keeps working when the ring grows.
    """
    rt = _runtime.get()
    if rt is not None and rt.elastic:
        with _hooks_forced():
            opt = _hvd.DistributedOptimizer(optimizer, *args, **kwargs)
    else:
        opt = _hvd.DistributedOptimizer(optimizer, *args, **kwargs)
    inner_step = opt.step
    if rt is not None:
        # Horovod's step() calls self.synchronize(): the wait for the gradients' allreduces
        opt.synchronize = _timed_wait(opt.synchronize)

    @functools.wraps(inner_step)
    def step(*a, **kw):
        result = inner_step(*a, **kw)
        if rt is not None:
            rt.on_step_end()
        return result

    opt.step = step
    return opt


@contextlib.contextmanager
def _hooks_forced():
    """While Horovod's optimizer is built, answer its "is this process in the set and is the
    world larger than one?" check with yes: the check calls into Horovod, which is not
    initialised before the worker joins."""
    from horovod.torch import optimizer as _opt_mod
    ps = _hvd.global_process_set
    saved_size = _opt_mod.size
    ps.included = lambda: True
    _opt_mod.size = lambda: 2
    try:
        yield
    finally:
        del ps.included
        _opt_mod.size = saved_size


import importlib as _importlib  # noqa: E402

# hvd.elastic.run / TorchState / ElasticSampler: ours, not the horovod.torch.elastic the star
# import brought in.
elastic = _importlib.import_module("hvd_edl.torch.elastic")
