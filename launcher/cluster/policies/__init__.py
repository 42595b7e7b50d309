"""The scheduling policies, one module each: ``fifo``, ``tiresias``, ``edl``, ``goodput``,
``typed`` (GPU types, prices, objectives: issue 42)
(:class:`launcher.cluster.policy.Policy` subclasses), and :func:`make_policy` by name."""
from __future__ import annotations

from typing import Optional

from launcher.cluster.policy import Policy

POLICIES = ("fifo", "tiresias", "edl", "goodput", "typed")
FAIR_SHARE_POLICIES = ("fifo", "tiresias", "edl", "goodput")
"""The policies that share fairly between users and keep a per-user quota
(:mod:`launcher.cluster.fair_share`)."""
TYPED_OBJECTIVES = {"jct": "sia", "sia": "sia", "remaining": "remaining"}
"""``serve --policy typed --objective X``: how ``typed`` values a job without an objective of its
own (:class:`launcher.cluster.policies.typed.TypedPolicy`'s ``objective``; jct, the default
``--objective``, is Sia's)."""


def parse_objective(objective: str):
    """``"jct"`` / ``"throughput"`` / ``"efficiency:E"`` -> (name, E or None); ValueError (one
    line) otherwise, E must be a number with 0 < E <= 1."""
    name, sep, arg = objective.partition(":")
    if name in ("jct", "throughput") and not sep:
        return name, None
    if name == "efficiency" and sep:
        try:
            e = float(arg)
        except ValueError:
            e = float("nan")
        if 0 < e <= 1:
            return name, e
        raise ValueError(f"objective efficiency:E needs 0 < E <= 1, got {arg!r}")
    raise ValueError(f"unknown objective {objective!r} (jct, throughput or efficiency:E)")


def make_policy(name: str, objective: str = "jct", *, fair_share: bool = True,
                user_quota: Optional[int] = None) -> Policy:
    """The policy called ``name`` (fifo, tiresias, edl, goodput, typed) for ``objective`` (jct,
    throughput, efficiency:E; only edl and goodput optimise one, fifo and tiresias accept any
    valid objective and ignore it; typed: sia (jct) or remaining, :data:`TYPED_OBJECTIVES`),
    fair between users (``fair_share``, :mod:`launcher.cluster.fair_share`; no effect with one
    user), with at most ``user_quota`` slots per user (None: no cap).  ValueError, one line,
    for an unknown name, a bad objective or a quota below 1."""
    if name == "typed":
        if user_quota is not None:
            raise ValueError(f"policy typed keeps no per-user quota (one of "
                             f"{', '.join(FAIR_SHARE_POLICIES)} does)")
        if objective not in TYPED_OBJECTIVES:
            raise ValueError(f"policy typed: unknown objective {objective!r} (sia, remaining; "
                             f"jct means sia)")
        from launcher.cluster.policies.typed import TypedPolicy
        return TypedPolicy(objective=TYPED_OBJECTIVES[objective])
    obj, e = parse_objective(objective)
    if name == "fifo":
        from launcher.cluster.policies.fifo import FifoPolicy
        return FifoPolicy(fair_share=fair_share, user_quota=user_quota)
    if name == "tiresias":
        from launcher.cluster.policies.tiresias import TiresiasPolicy
        return TiresiasPolicy(fair_share=fair_share, user_quota=user_quota)
    if name == "edl":
        from launcher.cluster.policies.edl import EdlPolicy
        return EdlPolicy(obj, e, fair_share=fair_share, user_quota=user_quota)
    if name == "goodput":
        from launcher.cluster.policies.goodput import GoodputPolicy
        return GoodputPolicy(obj, e, fair_share=fair_share, user_quota=user_quota)
    raise ValueError(f"unknown policy {name!r} (one of {', '.join(POLICIES)})")
