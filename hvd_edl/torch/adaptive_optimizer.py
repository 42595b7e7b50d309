"""``AdaptiveOptimizer``: the optimizer side of an adaptive global batch (Pollux, Qiao et al.
OSDI'21; AdaptDL's ``AdaptiveDataParallel`` and ``AdaScale``), for a Horovod
``DistributedOptimizer`` and an :class:`hvd_edl.torch.elastic.AdaptiveBatchSampler`.

Per micro-batch the script calls ``zero_grad()``, ``backward()`` and ``step()`` as always.  This
wrapper turns the ``accumulation`` micro-batches of a global step into one optimizer step:
``zero_grad()`` clears the gradients only at a step's first micro-batch, Horovod allreduces them
only at the last backward pass (its ``backward_passes_per_step``, set to the generation's
accumulation), ``step()`` does nothing before the last micro-batch, and at the last one
synchronizes, averages the accumulated gradient (unless the script weighs its loss with
``sampler.loss_weight``), multiplies the learning rate by the rule's factor
(:mod:`hvd_edl.lr_scaling`, AdaScale by default) for that step, and counts the step's
scale-invariant progress (the gain ``r``).  At every generation change (the sampler's reset) a
step half accumulated is dropped (its samples are redone: the sampler had not counted them) and
the new accumulation is set.
"""
from __future__ import annotations

from typing import Dict

import torch

from hvd_edl.lr_scaling import RULES, lr_factor


class AdaptiveStep:
    """The per-optimizer controller (``opt.adaptive``).

    Attributes:
        progress: scale-invariant steps done (sum of the gain r per optimizer step; equals the
            step count at the initial batch), committed with the sampler.
        last_factor: the learning-rate factor of the last step.
    """

    def __init__(self, opt, sampler, rule: str, adam: bool):
        self.opt = opt
        self.sampler = sampler
        self.rule = rule
        self.adam = adam
        self.progress = 0.0
        self.last_factor = 1.0
        self._micro = 0
        self._resets = -1
        self._inner_step = opt.step
        self._inner_zero_grad = opt.zero_grad
        sampler.on_load = self.load

    # ---- generation changes -------------------------------------------------------------------

    def _sync_generation(self) -> None:
        """At the first call after the sampler's reset: drop a half-accumulated step and set
        Horovod's backward passes per step to the generation's accumulation."""
        if self.sampler.resets == self._resets:
            return
        self._resets = self.sampler.resets
        self._micro = 0
        handles = getattr(self.opt, "_handles", None)
        if handles is not None:
            handles.clear()  # micro-batch hooks that launched nothing (Horovod keeps (None, None))
        self.opt.set_backward_passes_per_step(self.sampler.accumulation)
        self._inner_zero_grad()

    # ---- the script's calls -------------------------------------------------------------------

    def zero_grad(self, *args, **kwargs):
        self._sync_generation()
        if self._micro == 0:
            return self._inner_zero_grad(*args, **kwargs)
        return None

    def step(self, closure=None):
        self._sync_generation()
        self._micro += 1
        accumulation = self.sampler.accumulation
        if self._micro < accumulation:
            return None  # gradients accumulate; Horovod has launched nothing yet
        self._micro = 0
        meter = getattr(self.opt, "gradient_noise", None)
        divide = accumulation > 1 and not self.sampler.weighted
        if meter is not None:  # norms of means (see GradientNoiseMeter)
            weighted = self.sampler.weighted and accumulation > 1
            meter.local_scale = float(accumulation ** 2) if weighted else 1.0
            meter.total_scale = 1.0 / accumulation ** 2 if divide else 1.0
        self.opt.synchronize()
        if divide:
            with torch.no_grad():
                for group in self.opt.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.div_(accumulation)
        noise = meter.noise if meter is not None else None
        batch, base = self.sampler.global_batch_size, self.sampler.bounds.base_batch
        sqr, var = (noise.sqr, noise.var) if noise is not None and noise.steps else (0.0, 0.0)
        factor = lr_factor(self.rule, batch, base, sqr, var, self.adam)
        saved = [group["lr"] for group in self.opt.param_groups]
        for group in self.opt.param_groups:
            group["lr"] = group["lr"] * factor
        try:
            with self.opt.skip_synchronize():
                result = self._inner_step(closure) if closure is not None else self._inner_step()
        finally:
            for group, lr in zip(self.opt.param_groups, saved):
                group["lr"] = lr
        self.last_factor = factor
        self.progress += lr_factor("adascale", batch, base, sqr, var) if noise is not None \
            else 1.0
        self.sampler.extra_state = self.state()
        return result

    # ---- state (kept in the sampler's state_dict: committed, synced, checkpointed) -----------

    def state(self) -> Dict[str, float]:
        """``adaptive_*`` figures: progress and the noise averages."""
        out = {"adaptive_progress": self.progress}
        meter = getattr(self.opt, "gradient_noise", None)
        if meter is not None:
            out.update({f"adaptive_noise_{k}": float(v)
                        for k, v in meter.noise.state_dict().items()})
        return out

    def load(self, state: Dict[str, float]) -> None:
        """Restore :meth:`state`'s figures (a restore, a sync from rank 0, a checkpoint)."""
        if "adaptive_progress" in state:
            self.progress = float(state["adaptive_progress"])
        meter = getattr(self.opt, "gradient_noise", None)
        noise = {k[len("adaptive_noise_"):]: v for k, v in state.items()
                 if k.startswith("adaptive_noise_")}
        if meter is not None and noise:
            meter.noise.load_state_dict(noise)


def AdaptiveOptimizer(optimizer, sampler, lr_rule: str = "adascale"):  # noqa: N802
    """Make ``optimizer`` (an ``hvd.DistributedOptimizer``) step once per global step of
    ``sampler`` (an :class:`hvd_edl.torch.elastic.AdaptiveBatchSampler`) with the learning rate
    following the batch (see the module).  Returns the same optimizer object (its ``step`` and
    ``zero_grad`` wrapped; ``optimizer.adaptive`` is the :class:`AdaptiveStep`), so
    ``TorchState(model, optimizer, ...)`` and ``state_dict()`` work as before.

    Args:
        lr_rule: "adascale" (Johnson et al. 2020; default), "sqrt", "linear" or "none"
            (:mod:`hvd_edl.lr_scaling`).  Optimizers with ``betas`` (Adam-like) take square
            roots (AdaptDL's AdamScale).

    Raises:
        ValueError: an unknown rule, or an optimizer without Horovod's
            ``set_backward_passes_per_step`` (not a DistributedOptimizer).
    """
    if lr_rule not in RULES:
        raise ValueError(f"unknown lr_rule {lr_rule!r} (one of {', '.join(RULES)})")
    if not hasattr(optimizer, "set_backward_passes_per_step"):
        raise ValueError("AdaptiveOptimizer wraps an hvd.DistributedOptimizer (Horovod's "
                         "allreduce optimizer), not a plain torch optimizer")
    adam = any("betas" in group for group in optimizer.param_groups)
    ctl = AdaptiveStep(optimizer, sampler, lr_rule, adam)
    optimizer.adaptive = ctl
    optimizer.step = ctl.step
    optimizer.zero_grad = ctl.zero_grad
    return optimizer
