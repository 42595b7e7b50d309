"""Profiling through elasticity (EDL, Wu et al., arXiv 1909.11985, section "performance
profiling"): the running job walks through several world sizes stop-free, its steady
throughput is measured at each, and it returns to the size it had.

``hvd-edl-ctl profile --sizes 1,2,4 [--seconds S] [--out DIR]`` starts one through the control
API (``/ctl/profile``); it runs in a thread of the launcher:

1. every size is checked first (within [--min-np, --max-np] and the usable slots discovery
   offers now); a bad one refuses the profile before anything changes;
2. per size: the target world size is set (``Driver.set_target``: a normal stop-free
   scale-out or graceful scale-in, nothing rolled back, exactly-once data), then it waits until
   a generation of that size formed and its switch is over (every continuing member trains
   again; leavers still exiting are not waited for), then
   ``settle_s`` more seconds (default 2 s, at least ``Telemetry.WINDOW_S - seconds`` so that the
   per-worker means cover only the new size), then measures for ``seconds``: the job's samples/s
   (``Telemetry.throughput``) and the members' mean step, compute and wait seconds per step;
3. it sets the target it found back and waits until the job is back at its size;
4. it writes ``profile.json`` (the points, the fitted :class:`launcher.apps.speed_model.SpeedModel`
   and its leave-one-size-out error) and ``profile.png`` (throughput and scaling efficiency
   against world size) into the output folder (created if missing), and notes ``profile`` in
   the event log.  An earlier profile there is never overwritten: the next free name is taken
   (``profile-2.json`` / ``profile-2.png``, ...) and the note and ``hvd-edl-ctl profile`` say
   which.

A generation that forms during a measurement without being asked for (a failure, discovery
taking a host away) aborts the profile: it says so (status, event log) and returns to the size.
One profile at a time.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence

if TYPE_CHECKING:  # the speed model needs scikit-learn: imported when a profile ends, not at
    from launcher.apps.speed_model import SpeedModel  # every launcher start (--help: 1.4 -> 0.3 s)

log = logging.getLogger(__name__)

SETTLE_S = 2.0            # seconds of training at a new size before measuring
SECONDS = 10.0            # default measurement per size (seconds)
POLL_S = 0.1              # how often a wait re-checks the job (seconds)
SIZE_TIMEOUT_S = 180.0    # most seconds a size may take to form (a joiner's start-up)
DEFAULT_WINDOW_S = 5.0    # the telemetry's per-worker window when it has none to tell


class ProfileAborted(RuntimeError):
    """The job changed under the profile (a failure, a host gone) or a size never formed."""


class Profiler:
    """One profile at a time of the job run by ``driver`` (a :class:`launcher.job.driver.Driver`).

    :meth:`start` validates and starts a profile in a thread; :meth:`status` reports it;
    :attr:`model` is the speed model of the last completed profile (None before one)."""

    def __init__(self, driver):
        self.driver = driver
        self._lock = threading.Lock()
        self._state: dict = {"state": "idle"}
        self._thread: Optional[threading.Thread] = None
        self.model: Optional[SpeedModel] = None
        self.points: List[dict] = []

    # ---- control API ---------------------------------------------------------------------------

    def start(self, sizes: Sequence[int], seconds: float = SECONDS, out_dir: str = ".",
              settle_s: float = SETTLE_S) -> dict:
        """Start a profile over ``sizes`` (workers), ``seconds`` of measurement each, results
        in ``out_dir``.  Returns ``{"state": "running", "sizes", "seconds", "out"}``.

        Raises:
            ValueError: a static job; a profile already running; sizes empty, not integers,
                outside [--min-np, --max-np] or above the usable slots; seconds not in
                (0, 600]; ``out_dir`` cannot be created or written; no ring formed yet.
                Nothing changes then (but a missing ``out_dir`` is created)."""
        d = self.driver
        if not d.spec.elastic:
            raise ValueError("a static job cannot change its world size; start it with "
                             "--min-np/--max-np to profile it")
        if not sizes or any(isinstance(n, bool) or not isinstance(n, int) for n in sizes):
            raise ValueError(f"sizes must be a non-empty list of integers, got {sizes!r}")
        if not (isinstance(seconds, (int, float)) and 0 < seconds <= 600):
            raise ValueError(f"seconds must be in (0, 600], got {seconds!r}")
        if not (isinstance(settle_s, (int, float)) and 0 <= settle_s <= 600):
            raise ValueError(f"settle must be in [0, 600] seconds, got {settle_s!r}")
        lo, hi = d.spec.min_np, d.spec.max_np
        bad = [n for n in sizes if not lo <= n <= hi]
        if bad:
            raise ValueError(f"size {bad[0]} is outside [--min-np {lo}, --max-np {hi}]; no "
                             f"profile started, the job is unchanged")
        slots = d.usable_slot_count(hi)
        if max(sizes) > slots:
            raise ValueError(f"size {max(sizes)} needs {max(sizes)} slots, discovery offers "
                             f"{slots} usable now; no profile started, the job is unchanged")
        out = output_folder(out_dir)
        with self._lock:
            if self._state["state"] == "running":
                raise ValueError("a profile is already running (hvd-edl-ctl profile --status)")
            world = d.ring().world_size
            if world == 0:
                raise ValueError("the job has no ring yet: profile it once it trains")
            self._state = {"state": "running", "sizes": list(sizes), "seconds": seconds,
                           "out": str(out.resolve()), "points": [], "size": None,
                           "return_to": world, "started": time.time(), "error": None}
            self._thread = threading.Thread(
                target=self._run, args=(list(sizes), float(seconds), out, float(settle_s)),
                name="profile", daemon=True)
            self._thread.start()
            return {k: self._state[k] for k in ("state", "sizes", "seconds", "out")}

    def status(self) -> dict:
        """``{"state": "idle" | "running" | "done" | "aborted", "sizes", "size" (the one being
        measured), "points", "error", "json", "png", "mape", ...}`` of the last profile."""
        with self._lock:
            return json.loads(json.dumps(self._state, default=str))

    # ---- the walk ------------------------------------------------------------------------------

    def _set(self, **fields) -> None:
        with self._lock:
            self._state.update(fields)

    def _run(self, sizes: List[int], seconds: float, out: Path, settle_s: float) -> None:
        d = self.driver
        previous_target = d.target_np
        return_to = self._state["return_to"]
        points: List[dict] = []
        error = None
        window_s = getattr(d.telemetry, "WINDOW_S", DEFAULT_WINDOW_S)
        settle_s = max(settle_s, window_s - seconds)
        d.note("profile", f"profiling at sizes {', '.join(map(str, sizes))}, {seconds:g} s "
                      f"each (then back to {return_to} workers)", phase="start", sizes=sizes,
                      seconds=seconds)
        try:
            for n in sizes:
                self._set(size=n)
                generation = self._reach(n)
                self._pause(settle_s, generation, n)
                point = self._measure(n, seconds, generation)
                points.append(point)
                self._set(points=list(points))
        except ProfileAborted as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - a profile's bug must not end the job
            log.exception("profile failed")
            error = f"profile failed: {e!r}"
        finally:
            d.restore_target(previous_target)
        self._set(size=None, state="returning")
        try:
            self._reach(return_to if previous_target is None else previous_target,
                        timeout_s=SIZE_TIMEOUT_S, set_target=False)
        except ProfileAborted as e:
            error = error or f"did not return to {return_to} workers: {e}"
        result = self._finish(points, out, sizes, seconds, error)
        self._set(**result)

    def _reach(self, n: int, timeout_s: float = SIZE_TIMEOUT_S, set_target: bool = True) -> int:
        """Set the target to ``n`` (unless ``set_target`` is False: it is already set) and wait until
        a generation of ``n`` workers formed and its switch is over; returns its number.

        Raises:
            ProfileAborted: the job failed or is ending, or ``n`` workers did not form within
                ``timeout_s`` seconds."""
        d = self.driver
        if set_target:
            d.set_target(n)
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_job()
            # formed, its switch over, no member at a boundary; leavers still exiting do not
            # train and are not waited for
            ring = d.ring()
            size = ring.world_size
            if size == n and ring.switch_over:
                return ring.generation
            if time.monotonic() > deadline:
                raise ProfileAborted(f"no generation of {n} workers formed within "
                                     f"{timeout_s:g} s (world size {size})")
            time.sleep(POLL_S)

    def _check_job(self) -> None:
        ring = self.driver.ring()
        if ring.job_over:
            raise ProfileAborted("the job is ending" if not ring.failure else
                                 f"the job failed: {ring.failure}")

    def _pause(self, seconds: float, generation: int, n: int) -> None:
        """Train ``seconds`` at ``generation``; raises ProfileAborted if another one forms."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._check_generation(generation, n)
            time.sleep(min(POLL_S, max(deadline - time.monotonic(), 0.0)))
        self._check_generation(generation, n)

    def _check_generation(self, generation: int, n: int) -> None:
        self._check_job()
        ring = self.driver.ring()
        number, kind = (ring.generation, ring.kind or "?")
        if number != generation:
            raise ProfileAborted(f"generation {number} ({kind}) formed while measuring {n} "
                                 f"workers: profile aborted")

    def _measure(self, n: int, seconds: float, generation: int) -> dict:
        """Steady throughput and per-step times at ``n`` workers over ``seconds``."""
        d = self.driver
        telemetry = d.telemetry
        t0 = time.monotonic()
        start = self._progress()
        self._pause(seconds, generation, n)
        t1 = time.monotonic()
        end = self._progress()
        point = {"world_size": n, "generation": generation, "seconds": round(t1 - t0, 3),
                 "samples_per_s": None, "step_s": None, "compute_s": None, "wait_s": None,
                 "steps_per_s": None, "samples_per_step": None, "source": "telemetry"}
        if telemetry is not None:
            try:
                point["samples_per_s"] = float(telemetry.throughput(t0, t1))
            except ValueError:
                pass
            members = [w for w in telemetry.workers() if getattr(w, "rank", -1) >= 0]
            for key in ("step_s", "compute_s", "wait_s", "steps_per_s"):
                vals = [getattr(w, key) for w in members
                        if isinstance(getattr(w, key, None), float)
                        and not math.isnan(getattr(w, key))]
                if vals:
                    point[key] = sum(vals) / len(vals)
        if point["samples_per_s"] is None and start and end and end[0] > start[0]:
            # fallback: rank 0's commits (samples of every rank, as of its last commit)
            point["source"] = "progress"
            span = end[0] - start[0]
            point["samples_per_s"] = (end[2] - start[2]) / span
            if end[1] > start[1]:
                point["step_s"] = span / (end[1] - start[1])
        if point["samples_per_s"] is None:
            raise ProfileAborted(f"no samples reported at {n} workers in {seconds:g} s")
        if point["step_s"]:
            point["samples_per_step"] = point["samples_per_s"] * point["step_s"] / n
        return point

    def _progress(self):
        """(monotonic time, step, samples) of rank 0's last report, None when unknown."""
        p = self.driver.rank0_progress(fresh_wait_s=0.5)
        if p is None or p.samples < 0:
            return None
        return (p.at, p.step, p.samples)

    # ---- results -------------------------------------------------------------------------------

    def _finish(self, points: List[dict], out: Path, sizes: List[int], seconds: float,
                error: Optional[str]) -> dict:
        """Efficiencies, the model, profile.json / profile.png and the event-log note."""
        d = self.driver
        if points:
            base = min(points, key=lambda p: p["world_size"])
            per_worker = base["samples_per_s"] / base["world_size"]
            for p in points:
                p["efficiency"] = p["samples_per_s"] / (p["world_size"] * per_worker)
        from launcher.apps.speed_model import ProfilePoint, SpeedModel, loso_mape
        model_info, mape = None, {}
        model = None
        pps = [ProfilePoint.from_dict(p) for p in points]
        if len({p.world_size for p in pps}) >= 2:
            try:
                model = SpeedModel().fit(pps)
                mape = {str(k): round(v, 2) for k, v in loso_mape(pps).items()}
                model_info = {**model.describe(), "loso_mape_percent": mape,
                              "predicted_samples_per_s": {
                                  str(k): round(model.samples_per_s(k), 3)
                                  for k in range(1, min(d.spec.max_np, 2 * max(sizes)) + 1)}}
            except ValueError as e:
                model_info = {"error": str(e)}
        if model is not None and error is None:
            self.model = model
            self.points = points
        doc = {"sizes": sizes, "seconds": seconds, "points": points, "model": model_info,
               "aborted": error, "returned_to": self._state["return_to"],
               "time": time.time(), "command": list(d.spec.command)}
        files = {}
        try:
            json_path, png_path = free_names(out)
            with open(json_path, "x") as f:  # never over an earlier profile
                f.write(json.dumps(doc, indent=2))
            files["json"] = str(json_path)
            if points:
                script = next((Path(c).name for c in d.spec.command if c.endswith(".py")),
                              Path(d.spec.command[0]).name)
                plot(points, model, png_path, title=f"{script}: profile through elasticity")
                files["png"] = str(png_path)
        except (OSError, ValueError) as e:
            error = error or f"cannot write the results to {out}: {e}"
        table = ", ".join(f"{p['world_size']}: {p['samples_per_s']:.1f} samples/s "
                          f"({p['efficiency']:.2f})" for p in points)
        if error:
            d.note("profile", f"ABORTED: {error}; back to {self._state['return_to']} "
                          f"workers" + (f" (measured {table})" if points else ""),
                          phase="aborted", points=points, error=error)
        else:
            d.note("profile", f"{table}" + (f"; model LOSO MAPE {mape} %" if mape else ""),
                          phase="done", points=points, mape=mape, **files)
        return {"state": "aborted" if error else "done", "error": error, "points": points,
                "mape": mape, "model": model_info, **files}


def output_folder(out_dir: str) -> Path:
    """``out_dir`` as a folder the launcher can write, created (with its parents) if missing.

    Raises:
        ValueError: it cannot be created, is not a folder or cannot be written (one line)."""
    import os
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the output folder {out_dir}: {e.strerror or e}") \
            from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write into the output folder {out_dir}")
    return out


def free_names(out: Path) -> tuple:
    """``(json path, png path)``: ``profile.json`` / ``profile.png`` in ``out``, else the first
    ``profile-N`` (N = 2, 3, ...) for which neither exists (an earlier profile is never
    overwritten)."""
    n = 1
    while True:
        stem = "profile" if n == 1 else f"profile-{n}"
        j, p = out / f"{stem}.json", out / f"{stem}.png"
        if not j.exists() and not p.exists():
            return j, p
        n += 1


def plot(points: Sequence[dict], model: Optional[SpeedModel], path: Path, title: str = "") -> None:
    """``profile.png``: measured throughput (and the model's line) and scaling efficiency
    against world size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [p["world_size"] for p in points]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    a.plot(ns, [p["samples_per_s"] for p in points], "o", color="C0", label="measured")
    if model is not None:
        grid = list(range(1, max(ns) + 2))
        a.plot(grid, [model.samples_per_s(n) for n in grid], "-", color="C1", alpha=0.7,
               label="speed model")
        b.plot(grid, [model.efficiency(n) for n in grid], "-", color="C1", alpha=0.7,
               label="speed model")
    a.set_xlabel("world size (workers)")
    a.set_ylabel("samples/s")
    a.legend()
    b.plot(ns, [p["efficiency"] for p in points], "o", color="C0", label="measured")
    b.axhline(1.0, color="grey", lw=0.5)
    b.set_xlabel("world size (workers)")
    b.set_ylabel("scaling efficiency")
    b.set_ylim(0, 1.2)
    b.legend()
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
