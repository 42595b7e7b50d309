"""What a zygote's staleness check costs per fork request: ``hvd_edl.zygote.stale()`` (one stat
per loaded module, then ``hvd_edl.module_shadows.shadows()``: one stat per sys.path entry, a
listing only of entries that changed), with ``hvd_edl.torch`` imported as in a zygote, and the
shadow part alone.  Medians of N calls, milliseconds; also after an unrelated file appears in
the first sys.path entry (its one new listing).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/job/zygote_stale_check.py [--calls 50]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def _median_ms(fn, calls):
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    early = tempfile.mkdtemp(prefix="hvd-edl-stale-bench-")
    sys.path[:] = [early] + [p for p in sys.path if p]   # a zygote has no '' entry
    import hvd_edl.torch  # noqa: F401 - what a zygote holds
    from hvd_edl import module_shadows, zygote
    zygote._SHADOWS_AT_START.update(module_shadows.shadows())
    out = {"modules": len(sys.modules), "sys_path_entries": len(sys.path),
           "stale_ms": _median_ms(zygote.stale, args.calls),
           "shadows_ms": _median_ms(module_shadows.shadows, args.calls)}
    open(os.path.join(early, "unrelated.py"), "w").close()
    t = time.perf_counter()
    assert zygote.stale() is None
    out["stale_after_unrelated_file_ms"] = (time.perf_counter() - t) * 1e3
    os.unlink(os.path.join(early, "unrelated.py"))
    os.rmdir(early)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
