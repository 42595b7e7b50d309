"""Straggler mitigation (EDL): a worker slowed 3x (the digits job's --slow-worker) is found from
its compute time and replaced in one stop-free switch; a job without one is left alone; and the
detector's rules at unit level."""
import json
import math
import re

from conftest import long_digits
from launcher.straggler import StragglerDetector, StragglerPolicy
from launcher.telemetry import WorkerStats


def _notes(job, kind):
    if not job.events_path.exists():
        return []
    lines = [json.loads(x) for x in job.events_path.read_text().splitlines() if x]
    return [e for e in lines if e.get("event") == kind]


def test_slow_worker_is_replaced_in_one_switch_and_a_healthy_job_sees_no_straggler(
        tmp_path, job_factory):
    # the default --straggler-ratio 1.5 and --straggler-window 5 (s)
    flags = ["-np", "2", "--min-np", "1", "--max-np", "2", "--discovery-interval", "0.2"]
    slow_dir, clean_dir = tmp_path / "slow", tmp_path / "clean"
    slow_dir.mkdir()
    clean_dir.mkdir()
    from conftest import Job
    slow = Job(slow_dir, flags + ["--straggler-policy", "replace"],
               long_digits(slow_dir, "--step-delay", "0.03", "--slow-worker", "localhost:1:3"),
               hosts="localhost:2\n127.0.0.1:1")
    # the same job at the same time without the slow worker, policy evict: nothing may fire
    clean = Job(clean_dir, flags + ["--straggler-policy", "evict"],
                long_digits(clean_dir, "--step-delay", "0.03"),
                hosts="localhost:2\n127.0.0.1:1")
    try:
        ev = slow.wait_generation(1)
        assert ev["members"] == ["w1@localhost:0", "w2@localhost:1"]
        found = slow.wait_for("the straggler note", lambda: _notes(slow, "straggler"), 60)[0]
        assert found["worker"] == "w2" and found["phase"] == "found"
        assert found["compute_ms"] > 1.5 * found["median_ms"], found
        assert found["replacement_slot"] == "127.0.0.1:0"
        line = re.search(r"hvd-edl-run: straggler: worker w2 on localhost:1 compute "
                         r"([\d.]+) ms/step vs median ([\d.]+) ms for \d+ s", slow.output())
        assert line, slow.output()[-3000:]
        swap = slow.wait_generation(2, timeout_s=90)
        assert swap["kind"] == "replace" and swap["rolled_back_steps"] == 0, swap
        assert swap["members"] == ["w1@localhost:0", "w3@127.0.0.1:0"]
        assert swap["left"] == ["w2@localhost:1"]
        done = slow.wait_for("the replacement note", lambda: [
            n for n in _notes(slow, "straggler") if n.get("phase") == "done"], 30)[0]
        assert done["generations"][0]["kind"] == "replace"
        print(f"straggler: {found['compute_ms']:.1f} vs {found['median_ms']:.1f} ms/step, "
              f"replaced with stall {swap['stall_s']:.3f} s")
        clean_gens = clean.events()
        slow.end_training()
        clean.end_training()
        assert slow.finish() == 0, slow.output()[-3000:]
        assert clean.finish() == 0, clean.output()[-3000:]
        # nothing moved back onto the rested slot; the healthy job never changed
        assert [e["kind"] for e in slow.events()] == ["start", "replace"]
        assert clean_gens and [e["kind"] for e in clean.events()] == ["start"]
        assert _notes(clean, "straggler") == [] and "straggler" not in clean.output()
    finally:
        slow.stop()
        clean.stop()


def _stats(compute_ms, now, rank0=0):
    return [WorkerStats(f"w{i}", "h", i, rank0 + i, compute_s=c / 1e3, updated_at=now)
            for i, c in enumerate(compute_ms)]


def test_detector_needs_the_whole_window_and_ignores_start_up_tiny_steps_and_noise():
    d = StragglerDetector(StragglerPolicy("report", ratio=1.5, window_s=5.0, grace_s=5.0,
                                          floor_s=0.005))
    # start-up: a new generation's first seconds are not judged
    assert d.check(_stats([10, 10, 40], 0.0), 1, 1.0, 0.0) == []
    # above 1.5x the others' median: found only once it held for the whole window
    assert d.check(_stats([10, 10, 40], 6.0), 1, 6.0, 6.0) == []
    assert d.check(_stats([10, 10, 40], 10.0), 1, 10.0, 10.0) == []
    f = d.check(_stats([10, 10, 40], 11.0), 1, 11.0, 11.0)
    assert [x.worker_id for x in f] == ["w2"] and math.isclose(f[0].median_s, 0.010)
    assert d.check(_stats([10, 10, 40], 12.0), 1, 12.0, 12.0) == []  # once per generation
    d.check(_stats([10, 10, 10], 13.0), 1, 13.0, 13.0)
    assert d.check(_stats([10, 10, 40], 19.0), 1, 19.0, 19.0) == []
    # one dip below the threshold starts the count over
    d2 = StragglerDetector(StragglerPolicy("report", window_s=5.0, grace_s=0.0))
    d2.check(_stats([10, 10, 40], 0.0), 1, 10.0, 0.0)
    d2.check(_stats([10, 10, 14], 3.0), 1, 13.0, 3.0)
    assert d2.check(_stats([10, 10, 40], 6.0), 1, 16.0, 6.0) == []
    # two members: the slower one against the faster; equal ones never
    d3 = StragglerDetector(StragglerPolicy("report", window_s=1.0, grace_s=0.0))
    d3.check(_stats([10, 30], 0.0), 1, 10.0, 0.0)
    assert [x.worker_id for x in d3.check(_stats([10, 30], 2.0), 1, 12.0, 2.0)] == ["w1"]
    # tiny steps (others' median below the 5 ms floor) and a ring of one are not judged
    d4 = StragglerDetector(StragglerPolicy("report", window_s=1.0, grace_s=0.0))
    d4.check(_stats([1, 1, 4], 0.0), 1, 10.0, 0.0)
    assert d4.check(_stats([1, 1, 4], 2.0), 1, 12.0, 2.0) == []
    assert d4.check(_stats([40], 3.0), 1, 13.0, 3.0) == []
    # a new generation starts every count over; "off" never judges
    d5 = StragglerDetector(StragglerPolicy("report", window_s=1.0, grace_s=0.0))
    d5.check(_stats([10, 10, 40], 0.0), 1, 10.0, 0.0)
    assert d5.check(_stats([10, 10, 40], 2.0), 2, 12.0, 2.0) == []
    off = StragglerDetector(StragglerPolicy("off", window_s=1.0, grace_s=0.0))
    assert off.check(_stats([10, 40], 0.0), 1, 10.0, 0.0) == []
    assert off.check(_stats([10, 40], 5.0), 1, 15.0, 5.0) == []
