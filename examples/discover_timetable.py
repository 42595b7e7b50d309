#!/usr/bin/env python3
"""Host discovery that follows a timetable, standing for a cluster whose spot nodes come and go.

    discover_timetable.py --schedule 0:2,8:4,20:1,30:3 --clock /tmp/clock [--host localhost]
                          [--event-log EVENTS.jsonl]

prints ``host:N`` where N is the slot count of the latest schedule entry whose time (seconds since
the first call, remembered in the --clock file) has passed.  Horovod's discovery format.

With ``--event-log`` (the launcher's ``--event-log`` file) the timetable waits for the job: an
entry's time counts from the moment the job reached the previous entry's world size (the time of
that generation in the log), plus the gap between the two entries.  On a busy machine, where
workers take long to start, every phase is then seen for its full length instead of being
skipped; a size the job never reaches holds the timetable there.
"""
import argparse
import json
import os
import sys
import time


def read_events(path):
    """The event log's generations (dicts with "time", "world_size"); lines being written and
    a missing file are skipped."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    # generations (kind "generation"; older logs: no kind), not decisions
                    if rec.get("event", "generation") == "generation" and "generation" in rec:
                        out.append(rec)
                except ValueError:
                    pass
    except OSError:
        pass
    return out


def current_slots(entries, first_call, now, events=None):
    """Slots of the entry in force at unix time ``now``.  ``entries``: sorted (seconds, slots);
    ``events``: None for plain seconds since ``first_call``, else the event log's generations
    (each entry's time then counts from when the previous one's size was reached)."""
    if events is None:
        return [n for t, n in entries if t <= now - first_call][-1]
    active_at = first_call + entries[0][0]
    for i, (t, n) in enumerate(entries):
        if i + 1 == len(entries):
            return n
        if i > 0 and n == entries[i - 1][1]:
            reached = active_at
        else:
            reached = min((e["time"] for e in events
                           if e.get("world_size") == n and e.get("time", 0) >= active_at),
                          default=None)
        if reached is None:
            return n
        active_at = reached + entries[i + 1][0] - t
        if now < active_at:
            return n


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", required=True, help="t0:slots,t1:slots,... (seconds:slots)")
    p.add_argument("--clock", required=True, help="file holding the time of the first call")
    p.add_argument("--host", default="localhost")
    p.add_argument("--event-log", help="the launcher's event log: count each entry's time from "
                   "when the job reached the previous entry's world size")
    a = p.parse_args()
    entries = sorted((float(t), int(n)) for t, n in (e.split(":") for e in a.schedule.split(",")))
    if not os.path.exists(a.clock):
        with open(a.clock, "w") as f:
            f.write(str(time.time()))
    with open(a.clock) as f:
        first_call = float(f.read().strip())
    events = read_events(a.event_log) if a.event_log else None
    print(f"{a.host}:{current_slots(entries, first_call, time.time(), events)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
