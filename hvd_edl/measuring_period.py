"""Which optimizer steps the gradient noise meter measures: every k-th, k chosen from the
meter's own measured cost so that it stays within a budget of the step time, and the same k on
every rank (ranks must issue the same collectives).

AdaptDL (``adaptdl/torch/gradient_noise_scale.py``) measures every step.  Measuring every k-th
step chosen by its *number* (never by its values) keeps the estimate unbiased; each measurement
then weighs as k steps in the exponential average (:meth:`hvd_edl.gradient_noise.NoiseScale.
update`'s ``period``), so the average's memory stays the same number of steps.

How every rank reaches the same k without a collective of its own: each measured step's scalar
allreduce (the meter sends it anyway) also carries the meter's seconds since the previous
measured step and the wall seconds between them; the allreduce averages them, so every rank
reads the same two figures.  Within a generation every rank measures the same steps and reads
every result, in order.  After ``window`` measured steps a decision is due ``lag`` steps after
the window's last one; by then the ranks have read those results (the meter waits for any still
in flight, a case that a loaded host may see but a result 8 steps old practically never is), and
each computes the same ``k = ceil(c / budget)`` from the same floats: ``c = k_old x share``
is the meter's share of a step were every step measured, ``share`` the window's meter seconds
over its wall seconds, and ``c`` the median over the last three windows (a host's load stretches
a whole window now and then); k changes only when the share at the current k is above the
budget or below half of it.  At every
generation start (and after any jump of the step count: a restore) the schedule starts again at
``first`` from the generation's first step, which every member of the ring shares; nothing of
an older ring's figures is used, so a joiner needs no history.

Numbers only (no torch, no Horovod): :mod:`hvd_edl.torch.gradient_noise` drives it.
"""
from __future__ import annotations

import math
import statistics
from typing import List, Optional, Tuple

DEFAULT_BUDGET = 0.005
"""The meter's target share of the step time: half of the 1 % floor (issue 41), as margin for a
cost measured on a loaded host."""
FIRST_PERIOD = 4
"""k at a generation's start, until the first decision (28 steps later)."""
MAX_PERIOD = 16
"""The largest k: at 16 the estimator's 100-step memory still holds ~6 measurements."""
WINDOW = 6
"""Measured steps per decision."""
HISTORY = 3
"""Windows whose cost figures a decision weighs (their median)."""
LAG = 8
"""Steps between a window's last measured step and the decision (its result is read by then)."""


class MeasuringPeriod:
    """The schedule (one per meter; see the module).

    Args:
        budget: the meter's target share of the wall time between steps (0.005: 0.5 %).
        fixed: a k that never changes (``HVD_EDL_GRADIENT_NOISE_EVERY``); None: chosen.
        first, max_period, window, lag: see the module constants.

    Attributes:
        period: k now (steps per measurement).
        anchor: the step from which ``period`` counts (measured: anchor, anchor + k, ...).
        decisions: ``(step, k)`` of every decision since the schedule started (for reports).

    Raises:
        ValueError: budget not in (0, 1), or a k below 1.
    """

    def __init__(self, budget: float = DEFAULT_BUDGET, fixed: Optional[int] = None,
                 first: int = FIRST_PERIOD, max_period: int = MAX_PERIOD, window: int = WINDOW,
                 lag: int = LAG):
        if not 0.0 < budget < 1.0:
            raise ValueError(f"budget must be in (0, 1), got {budget}")
        if (fixed is not None and fixed < 1) or first < 1 or max_period < 1:
            raise ValueError("measuring periods must be >= 1")
        self.budget = budget
        self.fixed = fixed
        self.first = first
        self.max_period = max_period
        self.window = window
        self.lag = lag
        self.period = fixed or first
        self.anchor = 0
        self.decisions: List[Tuple[int, int]] = []
        self._launched: List[int] = []  # measured steps sent since the last decision
        self._results: List[Tuple[int, float, float]] = []  # (step, cost_s, wall_s), agreed
        self._last: Optional[int] = None  # the closed window's last measured step
        self._due: Optional[int] = None  # the step at which its decision is taken
        self._costs: List[float] = []  # the last windows' meter share at k = 1

    def start(self, step: int) -> None:
        """A generation (or a restored count) starts at ``step``: the schedule starts again."""
        self.period = self.fixed or self.first
        self.anchor = int(step)
        self.decisions = []
        self._costs = []
        self._launched, self._results = [], []
        self._last = self._due = None

    def armed(self, step: int, pair: bool = False) -> bool:
        """Whether ``step`` is measured.  ``pair``: one gradient per step (one rank, one
        pass), so the step before each measured one is measured too (the two make a pair)."""
        d = int(step) - self.anchor
        if d < 0:
            return False
        k = self.period
        return d % k == 0 or (pair and k > 1 and d % k == k - 1)

    def launched(self, step: int) -> None:
        """Measured step ``step``'s figures were sent (on every rank, the same steps)."""
        self._launched.append(int(step))
        if self.fixed is None and self._due is None and len(self._launched) >= self.window:
            self._last = int(step)
            self._due = int(step) + self.lag

    def result(self, step: int, cost_s: float, wall_s: float) -> None:
        """The agreed figures sent with measured step ``step``: the meter's seconds since the
        previous measured step and the wall seconds between the two (0: no previous one)."""
        if wall_s > 0 and math.isfinite(cost_s) and math.isfinite(wall_s):
            self._results.append((int(step), float(cost_s), float(wall_s)))

    def due(self, step: int) -> Optional[int]:
        """When a decision is due at ``step``: the last measured step whose result it needs
        (the caller reads every result up to it first, then calls :meth:`decide`)."""
        return self._last if self._due is not None and int(step) >= self._due else None

    def decide(self, step: int) -> int:
        """Choose k from the closed window's figures; measuring restarts at ``step`` with it.
        Returns the new k."""
        last = self._last if self._last is not None else int(step)
        # intervals of exactly k steps: after the anchor (the one ending there may be shorter)
        used = [r for r in self._results if self.anchor < r[0] <= last]
        self._results = [r for r in self._results if r[0] > last]
        self._launched = [s for s in self._launched if s > last]
        self._last = self._due = None
        wall = sum(r[2] for r in used)
        if wall > 0:  # the window's share (a ratio of sums: a median would miss rare costly steps)
            share = sum(r[1] for r in used) / wall
            self._costs = (self._costs + [self.period * share])[-HISTORY:]
            per_step = statistics.median(self._costs)  # the meter's share if every step
            now = per_step / self.period
            if now > self.budget * (1 + 1e-9) or now < self.budget / 2:  # else k stays
                need = per_step / self.budget
                self.period = min(max(int(math.ceil(need - 1e-9)), 1), self.max_period)
        self.anchor = int(step)
        self.decisions.append((int(step), self.period))
        return self.period
