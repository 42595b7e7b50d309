"""One rank of ``benchmarks/job/scale.py --parts init``: Horovod's Gloo set-up timed in a loop, the
way a switch does it (``hvd.init()`` against a fresh rendezvous, one allreduce,
``hvd.shutdown()``).  Not a benchmark of its own: scale.py starts N of them (``python
benchmarks/job/scale_worker.py`` in each rank's environment, ``benchmarks.common.ring_env``).

The harness sends one JSON line per round on stdin: ``{"port", "token", "fast"}`` (the
generation's rendezvous port and token, and ``HVD_EDL_GLOO_FAST_INIT`` for this init: our patch
0004 on or off, read by Horovod at each init); the rank answers one JSON line on stdout:
``{"rank", "init_s", "init_cpu_s", "allreduce_s", "shutdown_s", "ok"}`` (seconds,
``time.monotonic()``; ``init_cpu_s``: this process's CPU time in ``hvd.init()``, all threads).
An empty line or end of input ends it.  Rank, size and the rest come from the environment, as
a launcher sets them (``HOROVOD_RANK``, ``HOROVOD_SIZE``, ...).
"""
import json
import os
import sys
import time

import torch
import horovod.torch as hvd


def main() -> int:
    torch.set_num_threads(1)
    for line in sys.stdin:
        if not line.strip():
            break
        r = json.loads(line)
        os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"] = str(r["port"])
        os.environ["HOROVOD_GLOO_RENDEZVOUS_TOKEN"] = r["token"]
        os.environ["HVD_EDL_GLOO_FAST_INIT"] = "1" if r["fast"] else "0"
        t0, c0 = time.monotonic(), time.process_time()
        hvd.init()
        t1, c1 = time.monotonic(), time.process_time()
        total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="check").item()
        t2 = time.monotonic()
        hvd.shutdown()
        t3 = time.monotonic()
        print(json.dumps({"rank": int(os.environ["HOROVOD_RANK"]), "init_s": t1 - t0,
                          "init_cpu_s": c1 - c0,
                          "allreduce_s": t2 - t1, "shutdown_s": t3 - t2,
                          "ok": total == float(os.environ["HOROVOD_SIZE"])}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
