"""Chaos (``pytest -m chaos``, or ``make chaos``; not part of ``make test``): seeded random kill -9,
SIGTERM, discovery changes and bad discovery output over the digits job
(benchmarks/faults/chaos.py)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "faults"))
import chaos  # noqa: E402


@pytest.mark.chaos
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_chaos_run_survives_every_fault_with_exactly_once_data(seed, tmp_path):
    r = chaos.run_chaos(seed, n_faults=10, work=tmp_path)
    for f in r.faults:
        print(f"{f.detail}: survived {f.survived} ({f.seconds_to_handled} s)")
    assert len(r.faults) == 10 and all(f.survived for f in r.faults), r.error[-3000:]
    assert r.returncode == 0, r.error[-3000:]
    assert (r.repeated, r.missing) == (0, 0)
    assert r.accuracy >= 0.95
