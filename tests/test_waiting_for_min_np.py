"""Below ``--min-np`` the launcher says what it waits for (issue 30, item 7): at once, then every
``WAIT_REPORT_S`` (30 s; ``HVD_EDL_WAIT_REPORT_S`` shortens it here) until the ring forms or
``--elastic-timeout`` ends the job.  Before: nothing was printed until the timeout (600 s by
default) ran out."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from conftest import LAUNCHER

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
AWAITED = "hvd-edl-run: waiting for 3 usable slots (--min-np), 2 offered: localhost:2"


def test_the_wait_for_min_np_is_said_at_once_and_repeated():
    env = dict(os.environ, HVD_EDL_WAIT_REPORT_S="1")
    start = time.monotonic()
    proc = subprocess.Popen([LAUNCHER, "-np", "3", "--min-np", "3", "-H", "localhost:2",
                             "--elastic-timeout", "3.5", *SLEEPER], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    said = []
    try:
        for line in proc.stdout:
            if line.startswith(AWAITED):
                said.append((time.monotonic() - start, line.strip()))
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    assert said, "never said what it waits for"
    first_s, first = said[0]
    assert first_s < 10, said  # at once (the launcher's own start-up aside)
    assert "the job ends in 4 s (--elastic-timeout)" in first or \
        "the job ends in 3 s (--elastic-timeout)" in first, first
    assert 3 <= len(said) <= 6, said  # again every second until the timeout, not every pass
    assert code == 1
