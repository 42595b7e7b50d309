"""``hvd-edl-ctl top``: a live view of a running job's telemetry, refreshed every few seconds.

One frame: the generation, world size (and the target), optimizer step, the job's steps/s and
samples/s, mean step / compute / wait milliseconds, the last stall, the decision counters, and
one table row per worker (rank, host:slot, state, step, step / compute / wait ms per step,
steps/s, samples/s).  The figures are the heartbeats' (``launcher.observe.telemetry``, ``/ctl/telemetry``),
which asks the workers nothing, so watching costs the training nothing.

On a terminal the frame is redrawn in place (``rich.live.Live``) until Ctrl-C or the job's end;
otherwise (a pipe, a file) one plain-text frame is printed per interval, so the output can be
logged or grepped.  Like ``top``, it exits 0 on Ctrl-C.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Optional


from launcher.serve.control import ControlClient, ControlError

COUNTER_LABELS = (("failure", "failures"), ("eviction", "evictions"),
                  ("straggler", "stragglers"), ("migration", "migrations"),
                  ("autoscale", "autoscale decisions"))


def _ms(x: Optional[float]) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{1000 * x:.1f}"


def _num(x: Optional[float], fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def job_lines(t: dict) -> list:
    """The frame's header: three lines of text from a ``/ctl/telemetry`` answer."""
    j = t["job"]
    step = f", step {j['step']}" if j.get("step", -1) >= 0 else ""
    stall = "none yet" if j.get("last_stall_s") is None else f"{j['last_stall_s']:.3f} s"
    counts = t.get("counters", {})
    return [
        f"generation {j['generation']}, world size {j['world_size']} (target "
        f"{j.get('target_world_size', '?')}){step}" + (", finishing" if j.get("finishing")
                                                        else ""),
        f"{j['steps_per_s']:.2f} steps/s, {j['samples_per_s']:.1f} samples/s; per step "
        f"{_ms(j.get('step_s'))} ms = compute {_ms(j.get('compute_s'))} + wait "
        f"{_ms(j.get('wait_s'))} ms (last {t.get('window_s', 5):g} s); last stall {stall}",
        ", ".join(f"{label} {counts.get(kind, 0)}" for kind, label in COUNTER_LABELS),
    ]


COLUMNS = ("worker", "rank", "host:slot", "state", "step", "step ms", "comp ms", "wait ms",
           "steps/s", "samples/s")
# dropped first when the frame is too narrow: derivable or rarely read ones (steps/s is
# samples/s over the batch; step ms = comp + wait; "member" is the usual state)
DROP_ORDER = ("steps/s", "step ms", "state", "step", "rank")
GAP = 2  # rich's column padding with box=None, pad_edge=False: one space each side


def _row(w: dict) -> tuple:
    return (w["worker_id"], str(w["rank"]) if w["rank"] >= 0 else "-",
            f"{w['host']}:{w['slot']}", w.get("state", "?"),
            str(w["step"]) if w.get("step", -1) >= 0 else "-",
            _ms(w["step_s"]), _ms(w["compute_s"]), _ms(w["wait_s"]),
            _num(w["steps_per_s"], "{:.2f}"), _num(w["samples_per_s"]))


def fitting_columns(rows: list, width: int) -> list:
    """Indexes into :data:`COLUMNS` of the columns shown in ``width`` characters: all of
    them when they fit whole (no cell cut, no header split), else without the least useful
    ones (:data:`DROP_ORDER`) until they do."""
    keep = list(range(len(COLUMNS)))
    widths = [max([len(COLUMNS[i])] + [len(r[i]) for r in rows]) for i in keep]
    drop = [COLUMNS.index(name) for name in DROP_ORDER]
    while sum(widths[i] for i in keep) + GAP * (len(keep) - 1) > width and drop:
        keep.remove(drop.pop(0))
    return keep


def _fit_line(line: str, width: int) -> list:
    """A header line longer than ``width`` broken at its "; " parts."""
    if len(line) <= width or "; " not in line:
        return [line]
    parts = line.split("; ")
    return [p + (";" if i < len(parts) - 1 else "") for i, p in enumerate(parts)]


def render(t: dict, width: int = 120):
    """One frame of a ``/ctl/telemetry`` answer, ``width`` characters wide: a
    ``rich.console.Group`` of the job's lines and the workers' table (columns that do not fit
    are left out, :func:`fitting_columns`; rich is imported here, for the view itself:
    ``hvd-edl-ctl status`` needs only :func:`job_lines`)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text
    rows = [_row(w) for w in t["workers"]]
    keep = fitting_columns(rows, width)
    table = Table(box=None, pad_edge=False, header_style="bold")
    for i in keep:
        name = COLUMNS[i]
        table.add_column(name, no_wrap=True,
                         justify="left" if name in ("worker", "host:slot", "state")
                         else "right")
    for r in rows:
        table.add_row(*(r[i] for i in keep))
    header = [Text("hvd-edl-ctl top  " + time.strftime("%H:%M:%S"), style="bold")]
    header += [Text(part) for line in job_lines(t) for part in _fit_line(line, width)]
    return Group(*header, Text(""), table)


def _launcher_alive(client: ControlClient) -> bool:
    """Whether the launcher process named in the job file still runs (this host only; a job
    file without a pid counts as gone)."""
    import psutil
    pid = client.job.get("pid")
    return isinstance(pid, int) and psutil.pid_exists(pid)


def run(client: ControlClient, interval_s: float = 1.0, once: bool = False,
        out=None) -> int:
    """Show the job every ``interval_s`` seconds until Ctrl-C or its end (or one frame with
    ``once``); returns the exit code: 0, or 3 when the job cannot be reached at the first call,
    1 when it refuses the call (an older launcher).

    Raises:
        ValueError: ``interval_s`` is not positive.
    """
    from rich.console import Console
    from rich.live import Live
    if not interval_s > 0:
        raise ValueError(f"interval must be positive, got {interval_s}")
    out = out or sys.stdout
    tty = out.isatty() and not once
    console = Console(file=out, highlight=False) if tty else \
        Console(file=out, width=120, no_color=True, highlight=False, force_terminal=False)
    last: Optional[dict] = None
    live = Live(console=console, auto_refresh=False, transient=False) if tty else None
    try:
        if live is not None:
            live.start()
        next_at = time.monotonic()
        while True:
            try:
                t: Optional[dict] = client.call("telemetry")
            except ControlError as e:
                if last is None or e.status is not None:
                    if live is not None:
                        live.stop()
                    print(f"hvd-edl-ctl: error: {e}", file=sys.stderr)
                    return 1 if e.status is not None and 400 <= e.status < 500 else 3
                if _launcher_alive(client):
                    t = None  # busy or briefly unreachable: try again at the next tick
                else:
                    break  # it answered before and its launcher is gone: the job ended
            if t is None:
                next_at = max(next_at + interval_s, time.monotonic())
                time.sleep(max(0.0, next_at - time.monotonic()))
                continue
            last = t
            if live is not None:
                live.update(render(t, console.width), refresh=True)
            else:
                console.print(render(t, console.width))
                if not once:
                    console.print()
                out.flush()
            if once:
                return 0
            next_at = max(next_at + interval_s, time.monotonic())
            time.sleep(max(0.0, next_at - time.monotonic()))
    except KeyboardInterrupt:
        if live is not None:
            live.stop()
        return 0
    if live is not None:
        live.stop()
    j = last["job"]
    print(f"hvd-edl-ctl: the job ended (last seen: generation {j['generation']}, world size "
          f"{j['world_size']}, step {j.get('step', -1)})", file=out, flush=True)
    return 0
