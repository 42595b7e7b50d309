"""Job migration (EDL, arXiv 1909.11985, section 5): the workers on one host move to another in
one stop-free switch.

``hvd-edl-ctl migrate --from A --to B`` asks the driver for a :class:`Migration`; the driver's
loop advances it once per pass (:meth:`Migration.advance`), top to bottom:

1. **build**: one new worker per worker on A is started on B's free slots, *reserved* in the
   coordinator (:meth:`Coordinator.reserve`): its ``hvd.init()`` registers it, it builds its
   model and data and reports ready while the ring trains on, but no generation takes it in;
2. **swap**: once every new worker is ready, one coordinator call (:meth:`Coordinator.swap`)
   asks the old workers to leave and releases the new ones, so the next step boundary forms
   one generation in which the old leave and the new join (kind "replace"); A is drained at
   the same moment, so no worker is placed there again and the job does not move back;
3. **done** once a generation holds every new worker and none of the old ones, and its switch
   is over (its stall known).

A new worker that dies (or exits) while building abandons the migration: the other new
workers are sent away, the old ones stay, A is not drained, and a note says why.  Every phase
is bounded (``build_timeout_s``, ``swap_timeout_s``).

When the workers on A are the ring's only members, no member stays to hand the committed state
to the new workers in the same ring: the coordinator keeps the oldest leaver one more
generation as rank 0 (its usual rule, see :meth:`Coordinator._try_form`), so that case takes
two switches (a scale-out and a scale-in) and the note says so.

The same mechanism replaces a straggler (:mod:`launcher.apps.straggler`): one leaver, one joiner.
"""
from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from launcher.job.registry import WorkerState

log = logging.getLogger(__name__)

SWAP_TIMEOUT_S = 120.0  # the longest the swap may take once the new workers are ready (s)


class MigrationError(ValueError):
    """A migration refused before it started (the job is unchanged); the message says why."""


class Phase(enum.Enum):
    """BUILDING -> SWAPPING -> DONE; BUILDING -> ABANDONED (a new worker died, or the build
    timed out); SWAPPING -> ABANDONED (no generation completed the swap in time)."""
    BUILDING = "building"
    SWAPPING = "swapping"
    DONE = "done"
    ABANDONED = "abandoned"


@dataclass
class Migration:
    """One swap of ``leavers`` (worker ids) for as many new workers on ``target_slots``.

    Args:
        source: the host the workers leave (drained at the swap when ``drain_source``), or
            for a straggler replacement the straggler's host.
        target_slots: (host, slot) for each new worker, as many as ``leavers``.
        purpose: "migration" or "straggler" (the event-log kind of the notes).
        build_timeout_s: the longest the new workers may take to become ready (seconds).
    """
    source: str
    target: str
    leavers: List[str]
    target_slots: List[Tuple[str, int]]
    purpose: str = "migration"
    drain_source: bool = True
    build_timeout_s: float = 130.0
    started_at: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.BUILDING
    joiners: List[str] = field(default_factory=list)
    reason: str = ""
    swap_generation: int = 0      # the generation current when the swap was asked for
    swapped_at: Optional[float] = None
    generations: List[dict] = field(default_factory=list)  # those that made the swap

    @property
    def active(self) -> bool:
        return self.phase in (Phase.BUILDING, Phase.SWAPPING)

    def result(self) -> dict:
        """What ``hvd-edl-ctl migrate`` prints (JSON-ready)."""
        return {"phase": self.phase.value, "from": self.source, "to": self.target,
                "leavers": list(self.leavers), "joiners": list(self.joiners),
                "reason": self.reason, "generations": list(self.generations),
                "stall_s": round(sum(g["stall_s"] for g in self.generations), 4),
                "drained": self.source if self.drain_source and self.phase == Phase.DONE
                else None,
                "seconds": round(time.monotonic() - self.started_at, 2)}

    # ---- the loop's pass ------------------------------------------------------------------------

    def advance(self, driver, now: float) -> None:
        """One pass (the driver's loop thread): start the new workers, swap when all are ready,
        finish when a generation holds them all; abandon on a dead new worker or a timeout."""
        if self.phase == Phase.BUILDING and not self.joiners:
            for host, slot in self.target_slots:
                rec = driver.start_worker(host, slot, reserve=True)
                self.joiners.append(rec.worker_id)
            return
        recs = [driver.worker(w) for w in self.joiners]
        if self.phase == Phase.BUILDING:
            gone = [r for r in recs if not r.state.alive or r.state == WorkerState.LEAVING]
            if gone:
                r = gone[0]
                why = (f"new worker {r.label} " + ("left" if r.state == WorkerState.LEAVING else
                       f"died (exit code {r.exit_code})") + " while building")
                return self._abandon(driver, why)
            if now - self.started_at > self.build_timeout_s:
                return self._abandon(driver, f"the new workers were not ready within "
                                             f"{self.build_timeout_s:g} s")
            if all(r.state == WorkerState.READY for r in recs):
                self._swap(driver, now)
            return
        # SWAPPING: done once a logged generation has every live new worker and no old one
        ring = driver.ring(since=self.swap_generation)
        live = [r.worker_id for r in recs if r.state.alive]
        done = ring.generation > 0 and ring.logged and set(live) <= set(ring.members) \
            and not set(self.leavers) & set(ring.members)
        figures = [{"generation": h.number, "kind": h.kind, "world_size": len(h.members),
                    "stall_s": h.stall_s, "rolled_back_steps": h.rolled_back_steps}
                   for h in ring.history]
        if done:
            self.generations = figures
            self.phase = Phase.DONE
            kinds = ", ".join(f"{f['kind']} (generation {f['generation']})" for f in figures)
            stall = sum(f["stall_s"] for f in figures)
            if self.purpose == "straggler":
                text = (f"{', '.join(self.leavers)} replaced by {', '.join(self.joiners)} on "
                        f"{', '.join(f'{h}:{s}' for h, s in self.target_slots)}")
            else:
                text = (f"{len(self.leavers)} worker{'s' if len(self.leavers) != 1 else ''} "
                        f"moved from {self.source} to {self.target}")
            text += (f" in {len(figures)} switch{'es' if len(figures) != 1 else ''}: {kinds}, "
                     f"stall {stall:.3f} s")
            if len(figures) > 1:
                text += (" (every member was on the source host: the oldest stayed one more "
                         "generation to hand the state over)")
            if self.drain_source:
                text += (f"; {self.source} stays drained (hvd-edl-ctl undrain {self.source} "
                         f"to use it again)")
            driver.note(self.purpose, text, phase="done", source=self.source,
                               target=self.target, leavers=self.leavers, joiners=self.joiners,
                               generations=figures, stall_s=round(stall, 4),
                               seconds=round(now - self.started_at, 3))
        elif now - (self.swapped_at or now) > SWAP_TIMEOUT_S:
            self.generations = figures
            self.phase = Phase.ABANDONED
            self.reason = f"no generation completed the swap within {SWAP_TIMEOUT_S:g} s"
            driver.note(self.purpose, f"incomplete: {self.reason}", phase="abandoned",
                               source=self.source, target=self.target, reason=self.reason)

    def _swap(self, driver, now: float) -> None:
        self.swap_generation = driver.ring().generation
        leavers = [w for w in self.leavers if driver.worker(w).state in (
            WorkerState.PENDING, WorkerState.READY, WorkerState.MEMBER)]
        if self.drain_source:  # no worker placed on the source again: the job does not move back
            driver.slots.set_drained(self.source, True)
        handover = self._handover(driver, leavers)
        for w in leavers:
            rec = driver.worker(w)
            if w == handover:  # named as left by the generation after the next (its line)
                print(f"hvd-edl-run: worker {w} (rank 0) on {rec.host} slot {rec.slot} stays "
                      f"one more generation to hand the committed state to "
                      f"{', '.join(self.joiners)} (every member is on {rec.host}), then "
                      f"goes: {self.purpose}", flush=True)
                continue
            print(f"hvd-edl-run: worker {w} on {rec.host} slot {rec.slot} leaves: "
                  f"{self.purpose}: replaced by the ready worker "
                  f"{self.joiners[self.leavers.index(w)]}", flush=True)
        driver.swap(leavers, self.joiners)
        self.swapped_at = now
        self.phase = Phase.SWAPPING
        log.info("%s: swap asked at generation %d", self.purpose, self.swap_generation)

    @staticmethod
    def _handover(driver, leavers: List[str]) -> Optional[str]:
        """The leaver that stays one more generation as rank 0 (the coordinator's rule,
        ``Formation._try_form``: when no member of the ring stays, its rank 0 hands the
        committed state to the joiners and leaves at the next boundary), or None."""
        live = [w for w in driver.ring().members
                if driver.worker(w).state in (WorkerState.MEMBER, WorkerState.LEAVING)]
        if live and all(w in leavers or driver.worker(w).state == WorkerState.LEAVING
                        for w in live):
            return live[0]
        return None

    def _abandon(self, driver, why: str) -> None:
        self.phase = Phase.ABANDONED
        self.reason = why
        for w in self.joiners:
            rec = driver.worker(w)
            if rec.state.alive and rec.state != WorkerState.LEAVING:
                driver.ask_to_leave(rec, f"{self.purpose} abandoned")
            driver.release_reserved(w)
        driver.note(self.purpose, f"abandoned: {why}; the workers on {self.source} stay",
                           phase="abandoned", source=self.source, target=self.target,
                           reason=why, leavers=self.leavers, joiners=self.joiners)


def free_slots(driver, host: str, now: float) -> List[int]:
    """``host``'s slots that may take a new worker now (:meth:`SlotBook.free_slots`, minus the
    slots of live workers)."""
    return driver.slots.free_slots(host, now, driver.taken_slots())


def plan(driver, source: str, target: str, now: float) -> Migration:
    """Check a ``migrate --from source --to target`` request and return its :class:`Migration`
    (not started).

    Raises:
        MigrationError: a static job; an unknown host; the same host twice; nothing runs on
            ``source``; ``target`` has fewer free usable slots than ``source`` has workers; a
            migration (or a straggler replacement) already running.
    """
    if not driver.spec.elastic:
        raise MigrationError("a static job cannot migrate: start it with --min-np/--max-np "
                             "(and a host discovery script or -H with several hosts)")
    known = set(driver.slots.hosts) | {w.host for w in driver.live_workers()}
    for what, host in (("--from", source), ("--to", target)):
        if host not in known:
            raise MigrationError(f"unknown host {host!r} ({what}); the job knows "
                                 f"{sorted(known)}")
    if source == target:
        raise MigrationError(f"--from and --to are the same host ({source}): nothing to move")
    running = getattr(driver, "migration", None)
    if running is not None and running.active:
        raise MigrationError(f"a {running.purpose} ({running.source} -> {running.target}) "
                             f"is running ({running.phase.value}); wait for it to end")
    leavers = sorted((w for w in driver.live_workers() if w.host == source
                      and w.state != WorkerState.LEAVING), key=lambda w: w.order)
    if not leavers:
        raise MigrationError(f"no worker runs on {source}: nothing to move")
    slots = free_slots(driver, target, now)
    if len(slots) < len(leavers):
        why = "drained" if target in driver.slots.drained() else \
            "blacklisted" if driver.slots.blacklisted(target, now) else \
            f"{len(slots)} free usable slot{'s' if len(slots) != 1 else ''}"
        raise MigrationError(f"{target} cannot take the {len(leavers)} worker"
                             f"{'s' if len(leavers) != 1 else ''} of {source}: {why}; "
                             f"the job is unchanged")
    return Migration(source=source, target=target, leavers=[w.worker_id for w in leavers],
                     target_slots=[(target, s) for s in slots[:len(leavers)]],
                     build_timeout_s=driver.spec.start_timeout_s + 10.0)


def status(migration: Optional[Migration]) -> Optional[Dict]:
    """The running or last migration for ``hvd-edl-ctl status`` (None: never one)."""
    return None if migration is None else migration.result()
