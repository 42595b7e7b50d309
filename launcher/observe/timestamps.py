"""Lines that carry the time they were written, for logs read after the fact.

* ``--prefix-output-with-timestamp`` (horovodrun's flag, horovodrun's format from
  ``horovod/runner/common/util/safe_shell_exec.py``, ``prefix_connection``): each line of a
  worker's output starts with the local time, ``time.asctime()``, glued to its prefix:
  ``Mon Jan  6 10:00:00 2025[0]<stdout>:loss 0.3``.  horovodrun stamps the workers' lines only.
* ``--timestamps`` (ours): the workers' lines as above, and every line hvd-edl-run writes itself
  (a switch, a straggler, a failure) with the same time and a space: ``Mon Jan  6 10:00:00
  2025 hvd-edl-run: generation 2 (scale_out) ...``, through :class:`StampedStream` around the
  launcher's stdout and stderr.  Seconds, like horovodrun's; the event log has exact times.
"""
from __future__ import annotations

import threading
import time


def stamp() -> str:
    """The local time as horovodrun prefixes lines with it (``time.asctime``, 24 characters)."""
    return time.asctime(time.localtime(time.time()))


class StampedStream:
    """A text stream whose every line starts with :func:`stamp` and a space; everything else
    (``fileno``, ``isatty``, ``encoding``...) is the wrapped stream's.  Thread-safe: a line's
    start is tracked under a lock, so two threads printing at once never split a stamp."""

    def __init__(self, stream):
        self._stream = stream
        self._lock = threading.Lock()
        self._at_line_start = True

    def write(self, text: str) -> int:
        if not text:
            return 0
        with self._lock:
            out = []
            for piece in text.splitlines(keepends=True):
                if self._at_line_start:
                    out.append(stamp() + " ")
                out.append(piece)
                self._at_line_start = piece.endswith(("\n", "\r"))
            self._stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)
