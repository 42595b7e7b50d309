#!/usr/bin/env python3
"""Host discovery that follows a timetable, standing for a cluster whose spot nodes come and go.

    discover_timetable.py --schedule 0:2,8:4,20:1,30:3 --clock /tmp/clock [--host localhost]

prints ``host:N`` where N is the slot count of the latest schedule entry whose time (seconds since
the first call, remembered in the --clock file) has passed.  Horovod's discovery format.
"""
import argparse
import os
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", required=True, help="t0:slots,t1:slots,... (seconds:slots)")
    p.add_argument("--clock", required=True, help="file holding the time of the first call")
    p.add_argument("--host", default="localhost")
    a = p.parse_args()
    entries = sorted((float(t), int(n)) for t, n in (e.split(":") for e in a.schedule.split(",")))
    if not os.path.exists(a.clock):
        with open(a.clock, "w") as f:
            f.write(str(time.time()))
    with open(a.clock) as f:
        elapsed = time.time() - float(f.read().strip())
    slots = [n for t, n in entries if t <= elapsed][-1]
    print(f"{a.host}:{slots}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
