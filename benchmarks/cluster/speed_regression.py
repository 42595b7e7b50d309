"""CM-DARE's speed regression across GPU types, reproduced on its own data, then on Sia's profiles.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/cluster/speed_regression.py

Measures the held-out error of :class:`launcher.cluster.speed_types.TypeSpeedModel` (a job's speed
on a GPU type it has not run on, from its rows on other types plus each type's TFLOPS and the
model's FLOPs and parameters) and prints it beside CM-DARE's published 3.4 % (Li, Walls and Guo,
arXiv 2004.03072).  Splits (MAPE of steps/s over the held-out rows):

* ``single`` (the headline ``mape``): CM-DARE's one-GPU table, 20 models x K80 / P100 x 13 runs;
  leave one model out: coefficients fitted on the 19 other models (both GPUs), the held-out model
  measured on one GPU, predicted on the other; both directions pooled (520 predictions).
* ``cluster``: CM-DARE's 1..8-worker runs (1 parameter server, 4 models, K80 / P100); leave one
  model out; the held-out model's K80 runs (all sizes) and its 1-worker P100 run known, its 2..8
  worker P100 speeds predicted.
* ``sia``: Sia's per-type profiles (5 applications x t4 / rtx / a100, every placement and batch);
  leave one application out; the held-out application's rows on two types known, its third
  type's rows predicted (each type in turn).

Writes ``benchmarks/results/speed_regression.json``.  Needs ``../shared/traces/transient-cloud``
and ``../shared/traces/sia-sosp23``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from launcher.cluster.speed_types import leave_one_job_out, mape          # noqa: E402
from launcher.cluster.type_profiles import (SIA_TYPES, cmdare_cluster,    # noqa: E402
                                            cmdare_single, sia_profiles)

PUBLISHED_MAPE = 0.034
SPLIT = ("leave-one-model-out on CM-DARE's one-GPU table (speed_data/0latency_norm_computation.csv, "
         "20 models x K80/P100 x 13 runs): fit on the other 19 models, the held-out model measured "
         "on one GPU type, its speed predicted on the other; both directions pooled")


def _mape(pairs):
    return mape([1 / r.step_s for r, _ in pairs], [1 / p for _, p in pairs])


def main() -> int:
    single = cmdare_single()
    pairs = []
    per_dir = {}
    for known in ("k80", "p100"):
        got = leave_one_job_out(single, lambda r, k=known: r.gpu_type == k)
        per_dir[f"known_{known}"] = round(_mape(got), 4)
        pairs += got
    cluster = leave_one_job_out(cmdare_cluster(), lambda r: r.gpu_type == "k80" or r.n == 1)
    sia = {}
    rows = sia_profiles()
    for t in SIA_TYPES:
        got = leave_one_job_out(rows, lambda r, t=t: r.gpu_type != t)
        sia[t] = {"mape": round(_mape(got), 4), "rows": len(got)}
    out = {"mape": round(_mape(pairs), 4), "published_mape": PUBLISHED_MAPE, "split": SPLIT,
           "predictions": len(pairs), "per_direction": per_dir,
           "cluster": {"mape": round(_mape(cluster), 4), "predictions": len(cluster),
                       "split": "leave-one-model-out; K80 1..8 workers and P100 1 worker known, "
                                "P100 2..8 workers predicted (1 parameter server)"},
           "sia": sia}
    print("CM-DARE speed regression, held-out MAPE (steps/s)")
    print(f"{'split':<44}{'ours':>8}{'published':>11}")
    print(f"{'one GPU, unseen type (520 rows)':<44}{out['mape']:>8.1%}{PUBLISHED_MAPE:>11.1%}")
    for k, v in per_dir.items():
        print(f"{'  ' + k:<44}{v:>8.1%}")
    print(f"{'cluster size 2..8 on P100 (28 rows)':<44}{out['cluster']['mape']:>8.1%}")
    for t, v in sia.items():
        print(f"{'Sia profiles, unseen type ' + t + ' (' + str(v['rows']) + ' rows)':<44}"
              f"{v['mape']:>8.1%}")
    res = ROOT / "benchmarks" / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / "speed_regression.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
