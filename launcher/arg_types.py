"""argparse types shared by ``hvd-edl-run`` and ``hvd-edl-cluster``: a bad value is one line
(``expected ...``) and exit code 2, as argparse does for every ``ArgumentTypeError``."""
from __future__ import annotations

import argparse

MAX_WORKERS = 65536  # upper bound of -np/--min-np/--max-np/--slots-per-host (a sanity limit)


def positive_int(text: str) -> int:
    """A worker or slot count: an integer from 1 to :data:`MAX_WORKERS`."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if not 1 <= v <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"expected an integer from 1 to {MAX_WORKERS}, got {v}")
    return v


MAX_PRIORITY = 10 ** 9  # a job priority's bound either side of 0 (the store holds 64 bits)


def priority(text: str) -> int:
    """A job's priority: an integer from -:data:`MAX_PRIORITY` to :data:`MAX_PRIORITY`."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not -MAX_PRIORITY <= v <= MAX_PRIORITY:
        raise argparse.ArgumentTypeError(f"expected an integer from -{MAX_PRIORITY} to "
                                         f"{MAX_PRIORITY}, got {v}")
    return v


def positive_float(text: str) -> float:
    """A number above 0 (seconds, ratios)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return v


def nonnegative_float(text: str) -> float:
    """A finite number from 0 (seconds; 0 often meaning "none")."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0, got {text!r}") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number from 0, got {text}")
    return v


def tcp_port(text: str) -> int:
    """A TCP port from 0 to 65535 (0: any free one)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 0 to 65535, got {text!r}") \
            from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 0 to 65535 (0: any free "
                                         f"one), got {v}")
    return v
