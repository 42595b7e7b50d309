"""``DistributedOptimizer`` (Horovod's ``horovod/torch/optimizer.py``), counting and timing its
steps for the elastic state and the launcher.  Re-exported by :mod:`hvd_edl.torch`.
"""
from __future__ import annotations

import contextlib
import functools

import horovod.torch as _hvd

from hvd_edl import runtime as _runtime
from hvd_edl.step_timer import timed_wait as _timed_wait
from hvd_edl.torch.gradient_noise import GradientNoiseMeter


def DistributedOptimizer(optimizer, *args, **kwargs):  # noqa: N802 - Horovod's name
    """``horovod.torch.DistributedOptimizer`` (same arguments) whose ``step()`` is counted.

    The count (optimizer steps, an int) is part of every elastic state's commit; the launcher's
    event log reports step boundaries and rolled-back steps with it.  In an elastic job the
    gradient hooks are always registered, also before the worker joined a ring and at world
    size 1 (Horovod registers them only when ``size() > 1`` or under its own elastic driver), so
    the optimizer keeps working when the ring grows.

    Every such optimizer measures the gradient noise scale (``opt.gradient_noise``, a
    :class:`hvd_edl.torch.gradient_noise.GradientNoiseMeter`; McCandlish et al. 2018) from the
    local and averaged gradients' squared norms; ``opt.gradient_noise.enabled = False`` turns it
    off.  Under ``hvd-edl-run`` the heartbeat reports it (``hvd-edl-ctl status --json``'s
    ``gradient_noise``).
    """
    rt = _runtime.get()
    if rt is not None and rt.elastic:
        with _hooks_forced():
            opt = _hvd.DistributedOptimizer(optimizer, *args, **kwargs)
    else:
        opt = _hvd.DistributedOptimizer(optimizer, *args, **kwargs)
    # the gradient noise scale, measured at every step (hvd_edl.torch.gradient_noise)
    opt.gradient_noise = GradientNoiseMeter(opt)
    opt.gradient_noise.install()
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
