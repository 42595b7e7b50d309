#!/usr/bin/env python3
"""Run one set-up step and show what it does, with elapsed time, without its noise.

    python cmake/progress.py "installing requirements" --log build/setup-pip.log -- \\
        .venv/bin/python -m pip install -r requirements.txt

Every line the command prints goes to ``--log``.  On the terminal: the lines that say what is
being installed or built (pip's ``Collecting`` / ``Installing collected packages`` /
``Successfully installed``, cmake's ``[ 42%]`` build progress and our ``applied Horovod patch``
lines), at most one a second and a build's percentage only when it moved, each prefixed with
the elapsed time; a ``still ...`` line when the command has said nothing worth showing for
``--heartbeat`` seconds; ``done in ...`` at the end.  A failing command's last 40 log lines are
printed and its exit code returned.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time
from typing import List, Optional

SHOWN = [
    (re.compile(r"^\s*Collecting (\S+)"), "collecting {0}"),
    (re.compile(r"^\s*Installing collected packages: (.+)$"), "installing {0}"),
    (re.compile(r"^\s*Successfully installed (.+)$"), "installed {0}"),
    (re.compile(r"^\s*Building wheel for (\S+)"), "building a wheel for {0}"),
    (re.compile(r"^\s*Obtaining (\S+)"), "obtaining {0}"),
    (re.compile(r"^-- (applied Horovod patch \S+)"), "{0}"),
    (re.compile(r"^-- (Horovod .* nothing to do)"), "{0}"),
    (re.compile(r"^(?:.*\s)?(ERROR|error): (.+)$"), "{0}: {1}"),
]
BUILD = re.compile(r"^\s*\[\s*(\d+)%\]\s+(?:Building \S+ object \S*?([^/\s]+)\.o|(.*))")
MIN_GAP_S = 1.0
TAIL_LINES = 40


def elapsed(seconds: float) -> str:
    """``75.2`` -> ``"1 min 15 s"``; ``9.3`` -> ``"9 s"``."""
    s = int(seconds)
    return f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{s} s"


class Progress:
    """Picks the lines worth showing from a command's output; see the module docstring."""

    def __init__(self, label: str, out=sys.stdout, heartbeat_s: float = 20.0):
        self.label = label
        self.out = out
        self.heartbeat_s = heartbeat_s
        self.start = time.monotonic()
        self.last_shown = float("-inf")
        self.last_percent = -10
        self.latest: Optional[str] = None  # the newest line worth showing, maybe not yet shown
        self.lock = threading.Lock()

    def say(self, text: str) -> None:
        with self.lock:
            self.out.write(f"  [{elapsed(time.monotonic() - self.start):>10}] {text}\n")
            self.out.flush()
            self.last_shown = time.monotonic()

    def feed(self, line: str) -> None:
        """One output line of the command."""
        text = self.pick(line.rstrip())
        if text is None:
            return
        self.latest = text
        if time.monotonic() - self.last_shown >= MIN_GAP_S or text.startswith(("installed",
                                                                                "error")):
            self.say(text)
            self.latest = None

    def pick(self, line: str) -> Optional[str]:
        m = BUILD.match(line)
        if m:
            percent = int(m.group(1))
            if percent < self.last_percent + 10 and percent != 100:
                return None
            self.last_percent = percent
            what = m.group(2) or (m.group(3) or "").strip()
            return f"building: {percent}%" + (f" ({what})" if what else "")
        for pattern, fmt in SHOWN:
            m = pattern.match(line)
            if m:
                text = fmt.format(*m.groups())
                return text if len(text) <= 160 else text[:157] + "..."
        return None

    def beat(self, done: threading.Event) -> None:
        while not done.wait(1.0):
            if time.monotonic() - self.last_shown >= self.heartbeat_s:
                self.say(self.latest or f"still {self.label}")
                self.latest = None


def run(label: str, command: List[str], log_path: Optional[str], heartbeat_s: float,
        out=sys.stdout) -> int:
    """Run ``command``; returns its exit code.

    Raises:
        OSError: the log file cannot be written or the command cannot be started.
    """
    out.write(f"set-up: {label} ...\n")
    out.flush()
    progress = Progress(label, out, heartbeat_s)
    log = open(log_path, "w") if log_path else None
    tail: List[str] = []
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    done = threading.Event()
    beater = threading.Thread(target=progress.beat, args=(done,), daemon=True)
    beater.start()
    try:
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            if log:
                log.write(line)
            tail = (tail + [line.rstrip("\n")])[-TAIL_LINES:]
            progress.feed(line)
        code = proc.wait()
    finally:
        done.set()
        if log:
            log.close()
    took = elapsed(time.monotonic() - progress.start)
    if code != 0:
        out.write(f"set-up: {label} FAILED (exit code {code}) after {took}; last lines"
                  f"{' of ' + log_path if log_path else ''}:\n")
        out.write("".join(f"    {line}\n" for line in tail))
    else:
        out.write(f"set-up: {label}: done in {took}\n")
    out.flush()
    return code


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="progress.py", usage="%(prog)s LABEL [--log FILE] "
                                "[--heartbeat S] -- COMMAND...",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("label", help="what the step does, e.g. 'installing requirements'")
    p.add_argument("--log", help="write the command's whole output here")
    p.add_argument("--heartbeat", type=float, default=20.0,
                   help="seconds of silence before a 'still ...' line (default 20)")
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        p.error("no command given after --")
    cut = argv.index("--")
    a = p.parse_args(argv[:cut])
    return run(a.label, argv[cut + 1:], a.log, a.heartbeat)


if __name__ == "__main__":
    sys.exit(main())
