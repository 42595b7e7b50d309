"""Room for a job whose hosts are revoked (a drain with a deadline, a spot notice), when no
slot is free: make-before-break without a free host (issue 42, section 3; Parcae, NSDI 2024,
moves work before a revocation, ours without its restart).

A *displaced* job still runs on hosts that left the pool (:attr:`JobView.displaced`).  Its
replacement workers must start elsewhere before the deadline, so that the revoked host's
workers leave at the commit after they joined (no step rolled back, no pause beyond a switch).
A policy first gives it free slots; when there are too few, :func:`make_room` takes the rest
stop-free from running jobs that can spare them: jobs above their ``min_np``, in the order the
policy passes (its lowest first: the least priority, the most elastic room), each giving back
its slots on its least-used hosts first (a stop-free shrink: one switch, ~0.5 s, for the
donor; its leavers go at their next commit, and the service starts the replacement only once
their slots are released, so no slot or GPU is used by two jobs).  Only when free and spare
slots together are fewer than the job's ``min_np`` is nothing taken: the job is then
checkpointed and resumed later (the service's last resort, :mod:`launcher.cluster.drains`).

Pure: it changes only the dictionaries it is given.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from launcher.cluster.policy import Allocation, JobView, fill_hosts


def wanted(j: JobView) -> int:
    """Slots a displaced job asks for: what it runs on now (kept hosts plus revoked ones),
    within ``[min_np, max_np]``."""
    return max(j.min_np, min(j.max_np, j.world_size + j.displaced))


def donor_order(jobs: Sequence[JobView], alloc: Allocation) -> List[JobView]:
    """The running jobs of ``jobs`` that can spare slots in ``alloc`` (elastic, holding more
    than ``min_np``, not displaced themselves), lowest first: least priority, then jobs without
    an objective (``goal``: a deadline or budget would suffer), then the most slots above their
    minimum, then the latest submitted (the default order for policies with no order of their
    own)."""
    def spare(j: JobView) -> int:
        return sum(alloc.get(j.id, {}).values()) - j.min_np
    out = [j for j in jobs if j.elastic and not j.displaced and spare(j) > 0]
    return sorted(out, key=lambda j: (j.priority, bool(j.goal), -spare(j), -j.submitted_at,
                                      j.id))


def make_room(j: JobView, alloc: Allocation, free: Dict[str, int],
              donors: Sequence[JobView], want: Optional[int] = None,
              allowed: Optional[Callable[[str], bool]] = None,
              ) -> Optional[Tuple[Dict[str, int], Dict[str, Dict[str, int]]]]:
    """Slots for the displaced job ``j``: free ones first (its own hosts first), then slots
    taken from ``donors`` (in that order, each down to its ``min_np`` at most), up to ``want``
    (default :func:`wanted`).

    Args:
        j: the displaced job (not in ``alloc``, or holding there what it keeps).
        alloc: job id -> host -> slots decided so far this round; changed in place (the
            donors shrink, ``j`` gets its slots).
        free: host -> slots still free; changed in place.
        donors: the jobs that may give slots, lowest first (:func:`donor_order`).
        want: slots to aim for (at least ``j.min_np`` are needed).
        allowed: the hosts ``j`` may run on (None: any; ``typed``: those of its ``--types``).

    Returns:
        ``(hosts, taken)``: ``j``'s new allocation (host -> slots, what it kept included) and
        donor id -> host -> slots taken from it; None, with ``alloc`` and ``free`` unchanged,
        when fewer than ``j.min_np`` slots can be found.
    """
    want = wanted(j) if want is None else want
    kept = dict(alloc.get(j.id, {}))
    need = want - sum(kept.values())
    saved_free = dict(free)
    usable = {h: k for h, k in free.items() if allowed is None or allowed(h)}
    got = fill_hosts(usable, min(max(0, need), sum(max(0, k) for k in usable.values())),
                     prefer=list(kept)) or {}
    got = {h: k for h, k in got.items() if k > 0}
    for h, k in got.items():
        free[h] -= k
    have = sum(got.values())
    taken: Dict[str, Dict[str, int]] = {}
    for d in donors:
        if have >= need:
            break
        if d.id == j.id:
            continue
        held = dict(alloc.get(d.id, {}))
        spare = sum(held.values()) - d.min_np
        for h in sorted(held, key=lambda h: (held[h], h)):  # its least-used hosts first
            if allowed is not None and not allowed(h):
                continue
            k = min(spare, held[h], need - have)
            if k <= 0:
                continue
            held[h] -= k
            spare -= k
            have += k
            got[h] = got.get(h, 0) + k
            taken.setdefault(d.id, {})[h] = k
        if d.id in taken:
            alloc[d.id] = {h: k for h, k in held.items() if k > 0}
    if sum(kept.values()) + have < j.min_np:
        for d_id, hosts in taken.items():  # undo: nothing is taken for nothing
            for h, k in hosts.items():
                alloc[d_id][h] = alloc[d_id].get(h, 0) + k
        free.clear()
        free.update(saved_free)
        return None
    hosts = dict(kept)
    for h, k in got.items():
        hosts[h] = hosts.get(h, 0) + k
    alloc[j.id] = hosts
    return hosts, taken


def lent_reason(policy: str, to: str, hosts: Mapping[str, int]) -> str:
    """The donor's reason line: ``{policy}: lends 1 slot on h3 to j1 (its host is revoked:
    make-before-break, a stop-free shrink)``."""
    n = sum(hosts.values())
    where = ", ".join(f"{h}" for h in sorted(hosts))
    return (f"{policy}: lends {n} slot{'s' if n != 1 else ''} on {where} to {to} (its host is "
            f"revoked: make-before-break, a stop-free shrink)")
