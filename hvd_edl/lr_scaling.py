"""How the learning rate follows the global batch: AdaScale (Johnson, Agrawal, Gu and Guestrin
2020, "AdaScale SGD"), the square-root rule (Krizhevsky 2014; Hoffer et al. 2017) and the linear
rule (Goyal et al. 2017).  Numbers only; applied per step by
:func:`hvd_edl.torch.adaptive_optimizer.AdaptiveOptimizer`.

At scale ``S = B / B0`` (``B0`` the batch the script's learning rate is tuned for):

* ``adascale``: the gain ``r = (var/B0 + sqr) / (var/B + sqr)`` in [1, S]
  (:func:`hvd_edl.gradient_noise.gain`); SGD's rate x r, and progress counts r per step
  ("scale-invariant iterations"); for Adam-like optimizers x r^0.5 (AdaptDL's AdamScale);
* ``sqrt``: x S^0.5;  ``linear``: x S (SGD; for Adam-like ones S^0.5, as AdaptDL);
* ``none``: the script's rate unchanged.
"""
from __future__ import annotations

import math

from hvd_edl.gradient_noise import gain

RULES = ("adascale", "sqrt", "linear", "none")


def lr_factor(rule: str, batch: float, base_batch: float, sqr: float = 0.0, var: float = 0.0,
              adam: bool = False) -> float:
    """The factor on the script's learning rate at global batch ``batch``.

    Args:
        rule: one of :data:`RULES`.
        batch, base_batch: B and B0 (samples).
        sqr, var: |G|^2 and tr(Sigma) per sample (:class:`hvd_edl.gradient_noise.NoiseScale`);
            used by ``adascale`` (with neither known its factor is 1).
        adam: the optimizer adapts per parameter (Adam, AdamW...): square roots.

    Raises:
        ValueError: an unknown rule.
    """
    scale = batch / base_batch
    if rule == "adascale":
        r = gain(sqr, var, batch, base_batch)
        return math.sqrt(r) if adam else r
    if rule == "sqrt":
        return math.sqrt(scale)
    if rule == "linear":
        return math.sqrt(scale) if adam else scale
    if rule == "none":
        return 1.0
    raise ValueError(f"unknown learning-rate rule {rule!r} (one of {', '.join(RULES)})")
