"""``hvd-edl-ctl``: drive a running ``hvd-edl-run`` job (EDL's scheduler interface).

    hvd-edl-ctl status [--json]           generation, world size, step, epoch, samples/s,
                                          time since the last change, workers, last stall
    hvd-edl-ctl top [--interval S] [--once]  live view: steps/s, samples/s, per-worker step,
                                          compute and wait ms (Ctrl-C ends it)
    hvd-edl-ctl list                      running jobs: pid, command, hosts, world size, started
    hvd-edl-ctl scale --np N [--wait S]   target world size N within [--min-np, --max-np]
    hvd-edl-ctl drain HOST                workers on HOST leave gracefully; none placed there
    hvd-edl-ctl undrain HOST              HOST may be used again (an unknown HOST is refused)
    hvd-edl-ctl checkpoint [--wait S]     rank 0 writes a checkpoint at its next commit; prints
                                          its path once written (--checkpoint-dir jobs)
    hvd-edl-ctl profile --sizes 1,2,4 [--seconds S] [--out DIR]
                                          walk through those world sizes stop-free, measure
                                          samples/s at each, return; profile.json/.png in DIR
    hvd-edl-ctl migrate --from A --to B [--wait S]
                                          the workers on A move to B in one stop-free switch
                                          (the new ones build first); A stays drained

The job is found through ``--job FILE`` or ``--job PID`` (the launcher's pid, as ``list`` shows
it), else ``$HVD_EDL_JOB``, else the only running job's file in the default directory
(:mod:`launcher.serve.control`).  Exit codes: 0 done, 1 the job refused the request (the reason is
printed, the job is unchanged), 2 bad usage (e.g. ``--timeout`` not a positive number of seconds,
a HOST that is not an RFC 1123 name or IP address), 3 no job found, an unsafe job file or the job
cannot be reached, 4 ``scale --wait S`` or ``migrate --wait S`` ran out (a migration goes on):
the new target stays in force (the job grows or shrinks when it can) but no generation of that
size formed within S seconds; or ``checkpoint
--wait S`` ran out before the checkpoint was written, or ``profile --wait S`` before the
profile ended (it goes on).  ``profile`` exits 2 when the job refuses it (a size outside
[--min-np, --max-np] or above the usable slots, a profile already running: nothing changed) and
1 when it was aborted (the job returned to its size).
"""
from __future__ import annotations

import argparse
import json
import shlex
import os
import sys
import time
from typing import List, Optional

from launcher.serve.control import (ControlClient, ControlError, default_job_dir, find_job_file,
                              running_jobs)
from launcher.discovery.hosts import HostSpecError, check_host

EXIT_REFUSED = 1
EXIT_UNREACHABLE = 3
EXIT_WAIT_TIMEOUT = 4
WAIT_POLL_S = 0.5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hvd-edl-ctl", description="Inspect and resize a running hvd-edl-run job.",
        epilog="exit codes: 0 done; 1 refused (the reason is printed, the job is unchanged); "
               "2 bad usage; 3 no job found, an unsafe job file, or the job cannot be reached; "
               "4 scale --wait ran out (the new target stays in force), or checkpoint --wait "
               "did (the request stays: rank 0 writes one at a later commit)")
    p.add_argument("--job", metavar="FILE|PID",
                   help="the job file hvd-edl-run printed at start, or its pid (default "
                        "$HVD_EDL_JOB, else the only running job)")
    p.add_argument("--timeout", type=_positive_seconds, default=30.0, metavar="S",
                   help="seconds per request, > 0 (default 30)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    st = sub.add_parser("status", help="generation and its age, world size, current step and "
                        "epoch, samples/s, workers, last stall")
    st.add_argument("--json", action="store_true", help="print the raw JSON answer")
    tp = sub.add_parser("top", help="live view of the job's telemetry: steps/s, samples/s, "
                        "per-worker step / compute / wait ms (Ctrl-C ends it)")
    tp.add_argument("--interval", type=_positive_seconds, default=1.0, metavar="S",
                    help="seconds between refreshes (default 1)")
    tp.add_argument("--once", action="store_true", help="print one frame and exit")
    sub.add_parser("list", help="running jobs: pid, command, hosts, world size, started")
    sc = sub.add_parser("scale", help="set the target world size")
    sc.add_argument("--np", type=int, required=True, help="target number of workers")
    sc.add_argument("--wait", type=_seconds, default=0.0, metavar="S",
                    help="then wait up to S seconds until a generation of that size formed "
                         "(exit 4 if none did: the target stays set)")
    bt = sub.add_parser("batch", help="ask for a global batch from the next switch on (a "
                        "script with hvd.elastic.AdaptiveBatchSampler applies it; others keep "
                        "theirs)")
    bt.add_argument("batch", type=_batch_arg,
                    help="samples per optimizer step over all ranks, >= 1: pins it (--adapt-batch "
                         "leaves it); 'auto' lifts the pin")
    dr = sub.add_parser("drain", help="move every worker off HOST, place none there")
    dr.add_argument("host", type=_host)
    ud = sub.add_parser("undrain", help="let HOST be used again")
    ud.add_argument("host", type=_host)
    ck = sub.add_parser("checkpoint", help="write a checkpoint at the next commit and print "
                        "its path (exit 4 if none was written within --wait)")
    ck.add_argument("--wait", type=_seconds, default=60.0, metavar="S",
                    help="seconds to wait for it (default 60)")
    pr = sub.add_parser("profile", help="walk the job through world sizes stop-free, measure "
                        "its throughput at each and return (profile.json, profile.png)")
    pr.add_argument("--sizes", type=_sizes, required=True, metavar="N,N,...",
                    help="world sizes to measure, in this order, e.g. 1,2,4")
    pr.add_argument("--seconds", type=float, default=10.0, metavar="S",
                    help="seconds of measurement per size (default 10)")
    pr.add_argument("--settle", type=float, default=2.0, metavar="S",
                    help="seconds of training at a new size before measuring (default 2)")
    pr.add_argument("--out", default=".", metavar="DIR",
                    help="folder for profile.json and profile.png, created if missing; an "
                         "earlier profile there is kept (the next is profile-2.json ...; "
                         "default .)")
    pr.add_argument("--wait", type=_seconds, default=None, metavar="S",
                    help="seconds to wait for the profile (default: a bound from the sizes; "
                         "exit 4 when it ran out: the profile goes on)")
    mg = sub.add_parser("migrate", help="move the workers on one host to another in one "
                        "stop-free switch; the source host stays drained")
    mg.add_argument("--from", dest="source", type=_host, required=True, metavar="HOST")
    mg.add_argument("--to", dest="target", type=_host, required=True, metavar="HOST")
    mg.add_argument("--wait", type=float, default=120.0, metavar="S",
                    help="seconds to wait for the move to end (default 120; exit 4 if it has "
                         "not: it goes on)")
    return p


def _sizes(text: str) -> List[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (argparse type of ``profile --sizes``)."""
    try:
        sizes = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected world sizes like 1,2,4, got {text!r}") \
            from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive world sizes like 1,2,4, got "
                                         f"{text!r}")
    return sizes


def format_profile(r: dict) -> str:
    """A finished profile (``/ctl/profile`` status) as a table: one line per world size."""
    lines = [f"{'np':>3}  {'samples/s':>10}  {'efficiency':>10}  {'step ms':>8}  "
             f"{'compute ms':>10}  {'wait ms':>8}  {'LOSO err %':>10}"]
    mape = r.get("mape") or {}

    def ms(v):
        return f"{v * 1000:.1f}" if isinstance(v, (int, float)) else "-"
    for p in r.get("points", []):
        err = mape.get(str(p["world_size"]))
        lines.append(f"{p['world_size']:>3}  {p['samples_per_s']:>10.1f}  "
                     f"{p.get('efficiency', 0):>10.3f}  {ms(p.get('step_s')):>8}  "
                     f"{ms(p.get('compute_s')):>10}  {ms(p.get('wait_s')):>8}  "
                     f"{'-' if err is None else f'{err:.1f}':>10}")
    for key in ("json", "png"):
        if r.get(key):
            lines.append(f"{key}: {r[key]}")
    return "\n".join(lines)


def _run_profile(client: ControlClient, a) -> int:
    """``profile``: start it, wait (bounded) and print the table; returns the exit code."""
    import os
    if not 0 < a.seconds <= 600 or not 0 <= a.settle <= 600:
        print("hvd-edl-ctl: error: --seconds must lie within (0, 600] and --settle within "
              "[0, 600]", file=sys.stderr)
        return 2
    try:
        client.call("profile", sizes=a.sizes, seconds=a.seconds, settle=a.settle,
                    out=os.path.abspath(a.out))
    except ControlError as e:
        if e.status is not None and 400 <= e.status < 500:
            print(f"hvd-edl-ctl: error: {e}", file=sys.stderr)
            return 2  # a size outside the bounds or the slots: nothing changed
        raise
    wait_s = a.wait if a.wait is not None else \
        len(a.sizes) * (a.seconds + max(a.settle, 5.0) + 180.0) + 180.0
    deadline = time.monotonic() + wait_s
    shown = 0
    while True:
        r = client.call("profile", status=True)
        for p in r.get("points", [])[shown:]:
            print(f"hvd-edl-ctl: {p['world_size']} workers: {p['samples_per_s']:.1f} "
                  f"samples/s", flush=True)
        shown = len(r.get("points", []))
        if r["state"] in ("done", "aborted"):
            break
        if time.monotonic() > deadline:
            print(f"hvd-edl-ctl: the profile is still {r['state']} after {wait_s:g} s: it goes "
                  f"on (hvd-edl-ctl status shows it)",
                  file=sys.stderr)
            return EXIT_WAIT_TIMEOUT
        time.sleep(WAIT_POLL_S)
    print(format_profile(r))
    if r["state"] == "aborted":
        print(f"hvd-edl-ctl: profile aborted: {r.get('error')} (the job returned to its size)",
              file=sys.stderr)
        return EXIT_REFUSED
    return 0


def _positive_seconds(text: str) -> float:
    """argparse type: seconds, a finite number > 0 (``0``, ``-1``, ``nan``, ``inf`` are usage
    errors, exit 2)."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds (a positive number), got "
                                         f"{text[:40]!r}")
    return v


MAX_WAIT_S = 86400.0  # the longest --wait (seconds): a day (1e10 overflowed a timestamp)


def _seconds(text: str) -> float:
    """argparse type: seconds, a finite number >= 0 (``--wait``)."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 <= v <= MAX_WAIT_S:
        raise argparse.ArgumentTypeError(f"expected seconds (a number from 0 to {MAX_WAIT_S:g}), "
                                         f"got {text[:40]!r}")
    return v


def _batch_arg(text: str):
    """argparse type: ``batch``'s global batch, an integer >= 1, or ``auto``."""
    if text == "auto":
        return text
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a global batch (an integer >= 1) or 'auto', "
                                         f"got {text[:40]!r}")
    return v


def _host(text: str) -> str:
    """argparse type: a host in the launcher's canonical form (:func:`launcher.discovery.hosts.check_host`:
    an RFC 1123 name, lower-cased, or an IP address; ``[::1]`` brackets allowed)."""
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return check_host(text)
    except HostSpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _known_hosts(s: dict) -> set:
    """Hosts a ``status`` answer knows: discovered, drained or running workers."""
    return set(s.get("hosts", {})) | set(s.get("drained", [])) | \
        {w["host"] for w in s.get("workers", [])}


def _duration(seconds: float) -> str:
    """``75.0`` -> ``"1 min 15 s"``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    return f"{minutes // 60} h {minutes % 60} min"


def _progress_lines(s: dict) -> List[str]:
    p = s.get("progress")
    if not p:
        return [f"step:       {s['step']} (when this generation formed; no report since)"]
    epoch = f", epoch {p['epoch']}" if p.get("epoch") is not None else ""
    age = f" ({p['age_s']:.0f} s ago)" if p.get("age_s", 0) >= 1.5 else ""
    rate = []
    if p.get("samples_per_s") is not None:
        rate.append(f"{p['samples_per_s']:.1f} samples/s")
    if p.get("steps_per_s") is not None:
        rate.append(f"{p['steps_per_s']:.2f} steps/s")
    return [f"step:       {p['step']}{epoch}{age}",
            "speed:      " + (", ".join(rate) or "not measured yet")]


def _autoscale_lines(a: Optional[dict]) -> List[str]:
    """``status``'s autoscale lines (--autoscale jobs): objective, phase, the model's
    prediction at the current size, the last decision."""
    if not a:
        return []
    what = a["objective"] + (f":{a['efficiency']:g}" if a.get("efficiency") else "")
    lines = [f"autoscale:  {what}, {a['phase']}, target "
             f"{a['target'] if a.get('target') is not None else 'not decided yet'}"]
    p = a.get("prediction")
    if p:
        text = (f"predicted:  {p['samples_per_s']:.1f} samples/s at {p['world_size']} workers "
                f"(efficiency {p['efficiency']:.2f}, next worker adds "
                f"{p['marginal_efficiency']:.2f})")
        if "cost_per_million_samples" in p:
            text += (f", cost {p['cost_per_million_samples']} per million samples "
                     f"({p['lost_s_per_hour']:.1f} s/h lost to revocations)")
        lines.append(text)
    if a.get("decisions"):
        d = a["decisions"][-1]
        lines.append(f"decision:   {d['from']} -> {d['to']} workers: {d['reason']}")
    return lines


def _batch_line(s: dict) -> str:
    """One ``batch:`` line from ``status``'s ``adaptive_batch`` and ``gradient_noise`` (either
    may be absent), e.g. ``batch:      248 = 2 ranks x 62 x 2 accumulation (pinned by
    hvd-edl-ctl batch); noise scale 108.5 samples at step 588, measured every 13 steps``;
    empty when neither is known."""
    plan, noise = s.get("adaptive_batch"), s.get("gradient_noise")
    parts = []
    if plan:
        text = (f"{plan['batch']:g} = {plan['world_size']:g} ranks x {plan['local_batch']:g}"
                f" x {plan['accumulation']:g} accumulation")
        if s.get("batch_pinned") is not None:
            text += f" (pinned at {s['batch_pinned']} by hvd-edl-ctl batch)"
        parts.append(text)
    elif noise:
        parts.append(f"{noise['batch']} (fixed: the script did not opt in)")
    if noise:
        ns = noise.get("noise_scale_samples")
        k = noise.get("period", 1)
        parts.append("noise scale " + (f"{ns:.1f} samples" if ns is not None else
                                       "unknown yet (|G|^2 <= 0)")
                     + f" at step {noise['step']}, measured every "
                     + ("step" if k == 1 else f"{k} steps"))
    return ("batch:      " + "; ".join(parts)) if parts else ""


def format_status(s: dict) -> str:
    """``status`` for people: a few ``key: value`` lines and one line per live worker."""
    target = s.get("target_np")
    last = s.get("last_change")
    since = s.get("since_change_s")
    lines = [
        f"generation: {s['generation']}"
        + (f" (formed {_duration(since)} ago at step {s['step']})" if since is not None else ""),
        f"world size: {s['world_size']}",
        f"target np:  {target if target is not None else 'every usable slot'} "
        f"(min-np {s['min_np']}, max-np {s['max_np']})",
        *_progress_lines(s),
        "last stall: " + ("none yet" if last is None else
                          f"{last['stall_s']:.3f} s ({last['kind']}, generation "
                          f"{last['generation']})"),
        "hosts:      " + (", ".join(f"{h}:{n}" for h, n in s["hosts"].items()) or "none"),
        "drained:    " + (", ".join(s["drained"]) or "none"),
    ]
    if "checkpoint" in s:  # --checkpoint-dir jobs
        c = s["checkpoint"]
        lines.append("checkpoint: " + ("none written yet" if c is None else
                                       f"{c['path']} (step {c['step']}, "
                                       f"{_duration(c['age_s'])} ago)"))
    m = s.get("migration")
    if m:  # the running or last hvd-edl-ctl migrate
        lines.append(f"migration:  {', '.join(m['leavers'])} {m['from']} -> {m['to']}: "
                     f"{m['phase']}" + (f" ({m['reason']})" if m.get("reason") else ""))
    if s.get("blacklisted"):
        lines.append("blacklisted: " + ", ".join(s["blacklisted"]))
    lines.extend(_autoscale_lines(s.get("autoscale")))
    batch_line = _batch_line(s)
    if batch_line:
        lines.append(batch_line)
    tel = s.get("telemetry")
    rows = {}
    if tel:  # the heartbeats' figures (launcher.observe.telemetry)
        from launcher.observe.top import job_lines
        speed, counts = job_lines(tel)[1:]
        lines += ["telemetry:  " + speed, "counted:    " + counts]
        rows = {w["worker_id"]: w for w in tel["workers"]}
    lines.append("workers:" + ("                            step ms = compute + wait   samples/s"
                               if rows else ""))
    for w in s["workers"]:
        rank = f"rank {w['rank']}" if w["rank"] is not None else "no rank"
        line = f"  {w['worker_id']:<6} {rank:<8} {w['host']}:{w['slot']:<3} {w['state']}"
        t = rows.get(w["worker_id"])
        if t is not None and t.get("step_s") is not None:
            line = (f"{line:<36} {_ms(t['step_s']):>7} = {_ms(t['compute_s']):>7} + "
                    f"{_ms(t['wait_s']):>6} {t['samples_per_s']:>11.1f}")
        lines.append(line)
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f}"


def _wait_for_size(client: ControlClient, np_: int, wait_s: float) -> Optional[dict]:
    """Polls status until a settled generation of ``np_`` workers exists; None when it did,
    else the last status seen after ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        s = client.call("status")
        busy = any(w["state"] in ("pending", "ready", "leaving") for w in s["workers"])
        if s["world_size"] == np_ and not busy:
            return None
        if time.monotonic() > deadline:
            return s
        time.sleep(WAIT_POLL_S)


def _usable_slots(s: dict) -> int:
    """Slots the job may use now (the launcher's count, up to the target; else the hosts'
    slots that are neither drained nor blacklisted)."""
    if "usable_slots" in s:
        return s["usable_slots"]
    skip = set(s.get("drained", [])) | set(s.get("blacklisted", []))
    return sum(n for h, n in s.get("hosts", {}).items() if h not in skip)


def _print_migration(r: dict, wait_s: float) -> int:
    """``migrate``'s output; returns the exit code (0 done, 1 abandoned, 4 still running)."""
    moved = f"{', '.join(r['leavers'])} on {r['from']}"
    if r["phase"] == "done":
        gens = ", ".join(f"generation {g['generation']} ({g['kind']}, stall "
                         f"{g['stall_s']:.3f} s, rolled back {g['rolled_back_steps']} steps)"
                         for g in r["generations"])
        print(f"hvd-edl-ctl: migrated {moved} to {r['to']} as {', '.join(r['joiners'])} in "
              f"{r['seconds']:.1f} s: {gens}")
        print(f"hvd-edl-ctl: {r['from']} stays drained (hvd-edl-ctl undrain {r['from']} to "
              f"use it again)")
        return 0
    if r["phase"] == "abandoned":
        print(f"hvd-edl-ctl: migration abandoned: {r['reason']}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"hvd-edl-ctl: migration of {moved} to {r['to']} still {r['phase']} after "
          f"{wait_s:g} s: it goes on (hvd-edl-ctl status shows it)", file=sys.stderr)
    return EXIT_WAIT_TIMEOUT


def list_jobs(timeout_s: float) -> List[str]:
    """``list``: one line per running job in the default directory (a job that does not answer
    is listed with what its file says)."""
    rows = [("PID", "WORLD", "HOSTS", "STARTED", "COMMAND")]
    for path in running_jobs():
        try:
            client = ControlClient(path, timeout_s=timeout_s)
        except ControlError:
            continue
        job = client.job
        try:
            s = client.call("status")
            world = str(s["world_size"])
            hosts = ",".join(f"{h}:{n}" for h, n in s["hosts"].items()) or "none"
        except ControlError:
            world, hosts = "?", "(not answering)"
        started = job.get("started")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) \
            if isinstance(started, (int, float)) else "?"
        command = " ".join(shlex.quote(c) for c in job.get("command") or []) or "?"
        rows.append((str(job.get("pid", "?")), world, hosts, when, command))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]


def main(argv: Optional[List[str]] = None) -> int:
    """Run one ``hvd-edl-ctl`` command; returns the exit code (see the module docstring).
    Output piped into a reader that stops early (``| head``) ends it quietly."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit: a reader gone is caught below, not a trace
        return code
    except BrokenPipeError:
        try:  # the reader is gone: say nothing more (Python's own flush at exit would raise)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return 0


def _main(argv: Optional[List[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if a.cmd == "list":
            lines = list_jobs(a.timeout)
            if len(lines) == 1:
                print(f"hvd-edl-ctl: no running job in {default_job_dir()}", file=sys.stderr)
            else:
                print("\n".join(lines))
            return 0
        client = ControlClient(find_job_file(a.job), timeout_s=a.timeout)
        if a.cmd == "top":
            from launcher.observe import top
            return top.run(client, a.interval, a.once)
        if a.cmd == "status":
            s = client.call("status")
            print(json.dumps(s, indent=2) if a.json else format_status(s))
        elif a.cmd == "scale":
            r = client.call("scale", np=a.np)
            print(f"hvd-edl-ctl: target world size {r['target_np']}")
            if r.get("warning"):
                print(f"hvd-edl-ctl: warning: {r['warning']}", file=sys.stderr)
            last = _wait_for_size(client, a.np, a.wait) if a.wait > 0 else None
            if last is not None:
                print(f"hvd-edl-ctl: target set to {a.np}; not reached within {a.wait:g} s: "
                      f"{_usable_slots(last)} usable slots, world size {last['world_size']} "
                      f"(the target stays; the job resizes when it can)", file=sys.stderr)
                return EXIT_WAIT_TIMEOUT
        elif a.cmd == "batch":
            r = client.call("batch", batch=a.batch)
            now = r['batch'] if r['batch'] is not None else 'unknown'
            if a.batch == "auto":
                print(f"hvd-edl-ctl: batch no longer pinned (now {now})")
            else:
                print(f"hvd-edl-ctl: global batch {r['requested_batch']} asked for and pinned "
                      f"(now {now}; 'batch auto' lifts the pin)")
            if r.get("warning"):
                print(f"hvd-edl-ctl: warning: {r['warning']}", file=sys.stderr)
        elif a.cmd == "checkpoint":
            client.timeout_s = max(client.timeout_s, a.wait + 10.0)
            r = client.call("checkpoint", wait=a.wait)
            if r.get("path") is None:
                print(f"hvd-edl-ctl: {r.get('warning')}", file=sys.stderr)
                return EXIT_WAIT_TIMEOUT
            print(f"hvd-edl-ctl: checkpoint {r['path']} (step {r['step']})")
        elif a.cmd == "profile":
            return _run_profile(client, a)
        elif a.cmd == "migrate":
            if not 0 <= a.wait <= 600:
                print("hvd-edl-ctl: error: --wait must lie within [0, 600] seconds",
                      file=sys.stderr)
                return 2
            client.timeout_s = max(client.timeout_s, a.wait + 10.0)
            r = client.call("migrate", **{"from": a.source, "to": a.target, "wait": a.wait})
            return _print_migration(r, a.wait)
        else:
            if a.cmd == "undrain":  # the job takes any name for undrain: check it here
                known = _known_hosts(client.call("status"))
                if a.host not in known:
                    names = sorted(known)
                    more = f" and {len(names) - 10} more" if len(names) > 10 else ""
                    print(f"hvd-edl-ctl: error: unknown host {a.host!r} (not discovered, not "
                          f"drained, no worker on it); the job knows "
                          f"{', '.join(names[:10]) or 'none'}{more}", file=sys.stderr)
                    return EXIT_REFUSED
            r = client.call(a.cmd, host=a.host)
            print(f"hvd-edl-ctl: drained hosts: {', '.join(r['drained']) or 'none'}")
            if r.get("warning"):
                print(f"hvd-edl-ctl: warning: {r['warning']}", file=sys.stderr)
    except ControlError as e:
        print(f"hvd-edl-ctl: error: {e}", file=sys.stderr)
        return EXIT_REFUSED if e.status is not None and 400 <= e.status < 500 \
            else EXIT_UNREACHABLE
    return 0


if __name__ == "__main__":
    sys.exit(main())
