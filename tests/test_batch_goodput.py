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


class _FakeJob:
    """A job's telemetry as ``BatchAdapter.tick`` reads it, from a true step-time model with a
    loaded machine's wobble (each look x 0.75 or x 1.25 in turn); ``set_batch`` switches at
    once (a new generation), as the driver does at the next switch."""

    def __init__(self, truth, world_size=2, batch=32, sqr=1.0, var=150.0):
        self.truth, self.world_size, self.batch = truth, world_size, batch
        self.sqr, self.var = sqr, var
        self.generation, self.looks, self.batch_pinned = 1, 0, None
        self.history = [batch]
        self.spec = type("Spec", (), {"max_np": 4})()

    def telemetry_snapshot(self):
        from launcher.cluster.goodput import split_batch
        micro, accum = split_batch(self.batch, self.world_size, 64)
        self.looks += 1
        wobble = 0.75 if self.looks % 2 else 1.25
        step = self.truth.step_seconds(self.world_size, 1, micro, accum + 1) * wobble
        sync = self.truth.alpha_r
        return {"job": {"generation": self.generation, "world_size": self.world_size,
                        "compute_s": step - sync * wobble, "wait_s": sync * wobble},
                "adaptive_batch": {"batch": self.batch, "world_size": self.world_size,
                                   "local_batch": micro, "accumulation": accum + 1,
                                   "base_batch": 32, "min_batch": 32, "max_batch": 512,
                                   "max_local_batch": 64},
                "gradient_noise": {"sqr": self.sqr, "var": self.var,
                                   "noise_scale_samples": self.var / self.sqr},
                "workers": [{"host": "h", "rank": 0}, {"host": "h", "rank": 1}]}

    def note(self, *a, **k):
        pass

    def set_batch(self, batch, pin=True):
        assert not pin, "the chooser must not pin"
        if self.batch_pinned is None and batch != self.batch:
            self.batch, self.generation = batch, self.generation + 1
            self.history.append(batch)


def _run(adapter, job, seconds, start=0.0):
    for t in range(int(seconds)):
        adapter.tick(start + t)
    return start + seconds


def test_chooser_tries_the_prior_once_and_does_not_ping_pong_on_a_wobbling_machine():
    # compute-bound (no per-step overhead), as the large CNN on these cores: every batch above
    # 32 loses efficiency for no throughput; the prior's first try is optimistic
    from launcher.apps.batch_goodput import BatchAdapter
    job = _FakeJob(PerfParams(alpha_c=0.0, beta_c=0.002, alpha_r=0.01))
    adapter = BatchAdapter(job)
    _run(adapter, job, 300)
    changes = len(job.history) - 1
    assert changes <= 2, job.history       # one try, one return at most in 5 minutes
    assert job.history[-1] == 32, job.history
    # each change beat the current batch's measured goodput by > 5 %; none within HOLD_S
    assert all(d["goodput"] > 1.05 * d["current_goodput"] for d in adapter.decisions)
    at = [d["at"] for d in adapter.decisions]
    assert len(at) == changes


def test_chooser_moves_to_a_batch_that_pays_and_stays():
    # overhead-bound (as the small CNN): a larger batch pays; the noise scale is large
    from launcher.apps.batch_goodput import BatchAdapter
    job = _FakeJob(PerfParams(alpha_c=0.05, beta_c=0.0002, alpha_r=0.02), var=2000.0)
    adapter = BatchAdapter(job)
    _run(adapter, job, 300)
    assert job.batch > 32 and len(job.history) - 1 <= 3, job.history
    last = job.history[-1]
    assert job.history.count(last) == 1 or job.history[-2] != job.history[-3], job.history


def test_an_operators_batch_pins_it_until_auto():
    from launcher.apps.batch_goodput import BatchAdapter
    job = _FakeJob(PerfParams(alpha_c=0.0, beta_c=0.002, alpha_r=0.01))  # 512 loses
    adapter = BatchAdapter(job)
    job.batch_pinned, job.batch = 512, 512   # hvd-edl-ctl batch 512 (clamped by the script)
    t = _run(adapter, job, 120)
    assert job.history == [32] and adapter.decisions == []   # the chooser left it alone
    job.batch_pinned = None                  # hvd-edl-ctl batch auto
    job.generation += 1
    _run(adapter, job, 120, start=t)
    assert job.history[-1] < 512 and adapter.decisions, "the chooser decides again after auto"
