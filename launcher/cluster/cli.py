"""``hvd-edl-cluster``: one pool of hosts shared by many elastic Horovod jobs.

    hvd-edl-cluster serve -H localhost:8 --state-dir ~/cluster --policy edl   # the service
    hvd-edl-cluster submit --min-np 1 --max-np 4 -- python train.py           # prints the id
    hvd-edl-cluster queue | status [JOB] [--json] | cancel JOB | top
    hvd-edl-cluster logs JOB [--run N] [--follow]                             # its output

``serve`` owns the pool (horovodrun's host formats: ``-H host:slots,...``, ``--hostfile F``, or
``--host-discovery-script CMD`` for hosts that come and go), runs the policy and the jobs, and
writes the cluster file (0644, no secret; default ``~/.hvd_edl/cluster.json``) that the other
commands read (``--cluster F``).  The service learns who calls from the kernel
(:mod:`launcher.cluster.users`): under root it runs each job as its submitter, with the
environment ``submit`` ran in.  Bad input (an unknown job, --min-np above --max-np, --np out of
range, no command, an unreadable or unsafe cluster file, a job that could not start as its user)
is one line and exit code 2; a refusal (another user's job: cancel, logs) and a service that
cannot be reached are one line and exit code 1.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from typing import List, Optional

from launcher.arg_types import MAX_PRIORITY
from launcher.arg_types import positive_float as _positive_float
from launcher.arg_types import priority as _priority
from launcher.arg_types import positive_int as _positive_int
from launcher.arg_types import tcp_port as _tcp_port

PROG = "hvd-edl-cluster"


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (and exit code 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _finite_seconds(text: str) -> float:
    """Seconds above 0 and finite (``--unreachable-after``); argparse's one line otherwise."""
    v = _positive_float(text)
    if v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds, got {text}")
    return v


def _fail(message: str, code: int = 2) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="A pool of hosts shared by many elastic Horovod jobs.")
    p.add_argument("--cluster", metavar="FILE", help="the cluster file serve wrote (default "
                   "$HVD_EDL_CLUSTER, else ~/.hvd_edl/cluster.json, else "
                   "/etc/hvd_edl/cluster.json)")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser)
    s = sub.add_parser("serve", help="run the service: own the pool, schedule and run jobs")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("-H", "--hosts", help="host1:slots,host2:slots (horovodrun's -H)")
    src.add_argument("--hostfile", metavar="FILE",
                     help="file with one host a line: 'host[:slots] [slots=N] [gpus=0,1] "
                          "[type=NAME] [price=DOLLARS_PER_GPU_HOUR] [zone=Z] [spot] "
                          "[ends=UNIX_S]' (gpus=: the host's GPUs, slot i the i-th; type=, "
                          "price=, zone=, spot: for --policy typed, docs/transient.md; ends=: "
                          "a notice, the host leaves the pool and its jobs move off it)")
    src.add_argument("--host-discovery-script", dest="discovery_script",
                     help="executable printing one 'host[:slots]' a line; hosts come and go, "
                          "and a host that leaves takes its slots from the jobs that used them")
    s.add_argument("--slots-per-host", "--slots", dest="slots", type=_positive_int, default=1,
                   help="slots of hosts that give none (default 1)")
    s.add_argument("--discovery-interval", type=_positive_float, default=1.0,
                   help="seconds between pool discovery calls (default 1)")
    s.add_argument("-p", "--ssh-port", dest="ssh_port", type=_tcp_port, default=None,
                   help="the pool's hosts' ssh port (every job's hvd-edl-run -p)")
    s.add_argument("-i", "--ssh-identity-file", dest="ssh_identity_file", default=None,
                   help="the key every job's hvd-edl-run reaches the hosts with (its -i)")
    s.add_argument("--network-interface", dest="nic", default=None,
                   help="the interface every job's rings use (its --network-interface)")
    s.add_argument("--state-dir", required=True, help="the service's folder (0711; the "
                   "database 0600, each job's folder 0700 and its user's): its "
                   "database, the jobs' files and logs, the event log; a restarted service "
                   "with the same folder re-adopts the running jobs")
    s.add_argument("--cluster-file", help="where to write the cluster file (default "
                   "--cluster, else ~/.hvd_edl/cluster.json)")
    s.add_argument("--assume-gpus", action="store_true",
                   help="every slot is one GPU, indices 0..slots-1 on its host, without asking "
                        "nvidia-smi (hosts without it, tests on CPU machines); by default a "
                        "host's GPUs are its line's gpus= or what nvidia-smi there reports, and "
                        "a host without GPUs has CPU slots")
    s.add_argument("--policy", choices=("edl", "tiresias", "fifo", "typed", "goodput"),
                   default="edl",
                   help="edl: elastic (lend idle slots, take them back stop-free); goodput: edl "
                        "judging jobs that adapt their batch by goodput and passing each its "
                        "best batch (docs/cluster.md); tiresias: "
                        "least attained service with preemption; fifo: gang-scheduled, first "
                        "come first served; typed: GPU types and prices, each job's --objective "
                        "(docs/transient.md) (default edl)")
    s.add_argument("--start-cost", type=_positive_float, default=None, metavar="SECONDS",
                   help="seconds a job's (re)start costs (launcher, workers' imports, first "
                        "ring; default 10): what the policies, and typed's predictions, count")
    s.add_argument("--prices", metavar="FILE", default=None,
                   help="price table, CSV type,on_demand,spot[,tflops] in dollars per GPU-hour "
                        "(host lines' price= win); docs/transient.md")
    s.add_argument("--revocation-risk", metavar="FILE", default=None,
                   help="revocations per GPU-hour of spot hosts, CSV type,zone,"
                        "revocations_per_hour (default GCE's measured preemptible lifetimes)")
    s.add_argument("--objective", default="jct", help="jct, throughput or efficiency:E "
                   "(edl; default jct); typed: sia (jct) or remaining, how a job without "
                   "its own --objective is valued (docs/transient.md)")
    s.add_argument("--queue-thresholds", metavar="GPU_S[,GPU_S...]", default=None,
                   help="tiresias, edl: attained-service thresholds between the priority "
                        "queues, in GPU-seconds (a slot held for a second is one), ascending "
                        "(default the policies': 16 GPU-hours)")
    s.add_argument("--hold", type=_positive_float, default=None, metavar="SECONDS",
                   help="edl: seconds a job keeps its size after a change before it may grow "
                        "again (default the policy's: the larger of 60 s and 20 x the cost of "
                        "a change)")
    s.add_argument("--user-quota", type=_positive_int, default=None, metavar="N",
                   help="the most slots one user's jobs hold together (default: no cap); "
                        "the policies share the pool fairly between users either way")
    s.add_argument("--no-fair-share", dest="fair_share", action="store_false",
                   help="order jobs by the policy alone, not fair between users (fifo, "
                        "tiresias, edl, goodput share between users by default)")
    s.add_argument("--metrics-port", type=_tcp_port, default=None,
                   help="serve Prometheus metrics on this port (0: a free one, printed)")
    s.add_argument("--bind-address", default="127.0.0.1",
                   help="address the API and metrics listen on (default 127.0.0.1)")
    s.add_argument("--port", type=_tcp_port, default=0, help="the API's port (default: free)")
    s.add_argument("--unreachable-after", dest="unreachable_s", type=_finite_seconds,
                   default=None, metavar="SECONDS",
                   help="a pool host where every running job allocated slots has had no live "
                        "worker this long (its network cut, powered off) rests: it leaves the "
                        "pool for a cooldown (default 10)")
    s.add_argument("--round", dest="round_s", type=_positive_float, default=5.0,
                   help="seconds between scheduling rounds; a submit, an end or a pool change "
                        "starts one at once (default 5)")
    t = sub.add_parser("submit", help="queue a job; prints its id last")
    t.add_argument("--name", help="a name for people (default: the script's name)")
    t.add_argument("--min-np", type=_positive_int, help="fewest workers it runs with")
    t.add_argument("--max-np", type=_positive_int, help="most workers it may be lent")
    t.add_argument("--np", type=_positive_int, help="the size it asks for (a static "
                   "scheduler's; default --min-np, else 1)")
    t.add_argument("--priority", type=_priority, default=0, help="larger first among equals "
                   f"(from -{MAX_PRIORITY} to {MAX_PRIORITY}; default 0)")
    t.add_argument("--checkpoint-dir", help="its --checkpoint-dir (preemption and resume; "
                   "default a folder of the service's)")
    t.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set in the job's environment (repeatable); the job runs with the "
                        "environment submit runs in (PATH, a virtual environment, PYTHONPATH) "
                        "plus these, as sbatch does")
    t.add_argument("--objective", choices=("time", "cost"), default=None,
                   help="choose the GPU type and number (serve --policy typed): time: finish "
                        "soonest within --budget (without one: whatever it costs); cost: "
                        "cheapest within --deadline (without one: however long it takes); "
                        "expected revocations of spot hosts counted (docs/transient.md); "
                        "needs --samples")
    t.add_argument("--samples", type=_positive_float, default=None, metavar="N",
                   help="--objective: the job's work, samples in all (epochs x dataset)")
    t.add_argument("--deadline", type=float, default=None, metavar="S",
                   help="--objective cost: finish within S seconds from now (or by the unix "
                        "time S when S >= 1e9)")
    t.add_argument("--budget", type=float, default=None, metavar="DOLLARS",
                   help="--objective time: spend at most this many dollars")
    t.add_argument("--types", default=None, metavar="TYPE[,TYPE...]",
                   help="--objective: only these GPU types (default any in the pool)")
    t.add_argument("--speed-profile", default=None, metavar="FILE",
                   help='--objective: the job\'s samples/s per type and size, JSON '
                        '{"t4": {"1": 50, "2": 96}} (else learned as it runs, other types '
                        'scaled by TFLOPS)')
    t.add_argument("command", nargs=argparse.REMAINDER, help="-- python train.py ...")
    sub.add_parser("queue", help="the jobs waiting, in order")
    st = sub.add_parser("status", help="every job, or one")
    st.add_argument("job", nargs="?")
    st.add_argument("--json", action="store_true",
                    help='{"jobs": [...], "resting": {HOST: S}, "pool": {HOST: SLOTS}, '
                         '"pool_gpus": {HOST: [GPU, ...]}} for scripts')
    c = sub.add_parser("cancel", help="end a job (a running one gets SIGTERM)")
    c.add_argument("job")
    dr = sub.add_parser("drain", help="take a pool host out: its jobs leave it stop-free "
                        "(a job left with no host is checkpointed and resumes later)")
    dr.add_argument("host")
    dr.add_argument("--deadline", type=_positive_float, default=None, metavar="S",
                    help="seconds its jobs have to leave it (a spot notice: AWS 120, GCE 30); "
                         "the events say whether they did")
    dr.add_argument("--undo", action="store_true", help="make the host schedulable again")
    lg = sub.add_parser("logs", help="a job's output: its launcher's and its workers'")
    lg.add_argument("job")
    lg.add_argument("--run", type=_positive_int, default=None, metavar="N",
                    help="which run (1 the first start, then one per resume; default the "
                         "latest)")
    lg.add_argument("-f", "--follow", action="store_true",
                    help="then print what it writes until the run ends (Ctrl-C stops)")
    tp = sub.add_parser("top", help="live view: slots per job, queue, utilisation")
    tp.add_argument("--interval", type=_positive_float, default=2.0)
    tp.add_argument("--once", action="store_true", help="one frame, then exit")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.cmd is None:
        parser.error("a command is needed: serve, submit, queue, status, logs, cancel, drain "
                     "or top")
    if a.cmd == "serve":
        return serve(a, parser)
    from launcher.cluster import cluster_file
    from launcher.cluster.server import ClusterClient, ClusterRefused
    try:
        cluster = cluster_file.read(a.cluster or cluster_file.default_path())
    except cluster_file.ClusterFileError as e:
        return _fail(str(e))
    client = ClusterClient(cluster)
    try:
        if a.cmd == "submit":
            return submit(a, client)
        if a.cmd == "logs":
            return logs(a, client)
        if a.cmd == "top":
            from launcher.cluster import top
            return top.run(client, a.interval, a.once)
        if a.cmd == "drain":
            r = client.call("drain", host=a.host, deadline_s=a.deadline, undo=a.undo)
            print(f"{PROG}: host {r['host']} " + (
                "drained" + (f", deadline in {a.deadline:g} s" if a.deadline else "")
                + (f"; leaving it: {', '.join(r['jobs'])}" if r["jobs"] else "; no job held it")
                if r["draining"] else "schedulable again"))
            return 0
        if a.cmd == "cancel":
            r = client.call("cancel", job=a.job)
            print(f"{PROG}: {r['id']}: " + ("cancelling (SIGTERM sent)" if r.get("cancelling")
                                            else r["state"]))
            return 0
        status = client.call("status", **({"job": a.job} if a.cmd == "status" and a.job
                                           else {}))
    except ClusterRefused as e:
        return _fail(str(e), 2 if e.status in (400, 404) else 1)
    if a.cmd == "queue":
        waiting = [j for j in status["jobs"] if j["state"] in ("queued", "suspended")]
        for i, j in enumerate(waiting, 1):
            print(f"{i:>3}. {j['id']:<6} {j['name'][:24]:<24} {j['state']:<10} np {j['np']} "
                  f"[{j['min_np']}-{j['max_np']}]: {j.get('reason') or ''}")
        if not waiting:
            print("(no job waiting)")
        return 0
    if a.json:
        json.dump({"jobs": status["jobs"], "resting": status.get("resting", {}),
                   "pool": status.get("pool", {}), "pool_gpus": status.get("pool_gpus", {})},
                  sys.stdout)
        print()
        return 0
    from launcher.cluster.top import frame_lines
    print("\n".join(frame_lines(status)))
    return 0


FOLLOW_POLL_S = 0.5  # logs --follow asks for more this often while the run writes nothing


def logs(a, client) -> int:
    """``logs JOB [--run N] [--follow]``: print the run's output so far (its ``run<N>.log``:
    the launcher's lines and its workers' with hvd-edl-run's prefix, Horovod's
    ``[0]<stdout>:...``, or ``[w1]<stdout>:...`` before a worker joined a ring and has a
    rank); with ``--follow`` go on
    printing what it writes until the run ends, then exit 0 (Ctrl-C: exit 0 at once)."""
    import time
    offset, run = 0, a.run
    try:
        while True:
            r = client.call("logs", job=a.job, run=run, offset=offset)
            run = r["run"]  # --follow stays on the run it began with
            sys.stdout.write(r["data"])
            sys.stdout.flush()
            offset = r["next"]
            if offset < r["size"]:
                continue
            if not a.follow or r["ended"]:
                return 0
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # | head
        return 0


def submit(a, client) -> int:
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        return _fail("no training command given (e.g. -- python train.py)")
    lo, hi = a.min_np, a.max_np
    np_ = a.np or lo or 1
    lo = lo or np_
    hi = hi or max(np_, lo)
    if lo > hi:
        return _fail(f"--min-np {lo} is larger than --max-np {hi}")
    if not lo <= np_ <= hi:
        return _fail(f"--np {np_} must lie within [--min-np {lo}, --max-np {hi}]")
    if not shutil.which(command[0]):
        if "/" in command[0] and os.path.lexists(command[0]):
            import getpass
            return _fail(f"training command {command[0]!r}: {getpass.getuser()} cannot run it "
                         f"(an interpreter under another user's home? docs/cluster.md, "
                         f"'A team's head host')")
        return _fail(f"training command {command[0]!r} not found (not an executable file or "
                     f"on PATH)")
    from launcher.cluster.runs import environment
    try:
        env = environment(a.env)
        goal = goal_request(a)
    except ValueError as e:
        return _fail(str(e))
    from launcher.cluster.exec_input import NAME
    # the job's environment: this one, less what is no variable name (bash's exported
    # functions, BASH_FUNC_f%%: the service takes POSIX names only)
    environ = {k: v for k, v in os.environ.items() if NAME.fullmatch(k)}
    r = client.call("submit", argv=command, cwd=os.getcwd(), env=env, environ=environ,
                    name=a.name, np=np_,
                    min_np=lo, max_np=hi, priority=a.priority,
                    checkpoint_dir=os.path.abspath(a.checkpoint_dir) if a.checkpoint_dir
                    else None, **goal)
    print(f"{PROG}: submitted {r['id']} ({r['state']}); {PROG} status {r['id']}")
    print(r["id"])
    return 0


def goal_request(a) -> dict:
    """``submit``'s --objective and its companions as the request's ``goal`` and
    ``speed_profile`` ({} without --objective).

    Raises:
        ValueError: one line: a companion flag without --objective, the other objective's
            limit (--deadline with time, --budget with cost), no --samples, a deadline
            already past, a negative budget, an empty name in --types, an unreadable speed
            profile.  Without its limit
            an objective has none: time is the soonest whatever it costs, cost the cheapest
            however long it takes."""
    import math
    import time
    extra = [f for f, v in (("--samples", a.samples), ("--deadline", a.deadline),
                            ("--budget", a.budget), ("--types", a.types),
                            ("--speed-profile", a.speed_profile)) if v is not None]
    if a.objective is None:
        if extra:
            raise ValueError(f"{', '.join(extra)} {'go' if len(extra) > 1 else 'goes'} with "
                             f"--objective time|cost (time: the soonest within --budget; "
                             f"cost: the cheapest by --deadline)")
        return {}
    wrong = {"time": ("--deadline", a.deadline, "cost"),
             "cost": ("--budget", a.budget, "time")}[a.objective]
    if wrong[1] is not None:  # the limit of the other objective: it would be ignored
        raise ValueError(f"{wrong[0]} goes with --objective {wrong[2]}, not "
                         f"{a.objective} (time: the soonest within --budget; cost: the "
                         f"cheapest by --deadline)")
    if a.samples is None:
        raise ValueError("--objective needs --samples N: the job's work in samples (epochs x "
                         "the dataset's size)")
    deadline_at = None
    if a.deadline is not None:
        if not math.isfinite(a.deadline):
            raise ValueError(f"--deadline {a.deadline}: not a finite number of seconds")
        deadline_at = a.deadline if a.deadline >= 1e9 else time.time() + a.deadline
        if deadline_at <= time.time():
            raise ValueError(f"--deadline {a.deadline:g} is already past")
    if a.budget is not None and not (math.isfinite(a.budget) and a.budget > 0):
        raise ValueError(f"--budget needs a positive number of dollars, got {a.budget:g}")
    types = [t.strip().lower() for t in a.types.split(",")] if a.types is not None else []
    if "" in types:  # a stray comma must not pass for a shorter list
        raise ValueError(f"--types {a.types!r}: an empty GPU type name; give names separated "
                         f"by single commas (--types a100,t4)")
    profile = None
    if a.speed_profile is not None:
        try:
            with open(a.speed_profile) as f:
                profile = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"--speed-profile {a.speed_profile}: not a readable JSON file "
                             f"({e})") from None
    return {"goal": {"objective": a.objective, "samples": a.samples, "deadline_at": deadline_at,
                     "budget_usd": a.budget, "types": types}, "speed_profile": profile}


def policy_from_args(a):
    """The scheduling policy ``serve``'s parsed arguments ``a`` ask for: ``--policy``,
    ``--objective``, ``--user-quota``, ``--no-fair-share`` (make_policy's ``fair_share``),
    ``--queue-thresholds`` and ``--hold`` applied.  ValueError, one line, for a bad value."""
    from launcher.cluster.policies import make_policy
    policy = make_policy(a.policy, a.objective, fair_share=a.fair_share,
                         user_quota=a.user_quota)
    if a.queue_thresholds is not None and hasattr(policy, "thresholds_gpu_s"):
        try:
            th = tuple(float(x) for x in a.queue_thresholds.split(","))
        except ValueError:
            th = ()
        if not th or any(t <= 0 for t in th) or list(th) != sorted(th):
            raise ValueError(f"--queue-thresholds {a.queue_thresholds!r}: expected "
                             f"positive ascending slot-seconds, e.g. 60,600")
        policy.thresholds_gpu_s = th
    if a.hold is not None and hasattr(policy, "hold_s"):
        policy.hold_s = a.hold
    return policy


def serve(a, parser) -> int:
    import logging
    from launcher.cluster import cluster_file
    from launcher.cluster.server import ClusterServer, routes
    from launcher.cluster.service import Service, ServiceError
    from launcher.discovery import FixedHosts, HostDiscoveryScript
    from launcher.discovery.hosts import HostSpecError, parse_hosts_arg
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(message)s")
    try:
        policy = policy_from_args(a)
    except ValueError as e:
        return _fail(str(e))
    try:
        if a.discovery_script is not None:
            if not a.discovery_script.strip():
                return _fail("--host-discovery-script is empty: give the command that prints "
                             "the pool's hosts")
            discovery = HostDiscoveryScript(a.discovery_script, a.slots, 5.0)
        elif a.hosts is not None:
            discovery = FixedHosts(parse_hosts_arg(a.hosts))
        else:
            with open(a.hostfile) as f:
                discovery = FixedHosts.from_lines(f.read(), a.slots)
    except HostSpecError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"cannot read --hostfile: {e.strerror or e}")
    if a.discovery_script is None:  # a fixed pool: every host known now, so checked now
        which = f"-H {a.hosts!r}" if a.hosts is not None else f"--hostfile {a.hostfile}"
        if not discovery.hosts:
            return _fail(f"{which} names no host (expected host:slots,...)")
        from launcher.cluster.resolve import RESOLVE_TIMEOUT_S, unresolved
        bad = unresolved(discovery.hosts, RESOLVE_TIMEOUT_S)
        if bad:
            return _fail(f"{which}: " + "; ".join(f"host {h} {why}" for h, why in bad.items())
                         + " (fix the name, or /etc/hosts)")
    launcher_args = []
    if a.ssh_port is not None:
        launcher_args += ["-p", str(a.ssh_port)]
    if a.ssh_identity_file is not None:
        key = os.path.abspath(os.path.expanduser(a.ssh_identity_file))
        if not os.access(key, os.R_OK):
            return _fail(f"--ssh-identity-file {a.ssh_identity_file}: cannot read it")
        launcher_args += ["-i", key]
    if a.nic is not None:
        launcher_args += ["--network-interface", a.nic]
    from launcher.discovery.prices import RiskTable, TableError, read_prices
    try:
        prices = read_prices(a.prices) if a.prices else {}
        risk = RiskTable.read(a.revocation_risk) if a.revocation_risk else RiskTable()
    except TableError as e:
        return _fail(str(e))
    service = Service(os.path.abspath(os.path.expanduser(a.state_dir)), discovery, policy,
                      discovery_interval_s=a.discovery_interval, round_s=a.round_s,
                      fixed_pool=not a.discovery_script, launcher_args=launcher_args,
                      assume_gpus=a.assume_gpus, prices=prices, risk=risk,
                      **({"restart_cost_s": a.start_cost} if a.start_cost else {}),
                      **({"unreached_s": a.unreachable_s} if a.unreachable_s else {}))
    try:
        service.open()
    except ServiceError as e:
        return _fail(str(e))
    try:
        server = ClusterServer(routes(service), a.bind_address, a.port)
    except OSError as e:
        service.close()
        return _fail(f"cannot listen on {a.bind_address}:{a.port}: {e.strerror or e}")
    port = server.start()
    host = f"[{a.bind_address}]" if ":" in a.bind_address else a.bind_address
    path = a.cluster_file or a.cluster or cluster_file.default_path()
    try:
        path = cluster_file.write(path, f"http://{host}:{port}", str(service.state_dir))
    except OSError as e:
        server.stop()
        service.close()
        return _fail(f"cannot write the cluster file {path}: {e.strerror or e}")
    metrics = None
    if a.metrics_port is not None:
        from launcher.cluster.metrics import ClusterCollector
        from launcher.observe.metrics import MetricsServer
        try:
            metrics = MetricsServer(ClusterCollector(service), a.bind_address, a.metrics_port)
        except OSError as e:
            server.stop()
            service.close()
            return _fail(f"--metrics-port {a.metrics_port}: {e.strerror or e}")
        print(f"{PROG}: metrics: {metrics.url(a.bind_address)}", flush=True)
    n_slots, n_hosts = sum(service.pool.values()), len(service.pool)
    print(f"{PROG}: serving {n_slots} slot{'' if n_slots == 1 else 's'} on {n_hosts} "
          f"host{'' if n_hosts == 1 else 's'}, policy {a.policy}, at http://{host}:{port}; "
          f"cluster file {path}", flush=True)
    from launcher.cluster.drains import kept_out
    for out_host, why in kept_out(service).items():  # whatever keeps a host out, and the undo
        if f"ends:{out_host}" not in service.pool_told:  # not said already (pool_notes)
            print(f"{PROG}: host {out_host} is {why}", flush=True)

    def stop(signum, frame):
        service.stopping = True
        service.wake.set()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        service.run()
    finally:
        server.stop()
        if metrics is not None:
            metrics.stop()
        service.close()
    print(f"{PROG}: stopped; running jobs keep running (a serve with --state-dir "
          f"{service.state_dir} re-adopts them)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
