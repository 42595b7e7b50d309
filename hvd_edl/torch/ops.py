"""``hvd.init()``, ranks and sizes, and the collectives (Horovod's ``horovod/torch/mpi_ops.py``),
for an elastic worker: ``init`` registers with the coordinator, ranks before joining are
provisional, a collective joins the ring first and a blocking one counts as the step's wait
(:mod:`hvd_edl.step_timer`).  Re-exported by :mod:`hvd_edl.torch`, where a script finds them.
"""
from __future__ import annotations

import functools

import horovod.torch as _hvd

from hvd_edl import runtime as _runtime
from hvd_edl.step_timer import timed_wait as _timed_wait

# Horovod's collectives, each joining the ring first (the broadcasts of parameters, optimizer
# state and objects have versions of their own: hvd_edl.torch.broadcasts)
_COLLECTIVES = [n for n in dir(_hvd) if not n.startswith("_") and n.split("_")[0] in (
    "allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "grouped", "barrier",
    "join", "sparse") and n not in ("broadcast_parameters", "broadcast_optimizer_state",
                                    "broadcast_object")]

__all__ = ["init", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
           "cross_size", "synchronize", "ENV_QUIET"] + _COLLECTIVES


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
    its own ``NCCL_HOSTID`` (benchmarks/gpu/gpu_check.sh does that on a 1-GPU machine)."""
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


def ensure_joined() -> None:
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
        ensure_joined()
        return fn(*args, **kwargs)
    return wrapper


for _name in _COLLECTIVES:
    # blocking collectives count as the step's wait (hvd_edl.step_timer); *_async return at once
    _fn = getattr(_hvd, _name)
    globals()[_name] = _joining(_fn if "async" in _name else _timed_wait(_fn))
synchronize = _timed_wait(_hvd.synchronize)
