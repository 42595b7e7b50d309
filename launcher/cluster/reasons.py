"""Why a job waits, in the cluster service: one line for each job a round leaves without slots,
what ``queue``, ``status`` and ``status --json`` (its ``reason``) show for a queued or suspended
job, e.g. ``needs 2 slots, 1 free; 3 jobs ahead``.

:func:`waiting` runs at the end of each round (:meth:`launcher.cluster.service.Service._round`,
the loop's thread) on the round's snapshot and allocation, so the words follow the policy's own
rules: the size a job starts at (its ``np`` under fifo and tiresias, which gang-schedule; its
``min_np`` under edl, which admits at the minimum and takes lent slots back), the slots the
round leaves free (under edl: not held at some job's minimum, so lent slots count as free), the
jobs ahead of it in the policy's order (fifo: priority, then submission; tiresias, edl: 2D-LAS,
:func:`launcher.cluster.policies.tiresias.las_order`), and fifo's head-of-line blocking.
A job held at its user's quota (``serve --user-quota``) says so.  A job limited to some GPU
types (``submit --types``) counts only the slots of those types (``needs 2 slots of a100, 0
free``).
:func:`shown` gives the reason a job's row shows: the waiting reason of a job without slots,
the store's (the last decision's, or how the job ended) otherwise.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from launcher.cluster.policy import Allocation, JobView, Snapshot


def _slots(n: int) -> str:
    return f"{n} slot{'s' if n != 1 else ''}"


def _jobs(n: int) -> str:
    return f"{n} job{'s' if n != 1 else ''}"


def order(snap: Snapshot, policy) -> List[JobView]:
    """The jobs of ``snap`` in ``policy``'s order (fifo: larger priority, then submission;
    tiresias and edl: 2D-LAS with the policy's thresholds; fair between users where the policy
    is: its ``order``)."""
    own = getattr(policy, "order", None)
    if callable(own):
        return own(snap)
    thresholds = getattr(policy, "thresholds_gpu_s", None)
    if thresholds is not None:
        from launcher.cluster.policies.tiresias import las_order
        return las_order(snap, thresholds)
    return sorted(snap.jobs, key=lambda j: (-j.priority, j.submitted_at, j.id))


def start_size(j: JobView, policy) -> int:
    """The slots ``j`` needs to start under ``policy``: its ``min_np`` under edl, else its
    requested ``np`` (gang scheduling)."""
    if getattr(policy, "name", "") == "edl":
        return j.min_np
    return max(j.min_np, min(j.np, j.max_np))


def waiting(snap: Snapshot, alloc: Allocation, policy, pool_slots: int) -> Dict[str, str]:
    """job id -> why it waits, for every job of ``snap`` that ``alloc`` gives no slots
    (``pool_slots``: the whole pool's, hosts of stopping jobs included)."""
    jobs = order(snap, policy)
    held = {j.id: sum(k for k in alloc.get(j.id, {}).values() if k > 0) for j in jobs}
    edl = getattr(policy, "name", "") == "edl"
    busy = sum(min(held[j.id], start_size(j, policy)) if edl else held[j.id]
               for j in jobs if held[j.id])
    free = max(0, sum(snap.pool.values()) - busy)
    out: Dict[str, str] = {}
    ahead: List[JobView] = []
    fifo = getattr(policy, "name", "") == "fifo"
    quota = getattr(policy, "user_quota", None)
    per_user: Dict[str, int] = {}
    for j in jobs:
        per_user[j.user] = per_user.get(j.user, 0) + held[j.id]
    for j in jobs:
        if held[j.id]:
            continue
        need = start_size(j, policy)
        user = j.user or "(default)"
        allowed = tuple((j.goal or {}).get("types") or ())  # submit --types: only these count
        j_free, j_pool, among = free, pool_slots, ""
        if allowed:
            j_free, j_pool = typed_room(snap, alloc, jobs, held, policy, allowed)
            among = f" of {', '.join(allowed)}"
        if quota is not None and need > quota:
            why = f"needs {_slots(need)}, over the quota of {_slots(quota)} per user: never " \
                  f"starts under this quota"
        elif quota is not None and per_user[j.user] + need > quota:
            why = f"needs {_slots(need)}; its user {user} holds {per_user[j.user]} of the " \
                  f"quota of {_slots(quota)} per user"
        elif need > j_pool:
            why = f"needs {_slots(need)}{among}, the whole pool has {j_pool}: waits for " \
                  f"hosts to join"
        else:
            why = f"needs {_slots(need)}{among}, {j_free} free; {_jobs(len(ahead))} ahead"
            if fifo and ahead and need <= j_free:
                why += f" (fifo: none passes {ahead[0].id}, first in line)"
        if j.started:
            why = "suspended to its checkpoint: " + why
        out[j.id] = why
        ahead.append(j)
    return out


def typed_room(snap: Snapshot, alloc: Allocation, jobs: List[JobView], held: Dict[str, int],
               policy, allowed) -> tuple:
    """(free, total) slots on the pool's hosts whose GPU type is one of ``allowed`` (a job's
    ``submit --types``), counted as :func:`waiting` counts the whole pool's (under edl a job's
    slots past its start size count as free)."""
    ok = {h for h in snap.pool if getattr(snap.hosts.get(h), "gpu_type", None) in allowed}
    total = sum(snap.pool[h] for h in ok)
    edl = getattr(policy, "name", "") == "edl"
    busy = 0
    for j in jobs:
        there = sum(k for h, k in alloc.get(j.id, {}).items() if h in ok and k > 0)
        busy += min(there, start_size(j, policy)) if edl and held[j.id] else there
    return max(0, total - busy), total


def shown(state: str, stored: Optional[str], allocation: Dict[str, int],
          waiting_now: Optional[str]) -> Optional[str]:
    """The reason a job's row shows: for a queued or suspended job, why it waits
    (``waiting_now``, the last round's :func:`waiting`; allocated slots not free yet; or the
    next round to come), else ``stored`` (the last decision's reason, or how the job ended)."""
    if state not in ("queued", "suspended"):
        return stored
    n = sum(allocation.values())
    if n:
        return f"allocated {_slots(n)}: starts as soon as other jobs have freed them"
    if waiting_now:
        return waiting_now
    return "submitted: the next scheduling round places it" if state == "queued" else stored
