"""``typed``: a policy for a pool of several GPU types with prices and transient (spot) hosts
(issue 42; CM-DARE, arXiv 2004.03072, for the choice of one job's servers; Sia, SOSP 2023, for
placing jobs on types by what each gains from a type).

Each round, in order:

1. a running job keeps its slots (on hosts still in the pool);
2. a job that runs on hosts that left the pool (a revocation notice, a drain:
   ``JobView.displaced``) is placed first, in the same round: its new workers start while the
   old ones finish their last commit, so it moves rather than stops; with too few free slots,
   slots are taken stop-free from running jobs above their minimum (the lowest first:
   :mod:`launcher.cluster.make_before_break`), and only when even that cannot give it its
   ``min_np`` is it left to be checkpointed and resumed;
3. a waiting job with an objective (``submit --objective time|cost``) whose speed is unknown
   on every type it may use starts at ``--np`` on the type with the most free slots, to be
   measured (and moved once that pays back);
4. the other jobs (waiting, and running ones whose last change is ``hold_s`` old) by the
   round's program the simulator solves
   (:mod:`launcher.cluster.round_program`, as :mod:`launcher.cluster.policies.hetero_goodput`
   does for Sia's cluster): each one configuration, ``n`` GPUs of one class (type, spot), or
   of two classes where mixed types pay (:mod:`launcher.cluster.mixed_types`: the ring runs
   at its slowest type's speed), a job without an objective valued as the simulator's default
   values it (Sia's objective, :func:`launcher.cluster.round_program.sia_values`: its speed per
   configuration over its least, concave; ``objective="remaining"``: ``1 / T`` over a horizon,
   a change's stall priced in); so a job that gains 3x from an a100 over a t4 takes the a100
   before one that gains 1.5x, a running job moves to another type only for ``move_gain`` or
   more, and is never stopped here.  A job with an objective is a row of the same program
   (:mod:`launcher.cluster.goal_program`): its configurations (``n`` in ``[min_np, max_np]``)
   predicted as CM-DARE predicts, valued by its objective, and only those its objective ranks
   at least as well as waiting for busy slots of a better class (soonest within its budget,
   or cheapest within its deadline: it then waits); a start is predicted at the number of
   workers starting at once (its own and other jobs'); a running one keeps where it runs or
   moves to a configuration its objective ranks :attr:`TypedPolicy.move_gain` better, the
   new workers' start counted in full, never out of its limit while where it runs is within;
5. a running job with an objective that the program could not weigh (where it runs is not
   predictable) moves (stop-free) to slots still free when that serves its objective better
   by :attr:`TypedPolicy.move_gain` or more, counting the new workers' start
   in full (pessimistic: the job trains on meanwhile), fits its budget or deadline (or its
   current choice does not), and its last change is ``hold_s`` old.

Pure: a function of the snapshot (its ``hosts`` give each host's type, price, risk); the
choices of the last round are kept in :attr:`TypedPolicy.choices` (job id ->
:class:`launcher.cluster.choice.Prediction`) for the service to show, the jobs it started to
measure their speed in :attr:`TypedPolicy.measuring` (job id -> ``"1 x t4 spot"``), and
:meth:`explain` gives one line per decision.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from launcher.cluster.choice import (Goal, Offer, Prediction, better, choose, pick, predict,
                                     rank_key, start_of)
from launcher.cluster.goal_program import (QUEUE_TIE, config_prediction, goal_values, running_releases,
                                           wait_options)
from launcher.cluster.make_before_break import donor_order, lent_reason, make_room
from launcher.cluster.mixed_types import mixed_pays, ring_speed, single_speed
from launcher.cluster.round_program import reallocation_factor, sia_values, solve, value
from launcher.cluster.policy import Allocation, JobView, Policy, Snapshot, fill_hosts

Klass = Tuple[str, bool]  # (GPU type, spot)
PROGRAM_JOBS = 64       # waiting jobs in one round's program (the rest wait for the next)
PROGRAM_LIMIT_S = 1.0   # the solver's bound in the live loop, seconds
WAIT_SLACK_S = 60.0     # a wait for busy slots is over this long after the end first predicted


class TypedPolicy(Policy):
    """See the module docstring.

    Args:
        commit_s: a job's commit period, seconds (what a revocation without notice loses).
        switch_s: a stop-free switch, seconds (None: the snapshot's ``change_cost_s``).
        start_s: a job's start (launcher, imports, first ring), seconds (None: the
            snapshot's ``restart_cost_s``, ``serve --start-cost``).
        move_gain: the least relative gain (time or cost) that moves a running job.
        notice: revocations come with a notice (no work lost).
        hold_s: seconds after a job's last change before it may be moved.
        horizon_s: the work a job without an objective counts as left, seconds at its slowest
            speed (step 4, ``objective="remaining"``: what a start's stall weighs against).
        objective: how step 4 values a job without an objective of its own: ``"sia"`` (the
            default, Sia's objective, the simulator's default:
            :func:`launcher.cluster.round_program.sia_values`) or ``"remaining"`` (the sum of
            ``1 / T`` over a horizon: :func:`launcher.cluster.round_program.value`).
            ValueError (one line) for another."""

    name = "typed"

    def __init__(self, commit_s: float = 2.0, switch_s: Optional[float] = None,
                 start_s: Optional[float] = None, move_gain: float = 0.25,
                 notice: bool = False, hold_s: float = 20.0, horizon_s: float = 600.0,
                 objective: str = "sia"):
        if objective not in ("sia", "remaining"):
            raise ValueError(f"unknown objective {objective!r} for typed (sia, remaining)")
        self.objective = objective
        self.commit_s = commit_s
        self.switch_s = switch_s
        self.start_s = start_s
        self.move_gain = move_gain
        self.notice = notice
        self.hold_s = hold_s
        self.horizon_s = horizon_s
        self.choices: Dict[str, Prediction] = {}
        self.measuring: Dict[str, str] = {}
        self._why: Dict[str, str] = {}
        # a waiting job -> when the wait for busy slots first chosen for it is over (its
        # prediction plus WAIT_SLACK_S): the running jobs' ends are predictions (a stalled job's
        # never comes), so past it the job takes what is free, as without waits
        self._wait_until: Dict[str, float] = {}

    def explain(self, job_id: str) -> Optional[str]:
        """The last round's reason for ``job_id``'s allocation (None: none given)."""
        return self._why.get(job_id)

    # ---- the round ------------------------------------------------------------------------------

    def allocate(self, snap: Snapshot) -> Allocation:
        self.choices, self._why, self.measuring = {}, {}, {}
        self._switch_s = snap.change_cost_s if self.switch_s is None else self.switch_s
        self._start_s = snap.restart_cost_s if self.start_s is None else self.start_s
        klass = {h: _klass(snap.hosts.get(h)) for h in snap.pool}
        free = dict(snap.pool)
        alloc: Allocation = {}
        for j in snap.jobs:  # 1. running jobs keep their slots
            held = {h: min(k, free[h]) for h, k in j.allocation.items() if free.get(h, 0) > 0}
            if sum(held.values()) >= j.min_np:
                alloc[j.id] = held
                for h, k in held.items():
                    free[h] -= k
        running = [j.id for j in snap.jobs if j.id in alloc]
        waiting = sorted((j for j in snap.jobs if j.id not in alloc),  # 2. displaced first
                         key=lambda j: (not j.started, j.submitted_at, j.id))
        for j in [j for j in waiting if j.displaced]:
            self._place_displaced(snap, j, alloc, free, klass)
        waiting = [j for j in waiting if j.id not in alloc]
        self._starting = self._starting_now(snap, klass)
        self._releases = running_releases(snap.jobs, klass, snap.now)
        self._terms = {o_k: o for o_k, o in (((o.gpu_type, o.spot), o) for o in self._offers(
            snap, dict(snap.pool), klass))}
        for j in [j for j in waiting if j.goal]:  # 3. objectives of unknown speed: measured
            if self._choose(snap, j, list(self._terms.values()), self._start_s) is None:
                self._place_goal(snap, j, alloc, free, klass)
        rest = sorted((j for j in waiting if j.id not in alloc),  # 4. the round's program
                      key=lambda j: (not j.started, -j.priority, -_gain(j, klass),
                                     j.submitted_at, j.id))
        movable = [j for j in snap.jobs if j.id in running and j.id in alloc
                   and not j.displaced and snap.now - j.last_change_at >= self.hold_s
                   and (not j.goal or self._predict_config(
                       snap, j, _config_of(alloc[j.id], klass), stay=True) is not None)]
        self._place_program(snap, rest, alloc, free, klass, movable)
        in_program = {j.id for j in movable}
        for j in snap.jobs:  # 5. the others with an objective: moves that pay back
            if j.id in running and j.goal and j.id not in in_program and \
                    snap.now - j.last_change_at >= self.hold_s:
                self._maybe_move(snap, j, alloc, free, klass)
        waiting_ids = {j.id for j in snap.jobs if j.id not in alloc}
        self._wait_until = {i: t for i, t in self._wait_until.items() if i in waiting_ids}
        return alloc

    # ---- helpers --------------------------------------------------------------------------------

    def _offers(self, snap: Snapshot, free: Dict[str, int], klass, extra=None) -> List[Offer]:
        by: Dict[Klass, List[str]] = {}
        for h, k in free.items():
            if k + (extra or {}).get(h, 0) > 0:
                by.setdefault(klass[h], []).append(h)
        out = []
        for (t, spot), hosts in sorted(by.items()):
            terms = [snap.hosts.get(h) for h in hosts]
            out.append(Offer(t, sum(free[h] + (extra or {}).get(h, 0) for h in hosts),
                             max((getattr(x, "price", None) or 0.0) for x in terms),
                             max((getattr(x, "revocations_per_h", 0.0) or 0.0) for x in terms),
                             max((getattr(x, "startup_s", 0.0) or 0.0) for x in terms), spot))
        return out

    def _choose(self, snap: Snapshot, j: JobView, offers: List[Offer],
                start_s: float) -> Optional[Prediction]:
        g = Goal.from_dict(dict(j.goal))
        remaining = max(0.0, g.samples - float(j.goal.get("done_samples") or 0.0))
        speed = j.speed_of or (lambda t, n: None)
        per_type = j.goal.get("start_s") if start_s == self._start_s else None
        start = dict(per_type, **{"*": start_s}) if isinstance(per_type, dict) else start_s
        return choose(g, remaining, speed, offers, snap.now, j.min_np, j.max_np,
                      spent_usd=j.spent_usd, commit_s=self.commit_s, switch_s=self._switch_s,
                      start_s=start, notice=self.notice)

    def _take(self, free, klass, k: Klass, n: int, prefer=()) -> Optional[Dict[str, int]]:
        sub = {h: free[h] for h in free if klass[h] == k and free[h] > 0}
        got = fill_hosts(sub, n, prefer)
        if got is not None:
            for h, m in got.items():
                free[h] -= m
        return got

    def _place_goal(self, snap, j: JobView, alloc, free, klass) -> None:
        best = self._choose(snap, j, self._offers(snap, free, klass), self._start_s)
        if best is None:  # speed unknown everywhere: start at np where most slots are free
            allowed = tuple(j.goal.get("types") or ())  # --types: only these, measuring too
            room: Dict[Klass, int] = {}
            for h, k in free.items():
                if not allowed or klass[h][0] in allowed:
                    room[klass[h]] = room.get(klass[h], 0) + max(0, k)
            k = max(sorted(room), key=lambda c: room[c], default=None)
            n = min(j.np, room.get(k, 0)) if k is not None else 0
            if k is None or n < j.min_np:
                self._why[j.id] = ("typed: waits for slots of one type"
                                   + (f" among {', '.join(allowed)}" if allowed else ""))
                return
            got = self._take(free, klass, k, n)
            alloc[j.id] = got
            self.measuring[j.id] = f"{n} x {_label(k)}"
            self._why[j.id] = f"typed: speed unknown, starts on {n} x {_label(k)} to measure it"
            return
        got = self._take(free, klass, (best.gpu_type, best.spot), best.n)
        if got is None:
            return
        alloc[j.id] = got
        self.choices[j.id] = best
        self._why[j.id] = f"typed: {best.why}"

    def _maybe_move(self, snap, j: JobView, alloc, free, klass) -> None:
        held = alloc[j.id]
        kinds = {klass[h] for h in held}
        if len(kinds) != 1 or j.speed_of is None:
            return
        cur_k = next(iter(kinds))
        n = sum(held.values())
        g = Goal.from_dict(dict(j.goal))
        remaining = max(0.0, g.samples - float(j.goal.get("done_samples") or 0.0))
        mine = [o for o in self._offers(snap, free, klass, held)
                if (o.gpu_type, o.spot) == cur_k]
        if not mine:
            return
        per_type = j.goal.get("start_s")  # a replacement worker's start on its type
        join = start_of(dict(per_type, **{"*": self._start_s}) if isinstance(per_type, dict)
                        else self._start_s, cur_k[0], 1)
        cur = predict(remaining, lambda k: j.speed_of(cur_k[0], k), n, mine[0],
                      self.commit_s, self._switch_s, 0.0, self.notice, j.spent_usd,
                      join_s=join)
        best = self._choose(snap, j, self._offers(snap, free, klass, held), self._start_s)
        if cur is None or best is None:
            if best is not None:
                self.choices[j.id] = best
            return
        fits_now = (g.objective == "time" and (g.budget_usd is None
                                                or cur.cost_usd <= g.budget_usd)) or \
            (g.objective == "cost" and (g.deadline_at is None
                                         or cur.time_s <= g.deadline_at - snap.now))
        gain = better(g.objective, best, cur)
        if ((best.gpu_type, best.spot) == cur_k and best.n == n) or \
                gain < self.move_gain or (best.fits is False and fits_now):
            if (best.gpu_type, best.spot) == cur_k:  # "elsewhere" names only other classes
                best = self._choose(snap, j, [o for o in self._offers(snap, free, klass, held)
                                              if (o.gpu_type, o.spot) != cur_k], self._start_s)
            self.choices[j.id] = _keep(cur, best)
            return
        for h, k in held.items():  # give back, then take the new choice (prefer the same)
            free[h] += k
        got = self._take(free, klass, (best.gpu_type, best.spot), best.n, prefer=list(held))
        if got is None:
            for h, k in held.items():
                free[h] -= k
            self.choices[j.id] = _keep(cur, best)
            return
        alloc[j.id] = got
        self.choices[j.id] = best
        self._why[j.id] = f"typed: moves ({gain:.0%} better): {best.why}"

    def _place_displaced(self, snap, j: JobView, alloc, free, klass) -> None:
        """A job whose hosts are revoked: its own choice where slots are free, else room made
        on free slots and slots taken stop-free from jobs above their minimum
        (:mod:`launcher.cluster.make_before_break`); left out (preempted) only when even that
        finds fewer than its ``min_np``."""
        if j.goal:
            self._place_goal(snap, j, alloc, free, klass)
        else:
            self._place_plain(j, alloc, free, klass)
        if j.id in alloc:
            return
        kept = {h: k for h, k in j.allocation.items() if free.get(h, 0) >= k}
        for h, k in kept.items():  # what it keeps of its hosts (fewer than its min_np)
            free[h] -= k
        if kept:
            alloc[j.id] = kept
        types = tuple((j.goal or {}).get("types") or ())  # --types: never outside them
        room = make_room(j, alloc, free, donor_order(snap.jobs, alloc), allowed=(
            (lambda h: klass.get(h, ("", False))[0] in types) if types else None))
        if room is None:
            for h, k in kept.items():
                free[h] += k
            alloc.pop(j.id, None)
            self._why[j.id] = ("typed: its host is revoked and no slot is free or can be "
                               "spared: checkpointed, it resumes later")
            return
        hosts, taken = room
        for d, got in taken.items():
            self._why[d] = lent_reason(self.name, j.id, got)
        self._why[j.id] = (f"typed: its host is revoked: moves stop-free to "
                           f"{sum(hosts.values())} slots"
                           + (f", {sum(sum(t.values()) for t in taken.values())} taken from "
                              f"{', '.join(sorted(taken))}" if taken else ""))

    def _configs(self, j: JobView, cap: Dict[Klass, int],
                 hi: Optional[int] = None) -> List[Dict[Klass, int]]:
        """The configurations ``j`` may start in: ``n`` slots of one class (type, spot), or
        of two where mixing pays (:func:`launcher.cluster.mixed_types.mixed_pays`: the fewest
        and the most of the first class that fit), ``n`` its ``min_np``, ``hi`` (default its
        ``np``), every size between up to 8 and the powers of two above (a program of
        bounded size on a large pool)."""
        out: List[Dict[Klass, int]] = []
        lo, hi = j.min_np, max(j.min_np, j.np if hi is None else hi)
        ns = sorted({lo, hi} | {2 ** e for e in range(hi.bit_length()) if lo < 2 ** e < hi}
                    | {n for n in range(lo, min(hi, 8) + 1)})
        for k, room in sorted(cap.items()):
            out += [{k: n} for n in ns if n <= room]
        classes = sorted(k for k in cap if cap[k] > 0)
        for i, k1 in enumerate(classes):
            for k2 in classes[i + 1:]:
                for n in (n for n in ns if n >= 2):
                    splits = {(a, n - a) for a in (max(1, n - cap[k2]), min(cap[k1], n - 1))
                              if 1 <= a <= cap[k1] and 1 <= n - a <= cap[k2]}
                    for a, b in sorted(splits):
                        if mixed_pays(j.speed_of, k1[0], a, k2[0], b):
                            out.append({k1: a, k2: b})
        return out

    def _place_program(self, snap, jobs: List[JobView], alloc, free, klass,
                       movable: List[JobView] = ()) -> None:
        """Step 4 (module docstring): the waiting jobs without an objective (``jobs``) and the
        running ones held long enough (``movable``: in ``alloc`` now), each one configuration,
        chosen by :func:`launcher.cluster.round_program.solve`, the program the simulator's
        :mod:`launcher.cluster.policies.hetero_goodput` solves, each configuration valued as
        there: ``objective="sia"`` (default) Sia's (:func:`launcher.cluster.round_program.
        sia_values`: the ring's samples/s there over its least over every configuration it may
        take, Sia's re-allocation factor counted from its last change, no changes since);
        ``"remaining"``: ``1 / T``, ``T`` = remaining work / speed there + the stall of getting
        there (a start; a stop-free switch to resize; a switch and the new workers' start to
        change type; none to stay), a live job's remaining work unknown: each counts
        :attr:`TypedPolicy.horizon_s` seconds of work at its slowest speed at ``min_np``.  A
        running job moves to another type only for :attr:`TypedPolicy.move_gain` or more, and
        always gets one configuration (never preempted here); a job ``priority``
        higher is placed in a program of its own first, and at most :data:`PROGRAM_JOBS`
        waiting jobs of one priority, in queue order, are in one program."""
        for prio in sorted({j.priority for j in list(jobs) + list(movable)}, reverse=True):
            waiting = [j for j in jobs if j.priority == prio][:PROGRAM_JOBS]
            moving = [j for j in movable if j.priority == prio]
            held = {j.id: alloc.pop(j.id) for j in moving}
            for hosts in held.values():
                for h, k in hosts.items():
                    free[h] += k
            placed = self._solve_group(snap, moving + waiting, held, free, klass)
            if placed is None and moving:  # no solution in time: the running keep their slots
                for j in moving:
                    alloc[j.id] = held[j.id]
                    for h, k in held[j.id].items():
                        free[h] -= k
                held = {}
                placed = self._solve_group(snap, waiting, held, free, klass) or {}
            for j in moving + waiting:  # stayers first: their very slots
                hosts, c = (placed or {}).get(j.id, (None, None))
                if hosts is not None and c is None:
                    alloc[j.id] = hosts
                    for h, k in hosts.items():
                        free[h] -= k if j.id in held else 0
            for j in sorted(moving + waiting, key=lambda j: -sum(
                    ((placed or {}).get(j.id, (None, None))[1] or {}).values())):
                hosts, c = (placed or {}).get(j.id, (None, None))
                if c is None:
                    continue
                got: Dict[str, int] = {}
                for k, n in sorted(c.items()):
                    for h, m in (self._take(free, klass, k, n, prefer=list(held.get(j.id, {})))
                                 or {}).items():
                        got[h] = got.get(h, 0) + m
                alloc[j.id] = got
                self._why[j.id] = self._started_why(
                    j, c, moved=sum(held[j.id].values()) if j.id in held else 0)
            self._note_goals(snap, waiting, alloc, placed or {}, moving)

    def _goal_row(self, j: JobView, placed):
        """``(predictions by configuration, best, Goal, configuration placed or None)`` of job
        ``j`` with an objective in this round's program; None for a job without one."""
        if not j.goal or j.id not in getattr(self, "_goal_rows", {}):
            return None
        preds, best = self._goal_rows[j.id]
        return preds, best, Goal.from_dict(dict(j.goal)), (placed.get(j.id) or (None, None))[1]

    def _note_goals(self, snap, waiting: List[JobView], alloc, placed,
                    moving: List[JobView] = ()) -> None:
        """The choice and reason of each job with an objective after the program: the
        configuration a waiting one got, its prediction made again with every worker the round
        starts (their starts share the CPUs: :func:`launcher.cluster.goal_program`), or what
        it waits for; a running one's move (how much better), or that it stays."""
        starting = self._starting + sum(
            sum(alloc[j.id].values()) for j in waiting if j.id in alloc)
        for j in moving:
            row = self._goal_row(j, placed)
            if row is None:
                continue
            preds, best, g, c = row
            here = next(iter(preds.values()), None)  # the first: where it runs
            if c is None or here is None:
                if here is not None:  # "best elsewhere": the best of the other placements
                    others = [q for q in preds.values() if q is not None and q is not here]
                    self.choices[j.id] = _keep(here, pick(g, others, snap.now))
                continue
            p = preds.get(_frozen(c))
            if p is None:
                continue
            p = pick(g, [p], snap.now)
            self.choices[j.id] = p
            self._why[j.id] = (f"typed: moves ({better(g.objective, p, here):.0%} better): "
                               f"{p.why}")
        for j in waiting:
            row = self._goal_row(j, placed)
            if row is None:
                continue
            preds, best, g, c = row
            if j.id in alloc and c is not None:
                n = sum(c.values())
                p = self._predict_config(snap, j, c, starting - n) or preds.get(_frozen(c))
                if p is None:
                    continue
                p = pick(g, [p], snap.now)
                self.choices[j.id] = p
                other = "" if best is None or best.wait_s or best.label == p.label else \
                    f" (its best, {best.label}, went to another job this round)"
                self._why[j.id] = f"typed: {p.why}{other}"
            elif best is not None and best.wait_s:
                self.choices[j.id] = best
                self._why[j.id] = f"typed: {best.why}: sooner or cheaper than what is free"
            else:
                self._why[j.id] = ("typed: waits: the round gave the slots it could use to "
                                   "others" if best is not None else
                                   "typed: waits: no configuration of it is predicted")

    def _start_spec(self, j: JobView):
        """The job's start: its ``--speed-profile``'s per type (and number starting at once),
        the service's ``--start-cost`` for the others."""
        per_type = j.goal.get("start_s") if j.goal else None
        return dict(per_type, **{"*": self._start_s}) if isinstance(per_type, dict) \
            else self._start_s

    def _predict_config(self, snap, j: JobView, c: Dict[Klass, int],
                        starting: Optional[int] = None, stay: bool = False
                        ) -> Optional[Prediction]:
        """``j``'s prediction on configuration ``c`` (:func:`launcher.cluster.goal_program.
        config_prediction`): from a start (the workers starting at once: ``starting`` others,
        default those still starting), or, ``stay``, where it runs now (no start)."""
        g = Goal.from_dict(dict(j.goal))
        remaining = max(0.0, g.samples - float(j.goal.get("done_samples") or 0.0))
        return config_prediction(remaining, j.speed_of or (lambda t, n: None), c, self._terms,
                                 self._start_spec(j),
                                 self._starting if starting is None else starting,
                                 j.spent_usd, self.commit_s, self._switch_s, self.notice,
                                 stay=stay)

    def _moves_that_pay(self, snap, j: JobView, cs, cur, preds) -> List[Optional[Prediction]]:
        """A running job's row: where it runs (``cs[0] == cur``) and the configurations its
        objective ranks better by :attr:`move_gain` or more (time or cost,
        :func:`launcher.cluster.choice.better`; the new workers' start counted in full:
        pessimistic, the job trains on meanwhile), none that leaves its limit while where it
        runs is within it; the others None."""
        g = Goal.from_dict(dict(j.goal))
        here = preds[0]
        if here is None:
            return [None] * len(preds)
        here_fits = rank_key(g, here, snap.now)[0] == 0
        out: List[Optional[Prediction]] = [here]
        for c, p in zip(cs[1:], preds[1:]):
            ok = p is not None and better(g.objective, p, here) >= self.move_gain and not (
                here_fits and rank_key(g, p, snap.now)[0] != 0)
            out.append(p if ok else None)
        return out

    def _waits(self, snap, j: JobView, cap: Dict[Klass, int]) -> List[Prediction]:
        """``j``'s options of waiting for busy slots (:func:`launcher.cluster.goal_program.
        wait_options`), on its allowed types only."""
        until = self._wait_until.get(j.id)
        if until is not None and snap.now > until:   # the slots never came: no more waits
            return []
        allowed = tuple(j.goal.get("types") or ())
        rel = {k: r for k, r in self._releases.items() if not allowed or k[0] in allowed}
        g = Goal.from_dict(dict(j.goal))
        remaining = max(0.0, g.samples - float(j.goal.get("done_samples") or 0.0))
        return wait_options(remaining, j.speed_of or (lambda t, n: None),
                            range(max(1, j.min_np), j.max_np + 1), self._terms, cap, rel,
                            start=self._start_spec(j), starting=self._starting,
                            spent_usd=j.spent_usd, commit_s=self.commit_s,
                            switch_s=self._switch_s, notice=self.notice)

    def _starting_now(self, snap, klass) -> int:
        """Workers of running jobs still starting (started within their start's time, and
        for a job with an objective, no sample trained yet): their starts share the CPUs
        with any the round starts."""
        n = 0
        for j in snap.jobs:
            k = sum(j.allocation.values())
            if not k or (j.goal and float(j.goal.get("done_samples") or 0.0) > 0):
                continue
            types = {klass[h][0] for h in j.allocation if h in klass} or {""}
            if snap.now - j.last_change_at < max(start_of(self._start_spec(j), t, k)
                                                 for t in types):
                n += k
        return n

    def _solve_group(self, snap, group: List[JobView], held: Dict[str, Dict[str, int]],
                     free, klass) -> Optional[Dict[str, Tuple[Dict[str, int], Optional[dict]]]]:
        """One program over ``group`` on ``free`` (the running ones' ``held`` slots in it):
        job id -> (its hosts, None) to stay, or (None, configuration) to take; None when the
        solver found nothing for a running job."""
        cap: Dict[Klass, int] = {}
        for h, k in free.items():
            cap[klass[h]] = cap.get(klass[h], 0) + max(0, k)
        cfgs, curs = [], []
        for j in group:
            cs = self._configs(j, cap, hi=j.max_np if j.goal else None)
            if j.goal and j.goal.get("types"):  # --types: only these
                cs = [c for c in cs if all(k[0] in j.goal["types"] for k in c)]
            cur = _config_of(held[j.id], klass) if j.id in held else None
            if cur is not None and j.goal:  # its objective says which moves pay (below)
                cs = [cur] + [c for c in cs if c != cur]
            elif cur is not None:
                r_cur = ring_speed(j.speed_of, _by_type(cur))
                cs = [c for c in cs if set(c) == set(cur) or ring_speed(
                    j.speed_of, _by_type(c)) >= (1 + self.move_gain) * r_cur]
                cs = [cur] + [c for c in cs if c != cur]
            cfgs.append(cs)
            curs.append(cur)
        if not any(cfgs):
            return {}
        uses: List[Dict[Klass, int]] = []  # every job's configurations, each once
        for c in (c for cs in cfgs for c in cs):
            if c not in uses:
                uses.append(c)
        val = np.zeros((len(group), len(uses)))
        mask = np.zeros(val.shape, bool)  # set per row: an objective's, 1 / T: val > 0
        self._goal_rows = {}
        idle = dict(cap)  # free now: not the running jobs' (theirs free at their predicted end)
        for hosts in held.values():
            for h, k in hosts.items():
                idle[klass[h]] = idle.get(klass[h], 0) - k
        for i, (j, cs, cur) in enumerate(zip(group, cfgs, curs)):
            if j.goal:  # an objective: its own row (goal_program)
                preds = [self._predict_config(snap, j, c, stay=c == cur) for c in cs]
                waits = self._waits(snap, j, idle) if cur is None else []
                if cur is not None:  # running: a move only for move_gain, never out of its limit
                    preds = self._moves_that_pay(snap, j, cs, cur, preds)
                vals, best = goal_values(Goal.from_dict(dict(j.goal)), snap.now, preds, waits)
                if cur is None:  # its best among what is idle now and its waits
                    best = pick(Goal.from_dict(dict(j.goal)), [p for c, p in zip(cs, preds) if (
                        p is not None and all(idle.get(k, 0) >= n for k, n in c.items()))]
                        + waits, snap.now) or best
                    if best is not None and best.wait_s:
                        self._wait_until.setdefault(j.id, snap.now + best.wait_s + WAIT_SLACK_S)
                for c, v in zip(cs, vals):  # equal rows: the earlier in the queue first
                    val[i, uses.index(c)] = v * (1.0 - QUEUE_TIE * i)
                    mask[i, uses.index(c)] = v > 0
                self._goal_rows[j.id] = ({_frozen(c): p for c, p in zip(cs, preds)}, best)
                continue
            if self.objective == "sia":  # Sia's, as the simulator (round_program.sia_values)
                every = cs if cur is None else self._configs(j, cap)  # its least of all, as Sia
                least = min((r for r in (ring_speed(j.speed_of, _by_type(c)) for c in every)
                             if r > 0), default=None)
                f = 1.0 if cur is None else reallocation_factor(
                    snap.now - j.last_change_at, 0, self._switch_s)
                row, ok = sia_values([ring_speed(j.speed_of, _by_type(c)) for c in cs],
                                     None if cur is None else 0, f, least)
                for k, c in enumerate(cs):
                    val[i, uses.index(c)] = row[k]
                    mask[i, uses.index(c)] = ok[k]
                continue
            ref = min(single_speed(j.speed_of, t, j.min_np) for t, _ in cap) if cap \
                else float(j.min_np)
            for c in cs:
                stall = self._start_s if cur is None else 0.0 if c == cur else \
                    self._switch_s if set(c) == set(cur) else self._switch_s + self._start_s
                r = ring_speed(j.speed_of, _by_type(c))
                val[i, uses.index(c)] = value(self.horizon_s * ref, r, stall)
                mask[i, uses.index(c)] = val[i, uses.index(c)] > 0
        got = solve(val, [{_key(k): n for k, n in c.items()} for c in uses],
                    {_key(k): n for k, n in cap.items()}, time_limit_s=PROGRAM_LIMIT_S, mask=mask,
                    must=[cur is not None for cur in curs])
        if any(cur is not None and i not in got for i, cur in enumerate(curs)):
            return None
        out: Dict[str, Tuple[Optional[Dict[str, int]], Optional[dict]]] = {}
        for i, k in got.items():
            j, c = group[i], uses[k]
            out[j.id] = (dict(held[j.id]), None) if c == curs[i] else (None, c)
        return out

    def _started_why(self, j: JobView, c: Dict[Klass, int], moved: int = 0) -> str:
        """The reason line of a start (``moved`` 0) or of a running job's change from
        ``moved`` slots to configuration ``c``."""
        parts = " + ".join(f"{n} x {k[0] or 'untyped'}{' spot' if k[1] else ''}"
                           for k, n in sorted(c.items(), key=lambda kv: -kv[1]))
        n = sum(c.values())
        verb = "starts on" if not moved else f"grows {moved} -> {n} stop-free:" if n > moved \
            else f"shrinks {moved} -> {n} stop-free:" if n < moved else "moves stop-free to"
        if len({k[0] for k in c}) < 2:
            return f"typed: {verb} {parts}" + (" (the round's program)" if moved else "")
        alone = max(single_speed(j.speed_of, k[0], n) for k, n in c.items())
        mixed = ring_speed(j.speed_of, _by_type(c))
        return (f"typed: {verb} {parts}: mixed types pay ({mixed:.0f} samples/s, the "
                f"faster part alone {alone:.0f})")

    def _place_plain(self, j: JobView, alloc, free, klass) -> None:
        room: Dict[Klass, int] = {}
        for h, k in free.items():
            room[klass[h]] = room.get(klass[h], 0) + max(0, k)
        order = sorted(room, key=lambda c: (-(_speed(j, c[0], j.np) or 0.0), -room[c], c))
        for k in order:
            if room[k] >= j.np:
                alloc[j.id] = self._take(free, klass, k, j.np)
                self._why[j.id] = f"typed: starts on {j.np} x {k[0] or 'untyped'}"
                return
        got = fill_hosts({h: k for h, k in free.items() if k > 0}, j.np)
        if got is not None:
            for h, m in got.items():
                free[h] -= m
            alloc[j.id] = got
            self._why[j.id] = f"typed: starts on {j.np} slots of several types"


def _frozen(c: Dict[Klass, int]) -> tuple:
    return tuple(sorted(c.items()))


def _config_of(hosts: Dict[str, int], klass) -> Dict[Klass, int]:
    out: Dict[Klass, int] = {}
    for h, k in hosts.items():
        out[klass[h]] = out.get(klass[h], 0) + k
    return out


def _key(k: Klass) -> str:
    return f"{k[0]}|{'spot' if k[1] else 'on-demand'}"


def _by_type(c: Dict[Klass, int]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for (t, _), n in c.items():
        out[t] = out.get(t, 0) + n
    return out


def _klass(terms) -> Klass:
    return (getattr(terms, "gpu_type", None) or "", bool(getattr(terms, "spot", False)))


def _speed(j: JobView, gpu_type: str, n: int) -> Optional[float]:
    return j.speed_of(gpu_type, n) if j.speed_of is not None else None


def _gain(j: JobView, klass) -> float:
    """The job's speed on its fastest type over its slowest (1 when fewer than two known)."""
    speeds = [s for s in (_speed(j, t, max(1, j.np)) for t in {k[0] for k in klass.values()})
              if s]
    return max(speeds) / min(speeds) if len(speeds) >= 2 else 1.0


def _label(k: Klass) -> str:
    """A class of hosts in words: ``t4 spot``, ``t4 on demand``."""
    return f"{k[0]} {'spot' if k[1] else 'on demand'}"


def _keep(cur: Prediction, best: Optional[Prediction]) -> Prediction:
    """The choice to stay where ``cur`` runs, its reason naming ``best``, the best other
    placement (None: none predicted), never the place it stays on."""
    here = _label((cur.gpu_type, cur.spot))
    other = (f"best elsewhere: {best.n} x {_label((best.gpu_type, best.spot))}, "
             f"{best.time_s:.0f} s, ${best.cost_usd:.4f}"
             if best is not None and (best.gpu_type, best.spot, best.n)
             != (cur.gpu_type, cur.spot, cur.n) else "no better placement elsewhere")
    return Prediction(cur.gpu_type, cur.n, cur.time_s, cur.cost_usd, cur.revocations,
                      True, f"stays on {cur.n} x {here} ({other})", cur.spot)
