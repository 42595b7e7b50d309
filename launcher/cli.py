"""``hvd-edl-run``: horovodrun's flags with horovodrun's meaning, elastic by design.

    hvd-edl-run -np 2 python train.py                                   # static, localhost
    hvd-edl-run -np 2 -H a:2,b:2 python train.py                        # static, two hosts
    hvd-edl-run -np 2 --min-np 1 --max-np 8 \\
        --host-discovery-script ./discover_hosts.sh python train.py     # elastic

Bad flags exit with code 2 and one clear line (a mistyped flag names the closest one: "did you
mean --max-np?").  The job's exit code is 0 when it finished, the first failing worker's exit code
in a static job (the message names its rank and host), 1 when an elastic job cannot go on.

horovodrun flags a user copies from an existing command keep their meaning where it applies:
``--log-level`` (Horovod's backend log level for the workers, and the launcher's own: DEBUG or
TRACE also shows the protocol traffic), ``--gloo`` (accepted: Gloo is the only controller),
``--output-filename DIR`` (each worker's output also goes to ``DIR/worker.<id>/stdout`` and
``stderr``), ``--disable-cache`` (accepted, no effect: hvd-edl-run runs no cached start-up checks)
and ``--verbose``; the flags that tune Horovod itself (``--fusion-threshold-mb``, ``--autotune``,
``--timeline-filename``, ``--config-file``, ...), ``--version`` and ``--check-build`` are
horovodrun's (``launcher/horovodrun_flags.py``).  ``--mpi`` / ``--jsrun`` / ``--mpi-args`` /
``--binding-args`` exit 2 saying what to use instead.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from typing import List, Optional


from launcher import horovodrun_flags
from launcher.network_interface import interface_address
from launcher.discovery import FixedHosts, HostDiscoveryScript
from launcher.job.driver import Driver, JobSpec
from launcher.discovery.hosts import HostSpecError, parse_hosts_arg


from launcher.arg_types import nonnegative_float as _nonnegative_float
from launcher.arg_types import positive_float as _positive_float
from launcher.arg_types import positive_int as _positive_int
from launcher.arg_types import tcp_port as _tcp_port
KEEP_ZYGOTE_S = 600.0  # --keep-zygote without a value: a kept zygote's idle life (docs/zygote.md)
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")  # horovodrun's choices


class _Parser(argparse.ArgumentParser):
    """argparse with a suggestion for a mistyped flag: ``unrecognized arguments: --max-nps``
    becomes ``unrecognized arguments: --max-nps (did you mean --max-np?)``."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):
            known = [o for a in self._actions for o in a.option_strings]
            flags = [t.split("=", 1)[0] for t in message.split(":", 1)[1].split()
                     if t.startswith("-")]
            import difflib  # here: only a refused command line needs it
            hints = []
            for flag in flags:
                # --min_np is --min-np mistyped; every horovodrun flag is known here, so a
                # copied one is never "corrected" to one of ours (--check-build once got
                # "did you mean --checkpoint-dir?")
                spelled = flag.replace("_", "-")
                close = [spelled] if spelled in known else \
                    difflib.get_close_matches(spelled, known, n=1, cutoff=0.6)
                if close:
                    hints.append(f"did you mean {close[0]}?" if len(flags) == 1
                                 else f"did you mean {close[0]} for {flag}?")
            if hints:
                message += " (" + "; ".join(hints) + ")"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="hvd-edl-run",
        # horovodrun's whole flag list makes argparse's own usage 2,700 characters: an error
        # shows this one line instead (--help lists every flag)
        usage="%(prog)s [flags] command ...   (hvd-edl-run --help lists the flags)",
        description="Launch a Horovod PyTorch job that workers can join and leave while it runs.")
    p.add_argument("-np", "--num-proc", dest="np", type=_positive_int, default=None,
                   help="number of workers to start with (default: min-np, else 1)")
    p.add_argument("--min-np", "--min-num-proc", dest="min_np", type=_positive_int,
                   help="elastic: the job waits (--elastic-timeout) while fewer workers exist")
    p.add_argument("--max-np", "--max-num-proc", dest="max_np", type=_positive_int,
                   help="elastic: never more workers than this")
    p.add_argument("--target-np", type=_positive_int, default=None,
                   help="elastic: keep the world size at this many workers instead of growing to "
                        "every usable slot up to --max-np; hvd-edl-ctl scale changes it")
    p.add_argument("-H", "--hosts", dest="hosts", help="host1:slots,host2:slots")
    p.add_argument("-p", "--ssh-port", dest="ssh_port", type=_positive_int, default=None,
                   help="horovodrun's meaning: ssh port on all the remote hosts (default: ssh's "
                        "configuration, usually 22)")
    p.add_argument("-i", "--ssh-identity-file", dest="ssh_identity_file", default=None,
                   help="horovodrun's meaning: file with the private key ssh authenticates "
                        "with on the remote hosts (default: ssh's configuration)")
    p.add_argument("-hostfile", "--hostfile", dest="hostfile",
                   help="file with one 'host[:slots]' or 'host slots=N' a line")
    p.add_argument("--ray", metavar="ADDRESS", default=None,
                   help="run on a Ray cluster (auto: the one this machine belongs to; else "
                        "HOST:PORT of its head): its alive nodes are the hosts, workers run as "
                        "Ray actors, nodes added / drained are hosts added / leaving "
                        "(docs/ray.md); launch it on a node of the cluster")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, metavar="N",
                   help="--ray: CPUs each worker's actor reserves (default 1)")
    p.add_argument("--gpus-per-worker", type=float, default=0.0, metavar="N",
                   help="--ray: GPUs each worker's actor reserves (default 0)")
    p.add_argument("--host-discovery-script", dest="discovery_script",
                   help="executable printing one 'host[:slots]' a line (Horovod's format)")
    p.add_argument("--slots-per-host", "--slots", dest="slots", type=_positive_int, default=None,
                   help="slots for discovered hosts that give none (default 1)")
    p.add_argument("--discovery-interval", type=_positive_float, default=1.0,
                   help="seconds between host discovery calls (default 1)")
    p.add_argument("--discovery-timeout", type=_positive_float, default=5.0,
                   help="seconds a discovery call may take (default 5)")
    p.add_argument("--reset-limit", type=int, default=None,
                   help="most generation changes before the job fails (default unlimited)")
    p.add_argument("--blacklist-cooldown-range", type=float, nargs=2, metavar=("MIN_S", "MAX_S"),
                   help="a failed slot / blacklisted host rests a random time in this range, "
                        "doubled per repeat up to MAX_S (default: for the rest of the job)")
    p.add_argument("--failure-blacklist", choices=("slot", "host"), default="slot",
                   help="what a failed worker takes out: its slot (default: the slot rests, "
                        "the host's other workers train on; a host is blacklisted after 3 "
                        "failures in 5 minutes) or its whole host, Horovod's rule (its other "
                        "workers are stopped; --blacklist-cooldown-range gives Horovod's "
                        "back-off, else for the rest of the job)")
    p.add_argument("--elastic-timeout", type=_positive_float, default=600.0,
                   help="seconds to wait for --min-np workers before failing (default 600)")
    p.add_argument("--start-timeout", type=_positive_float, default=120.0,
                   help="seconds a new worker may take to become ready (default 120)")
    p.add_argument("--network-interface", "--network-interfaces", dest="nic",
                   help="interface Gloo uses (default lo for local jobs)")
    p.add_argument("--bind-address", default=None,
                   help="address the coordinator, control API and rendezvous listen on "
                        "(default: the --network-interface's address, else 127.0.0.1; "
                        "0.0.0.0 listens on every interface)")
    p.add_argument("--job-file", help="where to write the job file hvd-edl-ctl reads (URL and "
                   "secret, mode 0600; default $XDG_RUNTIME_DIR/hvd-edl/<pid>.json or "
                   "~/.hvd_edl/jobs/<pid>.json)")
    p.add_argument("--event-log", help="write one JSON line per generation here")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="durable commits: rank 0 writes the committed state here in the "
                        "background every --checkpoint-every seconds, and a job that starts "
                        "(or loses every worker) with checkpoints here resumes from the newest "
                        "good one; one job per directory (a lock); on a cluster, a directory "
                        "every host can read (default: no checkpoints)")
    p.add_argument("--trust-checkpoint-dir", action="store_true",
                   help="use a --checkpoint-dir that other users can write or own (trusted "
                        "shared storage: NFS, a bucket); without it such a directory is refused "
                        "at start (another user could plant a checkpoint).  Checkpoints are "
                        "still authenticated with your key (~/.hvd_edl/checkpoint.key)")
    p.add_argument("--checkpoint-every", metavar="SECONDS", type=_positive_float, default=60.0,
                   help="seconds between checkpoints, the most work a loss of every worker "
                        "costs (default 60)")
    p.add_argument("--checkpoint-keep", metavar="K", type=_positive_int, default=3,
                   help="checkpoints kept, the newest K (default 3)")
    p.add_argument("--metrics-port", metavar="PORT", type=_tcp_port, default=None,
                   help="serve Prometheus metrics at http://BIND:PORT/metrics (world size, "
                        "generation, stalls, steps/s, samples/s, per-worker step, compute and "
                        "wait seconds, failures...) on the --bind-address; 0 picks a free port "
                        "and prints it (default: no metrics)")
    p.add_argument("--adapt-batch", action="store_true",
                   help="elastic: the job chooses its own global batch for goodput (Pollux: "
                        "throughput fitted from its telemetry x efficiency from its gradient "
                        "noise; launcher/apps/batch_goodput.py), asked at a switch; only a "
                        "script with hvd.elastic.AdaptiveBatchSampler follows "
                        "(docs/adaptive_batch.md)")
    p.add_argument("--autoscale", metavar="efficiency:E|cost|time", default=None,
                   help="elastic: size the job on a speed model fitted from a start-up profile "
                        "(launcher/apps/autoscale.py): efficiency:E grows while one more worker adds "
                        ">= E (0 < E <= 1) of a lone worker's throughput; cost picks the size "
                        "with the lowest predicted cost per sample (--price-*, "
                        "--revocation-rate).  With --samples and a typed --hostfile: time / "
                        "cost choose the GPU type and number at start, soonest within --budget "
                        "or cheapest within --deadline (launcher/apps/server_choice.py, "
                        "docs/transient.md)")
    p.add_argument("--samples", type=_positive_float, default=None, metavar="N",
                   help="--autoscale time|cost: the job's work in samples (epochs x dataset)")
    p.add_argument("--deadline", type=float, default=None, metavar="S",
                   help="--autoscale cost: finish within S seconds (a unix time if >= 1e9)")
    p.add_argument("--budget", type=float, default=None, metavar="DOLLARS",
                   help="--autoscale time: spend at most this many dollars")
    p.add_argument("--prices", default=None, metavar="FILE",
                   help="--autoscale time|cost: price table, CSV type,on_demand,spot[,tflops] "
                        "per GPU-hour (host lines' price= win)")
    p.add_argument("--revocation-risk", default=None, metavar="FILE",
                   help="--autoscale time|cost: spot revocations per GPU-hour, CSV type,zone,"
                        "revocations_per_hour (default GCE's measured preemptible lifetimes)")
    p.add_argument("--speed-profile", default=None, metavar="FILE",
                   help='--autoscale time|cost: the job\'s samples/s per type and size, JSON '
                        '{"t4": {"1": 50, "2": 96}}')
    p.add_argument("--price-on-demand", type=float, default=None, metavar="P",
                   help="--autoscale cost: price of an on-demand worker per hour (with "
                        "--price-spot: rank 0 on demand, the others spot)")
    p.add_argument("--price-spot", type=float, default=None, metavar="P",
                   help="--autoscale cost: price of a spot (revocable) worker per hour")
    p.add_argument("--revocation-rate", type=float, default=None, metavar="R",
                   help="--autoscale cost: revocations per spot worker-hour (default 0)")
    p.add_argument("--autoscale-hold", type=_positive_float, default=30.0, metavar="SECONDS",
                   help="--autoscale: a decision holds this long before the next (default 30)")
    p.add_argument("--autoscale-profile-seconds", type=_positive_float, default=5.0,
                   metavar="SECONDS", help="--autoscale: measurement per size of the start-up "
                   "profile, and of each size held afterwards (default 5)")
    p.add_argument("--autoscale-profile", metavar="FILE", default=None,
                   help="--autoscale: start from this profile.json (an earlier run's, or "
                        "hvd-edl-ctl profile's) instead of profiling at start-up")
    p.add_argument("--straggler-policy", choices=("off", "report", "evict", "replace"),
                   default="report",
                   help="a member whose compute time per step stays above --straggler-ratio x "
                        "the other members' median for --straggler-window seconds: report it "
                        "(event log and a line), evict it (scale-in, its slot rests), or "
                        "replace it by a worker built on a free slot elsewhere, in one "
                        "stop-free switch (default report; evict/replace: elastic jobs)")
    p.add_argument("--straggler-ratio", type=_positive_float, default=2.0, metavar="R",
                   help="a straggler computes more than R x the others' median (default 2)")
    p.add_argument("--straggler-window", type=_positive_float, default=5.0, metavar="SECONDS",
                   help="... for this many seconds in a row (default 5)")
    p.add_argument("--timestamps", action="store_true",
                   help="every line starts with the local time: the workers' (as "
                        "--prefix-output-with-timestamp, horovodrun's flag, which stamps only "
                        "those) and hvd-edl-run's own (switches, stragglers, failures)")
    p.add_argument("--zygote", action=argparse.BooleanOptionalAction, default=None,
                   help="start Python workers by forking them from a server that imported "
                        "hvd_edl.torch once (docs/zygote.md: a joiner is ready sooner); "
                        "--no-zygote: exec every worker (default: HVD_EDL_ZYGOTE=0|1, else on)")
    p.add_argument("--keep-zygote", type=_nonnegative_float, default=None, metavar="SECONDS",
                   help="(also bare: --keep-zygote) fork local workers from this user's kept "
                        "zygote, shared with your "
                        "later runs: it outlives this command and exits after SECONDS without "
                        f"workers (default {KEEP_ZYGOTE_S:g}; 0: keep none; docs/zygote.md); "
                        "without the flag: HVD_EDL_ZYGOTE_KEEP=SECONDS, else none")
    p.add_argument("--zygote-dir", default=None, metavar="DIR",
                   help="--keep-zygote: the folder of your kept zygotes (yours, 0700; default: "
                        "HVD_EDL_ZYGOTE_DIR, else $TMPDIR/hvd-edl-zygote-UID)")
    p.add_argument("--verbose", action="store_true",
                   help="horovodrun's meaning: extra messages (here: the coordinator's and the "
                        "rendezvous' requests, host set changes)")
    p.add_argument("--log-level", choices=LOG_LEVELS, type=str.upper, default=None,
                   help="horovodrun's meaning: the minimum level the Horovod backend logs to "
                        "stderr (HOROVOD_LOG_LEVEL for every worker; default WARNING); also "
                        "the launcher's own level (DEBUG/TRACE: protocol traffic as --verbose)")
    p.add_argument("--gloo", dest="use_gloo", action="store_true",
                   help="horovodrun's meaning: use the Gloo controller.  Accepted: Gloo is "
                        "hvd-edl-run's only controller (the elastic ring is rebuilt over it)")
    p.add_argument("--mpi", dest="use_mpi", action="store_true",
                   help="horovodrun's meaning: use the MPI controller.  Refused (exit 2): an MPI "
                        "world cannot change size; use Gloo (the default), or plain mpirun for "
                        "a static job")
    p.add_argument("--jsrun", dest="use_jsrun", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--output-filename", metavar="DIR",
                   help="horovodrun's meaning for Gloo: also write each worker's stdout/stderr "
                        "to files under DIR; here DIR/worker.<id>/stdout and "
                        "DIR/worker.<id>/stderr (<id>: w1, w2, ... in start order; ranks change "
                        "across generations, so files are per worker, not per rank)")
    p.add_argument("--disable-cache", action="store_true",
                   help="horovodrun's meaning: re-run the start-up checks instead of caching "
                        "them for 60 minutes.  Accepted, no effect: hvd-edl-run caches nothing "
                        "(each worker reaches the coordinator itself when it starts)")
    horovodrun_flags.add_arguments(p)  # --fusion-threshold-mb ... --version, --check-build
    p.add_argument("command", nargs=argparse.REMAINDER, help="the training command")
    return p


def _refuse(message: str) -> None:
    """A well-formed flag hvd-edl-run cannot honour: one line (no usage summary), exit 2."""
    print(f"hvd-edl-run: error: {message}", file=sys.stderr)
    sys.exit(2)


def _bare_keep_zygote(argv: List[str]) -> List[str]:
    """``--keep-zygote`` without ``=SECONDS`` (before the training command's ``--``, if any)
    as ``--keep-zygote=DEFAULT``: else argparse would take the training command's first word
    for its value."""
    end = argv.index("--") if "--" in argv else len(argv)
    return [f"--keep-zygote={KEEP_ZYGOTE_S:g}" if i < end and a == "--keep-zygote" else a
            for i, a in enumerate(argv)]


def parse_spec(argv: Optional[List[str]] = None) -> JobSpec:
    """Parse and validate ``argv``; exits with code 2 and a clear message on bad input."""
    parser = build_parser()
    a = parser.parse_args(_bare_keep_zygote(sys.argv[1:] if argv is None else list(argv)))
    if a.check_build:  # horovodrun's table, exit 0 (no training command needed)
        horovodrun_flags.check_build(a.verbose)
    for flag, instead in horovodrun_flags.REFUSED.items():
        if getattr(a, flag.strip("-").replace("-", "_")) is not None:
            _refuse(f"{flag} is not supported: {instead}")
    try:  # horovodrun's --config-file merge and value checks
        horovodrun_flags.apply_config_file(a)
    except OSError as e:
        parser.error(f"--config-file {a.config_file}: cannot read it: {e.strerror or e}")
    except ValueError as e:
        parser.error(f"--config-file {a.config_file}: {e}" if a.config_file else str(e))
    if a.use_mpi or a.use_jsrun:
        _refuse(f"--{'mpi' if a.use_mpi else 'jsrun'} is not supported: hvd-edl-run runs "
                     f"Horovod over Gloo (the default; --gloo is accepted) because an MPI world "
                     f"cannot change size.  Drop the flag, or run a static job with plain "
                     f"'mpirun -np N python train.py' (hvd.init(comm=MPI.COMM_WORLD) works)")
    if not a.command:
        parser.error("no training command given (e.g. python train.py)")
    if a.hosts and a.hostfile:
        parser.error("give -H or --hostfile, not both")
    if a.ray is not None and (a.hosts or a.hostfile or a.discovery_script):
        parser.error("--ray takes the hosts from the Ray cluster's nodes: drop -H, --hostfile "
                     "and --host-discovery-script")
    if a.ray is None and (a.cpus_per_worker != 1.0 or a.gpus_per_worker != 0.0):
        parser.error("--cpus-per-worker / --gpus-per-worker go with --ray")
    if a.cpus_per_worker < 0 or a.gpus_per_worker < 0 or \
            not (a.cpus_per_worker > 0 or a.gpus_per_worker > 0):
        parser.error(f"--cpus-per-worker / --gpus-per-worker must be >= 0 and not both 0, got "
                     f"{a.cpus_per_worker:g} / {a.gpus_per_worker:g}")
    if a.discovery_script and (a.hosts or a.hostfile):
        parser.error("--host-discovery-script replaces -H/--hostfile")
    if a.reset_limit is not None and a.reset_limit < 0:
        parser.error(f"--reset-limit must be >= 0, got {a.reset_limit}")
    if a.blacklist_cooldown_range:
        lo, hi = a.blacklist_cooldown_range
        if lo < 0 or hi < lo:
            parser.error(f"--blacklist-cooldown-range needs 0 <= MIN_S <= MAX_S, got {lo} {hi}")
    elastic = bool(a.discovery_script or a.min_np or a.max_np or a.ray is not None)
    try:
        if a.discovery_script:
            discovery = HostDiscoveryScript(a.discovery_script, a.slots or 1, a.discovery_timeout)
        elif a.hosts:
            discovery = FixedHosts(parse_hosts_arg(a.hosts))
        elif a.hostfile:
            with open(a.hostfile) as f:
                discovery = FixedHosts.from_lines(f.read(), a.slots or 1)
        else:
            # like horovodrun without -H: this host with -np slots (--min-np if no -np)
            discovery = FixedHosts({"localhost": a.slots or a.np or a.min_np or 1})
    except HostSpecError as e:
        parser.error(str(e))
    except OSError as e:
        parser.error(f"cannot read --hostfile: {e}")
    min_np = a.min_np or a.np or 1
    np_ = a.np or min_np
    max_np = a.max_np or (10 ** 6 if elastic else np_)
    if not elastic:
        min_np = max_np = np_
    if min_np > max_np:
        parser.error(f"--min-np {min_np} is larger than --max-np {max_np}" if a.min_np else
                     f"-np {np_} is larger than --max-np {max_np}")
    if not min_np <= np_ <= max_np:
        parser.error(f"-np {np_} must lie within [--min-np {min_np}, --max-np {max_np}]")
    if a.target_np is not None and not (elastic and min_np <= a.target_np <= max_np):
        parser.error(f"--target-np {a.target_np} needs an elastic job and must lie within "
                     f"[--min-np {min_np}, --max-np {max_np}]")
    if a.straggler_ratio <= 1.0:
        parser.error(f"--straggler-ratio must be > 1, got {a.straggler_ratio:g}")
    if a.straggler_policy in ("evict", "replace") and not elastic:
        parser.error(f"--straggler-policy {a.straggler_policy} needs an elastic job "
                     f"(--min-np/--max-np or a host discovery script)")
    typed = [f for f, v in (("--samples", a.samples), ("--deadline", a.deadline),
                            ("--budget", a.budget), ("--prices", a.prices),
                            ("--revocation-risk", a.revocation_risk),
                            ("--speed-profile", a.speed_profile)) if v is not None]
    if a.autoscale == "time" or (a.autoscale == "cost" and a.samples is not None):
        if not isinstance(discovery, FixedHosts) or not a.hostfile:
            parser.error(f"--autoscale {a.autoscale} --samples chooses among the hosts of a "
                         f"typed --hostfile (host:slots type=NAME [price=D] [spot])")
        from launcher.apps.server_choice import choose_hosts
        try:
            hosts, pred = choose_hosts(discovery.lines, a.autoscale, a.samples, a.deadline,
                                       a.budget, min_np, max_np if elastic else 10 ** 6,
                                       a.prices, a.revocation_risk, a.speed_profile,
                                       commit_s=a.checkpoint_every if a.checkpoint_dir
                                       else 2.0)
        except ValueError as e:
            _refuse(str(e))
        print(f"hvd-edl-run: --autoscale {a.autoscale}: {pred.why}"
              + ("" if pred.fits else " (runs anyway: the closest)"), flush=True)
        from launcher.cluster.pool_notes import pool_notes
        from launcher.discovery.prices import host_terms, read_prices
        chosen = {h: discovery.lines[h] for h in hosts if h in discovery.lines}
        for key, note in pool_notes(chosen, host_terms(chosen, read_prices(a.prices)
                                                       if a.prices else {}), 0.0).items():
            if key.startswith("price:"):  # the chosen hosts' class has no price: say so
                print(f"hvd-edl-run: {note}", flush=True)
        discovery = FixedHosts(hosts, {h: discovery.gpus[h][:k] for h, k in hosts.items()
                                       if h in discovery.gpus})
        np_ = pred.n
        min_np, max_np = (min(min_np, np_), max_np) if elastic else (np_, np_)
        a.autoscale = None
    elif typed:
        parser.error(f"{typed[0]} goes with --autoscale time|cost --samples N")
    autoscale = None
    if a.autoscale is not None or any(v is not None for v in (
            a.price_on_demand, a.price_spot, a.revocation_rate, a.autoscale_profile)):
        from launcher.apps.autoscale import parse_policy
        if a.autoscale is None:
            parser.error("--autoscale-profile goes with --autoscale" if a.autoscale_profile
                         else "--price-on-demand, --price-spot and --revocation-rate go with "
                         "--autoscale cost")
        if not elastic:
            parser.error("--autoscale needs an elastic job (--min-np/--max-np or "
                         "--host-discovery-script)")
        try:
            autoscale = parse_policy(a.autoscale, a.price_on_demand, a.price_spot,
                                     a.revocation_rate, a.autoscale_hold,
                                     a.autoscale_profile_seconds, a.autoscale_profile)
        except ValueError as e:
            parser.error(str(e))
    command = a.command[1:] if a.command[0] == "--" else a.command
    if not command:
        parser.error("no training command given after -- (e.g. -- python train.py)")
    if not shutil.which(command[0]):
        parser.error(f"training command {command[0]!r} not found (not an executable file or on "
                     f"PATH)")
    if a.trust_checkpoint_dir and not a.checkpoint_dir:
        parser.error("--trust-checkpoint-dir goes with --checkpoint-dir")
    if a.checkpoint_dir:
        from launcher.job.checkpoint_dir import CheckpointDirError, check_directory
        try:  # another user's, or one others can write: refused before anything starts
            check_directory(a.checkpoint_dir, trusted=a.trust_checkpoint_dir)
        except CheckpointDirError as e:  # one line (not the usage): the flag was well formed
            print(f"hvd-edl-run: error: {e}", file=sys.stderr)
            sys.exit(2)
    if a.output_filename:
        try:
            os.makedirs(a.output_filename, exist_ok=True)
        except OSError as e:
            parser.error(f"--output-filename {a.output_filename}: cannot create the folder: {e}")
    bind_addr = a.bind_address
    engine = None
    if a.ray is not None:  # one line and exit 2 when Ray cannot be used (launcher/ray/engine.py)
        from launcher.ray.engine import RayError, connect
        try:
            engine, bind_addr = connect(a.ray, a.cpus_per_worker, a.gpus_per_worker,
                                        a.start_timeout, a.nic, bind_addr)
        except RayError as e:
            _refuse(f"--ray {a.ray}: {e}")
        discovery = engine
    if bind_addr is None:
        bind_addr = interface_address(a.nic) if a.nic else "127.0.0.1"
        if bind_addr is None:
            parser.error(f"--network-interface {a.nic}: no such interface with an IPv4 address "
                         f"(give --bind-address)")
    return JobSpec(command=tuple(command), np=np_, min_np=min_np, max_np=max_np, elastic=elastic,
                   discovery=discovery, discovery_interval_s=a.discovery_interval,
                   elastic_timeout_s=a.elastic_timeout, start_timeout_s=a.start_timeout,
                   reset_limit=a.reset_limit,
                   blacklist_cooldown_range=(tuple(a.blacklist_cooldown_range)
                                             if a.blacklist_cooldown_range else None),
                   network_interface=a.nic, bind_addr=bind_addr, event_log=a.event_log,
                   verbose=a.verbose or a.log_level in ("TRACE", "DEBUG"), cwd=os.getcwd(),
                   job_file=a.job_file, target_np=a.target_np, log_level=a.log_level,
                   ssh_port=a.ssh_port, ssh_identity_file=a.ssh_identity_file,
                   output_dir=a.output_filename,
                   checkpoint_dir=a.checkpoint_dir, checkpoint_every_s=a.checkpoint_every,
                   checkpoint_keep=a.checkpoint_keep, metrics_port=a.metrics_port,
                   straggler_policy=a.straggler_policy, straggler_ratio=a.straggler_ratio,
                   straggler_window_s=a.straggler_window, autoscale=autoscale,
                   adapt_batch=a.adapt_batch,
                   horovod_env=horovodrun_flags.horovod_env(a), engine=engine,
                   failure_blacklist=a.failure_blacklist,
                   prefix_output_with_timestamp=a.prefix_output_with_timestamp,
                   timestamps=a.timestamps, zygote=a.zygote, keep_zygote=a.keep_zygote,
                   zygote_dir=a.zygote_dir)


def main(argv: Optional[List[str]] = None) -> int:
    spec = parse_spec(argv)
    if spec.timestamps:  # hvd-edl-run's own lines (and its log's) start with the time
        from launcher.observe.timestamps import StampedStream
        sys.stdout, sys.stderr = StampedStream(sys.stdout), StampedStream(sys.stderr)
    level = logging.DEBUG if spec.log_level in ("TRACE", "DEBUG") else \
        logging.INFO if spec.verbose or spec.log_level == "INFO" else \
        getattr(logging, {"FATAL": "CRITICAL"}.get(spec.log_level or "", spec.log_level or ""),
                logging.WARNING)
    logging.basicConfig(level=level, format="hvd-edl-run: %(message)s")
    return Driver(spec).run()


if __name__ == "__main__":
    sys.exit(main())
