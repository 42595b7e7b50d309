#!/usr/bin/env python3
"""Host discovery from a plain hosts file, re-read at every call: edit the file (atomically,
e.g. write a copy and ``mv`` it over) and the job follows.

    python -m launcher.discovery.hostsfile hosts.txt

The file holds one ``host[:slots]`` (or ``host slots=N``) a line, ``#`` comments allowed.  It is
validated before anything is printed: a malformed line or a host listed twice exits 1 with the
line's number, so the launcher keeps its last good host set instead of acting on half a file.
"""
import argparse
import sys
from pathlib import Path
from typing import List, Optional

if not __package__:  # run as a file: import from the repository, not from this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from launcher.discovery.hosts import HostSpecError, format_host_entry, parse_host_lines  # noqa: E402


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="hostsfile", description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="the hosts file")
    a = p.parse_args(argv)
    try:
        with open(a.path) as f:
            hosts = parse_host_lines(f.read(), default_slots=None)
    except (OSError, HostSpecError) as e:
        print(f"hostsfile: {a.path}: {e}", file=sys.stderr)
        return 1
    if not hosts:
        print(f"hostsfile: {a.path} lists no hosts", file=sys.stderr)
        return 1
    print("\n".join(format_host_entry(h, s) for h, s in hosts.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
