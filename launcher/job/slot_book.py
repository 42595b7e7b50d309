"""The slot book: the one owner of "may a worker run on this host's slot now".

Horovod keeps host state in one place (``horovod/runner/elastic/discovery.py``: ``HostManager``,
``HostState`` with its blacklist and cooldown); so do we.  The book holds

* the host set discovery reported last (``{host: slots}``, discovery order) and the GPUs its
  lines name (``host gpus=2,3``: slot 0 on GPU 2, slot 1 on GPU 3);
* slot cooldowns: a slot whose worker failed rests until a monotonic time (for the rest of the
  job, or a time from ``--blacklist-cooldown-range``, doubled per recent failure of its host);
  a straggler's slot rests too;
* the host blacklist: a host whose workers failed ``HOST_FAILURES_TO_BLACKLIST`` times within
  ``HOST_FAILURE_WINDOW_S`` is out until its cooldown ends; under ``--failure-blacklist host``
  (Horovod's rule, :meth:`blacklist_host`) one failure is enough;
* drained hosts (``hvd-edl-ctl drain``, a migration's source): no worker is placed there.

Everything is asked of the book: :meth:`usable` (slots per host, capped to a budget),
:meth:`capacity`, :meth:`free_slots` (one host's, minus the slots live workers take),
:meth:`allowed` (the slots a running worker may keep).  Times are ``time.monotonic()`` seconds.
All methods are thread-safe (the driver's loop, the discovery thread and the control API's
threads use it).
"""
from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

HOST_FAILURES_TO_BLACKLIST = 3   # failed workers on one host (within the window) blacklist it
HOST_FAILURE_WINDOW_S = 300.0


@dataclass(frozen=True)
class Rest:
    """What :meth:`SlotBook.record_failure` decided: the slot rests ``cooldown_s`` seconds
    (``inf``: for the rest of the job); ``blacklisted``: the host's failures within the window
    (``failures`` of them) blacklist it for as long."""
    cooldown_s: float
    failures: int
    blacklisted: bool


class SlotBook:
    """Hosts, slots, cooldowns, blacklist and drains of one job (see the module docstring)."""

    def __init__(self, hosts: Optional[Dict[str, int]] = None):
        self._lock = threading.Lock()
        self._hosts: Dict[str, int] = dict(hosts or {})
        self._gpus: Dict[str, Tuple[str, ...]] = {}  # host -> the GPU of each slot (gpus=)
        self._ends: Dict[str, float] = {}  # host -> its announced end (ends=), unix seconds
        self._cooldown: Dict[Tuple[str, int], float] = {}
        self._fenced: Set[Tuple[str, int]] = set()  # slots whose worker was fenced, not seen exit
        self._failures: Dict[str, List[float]] = {}
        self._blacklist: Dict[str, float] = {}
        self._blacklist_count: Dict[str, int] = {}  # blacklistings per host (Horovod's rule)
        self._drained: Set[str] = set()

    # ---- the host set -------------------------------------------------------------------------

    @property
    def hosts(self) -> Dict[str, int]:
        """A copy of the last host set, ``{host: slots}`` in discovery order."""
        with self._lock:
            return dict(self._hosts)

    def set_hosts(self, hosts: Dict[str, int],
                  gpus: Optional[Dict[str, Tuple[str, ...]]] = None,
                  ends: Optional[Dict[str, float]] = None) -> bool:
        """Take discovery's new host set, the GPUs its lines name (``host -> the GPU of each
        slot``, hosts without ``gpus=`` left out) and the ends they announce (``host -> unix
        time``: such a host takes no new worker and its workers leave, as a drained one; a
        host already announced keeps the earliest end it was given, since a script that cannot
        read the end from its notice prints "seen now + the notice period" on every call);
        True when any differs from the last."""
        gpus = {h: tuple(g) for h, g in (gpus or {}).items() if h in hosts}
        ends = {h: float(t) for h, t in (ends or {}).items() if h in hosts}
        with self._lock:
            ends = {h: min(t, self._ends.get(h, t)) for h, t in ends.items()}
            if hosts == self._hosts and gpus == self._gpus and ends == self._ends:
                return False
            self._hosts = dict(hosts)
            self._gpus = gpus
            self._ends = ends
            return True

    def ends_of(self, host: str) -> Optional[float]:
        """The end (unix seconds) discovery announces for ``host``, or None."""
        with self._lock:
            return self._ends.get(host)

    def gpus_of(self, host: str) -> Optional[Tuple[str, ...]]:
        """The GPUs discovery names for ``host``'s slots (slot i: the i-th), or None."""
        with self._lock:
            return self._gpus.get(host)

    def keeps(self, host: str, slot: int, gpu: Optional[str]) -> bool:
        """Whether a running worker on ``host``:``slot`` that started on ``gpu`` may stay: its
        slot is still listed, its host not drained, and where the host's line names GPUs, the
        slot's GPU is still the one it started on (a line that moved the slot to another GPU
        sends the worker away, as a slot taken away does)."""
        with self._lock:
            if host in self._drained or host in self._ends or slot >= self._hosts.get(host, 0):
                return False
            listed = self._gpus.get(host)
            return gpu is None or listed is None or listed[slot] == gpu

    def slots_of(self, host: str) -> Optional[int]:
        """Slots discovery offers on ``host`` now (None: not listed)."""
        with self._lock:
            return self._hosts.get(host)

    # ---- drains -------------------------------------------------------------------------------

    def drained(self) -> Set[str]:
        with self._lock:
            return set(self._drained)

    def set_drained(self, host: str, drained: bool) -> bool:
        """Drain ``host`` (or make it usable again); True when that changed anything."""
        with self._lock:
            before = host in self._drained
            (self._drained.add if drained else self._drained.discard)(host)
            return before != drained

    # ---- failures, cooldowns, blacklist ---------------------------------------------------------

    def rest(self, host: str, slot: int, until: float) -> None:
        """``host``:``slot`` takes no worker before monotonic time ``until``."""
        with self._lock:
            self._cooldown[(host, slot)] = until

    def record_failure(self, host: str, slot: int, now: float,
                       cooldown_range: Optional[Tuple[float, float]]) -> Rest:
        """A worker on ``host``:``slot`` failed at ``now``: rest the slot (``cooldown_range``
        None: for the rest of the job; else a uniform draw from it, doubled per recent failure
        of the host, never past its maximum, as Horovod's ``--blacklist-cooldown-range``), and
        blacklist the host after ``HOST_FAILURES_TO_BLACKLIST`` failures within
        ``HOST_FAILURE_WINDOW_S`` seconds."""
        with self._lock:
            fails = [t for t in self._failures.get(host, []) if now - t < HOST_FAILURE_WINDOW_S]
            fails.append(now)
            self._failures[host] = fails
            if cooldown_range is None:
                cooldown = float("inf")
            else:
                lo, hi = cooldown_range
                cooldown = min(random.uniform(lo, hi) * 2 ** (len(fails) - 1), hi)
            self._cooldown[(host, slot)] = now + cooldown
            blacklisted = len(fails) >= HOST_FAILURES_TO_BLACKLIST
            if blacklisted:
                self._blacklist[host] = now + cooldown
            return Rest(cooldown, len(fails), blacklisted)

    def blacklist_host(self, host: str, now: float,
                       cooldown_range: Optional[Tuple[float, float]]) -> Rest:
        """Horovod's rule (``--failure-blacklist host``): a worker on ``host`` failed at ``now``,
        so the whole host is blacklisted; without ``cooldown_range`` for the rest of the job,
        else as Horovod's ``HostState`` (``horovod/runner/elastic/discovery.py``): the n-th
        blacklisting lasts ``MIN_S * 2**n + U(0, 1) * MIN_S`` seconds, clamped to [MIN_S,
        MAX_S]; a failure while the host is still out changes nothing (n counts blacklistings,
        not failures).  ``Rest.failures`` is n."""
        with self._lock:
            until = self._blacklist.get(host, 0.0)
            count = self._blacklist_count.get(host, 0)
            if until > now:  # still out: Horovod neither counts nor extends it
                return Rest(until - now, count, True)
            count += 1
            self._blacklist_count[host] = count
            if cooldown_range is None:
                cooldown = float("inf")
            else:
                lo, hi = cooldown_range
                cooldown = max(lo, min(hi, lo * 2 ** count + random.uniform(0, 1) * lo))
            self._blacklist[host] = now + cooldown
            return Rest(cooldown, count, True)

    def blacklisted(self, host: str, now: float) -> bool:
        with self._lock:
            return self._blacklist.get(host, 0.0) > now

    def blacklisted_hosts(self, now: float) -> List[str]:
        with self._lock:
            return sorted(h for h, t in self._blacklist.items() if t > now)

    def note_fenced(self, host: str, slot: int) -> None:
        """The worker on ``host``:``slot`` was fenced (declared dead without an exit seen: its
        host frozen, gone or cut off), so its process may still live and hold the slot's GPU:
        :meth:`resting_for_good` never offers that slot (nor its host) back."""
        with self._lock:
            self._fenced.add((host, slot))

    def resting_for_good(self) -> Dict[str, List[int]]:
        """host -> its listed slots that rest for the rest of the job after a worker's exit
        (a failure, no cooldown range given; or the host blacklisted for good), sorted: what the
        cluster service gives back to its pool (``/ctl/telemetry``'s ``resting``).  A fenced
        worker's slot is left out, and so is every slot of its host (:meth:`note_fenced`)."""
        inf = float("inf")
        with self._lock:
            out: Dict[str, List[int]] = {}
            for host, n in self._hosts.items():
                if any(h == host for h, _ in self._fenced):
                    continue
                if self._blacklist.get(host, 0.0) == inf:
                    out[host] = list(range(n))
                    continue
                slots = [s for s in range(n) if self._cooldown.get((host, s), 0.0) == inf]
                if slots:
                    out[host] = slots
            return out

    def change_pending(self, now: float) -> bool:
        """Whether a cooldown or a blacklisting ends after ``now`` (at a finite time): a slot
        becomes usable with time alone, so the driver must look again."""
        with self._lock:
            ends = list(self._cooldown.values()) + list(self._blacklist.values())
        return any(now < t < float("inf") for t in ends)

    # ---- the questions --------------------------------------------------------------------------

    def _host_usable(self, host: str, now: float, drained: Set[str]) -> bool:
        return self._blacklist.get(host, 0.0) <= now and host not in drained \
            and host not in self._ends

    def usable(self, now: float, budget: Optional[int] = None,
               drained: Optional[Iterable[str]] = None) -> Dict[str, List[int]]:
        """Slots per host that may run a worker now (blacklist, drains -- ``drained``, by
        default the current set -- and cooldowns applied), capped to ``budget`` slots in all
        (None: no cap) in discovery order."""
        with self._lock:
            drained = set(self._drained if drained is None else drained)
            left = float("inf") if budget is None else max(budget, 0)
            out: Dict[str, List[int]] = {}
            for host, slots in self._hosts.items():
                if not self._host_usable(host, now, drained):
                    continue
                free = [s for s in range(slots) if self._cooldown.get((host, s), 0.0) <= now]
                take = free if left == float("inf") else free[:int(left)]
                out[host] = take
                left -= len(take)
            return out

    def capacity(self, now: float, budget: Optional[int] = None,
                 drained: Optional[Iterable[str]] = None) -> int:
        """How many slots :meth:`usable` gives."""
        return sum(len(v) for v in self.usable(now, budget, drained).values())

    def free_slots(self, host: str, now: float, taken: Iterable[Tuple[str, int]]) -> List[int]:
        """``host``'s slots that may take a new worker now: listed by discovery, the host
        neither drained nor blacklisted, the slot not resting nor in ``taken`` (the
        ``(host, slot)`` of live workers)."""
        taken = set(taken)
        with self._lock:
            if host not in self._hosts or not self._host_usable(host, now, self._drained):
                return []
            return [s for s in range(self._hosts[host])
                    if self._cooldown.get((host, s), 0.0) <= now and (host, s) not in taken]

    def allowed(self) -> Set[Tuple[str, int]]:
        """The ``(host, slot)`` pairs a running worker may keep: listed by discovery, the host
        not drained (a resting slot or a blacklisted host does not evict a live worker)."""
        with self._lock:
            return {(h, s) for h, n in self._hosts.items()
                    if h not in self._drained and h not in self._ends for s in range(n)}
