"""``hvd-edl-cluster top``: a live view of the pool, refreshed every ``--interval`` seconds: which
job holds which slot (one row per host, one cell per slot), the utilisation, the queue and each
job's state, size and times.  Fits 80 columns.  On a terminal the frame is redrawn in place
(``rich.live.Live``) until Ctrl-C; otherwise one plain-text frame per interval is printed (a
pipe, a file).  Exits 0 on Ctrl-C, like ``top``.
"""
from __future__ import annotations

import sys
import time

WIDTH = 80
MAX_SLOTS_SHOWN = 16  # cells per host row; more are summed up


def _age(t) -> str:
    if not t:
        return "-"
    s = max(0.0, time.time() - t)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


def frame_lines(status: dict) -> list:
    """The frame as plain lines (each at most 80 characters); under a waiting or failed
    job's row, its reason (cut to the width: ``status JOB --json`` has it whole)."""
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
        lines.append(f"{host[:20]:<20} {shown}{more}"[:WIDTH])
    lines.append("")
    lines.append(f"{'JOB':<6}{'NAME':<14}{'USER':<9}{'STATE':<10}{'SIZE':>5} {'NP':>3} "
                 f"{'MIN-MAX':>8} {'AGE':>6} {'RUN':>6} {'EXIT':>5}")
    for j in status["jobs"]:
        if j["state"] in ("done", "failed", "cancelled") and j["finished_at"] \
                and time.time() - j["finished_at"] > 600:
            continue
        size = j["world_size"] if j.get("allocated", j["world_size"]) == j["world_size"] \
            else f"{j['world_size']}/{j['allocated']}"  # the ring / the slots it holds
        lines.append(f"{j['id']:<6}{j['name'][:13]:<14}{(j.get('user') or '')[:8]:<9}"
                     f"{j['state']:<10}{size:>5} "
                     f"{j['np']:>3} {str(j['min_np']) + '-' + str(j['max_np']):>8} "
                     f"{_age(j['submitted_at']):>6} {_age(j['started_at']):>6} "
                     f"{'' if j['exit_code'] is None else j['exit_code']:>5}"[:WIDTH])
        goal_line = objective_line(j)
        if goal_line:
            lines.append(f"{'':6}{goal_line}"[:WIDTH])
        if j["state"] in ("queued", "suspended", "failed") and j.get("reason"):
            lines.append(f"{'':6}{j['reason']}"[:WIDTH])  # why it waits, why it failed
        elif "mixed types pay" in (j.get("reason") or ""):  # one job over GPU types: why
            lines.append(f"{'':6}{j['reason'].partition(': ')[2]}"[:WIDTH])
        if j.get("workers"):  # where its workers run: host:slot, and the GPU where there is one
            places = " ".join(f"{w['host']}:{w['slot']}"
                              + (f"/gpu{w['gpu']}" if w.get("gpu") is not None else "")
                              for w in j["workers"])
            lines.append(f"{'':6}{places}"[:WIDTH])
    return lines


def objective_line(j: dict) -> str:
    """A job with an objective (issue 42): its choice with the predicted time and cost, and
    the cost so far (``time<=$0.05: 2 x a100 spot, pred 120 s $0.0310; spent $0.0102``);
    "" for a job without one."""
    g = j.get("goal")
    if not g:
        return ""
    lim = (f"<=${g['budget_usd']:g}" if g.get("budget_usd") is not None else
           f" by {_age_left(g['deadline_at'])}" if g.get("deadline_at") else "")
    c = g.get("first_choice") or g.get("choice")
    what = (f"{c['n']} x {c['type']}{' spot' if c.get('spot') else ''}, pred "
            f"{c['time_s']:.0f} s ${c['cost_usd']:.4f}" + ("" if c.get("fits", True)
                                                          else " (does not fit)")) \
        if c else "no choice yet"
    now = g.get("choice")
    moved = (f"; now {now['n']} x {now['type']}" if c and now and
             (now["n"], now["type"]) != (c["n"], c["type"]) else "")
    return f"{g['objective']}{lim}: {what}{moved}; spent ${j.get('cost_usd', 0):.4f}"


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
