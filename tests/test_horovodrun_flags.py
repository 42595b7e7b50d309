"""horovodrun's whole command line under hvd-edl-run (issue 30, item 4): every option of the
installed Horovod's own parser (``horovod.runner.launch.parse_args``) is accepted, with
horovodrun's meaning: the tuning flags give a worker exactly the ``HOROVOD_*`` variables
horovodrun's own code computes (``config_parser.set_env_from_args``, after ``--config-file``),
``--version`` and ``--check-build`` print what horovodrun prints; only the flags that mean
nothing for an elastic Gloo job are refused, in one line saying what to use instead.

Before: ``--fusion-threshold-mb``, ``--cycle-time-ms``, ``--autotune``, ``--timeline-filename``,
``--no-stall-check``, ``--config-file``, ``--check-build``, ``--tcp``, ``--version``... were
unrecognized arguments (exit 2), some with a wrong suggestion (``--check-build (did you mean
--checkpoint-dir?)``)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from conftest import LAUNCHER, ROOT

from horovod.runner.common.util import config_parser
from launcher.cli import parse_spec

PY = sys.executable
HOROVODRUN = os.path.join(os.path.dirname(PY), "horovodrun")
# what config_parser can set: a worker must see these exactly as horovodrun computes them
TUNING_VARS = {v for k, v in vars(config_parser).items()
               if k.isupper() and isinstance(v, str) and v.startswith(("HOROVOD_", "NCCL_"))
               and k != "LOG_LEVELS"}


class _Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def horovodrun_parser() -> argparse.ArgumentParser:
    """horovodrun's own parser, as ``horovod.runner.launch.parse_args`` builds it (caught at its
    ``parse_args`` call, so a flag a future Horovod adds is listed here too)."""
    from horovod.runner import launch

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture
    try:
        launch.parse_args()
    except _Captured as c:
        return c.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError("horovod.runner.launch.parse_args built no parser")


def horovodrun_env(flags, monkeypatch) -> dict:
    """The variables horovodrun's own code sets for ``flags`` (what its ``_run_elastic`` and
    ``_launch_job`` add to the workers' environment)."""
    from horovod.runner import launch
    monkeypatch.setattr(sys, "argv", ["horovodrun", "-np", "1", *flags, "python", "x.py"])
    return config_parser.set_env_from_args({}, launch.parse_args())


def _values(action, tmp_path):
    """Command-line values for one of horovodrun's options."""
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:1\n")
    script.chmod(0o755)
    (tmp_path / "hosts.txt").write_text("localhost slots=1\n")
    (tmp_path / "config.yaml").write_text("params:\n  cycle_time_ms: 3\n")
    by_dest = {"hosts": "localhost:1", "hostfile": str(tmp_path / "hosts.txt"),
               "host_discovery_script": str(script),
               "config_file": str(tmp_path / "config.yaml"),
               "output_filename": str(tmp_path / "out"), "nics": "lo", "log_level": "INFO",
               "autotune_gaussian_process_noise": "0.5", "cooldown_range": ["1", "2"]}
    nargs = action.nargs
    if nargs == 0 or (nargs is None and action.const is not None) or \
            isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                argparse._VersionAction, argparse._HelpAction)):
        return []
    value = by_dest.get(action.dest)
    if value is None:
        value = "1" if action.type in (int, float) else str(tmp_path / action.dest)
    return value if isinstance(value, list) else [value]


def test_every_option_of_horovodruns_own_parser_is_accepted(tmp_path, capsys, monkeypatch):
    """Each option string horovodrun's parser has, alone with its value(s), parses here (or
    prints and exits 0 as horovodrun's --version / --check-build do); the only refusals are the
    MPI-only flags, in one line with what to use instead, never an unrecognized argument."""
    # the real table takes seconds (see test_version_and_check_build_print_what_horovodrun_prints)
    monkeypatch.setattr("launcher.horovodrun_flags.check_build", lambda verbose: sys.exit(0))
    refused, checked = {}, 0
    for action in horovodrun_parser()._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        for opt in action.option_strings:
            argv = ["-np", "1", opt, *_values(action, tmp_path), "true"]
            if opt in ("-np", "--num-proc"):
                argv = argv[2:]
            try:
                parse_spec(argv)
                code = 0
            except SystemExit as e:
                code = e.code
            err = capsys.readouterr().err
            checked += 1
            assert "unrecognized arguments" not in err and "invalid choice" not in err, \
                (opt, err)
            if code != 0:
                refused[opt] = err.strip().splitlines()
    assert checked >= 65, checked  # horovodrun 0.28.1 has 71 option strings (help aside)
    assert set(refused) == {"--mpi", "--jsrun", "--mpi-args", "--binding-args"}, refused
    for opt, lines in refused.items():
        assert len(lines) == 1 and f"{opt} is not supported" in lines[0] \
            and ("drop it" in lines[0] or "Drop the flag" in lines[0]), (opt, lines)


FLAG_SETS = [
    ["--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5", "--cache-capacity", "512",
     "--hierarchical-allreduce", "--no-hierarchical-allgather", "--autotune",
     "--autotune-log-file", "tune.csv", "--autotune-warmup-samples", "2",
     "--autotune-steps-per-sample", "5", "--autotune-bayes-opt-max-samples", "7",
     "--autotune-gaussian-process-noise", "0.3", "--timeline-filename", "tl.json",
     "--timeline-mark-cycles", "--no-stall-check", "--stall-check-warning-time-seconds", "20",
     "--stall-check-shutdown-time-seconds", "40", "--tcp", "--thread-affinity", "1",
     "--gloo-timeout-seconds", "45", "--num-nccl-streams", "2", "--mpi-threads-disable",
     "--log-level", "INFO", "--log-without-timestamp"],
    # the autotune knobs without --autotune, and the timeline cycles without a file: unset
    ["--autotune-warmup-samples", "2", "--timeline-mark-cycles", "--stall-check",
     "--no-torus-allreduce", "--log-with-timestamp"],
    [],
]


@pytest.mark.parametrize("flags", FLAG_SETS, ids=["all", "dependent", "none"])
def test_tuning_flags_give_horovodruns_variables(flags, monkeypatch):
    expected = horovodrun_env(flags, monkeypatch)
    assert parse_spec(["-np", "1", *flags, "true"]).horovod_env == expected


def test_config_file_is_merged_as_horovodrun_merges_it(tmp_path, monkeypatch, capsys):
    """The YAML's values apply unless the same parameter is given as a flag (horovodrun's rule,
    whatever the order); a bad value is horovodrun's message, exit 2."""
    cfg = tmp_path / "horovod.yaml"
    cfg.write_text("params:\n  fusion_threshold_mb: 16\n  cycle_time_ms: 7\n"
                   "  hierarchical_allreduce: true\nautotune:\n  enabled: true\n"
                   "  warmup_samples: 4\ntimeline:\n  filename: t.json\n  mark_cycles: true\n"
                   "stall_check:\n  enabled: false\n  warning_time_seconds: 9\n"
                   "library_options:\n  gloo_timeout_seconds: 50\nlogging:\n  level: DEBUG\n")
    flags = ["--cycle-time-ms", "3", "--config-file", str(cfg), "--no-hierarchical-allreduce"]
    expected = horovodrun_env(flags, monkeypatch)
    assert expected["HOROVOD_CYCLE_TIME"] == "3.0" and expected["HOROVOD_AUTOTUNE"] == "1"
    assert parse_spec(["-np", "1", *flags, "true"]).horovod_env == expected
    cfg.write_text("params:\n  cycle_time_ms: -1\n")
    with pytest.raises(SystemExit) as e:
        parse_spec(["-np", "1", "--config-file", str(cfg), "true"])
    assert e.value.code == 2 and "cycle_time_ms=-1 must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        parse_spec(["-np", "1", "--config-file", str(tmp_path / "none.yaml"), "true"])
    assert e.value.code == 2 and "cannot read it" in capsys.readouterr().err


def test_a_worker_sees_exactly_the_variables_horovodrun_sets(tmp_path, monkeypatch):
    """The real launcher: the worker's ``HOROVOD_*`` tuning variables are those horovodrun's
    code computes for the same flags, none more (the launcher's environment held none).  Remote
    workers get the same environment (test_cluster.py, ``--fusion-threshold-mb``)."""
    flags = FLAG_SETS[0]
    expected = horovodrun_env(flags, monkeypatch)
    dump = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"
    env = {k: v for k, v in os.environ.items() if k not in TUNING_VARS}
    r = subprocess.run([LAUNCHER, "-np", "1", *flags, PY, "-c", dump, str(tmp_path / "env")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = json.loads((tmp_path / "env").read_text())
    assert {k: v for k, v in seen.items() if k in TUNING_VARS} == expected
    assert len(expected) >= 20, expected


def test_version_prints_what_horovodrun_prints():
    for flag in ("--version", "-v"):
        ours = subprocess.run([LAUNCHER, flag], capture_output=True, text=True, timeout=60)
        theirs = subprocess.run([HOROVODRUN, flag], capture_output=True, text=True, timeout=60)
        assert (ours.returncode, ours.stdout) == (0, theirs.stdout), (flag, ours.stderr)
        assert theirs.returncode == 0 and theirs.stdout.strip()


# marker long: Horovod's build table takes 5-25 s on 2 cores (it imports each framework in
# subprocesses), whoever prints it
@pytest.mark.long
def test_check_build_prints_what_horovodrun_prints():
    """``--check-build`` (``-cb`` is the same option, see the enumeration above) prints the
    installed horovodrun's table and exits 0; ``make setup`` wrote horovodrun's to
    build/check-build.txt, so only ours is run when that file exists."""
    ours = subprocess.run([LAUNCHER, "--check-build"], capture_output=True, text=True,
                          timeout=120)
    table = ROOT / "build" / "check-build.txt"
    theirs = table.read_text() if table.exists() else subprocess.run(
        [HOROVODRUN, "--check-build"], capture_output=True, text=True, timeout=120).stdout
    assert (ours.returncode, ours.stdout) == (0, theirs), ours.stderr
    assert "Available Frameworks:" in theirs


@pytest.mark.parametrize("typed, meant", [("--chek-build", "--check-build"),
                                          ("--min_np", "--min-np"),
                                          ("--max-nps", "--max-np"),
                                          ("--fusion-treshold-mb", "--fusion-threshold-mb")])
def test_a_mistyped_flag_names_the_one_meant(typed, meant, capsys):
    with pytest.raises(SystemExit) as e:
        parse_spec(["-np", "1", typed, "true"] if typed != "--min_np" else
                   [typed, "2", "true"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"unrecognized arguments: {typed} (did you mean {meant}?)" \
        in err, err


def _horovodrun_prefixed(text: str) -> str:
    """What horovodrun's own output pump (``safe_shell_exec.prefix_connection``) writes for
    ``text`` from rank 0's stdout with ``--prefix-output-with-timestamp``."""
    import io
    from horovod.runner.common.util.safe_shell_exec import prefix_connection
    r, w = os.pipe()
    os.write(w, text.encode())
    os.close(w)
    out = io.StringIO()
    with os.fdopen(r, "rb") as src:
        prefix_connection(src, out, "stdout", 0, True)
    return out.getvalue()


def _stamped(line: str) -> str:
    """``line`` less its leading ``time.asctime()`` stamp (which must parse as one)."""
    import time
    time.strptime(line[:24], "%a %b %d %H:%M:%S %Y")
    return line[24:]


def test_prefix_output_with_timestamp_stamps_worker_lines_as_horovodrun(tmp_path):
    """horovodrun's flag, its format (``Mon Jan  6 10:00:00 2025[0]<stdout>:hi``) for the
    workers' lines; hvd-edl-run's own lines stay as they were (horovodrun stamps only the
    workers')."""
    theirs = _horovodrun_prefixed("hi\n").rstrip("\n")
    assert _stamped(theirs) == "[0]<stdout>:hi"
    r = subprocess.run([LAUNCHER, "-np", "1", "-prefix-timestamp", PY, "-c", "print('hi')"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.endswith("<stdout>:hi"))
    assert _stamped(line) == "[w1]<stdout>:hi", line
    assert any(x.startswith("hvd-edl-run: worker w1 started") for x in r.stdout.splitlines())


def test_timestamps_stamp_the_launchers_lines_too(tmp_path):
    """``--timestamps``: a log read after the fact places every line in time, the launcher's
    own (stdout and stderr) with the same stamp and a space."""
    r = subprocess.run([LAUNCHER, "-np", "1", "--timestamps", PY, "-c",
                        "import sys; print('hi'); sys.exit(3)"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stderr
    lines = r.stdout.splitlines() + r.stderr.splitlines()
    assert any(_stamped(x) == "[w1]<stdout>:hi" for x in lines), lines
    own = [x for x in lines if "hvd-edl-run:" in x]
    assert own and all(_stamped(x).startswith(" hvd-edl-run: ") for x in own), own
    assert any("failed with exit code 3" in x for x in r.stderr.splitlines()), r.stderr
