"""hvd-edl-run as a static launcher (issue: foundation)."""
import subprocess
import sys

import pytest

from conftest import LAUNCHER, digits, summary


def run(args, **kw):
    return subprocess.run([LAUNCHER] + args, capture_output=True, text=True, timeout=180, **kw)


@pytest.mark.parametrize("args, message", [
    (["-np", "0", "python", "x.py"], "expected an integer from 1 to 65536, got 0"),
    (["--max-np", "99999999999999999999", "python", "x.py"],
     "expected an integer from 1 to 65536"),
    (["-np", "1", "--"], "no training command given after --"),
    (["-np", "1", "/nonexistent/cmd"], "'/nonexistent/cmd' not found"),
    (["-np", "two", "python", "x.py"], "expected a positive integer, got 'two'"),
    (["-np", "2", "-H", "localhost:zero", "python", "x.py"], "must be a positive integer"),
    (["-np", "2", "-H", "localhost:-1", "python", "x.py"], "must be a positive integer"),
    (["-np", "2", "-H", "bad host!:2", "python", "x.py"], "unknown host syntax"),
    (["-np", "2"], "no training command given"),
    (["--min-np", "3", "--max-np", "2", "python", "x.py"], "larger than --max-np"),
])
def test_bad_flags_exit_2_with_a_clear_message(args, message):
    r = run(args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr


def run_two_workers(tmp_path, source: str):
    """Run ``source`` (a Python script) as 2 workers under hvd-edl-run."""
    script = tmp_path / "worker.py"
    script.write_text("import sys, torch, hvd_edl.torch as hvd\nhvd.init()\n" + source)
    return run(["-np", "2", sys.executable, str(script)])


def test_allreduce_sums_over_two_workers(tmp_path):
    r = run_two_workers(tmp_path,
                        "s = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)\n"
                        "print(f'RESULT rank={hvd.rank()} size={hvd.size()} sum={s.item()}')\n")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = sorted(l for l in r.stdout.splitlines() if "RESULT" in l)
    assert lines == ["[0]<stdout>:RESULT rank=0 size=2 sum=3.0",
                     "[1]<stdout>:RESULT rank=1 size=2 sum=3.0"]


def test_worker_exit_code_3_is_the_launchers_and_names_the_rank(tmp_path):
    r = run_two_workers(tmp_path, "hvd.allreduce(torch.ones(1))\n"
                                  "sys.exit(3 if hvd.rank() == 1 else 0)\n")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "rank 1 on host localhost" in r.stderr
    assert "exit code 3" in r.stderr


# marker long (make test's 15 minutes): make demo reaches the accuracy at world size 3; test_cluster.py trains digits over Gloo on two hosts
@pytest.mark.long
def test_digits_reaches_accuracy_floor_at_two_workers(tmp_path):
    r = run(["-np", "2"] + digits(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    s = summary(tmp_path)
    assert s["world_size"] == 2
    assert s["test_accuracy"] >= 0.95
    assert s["epochs"] == 12 and s["steps"] > 0 and s["wall_s"] > 0
