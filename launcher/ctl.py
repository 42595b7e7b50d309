"""``hvd-edl-ctl``: drive a running ``hvd-edl-run`` job (EDL's scheduler interface).

    hvd-edl-ctl status [--json]           generation, world size, workers, step, last stall
    hvd-edl-ctl scale --np N [--wait S]   target world size N within [--min-np, --max-np]
    hvd-edl-ctl drain HOST                workers on HOST leave gracefully; none placed there
    hvd-edl-ctl undrain HOST              HOST may be used again

The job is found through ``--job FILE``, else ``$HVD_EDL_JOB``, else the only running job's file
in the default directory (:mod:`launcher.control`).  Exit codes: 0 done, 1 the job refused the
request (the reason is printed, the job is unchanged) or ``--wait`` ran out, 2 bad usage, 3 no
job found or the job cannot be reached.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional

from launcher.control import ControlClient, ControlError, find_job_file

EXIT_REFUSED = 1
EXIT_UNREACHABLE = 3
WAIT_POLL_S = 0.5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hvd-edl-ctl",
                                description="Inspect and resize a running hvd-edl-run job.")
    p.add_argument("--job", help="the job file hvd-edl-run printed at start "
                   "(default $HVD_EDL_JOB, else the only running job)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per request (default 30)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    st = sub.add_parser("status", help="generation, world size, workers, step, last stall")
    st.add_argument("--json", action="store_true", help="print the raw JSON answer")
    sc = sub.add_parser("scale", help="set the target world size")
    sc.add_argument("--np", type=int, required=True, help="target number of workers")
    sc.add_argument("--wait", type=float, default=0.0, metavar="S",
                    help="then wait up to S seconds until a generation of that size formed")
    dr = sub.add_parser("drain", help="move every worker off HOST, place none there")
    dr.add_argument("host")
    ud = sub.add_parser("undrain", help="let HOST be used again")
    ud.add_argument("host")
    return p


def format_status(s: dict) -> str:
    """``status`` for people: a few ``key: value`` lines and one line per live worker."""
    target = s.get("target_np")
    last = s.get("last_change")
    lines = [
        f"generation: {s['generation']}",
        f"world size: {s['world_size']}",
        f"target np:  {target if target is not None else 'every usable slot'} "
        f"(min-np {s['min_np']}, max-np {s['max_np']})",
        f"step:       {s['step']} (when this generation formed)",
        "last stall: " + ("none yet" if last is None else
                          f"{last['stall_s']:.3f} s ({last['kind']}, generation "
                          f"{last['generation']})"),
        "hosts:      " + (", ".join(f"{h}:{n}" for h, n in s["hosts"].items()) or "none"),
        "drained:    " + (", ".join(s["drained"]) or "none"),
    ]
    if s.get("blacklisted"):
        lines.append("blacklisted: " + ", ".join(s["blacklisted"]))
    lines.append("workers:")
    for w in s["workers"]:
        rank = f"rank {w['rank']}" if w["rank"] is not None else "no rank"
        lines.append(f"  {w['worker_id']:<6} {rank:<8} {w['host']}:{w['slot']:<3} {w['state']}")
    return "\n".join(lines)


def _wait_for_size(client: ControlClient, np_: int, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        s = client.call("status")
        busy = any(w["state"] in ("pending", "ready", "leaving") for w in s["workers"])
        if s["world_size"] == np_ and not busy:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(WAIT_POLL_S)


def main(argv: Optional[List[str]] = None) -> int:
    """Run one ``hvd-edl-ctl`` command; returns the exit code (see the module docstring)."""
    a = build_parser().parse_args(argv)
    try:
        client = ControlClient(find_job_file(a.job), timeout_s=a.timeout)
        if a.cmd == "status":
            s = client.call("status")
            print(json.dumps(s, indent=2) if a.json else format_status(s))
        elif a.cmd == "scale":
            r = client.call("scale", np=a.np)
            print(f"hvd-edl-ctl: target world size {r['target_np']}")
            if r.get("warning"):
                print(f"hvd-edl-ctl: warning: {r['warning']}", file=sys.stderr)
            if a.wait > 0 and not _wait_for_size(client, a.np, a.wait):
                print(f"hvd-edl-ctl: error: no generation of {a.np} workers within {a.wait:g} s",
                      file=sys.stderr)
                return EXIT_REFUSED
        else:
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
