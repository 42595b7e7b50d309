"""``hvd-edl-cluster top``: a live view of the pool, refreshed every ``--interval`` seconds: which
job holds which slot (one row per host, one cell per slot), the utilisation, the queue and each
job's state, size and times.  Fits the terminal's width (``COLUMNS`` honoured; 80 at the least):
a longer line under a job is wrapped at a space, never cut, so no figure is lost.  On a terminal the frame is redrawn in place
(``rich.live.Live``) until Ctrl-C; otherwise one plain-text frame per interval is printed (a
pipe, a file).  Exits 0 on Ctrl-C, like ``top``.
"""
from __future__ import annotations

import math
import shutil
import sys
import textwrap
import time

WIDTH = 80  # the least width a frame is laid out for
MAX_SLOTS_SHOWN = 16  # cells per host row; more are summed up


def _age(t, until=None) -> str:
    """Seconds from unix time ``t`` to ``until`` (default now), short (``42s``, ``7m``,
    ``2.5h``); ``-`` without ``t``."""
    if not t:
        return "-"
    s = max(0.0, (until or time.time()) - t)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


ENDED = ("done", "failed", "cancelled")


def width() -> int:
    """The terminal's columns (``COLUMNS`` first, as :func:`shutil.get_terminal_size` reads
    it), never fewer than :data:`WIDTH`."""
    return max(WIDTH, shutil.get_terminal_size((WIDTH, 24)).columns)


def _wrapped(text: str, cols: int, indent: str = "") -> list:
    """``text`` as lines of at most ``cols`` characters, broken at spaces only (a word longer
    than a line stays whole: no figure is ever cut), each line after the first indented."""
    return textwrap.wrap(text, cols, subsequent_indent=indent or " " * 2,
                         break_long_words=False, break_on_hyphens=False) or [""]


def usd(x: float) -> str:
    """Dollars with enough digits for two significant ones (``$0.0049``, ``$0.00066``; four
    decimals at the least): a small cost never shows as ``$0.0000``."""
    if not x or not math.isfinite(x) or abs(x) >= 0.01:
        return f"${x or 0:.4f}"
    return f"${x:.{max(4, 1 - math.floor(math.log10(abs(x))))}f}"


def frame_lines(status: dict, cols: int = None) -> list:
    """The frame as plain lines, laid out for ``cols`` columns (default: :func:`width`); under
    a waiting or failed job's row, its reason, wrapped at spaces where longer (never cut)."""
    cols = cols or width()
    slots = status["slots"]
    total = slots["total"] or 1
    lines = [f"policy {status['policy']}: {slots['used']}/{slots['total']} slots used "
             f"({100 * slots['used'] / total:.0f} %), {slots['free']} free, {slots['lent']} "
             f"lent; queue {len(status['queue'])}"]
    lines.append("")
    for host, n in status["pool"].items():
        cells = []
        for job_id, k in status["holders"].get(host, []):
            cells += [job_id] * k
        cells = (cells + ["."] * max(0, n - len(cells)))[:n]
        shown = " ".join(f"{c:>4}" for c in cells[:MAX_SLOTS_SHOWN])
        more = f" +{n - MAX_SLOTS_SHOWN}" if n > MAX_SLOTS_SHOWN else ""
        rest = status.get("resting", {}).get(host)
        more += f" (resting {rest:.0f} s: no job reaches it)" if rest is not None else ""
        lines += _wrapped(f"{host[:20]:<20} {shown}{more}", cols, " " * 21)
    for host, why in status.get("kept_out", {}).items():  # one line each: why, the undo
        lines += _wrapped(f"{host[:20]:<20} {why}", cols, " " * 21)
    lines.append("")
    lines.append(f"{'JOB':<6}{'NAME':<14}{'USER':<9}{'STATE':<10}{'SIZE':>5} {'NP':>3} "
                 f"{'MIN-MAX':>8} {'AGE':>6} {'RUN':>6} {'EXIT':>5}")
    for j in status["jobs"]:
        if j["state"] in ("done", "failed", "cancelled") and j["finished_at"] \
                and time.time() - j["finished_at"] > 600:
            continue
        end = j["finished_at"] if j["state"] in ENDED else None  # an ended run's RUN stops
        size = j["world_size"] if j.get("allocated", j["world_size"]) == j["world_size"] \
            else f"{j['world_size']}/{j['allocated']}"  # the ring / the slots it holds
        lines.append(f"{j['id']:<6}{j['name'][:13]:<14}{(j.get('user') or '')[:8]:<9}"
                     f"{j['state']:<10}{size:>5} "
                     f"{j['np']:>3} {str(j['min_np']) + '-' + str(j['max_np']):>8} "
                     f"{_age(j['submitted_at']):>6} {_age(j['started_at'], end):>6} "
                     f"{'' if j['exit_code'] is None else j['exit_code']:>5}")
        under = []
        goal_line = objective_line(j)
        if goal_line:
            under.append(goal_line)
        if j["state"] in ("queued", "suspended", "failed") and j.get("reason"):
            under.append(j["reason"])  # why it waits, why it failed
        elif "mixed types pay" in (j.get("reason") or ""):  # one job over GPU types: why
            under.append(j["reason"].partition(": ")[2])
        if j.get("workers"):  # where its workers run: host:slot, and the GPU where there is one
            places = " ".join(f"{w['host']}:{w['slot']}"
                              + (f"/gpu{w['gpu']}" if w.get("gpu") is not None else "")
                              for w in j["workers"])
            under.append(places)
        for text in under:
            lines += _wrapped(f"{'':6}{text}", cols, " " * 8)
    return lines


def objective_line(j: dict) -> str:
    """A job with an objective (issue 42): its current choice with its prediction (the latest
    the policy made: after a move, the move's), the first where it differs, and the cost so far
    (``time<=$0.05: 2 x a100 spot, pred 120 s $0.0310; spent $0.0102``); before any choice,
    what it waits for (its speed, measured on the type it started on); "" for a job without
    one."""
    g = j.get("goal")
    if not g:
        return ""
    if j.get("state") in ENDED and j.get("finished_at") and (g.get("choice")
                                                            or g.get("first_choice")):
        return _ended_line(j, g)
    lim = (f"<=${g['budget_usd']:g}" if g.get("budget_usd") is not None else
           f" by {_age_left(g['deadline_at'])}" if g.get("deadline_at") else "")
    c, first = g.get("choice"), g.get("first_choice")
    if c:
        what = (f"{_config(c)}, pred {c['time_s']:.0f} s {usd(c['cost_usd'])}"
                + ("" if c.get("fits", True) else " (does not fit)"))
        if first and _config(first) != _config(c):
            what += f" (first {_config(first)}, pred {first['time_s']:.0f} s)"
    elif g.get("measuring"):
        ended = j.get("state") in ("done", "failed", "cancelled")
        what = (f"ended before a choice (its speed was measured on {g['measuring']})"
                if ended else f"no choice yet: measuring its speed on {g['measuring']}")
    else:
        what = "no choice yet: waits to start (its speed is measured where it starts)"
    return f"{g['objective']}{lim}: {what}; spent {usd(j.get('cost_usd') or 0)}"


def _ended_line(j: dict, g: dict) -> str:
    """An ended job's objective line: what it took (its run's time, from its start to its
    end, and its cost), the limit met or not, and its first prediction beside them
    (``time<=$0.05: ran 21 s, spent $0.0102 (predicted 2 x a100, 25 s $0.0120)``)."""
    ran = j["finished_at"] - (j.get("started_at") or j["finished_at"])
    spent = j.get("cost_usd") or 0.0
    lim = ""
    if g.get("budget_usd") is not None:
        lim = f"<=${g['budget_usd']:g}"
    elif g.get("deadline_at"):
        late = j["finished_at"] - g["deadline_at"]
        lim = (f" by its deadline (met, {-late:.0f} s to spare)" if late <= 0
               else f" by its deadline (missed by {late:.0f} s)")
    p = g.get("first_choice") or g.get("choice")
    return (f"{g['objective']}{lim}: ran {ran:.1f} s, spent {usd(spent)} (predicted "
            f"{_config(p)}, {p['time_s']:.0f} s {usd(p['cost_usd'])})")


def _config(c: dict) -> str:
    """``2 x t4 spot``; a mixed ring ``1 x a100 + 1 x t4 spot``; a choice to wait for busy
    slots ``waits 30 s for 2 x a100``."""
    parts = c.get("parts") or [c]
    what = " + ".join(f"{p['n']} x {p['type']}{' spot' if p.get('spot') else ''}"
                      for p in parts)
    return (f"waits {c['wait_s']:.0f} s for " if c.get("wait_s") else "") + what


def _age_left(t) -> str:
    s = t - time.time()
    return f"{s:.0f}s" if s >= 0 else "past"


def run(client, interval_s: float = 2.0, once: bool = False) -> int:
    """Show frames from ``client.call("status")`` until Ctrl-C (or once)."""
    from launcher.cluster.server import ClusterRefused
    live_view = sys.stdout.isatty() and not once
    try:
        if live_view:
            from rich.live import Live
            from rich.text import Text
            with Live(Text("\n".join(frame_lines(client.call("status")))), auto_refresh=False,
                      screen=False) as live:
                while True:
                    time.sleep(interval_s)
                    live.update(Text("\n".join(frame_lines(client.call("status")))),
                                refresh=True)
        while True:
            print("\n".join(frame_lines(client.call("status"))), flush=True)
            if once:
                return 0
            time.sleep(interval_s)
            print()
    except KeyboardInterrupt:
        return 0
    except ClusterRefused as e:
        print(f"hvd-edl-cluster: error: {e}", file=sys.stderr)
        return 1
