"""The job's own goodput model (launcher/apps/batch_goodput.py): Pollux's step-time terms
fitted from steady points, and the batch it chooses."""
import pytest

from launcher.apps.batch_goodput import GoodputModel, PerfParams, StepPoint, fit


def _point(n, hosts, local, accum, truth):
    """A point measured on a job whose true step is ``truth``."""
    compute = accum * (truth.alpha_c + (truth.beta_c + truth.gamma_c * (n / hosts - 1)) * local)
    return StepPoint(n, hosts, local, accum, compute,
                     truth.step_seconds(n, hosts, local, accum) - compute)


def test_fit_recovers_compute_sync_and_shared_host_terms():
    """Ranks sharing a host compute each sample slower (gamma_c): recovered with the rest."""
    truth = PerfParams(alpha_c=0.004, beta_c=0.0002, alpha_r=0.003, beta_r=0.001,
                       alpha_n=0.01, beta_n=0.0, gamma_c=0.0001)
    pts = [_point(n, h, l, a, truth) for n, h, l, a in (
        (1, 1, 16, 1), (2, 1, 16, 1), (2, 1, 32, 2), (4, 1, 16, 1), (4, 2, 48, 1))]
    got = fit(pts)
    for k in ("alpha_c", "beta_c", "alpha_r", "beta_r", "alpha_n", "gamma_c"):
        assert getattr(got, k) == pytest.approx(getattr(truth, k), rel=1e-6, abs=1e-9)


def test_one_local_batch_seen_splits_compute_half_fixed_half_per_sample():
    """AdaptDL's prior: alpha_c is half the compute, so one rank alone sees a larger batch
    as faster per sample and tries it (compute proportional to the batch never would)."""
    got = fit([StepPoint(2, 1, 16, 1, 0.016, 0.004)])
    assert (got.alpha_c, got.beta_c, got.alpha_r) == (pytest.approx(0.008),
                                                      pytest.approx(0.0005),
                                                      pytest.approx(0.004))
    alone = GoodputModel(fit([StepPoint(1, 1, 32, 1, 0.032, 0.0)]), sqr=1.0,
                         var_per_sample=100.0, base_batch=32, min_batch=32, max_batch=512,
                         max_local_batch=512)
    assert alone.best(1)[0] > 32


def test_best_batch_grows_with_the_noise_scale_and_the_sync_cost():
    """Little noise: the base batch is best (a larger one adds time, not progress); a noise
    scale far above the batch with a costly sync: the largest batch the bounds allow."""
    perf = PerfParams(alpha_c=0.002, beta_c=0.0001, alpha_r=0.05)
    quiet = GoodputModel(perf, sqr=1.0, var_per_sample=1.0, base_batch=32, min_batch=32,
                         max_batch=1024, max_local_batch=64)
    assert quiet.best(2)[0] == 32
    noisy = GoodputModel(perf, sqr=1.0, var_per_sample=1e6, base_batch=32, min_batch=32,
                         max_batch=1024, max_local_batch=64)
    batch, goodput = noisy.best(4)
    assert batch == 1024 and goodput > noisy.goodput(4, 1, 32)


def test_a_configuration_seen_again_is_the_mean_of_every_look():
    """A loaded machine's windows move by 2x: the fit takes the mean per configuration, so one
    slow look does not flip the choice back and forth."""
    from launcher.apps.batch_goodput import StepPoints
    pts = StepPoints()
    for compute in (0.010, 0.030, 0.020):
        pts.add(StepPoint(1, 1, 32, 1, compute, 0.0))
    pts.add(StepPoint(1, 1, 64, 1, 0.05, 0.0))
    got = {p.local_batch: p.compute_s for p in pts.points()}
    assert len(pts) == 2 and got[32] == pytest.approx(0.020) and got[64] == 0.05
