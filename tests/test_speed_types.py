"""The speed prediction across GPU types (issue 42 s2): held-out rows of CM-DARE's table and a
synthetic law the model must recover; bad input."""
import math

import pytest

from launcher.cluster.speed_types import Row, TypeSpeedModel, leave_one_job_out, mape


def _law(job, gpu, flops, params, n=1, b=1.0):
    tfl = {"k80": 4.113, "p100": 9.526, "v100": 15.7}[gpu]
    # compute part scales with FLOPs / TFLOPS, a per-job overhead does not
    t = flops / (tfl * 1e12 * 0.3) * b + 2e-9 * params * (1 + 0.1 * math.log(n))
    return Row(job, gpu, t, flops, params, n, b)


def test_synthetic_held_out_type_within_10_percent():
    rows = [_law(f"m{i}", g, 1e9 * (1 + i), 1e6 * (3 + 2 * i))
            for i in range(8) for g in ("k80", "p100", "v100")]
    got = leave_one_job_out(rows, lambda r: r.gpu_type != "v100")
    assert len(got) == 8
    assert mape([r.step_s for r, _ in got], [p for _, p in got]) < 0.10
    # the order of the types is right for every held-out job: v100 faster than its k80 row
    for r, p in got:
        k80 = next(x for x in rows if x.job == r.job and x.gpu_type == "k80")
        assert p < k80.step_s


def test_cmdare_held_out_model_rows():
    pytest.importorskip("numpy")
    from launcher.cluster.type_profiles import cmdare_single
    try:
        rows = cmdare_single()
    except FileNotFoundError:
        pytest.skip("no transient-cloud data beside the repository")
    keep = {"Res15", "Res32", "custom4", "custom8", "shake48", "shakebig", "shakesmall"}
    rows = [r for r in rows if r.job in keep]
    got = leave_one_job_out(rows, lambda r: r.gpu_type == "k80")
    assert {r.gpu_type for r, _ in got} == {"p100"}
    assert len(got) == 7 * 13
    err = mape([1 / r.step_s for r, _ in got], [1 / p for _, p in got])
    assert err < 0.15, err


def test_bad_input():
    m = TypeSpeedModel()
    with pytest.raises(RuntimeError):
        m.predict([Row("a", "k80", 0.1, 1e9, 1e6)], "p100")
    with pytest.raises(ValueError):
        m.fit([])
    with pytest.raises(ValueError):
        m.fit([Row("a", "h900", 0.1, 1e9, 1e6)])
    with pytest.raises(ValueError):
        m.fit([Row("a", "k80", -1.0, 1e9, 1e6)])
