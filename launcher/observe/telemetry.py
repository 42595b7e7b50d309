"""The job's telemetry, fed by the workers' heartbeats: per-worker step, compute and wait times,
steps/s and samples/s over a sliding window, the job's throughput, the stalls of its
generation changes and counters of the decisions taken about it.

Each beat (``messages.Beat``, every ``BEAT_S``) carries the sums since the worker's previous beat
(timed steps, compute and wait seconds, samples; see ``hvd_edl/step_timer.py``).  The coordinator
owns one :class:`Telemetry` (``coord.telemetry``) and feeds it from ``Coordinator.beat``; the
metrics endpoint (``launcher/observe/metrics.py``), ``hvd-edl-ctl status`` / ``top``, the straggler
detector and the profiler read it.  This is EDL's idea (Wu et al., arXiv 1909.11985) that the
leader learns what it needs from what members send anyway, and the measurements CM-DARE's speed
models are fitted on (Li, Walls and Guo, arXiv 2004.03072).

Times are ``time.monotonic()`` seconds of the launcher (a beat is dated when it arrives).
"""
from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Deque, Dict, List, Optional, Sequence, Tuple

COUNTER_KINDS = ("failure", "eviction", "straggler", "migration", "autoscale")
MAX_STALLS = 10000  # generation changes remembered for the stalls histogram


@dataclass
class WorkerStats:
    """One worker's figures over the last ``Telemetry.window_s`` seconds.

    ``rank`` is -1 when the worker is not a member of the current generation.  ``step_s``,
    ``compute_s``, ``wait_s``: mean seconds per step (total, computing, blocked in collectives;
    nan until a timed step was reported; when the window holds no step, the last window that
    did).  ``steps_per_s``, ``samples_per_s``: rates over the window.  ``steps``: timed
    optimizer steps reported in all.  ``updated_at``: ``time.monotonic()`` of the last beat that
    carried steps (nan before any).  ``step``: the worker's optimizer step count (committed
    and restored with its state) as of its last beat (-1 unknown).  ``gpu``: the GPU its host
    line gave its slot (``gpus=``; None: none named).
    """
    worker_id: str
    host: str
    slot: int
    rank: int
    step_s: float = math.nan
    compute_s: float = math.nan
    wait_s: float = math.nan
    steps_per_s: float = 0.0
    samples_per_s: float = 0.0
    steps: int = 0
    updated_at: float = math.nan
    step: int = -1
    gpu: Optional[str] = None

    def as_dict(self) -> dict:
        """JSON-ready (nan as None)."""
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in asdict(self).items()}


@dataclass
class _Beat:
    at: float
    steps: int
    compute_s: float
    wait_s: float
    samples: int


@dataclass
class _Worker:
    worker_id: str
    host: str
    slot: int
    order: int
    beats: Deque[_Beat] = field(default_factory=deque)  # the window, plus one beat before it
    steps: int = 0
    updated_at: float = math.nan
    means: Tuple[float, float, float] = (math.nan, math.nan, math.nan)  # last known
    step: int = -1
    gpu: Optional[str] = None


class Telemetry:
    """Sliding-window figures of every worker, and the job's.

    Args:
        window_s: seconds of the per-worker means and rates (default :attr:`WINDOW_S`).
        history_s: seconds of samples kept for :meth:`throughput`.

    Thread-safe (one lock, held for microseconds; never while calling out).
    """

    WINDOW_S = 5.0
    HISTORY_S = 900.0

    def __init__(self, window_s: float = WINDOW_S, history_s: float = HISTORY_S):
        self.window_s = float(window_s)
        self.history_s = float(history_s)
        self._lock = threading.Lock()
        self._workers: Dict[str, _Worker] = {}
        self._order = 0
        self._members: List[str] = []
        self._rank_of: Dict[str, int] = {}  # member -> rank: a list's index() per worker made
                                            # workers() O(N^2) (1,024 workers: control_plane.py)
        self._generation = 0
        self._samples: Deque[Tuple[float, int]] = deque()  # (arrival, samples) of beats
        self._counters: Dict[str, int] = {k: 0 for k in COUNTER_KINDS}
        self._stalls: Deque[Tuple[int, str, float]] = deque(maxlen=MAX_STALLS)
        self._noise: Dict[str, float] = {}  # the latest gradient noise a member reported
        self._batch: Dict[str, float] = {}   # the latest adaptive batch a member reported

    # ---- feeding -------------------------------------------------------------------------------

    def add_worker(self, worker_id: str, host: str, slot: int,
                   gpu: Optional[str] = None) -> None:
        """A worker was spawned on ``host`` in ``slot``, on ``gpu`` where its host line names
        one (its figures start empty)."""
        with self._lock:
            self._worker(worker_id, host, slot).gpu = gpu

    def forget(self, worker_id: str) -> None:
        """The worker's process ended: drop its row (its samples stay in the job's history)."""
        with self._lock:
            self._workers.pop(worker_id, None)

    def on_members(self, generation: int, members: Sequence[str]) -> None:
        """Generation ``generation`` formed with ``members`` (rank = position)."""
        with self._lock:
            self._generation = int(generation)
            self._members = list(members)
            self._rank_of = {m: i for i, m in enumerate(self._members)}

    def on_generation(self, event) -> None:
        """A generation change was logged (a ``launcher.observe.events.GenerationEvent``): its
        ``stall_s`` goes to the stalls histogram ("start" events have none)."""
        if event.kind == "start":
            return
        with self._lock:
            self._stalls.append((int(event.generation), str(event.kind), float(event.stall_s)))

    def note_statistics(self, worker_id: str, noise: Dict[str, float],
                        batch: Dict[str, float]) -> None:
        """A heartbeat's gradient noise estimate (``messages.Beat.noise``) and adaptive batch
        (``Beat.batch``): the latest of a member of the current generation is kept (every member
        holds the same figures: the estimator's inputs are allreduced)."""
        if not noise and not batch:
            return
        with self._lock:
            if self._members and worker_id not in self._rank_of:
                return
            if noise and noise.get("step", 0) >= self._noise.get("step", -1):
                self._noise = dict(noise)
            if batch:
                self._batch = dict(batch)

    def gradient_noise(self) -> Optional[dict]:
        """``{"sqr", "var", "noise_scale_samples", "batch", "step", "measured_steps", "period"}`` (see
        ``hvd_edl.gradient_noise.NoiseEstimate``: ``step`` the job's optimizer step of the last
        measured step; ``noise_scale_samples`` None while unknown, i.e. ``sqr`` <= 0), None
        before any member measured a step."""
        with self._lock:
            n = dict(self._noise)
        if not n:
            return None
        ns = n.get("noise_scale_samples", -1.0)
        return {"sqr": n.get("sqr"), "var": n.get("var"),
                "noise_scale_samples": None if ns is None or ns < 0 else ns,
                "batch": int(n.get("batch", 0)), "step": int(n.get("step", 0)),
                "measured_steps": int(n.get("measured_steps", 0)),
                "period": int(n.get("period", 1))}

    def adaptive_batch(self) -> Optional[dict]:
        """The script's adaptive batch (``hvd_edl.adaptive_batch.BatchPlan.as_dict`` with its
        bounds, as ints), None when no member reported one (the script did not opt in, or has
        not reset its sampler yet)."""
        with self._lock:
            b = dict(self._batch)
        return {k: int(v) for k, v in b.items()} if b else None

    def observe(self, worker_id: str, generation: int, now: float, steps_done: int,
                compute_s: float, wait_s: float, samples: int, step: int = -1) -> None:
        """One heartbeat of ``worker_id`` arrived at ``now`` (monotonic seconds) with the sums
        since its previous one: ``steps_done`` timed steps of ``compute_s`` + ``wait_s``
        seconds, ``samples`` samples; ``step`` its optimizer step count.  Negative or
        non-finite figures are taken as 0."""
        steps_done = max(int(steps_done), 0)
        compute_s = _clean(compute_s)
        wait_s = _clean(wait_s)
        samples = max(int(samples), 0)
        with self._lock:
            w = self._worker(worker_id)
            w.beats.append(_Beat(now, steps_done, compute_s, wait_s, samples))
            w.step = int(step)
            while len(w.beats) > 2 and w.beats[1].at <= now - self.window_s:
                w.beats.popleft()
            if steps_done:
                w.steps += steps_done
                w.updated_at = now
            if samples:
                self._samples.append((now, samples))
            while self._samples and self._samples[0][0] < now - self.history_s:
                self._samples.popleft()

    def count(self, kind: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``kind`` ("failure", "eviction", "straggler", "migration",
        "autoscale"; other kinds are counted too).

        Raises:
            ValueError: ``kind`` is empty or ``n`` negative."""
        if not kind or n < 0:
            raise ValueError(f"count({kind!r}, {n}): need a kind and n >= 0")
        with self._lock:
            self._counters[kind] = self._counters.get(kind, 0) + int(n)

    # ---- reading -------------------------------------------------------------------------------

    def counters(self) -> Dict[str, int]:
        """{kind: count} (the five kinds of ``COUNTER_KINDS`` always present)."""
        with self._lock:
            return dict(self._counters)

    def stalls(self) -> List[Tuple[int, str, float]]:
        """(generation, kind, stall_s) of every generation change since the start."""
        with self._lock:
            return list(self._stalls)

    def worker(self, worker_id: str) -> Optional[WorkerStats]:
        """The figures of ``worker_id``, or None when unknown (or its process ended)."""
        with self._lock:
            w = self._workers.get(worker_id)
            return None if w is None else self._stats(w)

    def workers(self) -> List[WorkerStats]:
        """Every known worker: the current generation's members first, by rank, then the
        others in spawn order."""
        with self._lock:
            members = [self._workers[m] for m in self._members if m in self._workers]
            rest = sorted((w for w in self._workers.values() if w.worker_id not in
                           self._rank_of), key=lambda w: w.order)
            return [self._stats(w) for w in members + rest]

    def job(self) -> dict:
        """The job's figures: ``world_size`` and ``generation`` (the current generation),
        ``steps_per_s`` (mean over the members: each takes every step), ``samples_per_s``
        (sum over the workers), ``step_s`` / ``compute_s`` / ``wait_s`` (means over the
        members that reported; None unknown), ``steps`` (most timed steps a member reported),
        ``step`` (the highest optimizer step count a member beat with; -1 unknown),
        ``changes`` (generation changes so far) and ``last_stall_s`` (None before any)."""
        rows = self.workers()
        with self._lock:
            members = set(self._members)
            generation, size = self._generation, len(self._members)
            last = self._stalls[-1][2] if self._stalls else None
            changes = len(self._stalls)
        in_ring = [r for r in rows if r.worker_id in members]

        def mean(key: str) -> Optional[float]:
            vals = [getattr(r, key) for r in in_ring if not math.isnan(getattr(r, key))]
            return sum(vals) / len(vals) if vals else None

        return {"world_size": size, "generation": generation,
                "steps_per_s": (sum(r.steps_per_s for r in in_ring) / len(in_ring)
                                if in_ring else 0.0),
                "samples_per_s": sum(r.samples_per_s for r in rows),
                "step_s": mean("step_s"), "compute_s": mean("compute_s"),
                "wait_s": mean("wait_s"),
                "steps": max((r.steps for r in in_ring), default=0),
                "step": max((r.step for r in in_ring), default=-1),
                "changes": changes, "last_stall_s": last}

    def throughput(self, since: float, until: float) -> float:
        """The job's samples/s between monotonic times ``since`` and ``until``: the samples of
        the beats that arrived in (since, until], over ``until - since`` (a beat carries up to
        ``BEAT_S`` of earlier work, so intervals of several seconds are accurate to a few
        percent).  Kept for :attr:`history_s` seconds.

        Raises:
            ValueError: ``until <= since``, or no samples were reported in that interval.
        """
        if not until > since:
            raise ValueError(f"throughput: empty interval ({since}, {until}]")
        with self._lock:
            total = sum(n for at, n in self._samples if since < at <= until)
        if total <= 0:
            raise ValueError(f"throughput: no samples reported between {since:.3f} and "
                             f"{until:.3f} (monotonic seconds)")
        return total / (until - since)

    # ---- internals (lock held) -----------------------------------------------------------------

    def _worker(self, worker_id: str, host: str = "", slot: int = -1) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            self._order += 1
            w = self._workers[worker_id] = _Worker(worker_id, host, slot, self._order)
        elif host:
            w.host, w.slot = host, slot
        return w

    def _stats(self, w: _Worker) -> WorkerStats:
        beats = list(w.beats)
        rank = self._rank_of.get(w.worker_id, -1)
        stats = WorkerStats(w.worker_id, w.host, w.slot, rank, steps=w.steps,
                            updated_at=w.updated_at, step=w.step, gpu=w.gpu)
        if len(beats) >= 2:
            base, window = beats[0], beats[1:]
            span = window[-1].at - base.at
            steps = sum(b.steps for b in window)
            if span > 0:
                stats.steps_per_s = steps / span
                stats.samples_per_s = sum(b.samples for b in window) / span
            if steps:
                compute = sum(b.compute_s for b in window)
                wait = sum(b.wait_s for b in window)
                w.means = ((compute + wait) / steps, compute / steps, wait / steps)
        elif beats and beats[0].steps:  # a single beat: means, no rate yet
            b = beats[0]
            w.means = ((b.compute_s + b.wait_s) / b.steps, b.compute_s / b.steps,
                       b.wait_s / b.steps)
        stats.step_s, stats.compute_s, stats.wait_s = w.means
        return stats


def _clean(x: float) -> float:
    x = float(x)
    return x if math.isfinite(x) and x > 0 else 0.0
