"""horovodrun's flags that tune Horovod itself, with horovodrun's meaning.

horovodrun (``horovod/runner/launch.py``, ``parse_args``) turns its tuning, autotune, timeline,
stall-check, library and logging flags into ``HOROVOD_*`` variables for every worker
(``horovod/runner/common/util/config_parser.py``: ``set_env_from_args``), after merging a
``--config-file`` YAML (``set_args_from_config``: a flag given on the command line wins over
the file) and checking the values (``validate_config_args``).  hvd-edl-run declares the same
flags with the same destinations and calls those three functions of the installed Horovod, so
the variables a worker sees are exactly horovodrun's (``tests/test_horovodrun_flags.py``
compares them, and checks that every option horovodrun's own parser has is accepted here).

``-v/--version`` prints Horovod's version and ``-cb/--check-build`` horovodrun's build table
(``horovod.runner.launch.check_build``), both exit 0.  The flags that only mean something to
mpirun or jsrun (``--mpi``, ``--jsrun``, ``--mpi-args``, ``--binding-args``) are refused by the CLI
with what to use instead (:data:`REFUSED`).
"""
from __future__ import annotations

import argparse
from typing import Dict, Set

# the destinations horovodrun's --config-file can set (set_args_from_config); a flag given on
# the command line (its value not None) is never overridden by the file, as in horovodrun
CONFIGURABLE = (
    "fusion_threshold_mb", "cycle_time_ms", "cache_capacity", "hierarchical_allreduce",
    "hierarchical_allgather", "torus_allreduce", "autotune", "autotune_log_file",
    "autotune_warmup_samples", "autotune_steps_per_sample", "autotune_bayes_opt_max_samples",
    "autotune_gaussian_process_noise", "timeline_filename", "timeline_mark_cycles",
    "no_stall_check", "stall_check_warning_time_seconds", "stall_check_shutdown_time_seconds",
    "mpi_threads_disable", "num_nccl_streams", "thread_affinity", "gloo_timeout_seconds",
    "log_level", "log_with_timestamp")

# horovodrun flags that cannot mean anything for an elastic Gloo job: flag -> what to use
REFUSED = {
    "--mpi-args": "it passes arguments to mpirun, and hvd-edl-run runs Horovod over Gloo "
                  "(an MPI world cannot change size): drop it, or run a static job with plain "
                  "mpirun",
    "--binding-args": "it passes process binding arguments to mpirun / jsrun, and hvd-edl-run "
                      "runs Horovod over Gloo: drop it (pin devices with hvd.local_rank())",
}


class _VersionAction(argparse.Action):
    """``-v/--version``: print Horovod's version, as horovodrun does, and exit 0."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        import horovod
        print(horovod.__version__)
        parser.exit(0)


def _pair(group, on: str, off: str, dest: str, help_on: str) -> None:
    """horovodrun's mutually exclusive ``--X`` / ``--no-X`` pair: True / False, None if neither
    was given (so a --config-file value may fill it)."""
    pair = group.add_mutually_exclusive_group()
    pair.add_argument(on, dest=dest, action="store_const", const=True, default=None,
                      help=help_on)
    pair.add_argument(off, dest=dest, action="store_const", const=False, default=None,
                      help=argparse.SUPPRESS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add horovodrun's Horovod-tuning flags to ``p`` (destinations as in horovodrun's parser;
    every value None unless given)."""
    p.add_argument("-v", "--version", action=_VersionAction,
                   help="horovodrun's meaning: print Horovod's version and exit")
    p.add_argument("-cb", "--check-build", dest="check_build", action="store_true",
                   help="horovodrun's meaning: show which frameworks and libraries Horovod was "
                        "built with, and exit")
    p.add_argument("--config-file", dest="config_file", metavar="YAML",
                   help="horovodrun's meaning: a YAML file of Horovod's runtime parameters "
                        "(params, autotune, timeline, stall_check, library_options, logging); "
                        "flags given on the command line win over it")
    g = p.add_argument_group("Horovod tuning (horovodrun's flags; each sets the HOROVOD_* "
                             "variable horovodrun sets, for every worker)")
    g.add_argument("--fusion-threshold-mb", type=int, default=None, metavar="MB",
                   help="HOROVOD_FUSION_THRESHOLD: tensor fusion buffer (0 disables fusion)")
    g.add_argument("--cycle-time-ms", type=float, default=None, metavar="MS",
                   help="HOROVOD_CYCLE_TIME: delay between tensor fusion cycles")
    g.add_argument("--cache-capacity", type=int, default=None, metavar="N",
                   help="HOROVOD_CACHE_CAPACITY: tensor names cached to save coordination")
    _pair(g, "--hierarchical-allreduce", "--no-hierarchical-allreduce", "hierarchical_allreduce",
          "HOROVOD_HIERARCHICAL_ALLREDUCE=1 (--no-...: 0)")
    _pair(g, "--hierarchical-allgather", "--no-hierarchical-allgather", "hierarchical_allgather",
          "HOROVOD_HIERARCHICAL_ALLGATHER=1 (--no-...: 0)")
    _pair(g, "--torus-allreduce", "--no-torus-allreduce", "torus_allreduce",
          "HOROVOD_TORUS_ALLREDUCE=1 (NCCL builds; --no-...: 0)")
    _pair(g, "--autotune", "--no-autotune", "autotune",
          "HOROVOD_AUTOTUNE=1: tune fusion threshold, cycle time and hierarchy while training")
    g.add_argument("--autotune-log-file", default=None, metavar="CSV",
                   help="HOROVOD_AUTOTUNE_LOG (with --autotune)")
    g.add_argument("--autotune-warmup-samples", type=int, default=None, metavar="N",
                   help="HOROVOD_AUTOTUNE_WARMUP_SAMPLES (with --autotune)")
    g.add_argument("--autotune-steps-per-sample", type=int, default=None, metavar="N",
                   help="HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE (with --autotune)")
    g.add_argument("--autotune-bayes-opt-max-samples", type=int, default=None, metavar="N",
                   help="HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES (with --autotune)")
    g.add_argument("--autotune-gaussian-process-noise", type=float, default=None, metavar="X",
                   help="HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE, 0 to 1 (with --autotune)")
    g.add_argument("--timeline-filename", default=None, metavar="JSON",
                   help="HOROVOD_TIMELINE: rank 0 records Horovod's timeline there")
    _pair(g, "--timeline-mark-cycles", "--no-timeline-mark-cycles", "timeline_mark_cycles",
          "HOROVOD_TIMELINE_MARK_CYCLES=1 (with --timeline-filename)")
    _pair(g, "--no-stall-check", "--stall-check", "no_stall_check",
          "HOROVOD_STALL_CHECK_DISABLE=1: no warning when ranks stall")
    g.add_argument("--stall-check-warning-time-seconds", type=int, default=None, metavar="S",
                   help="HOROVOD_STALL_CHECK_TIME_SECONDS")
    g.add_argument("--stall-check-shutdown-time-seconds", type=int, default=None, metavar="S",
                   help="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
    _pair(g, "--mpi-threads-disable", "--no-mpi-threads-disable", "mpi_threads_disable",
          "HOROVOD_MPI_THREADS_DISABLE=1 (MPI only: no effect over Gloo, as with horovodrun)")
    g.add_argument("--tcp", dest="tcp_flag", action="store_true",
                   help="NCCL_IB_DISABLE=1: TCP only")
    g.add_argument("--num-nccl-streams", type=int, default=None, metavar="N",
                   help="HOROVOD_NUM_NCCL_STREAMS (NCCL builds)")
    g.add_argument("--thread-affinity", type=int, default=None, metavar="CPU",
                   help="HOROVOD_THREAD_AFFINITY: Horovod's background thread's CPU")
    g.add_argument("--gloo-timeout-seconds", type=int, default=None, metavar="S",
                   help="HOROVOD_GLOO_TIMEOUT_SECONDS: Gloo operations' timeout")
    stamps = g.add_mutually_exclusive_group()
    stamps.add_argument("--log-with-timestamp", dest="log_with_timestamp",
                        action="store_const", const=True, default=None, help=argparse.SUPPRESS)
    stamps.add_argument("--log-without-timestamp", dest="log_with_timestamp",
                        action="store_const", const=False, default=None,
                        help="HOROVOD_LOG_HIDE_TIME=1: no time in Horovod's own log lines")
    stamps.add_argument("--log-hide-timestamp", dest="log_with_timestamp",
                        action="store_const", const=False, default=None, help=argparse.SUPPRESS)
    stamps.add_argument("--no-log-hide-timestamp", dest="log_with_timestamp",
                        action="store_const", const=True, default=None, help=argparse.SUPPRESS)
    stamps.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp",
                        dest="prefix_output_with_timestamp", action="store_true",
                        help="horovodrun's meaning: each line of a worker's output starts with "
                             "the local time (horovodrun's format: 'Mon Jan  6 10:00:00 2025"
                             "[0]<stdout>:...'); --timestamps also stamps hvd-edl-run's lines")
    for flag in REFUSED:
        p.add_argument(flag, dest=flag.strip("-").replace("-", "_"), default=None,
                       help=argparse.SUPPRESS)


def given(args: argparse.Namespace) -> Set[str]:
    """The configurable destinations given on the command line (horovodrun's
    ``override_args``)."""
    return {d for d in CONFIGURABLE if getattr(args, d, None) is not None}


def apply_config_file(args: argparse.Namespace) -> None:
    """Merge ``args.config_file`` (when given) into ``args`` as horovodrun does, then check the
    values with horovodrun's checks.

    Raises:
        OSError: the file cannot be read.
        ValueError: bad YAML, a bad value (horovodrun's message: ``cycle_time_ms=-1 must be >=
            0``), or a controller other than gloo/mpi.
    """
    from horovod.runner.common.util import config_parser
    if args.config_file:
        import yaml
        with open(args.config_file) as f:
            try:
                config = yaml.load(f, Loader=yaml.FullLoader)
            except yaml.YAMLError as e:
                raise ValueError(f"not YAML: {str(e).splitlines()[0]}") from None
        if config is not None and not isinstance(config, dict):
            raise ValueError("not a YAML mapping (params:, autotune:, timeline:, ...)")
        config_parser.set_args_from_config(args, config or {}, given(args))
    config_parser.validate_config_args(args)


def horovod_env(args: argparse.Namespace) -> Dict[str, str]:
    """The variables horovodrun's ``set_env_from_args`` sets for these flags (``HOROVOD_*`` and
    ``NCCL_IB_DISABLE``), as strings."""
    from horovod.runner.common.util import config_parser
    return config_parser.set_env_from_args({}, args)


def check_build(verbose: bool) -> None:
    """``--check-build``: horovodrun's own table of what Horovod was built with; exits 0."""
    from horovod.runner.launch import check_build as horovod_check_build
    horovod_check_build(verbose)
