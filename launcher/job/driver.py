"""The driver's main loop: monitor, decide, act.

One method, :meth:`Driver.run`, reads top to bottom every ``LOOP_S`` seconds while a change
is in flight, every ``IDLE_LOOP_S`` while the job is settled, and at once when a worker exits,
discovery reports a new host set, the control API changes something or a signal comes: take
the latest host set, ask workers on vanished hosts or slots to leave, spawn workers into free
slots up to ``max_np``, drop workers that miss their start timeout, enforce
``--elastic-timeout``, and decide when the job is over and with which exit
code.  Membership itself (generations) is the coordinator's.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

from hvd_edl import messages
from launcher.serve import control
from launcher.job.checkpoint_dir import CheckpointDir, CheckpointDirError
from launcher.job.coordinator import Coordinator, CoordinatorServer
from launcher.discovery import DiscoveryError
from launcher.observe.events import EventLog
from launcher.apps.profiler import Profiler
from launcher.apps import migration as migration_
from launcher.apps import straggler as straggler_
from launcher.job.registry import WorkerRecord, WorkerState
from launcher.job.rendezvous import GenerationRendezvous
from launcher.job.slot_book import SlotBook
from launcher.spawn import WorkerProcess, WorkerSpec, spawn, terminate_all

log = logging.getLogger(__name__)

LOOP_S = 0.1                     # seconds between passes while a change is in flight
IDLE_LOOP_S = 1.0                # ... while settled (Coordinator.settled, no slot to reopen):
                                 # a pass costs ~0.2 ms of a CPU the workers train on
SWITCH_TIMEOUT_S = 60.0          # a member this late to a step boundary is considered stuck
COLLATERAL_WINDOW_S = 5.0        # an abort this soon after another failure is taken as its echo
ECHO_CODES = (-signal.SIGABRT,)  # how Gloo ends a healthy peer of a crashed process
# below --min-np: what is awaited is said at once, then every this many seconds (the env
# variable shortens it for tests)
WAIT_REPORT_S = float(os.environ.get("HVD_EDL_WAIT_REPORT_S", "30"))


@dataclass(frozen=True)
class JobSpec:
    """Everything ``hvd-edl-run`` was asked to do (validated by the CLI).

    Times in seconds.  ``discovery`` answers ``find_available_hosts_and_slots()``.
    ``elastic`` is False for a static job (no discovery script, no --min-np/--max-np).
    ``target_np``: world size to hold (None: every usable slot up to ``max_np``); ``job_file``:
    where the control API's URL and secret go (None: :func:`control.default_job_dir`).
    """
    command: Tuple[str, ...]
    np: int
    min_np: int
    max_np: int
    elastic: bool
    discovery: object
    discovery_interval_s: float = 1.0
    elastic_timeout_s: float = 600.0
    start_timeout_s: float = 120.0
    reset_limit: Optional[int] = None
    blacklist_cooldown_range: Optional[Tuple[float, float]] = None
    network_interface: Optional[str] = None
    bind_addr: str = "127.0.0.1"
    event_log: Optional[str] = None
    verbose: bool = False
    cwd: str = "."
    job_file: Optional[str] = None
    target_np: Optional[int] = None
    log_level: Optional[str] = None     # --log-level: HOROVOD_LOG_LEVEL for the workers
    output_dir: Optional[str] = None    # --output-filename: DIR/worker.<id>/{stdout,stderr}
    ssh_port: Optional[int] = None       # -p/--ssh-port: remote hosts' sshd port
    ssh_identity_file: Optional[str] = None  # -i/--ssh-identity-file
    checkpoint_dir: Optional[str] = None     # --checkpoint-dir (None: no checkpoints)
    checkpoint_every_s: float = 60.0         # --checkpoint-every
    checkpoint_keep: int = 3                 # --checkpoint-keep
    straggler_policy: str = "report"         # --straggler-policy (launcher/apps/straggler.py)
    straggler_ratio: float = 2.0             # --straggler-ratio
    straggler_window_s: float = 5.0          # --straggler-window
    metrics_port: Optional[int] = None       # --metrics-port (None: no metrics; 0: any free)
    autoscale: Optional[object] = None       # --autoscale (a launcher.apps.autoscale.Policy)
    adapt_batch: bool = False                # --adapt-batch (launcher/apps/batch_goodput.py)
    # horovodrun's tuning flags (--fusion-threshold-mb, --autotune, --config-file, ...): the
    # HOROVOD_* variables horovodrun sets for them (launcher/horovodrun_flags.py), every worker
    horovod_env: Dict[str, str] = field(default_factory=dict)
    failure_blacklist: str = "slot"          # --failure-blacklist: "slot" (ours) or "host"
    prefix_output_with_timestamp: bool = False  # workers' lines start with the time
    timestamps: bool = False                 # --timestamps: the launcher's lines too
    zygote: Optional[bool] = None            # --zygote / --no-zygote (None: HVD_EDL_ZYGOTE)
    keep_zygote: Optional[float] = None      # --keep-zygote (None: HVD_EDL_ZYGOTE_KEEP)
    zygote_dir: Optional[str] = None         # --zygote-dir (None: HVD_EDL_ZYGOTE_DIR)
    engine: Optional[object] = None          # --ray: a launcher.ray.engine.RayEngine (its
                                             # nodes are the hosts, it starts the workers)


class Driver:
    """Runs one job to completion; :meth:`run` returns the launcher's exit code."""

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.secret = messages.new_secret()
        self.events = EventLog(spec.event_log)
        self.rendezvous = GenerationRendezvous(spec.bind_addr, spec.verbose)
        self.coord = Coordinator(min_np=spec.min_np, max_np=spec.max_np, elastic=spec.elastic,
                                 events=self.events, rendezvous=self.rendezvous,
                                 rendezvous_addr=spec.bind_addr, reset_limit=spec.reset_limit)
        self.coord.on_fence = self._on_fence
        self.coord.on_end_silent = self._on_end_silent
        self.checkpoints = None if spec.checkpoint_dir is None else CheckpointDir(
            spec.checkpoint_dir, spec.checkpoint_every_s, spec.checkpoint_keep)
        self.server = CoordinatorServer(self.coord, self.secret, spec.bind_addr,
                                        extra_routes=control.routes(self))
        self.target_np = spec.target_np   # None: every usable slot up to max_np
        self.job_path = None
        self.metrics = None  # launcher.observe.metrics.MetricsServer (--metrics-port)
        self.wake = threading.Event()
        self.procs: Dict[str, WorkerProcess] = {}
        self.slots = SlotBook()  # hosts, slots, cooldowns, blacklist, drains (launcher/job/slot_book.py)
        self.first_failure: Optional[Tuple[WorkerRecord, int]] = None
        # --failure-blacklist host: (the failure, its code, the ring's hosts) that blacklisted
        # the last host of the ring (the job fails, as Horovod's)
        self.every_host_blacklisted: Optional[Tuple[WorkerRecord, int, List[str]]] = None
        self.below_min_since: Optional[float] = None
        self._wait_said_at: Optional[float] = None  # when _report_wait last spoke
        self.last_failure_at = float("-inf")
        self.stop_signal: Optional[int] = None
        self._seq = 0
        self._initial_np = 0
        self._lock = threading.Lock()
        self._drain_lock = threading.Lock()
        self.profiler = Profiler(self)  # hvd-edl-ctl profile (EDL's profiling)
        self.autoscaler = None  # launcher.apps.autoscale.Autoscaler (--autoscale)
        self.batch_adapter = None  # launcher.apps.batch_goodput.BatchAdapter (--adapt-batch)
        self.batch_pinned: Optional[int] = None  # an operator's batch: --adapt-batch stays off it
        self.migration: Optional[migration_.Migration] = None  # running or last (hvd-edl-ctl)
        self.stragglers = straggler_.StragglerDetector(straggler_.StragglerPolicy(
            spec.straggler_policy, spec.straggler_ratio, spec.straggler_window_s))

    # ---- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        try:
            self.slots.set_hosts(self.spec.discovery.find_available_hosts_and_slots(),
                                 getattr(self.spec.discovery, "gpus", None),
                                 getattr(self.spec.discovery, "ends", None))
        except (DiscoveryError, OSError) as e:  # no last good host set to fall back on
            print(f"hvd-edl-run: error: first host discovery failed, nothing launched: {e}",
                  file=sys.stderr)
            return 1
        # a launch refused here leaves no job file (nor a server) behind: validate first
        initial = min(self.spec.np, self._capacity())
        if self.spec.elastic:
            # like Horovod Elastic's driver: the first ring takes every usable slot up to the
            # target (--max-np), not only -np of them, so it is not followed at once by a
            # scale-out of the slots spawned while it formed
            initial = max(initial, min(self._target(), self._capacity()))
        if not self.spec.elastic and initial < self.spec.np:
            print(f"hvd-edl-run: error: -np {self.spec.np} needs {self.spec.np} slots, the hosts "
                  f"give {initial}", file=sys.stderr)
            return 2
        if self.checkpoints is not None:
            try:  # one job per directory, for the job's life (released when it ends or dies)
                self.checkpoints.acquire()
            except CheckpointDirError as e:
                print(f"hvd-edl-run: error: {e}", file=sys.stderr)
                return 2
            try:  # bad checkpoints are named now, and only bad ones end the job before it starts
                self.checkpoints.restore_candidates()
            except CheckpointDirError as e:
                self.checkpoints.release()
                print(f"hvd-edl-run: error: {e}", file=sys.stderr)
                return 1
            self.coord.checkpoints = self.checkpoints
        port = self.server.start()
        try:
            if self.spec.metrics_port is not None and not self._start_metrics():
                return 2
            return self._run_started(port, initial)
        finally:
            if self.metrics is not None:
                self.metrics.stop()
            if self.checkpoints is not None:
                self.checkpoints.release()
            self.coord.flush_events()  # a generation whose reports never all came is logged
            self.coord.stopping = True
            terminate_all(list(self.procs.values()), grace_s=5.0)
            if self.spec.engine is not None:
                self.spec.engine.close()
            self.server.stop()
            self.rendezvous.close()
            if self.job_path is not None:
                control.remove_job_file(self.job_path)  # and its pointer (--job-file)

    def _start_metrics(self) -> bool:
        """Serve ``/metrics`` on the bind address and --metrics-port (``launcher.observe.metrics``);
        False (and one error line) when the port cannot be bound."""
        from launcher.observe.metrics import JobCollector, MetricsServer
        try:
            self.metrics = MetricsServer(JobCollector(self.coord.telemetry, self._capacity),
                                         self.spec.bind_addr, self.spec.metrics_port)
        except OSError as e:
            print(f"hvd-edl-run: error: --metrics-port {self.spec.metrics_port}: cannot listen "
                  f"on {self.spec.bind_addr}:{self.spec.metrics_port}: {e.strerror or e}",
                  file=sys.stderr)
            return False
        print(f"hvd-edl-run: metrics: {self.metrics.url(self.spec.bind_addr)}", flush=True)
        return True

    def _run_started(self, port: int, initial: int) -> int:
        """:meth:`run` once the coordinator listens; whatever happens here, ``run`` stops the
        workers and the servers and removes the job file."""
        self._install_signal_handlers()  # before the job file: a SIGTERM now still removes it
        host = f"[{self.spec.bind_addr}]" if ":" in self.spec.bind_addr else self.spec.bind_addr
        try:
            self.job_path = control.write_job_file(self.spec.job_file, f"http://{host}:{port}",
                                                   self.secret, command=self.spec.command)
            print(f"hvd-edl-run: control: hvd-edl-ctl --job {self.job_path} status", flush=True)
        except OSError as e:
            print(f"hvd-edl-run: cannot write the job file ({e}); hvd-edl-ctl will not find "
                  f"this job", file=sys.stderr)
        self.worker_env = {
            messages.ENV_COORD_ADDR: self.spec.bind_addr,
            messages.ENV_COORD_PORT: str(port),
            messages.ENV_SECRET: self.secret,
            messages.ENV_ELASTIC: "1" if self.spec.elastic else "0",
            messages.ENV_LAUNCHED_AT: f"{time.time():.6f}",  # the audit orders runs by it
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": self.spec.network_interface or "lo",
            "PYTHONUNBUFFERED": "1",
        }
        if self.spec.log_level:  # horovodrun's --log-level: the Horovod backend's level
            self.worker_env["HOROVOD_LOG_LEVEL"] = self.spec.log_level
        self.worker_env.update(self.spec.horovod_env)  # horovodrun's tuning flags
        if self.checkpoints is not None:
            self.worker_env.update(self.checkpoints.worker_env())
        self.worker_spec = WorkerSpec(list(self.spec.command), self.worker_env, self.spec.cwd,
                                      ssh_port=self.spec.ssh_port,
                                      ssh_identity_file=self.spec.ssh_identity_file,
                                      engine=self.spec.engine,
                                      timestamps=self.spec.prefix_output_with_timestamp
                                      or self.spec.timestamps, zygote=self.spec.zygote,
                                      keep_zygote=self.spec.keep_zygote,
                                      zygote_dir=self.spec.zygote_dir)
        if self.spec.elastic:
            threading.Thread(target=self._discovery_loop, daemon=True).start()
        self._initial_np = initial
        for _ in range(initial):
            self._spawn_one(initial=True)
        if self.spec.autoscale is not None and self.spec.elastic:
            from launcher.apps.autoscale import Autoscaler
            self.autoscaler = Autoscaler(self, self.spec.autoscale)
            self.autoscaler.start()
        if self.spec.adapt_batch and self.spec.elastic:
            from launcher.apps.batch_goodput import BatchAdapter
            self.batch_adapter = BatchAdapter(self)
            self.batch_adapter.start()
        while True:
            now = time.monotonic()
            code = self._step(now)
            if code is not None:
                return code
            self.wake.wait(IDLE_LOOP_S if self._settled(now) else LOOP_S)
            self.wake.clear()

    def _step(self, now: float) -> Optional[int]:
        """One pass of monitor / decide / act; returns an exit code when the job is over."""
        if self.stop_signal is not None:
            names = ", ".join(w.worker_id for w in self.coord.live_workers()) or "none left"
            print(f"hvd-edl-run: got signal {self.stop_signal}: stopping workers ({names}; "
                  f"{signal.Signals(self.stop_signal).name})", file=sys.stderr)
            self.coord.stopping = True
            terminate_all(list(self.procs.values()), grace_s=10.0, sig=self.stop_signal)
            if self.checkpoints is not None:  # where the work is, and how to get it back
                print(f"hvd-edl-run: {self.checkpoints.describe_newest()}: run the same command "
                      f"again (same --checkpoint-dir) to resume from it", file=sys.stderr)
            return 128 + self.stop_signal
        if not self.spec.elastic and self.first_failure is not None:
            rec, code = self.first_failure
            return self._fail_worker(rec, code)
        if self.every_host_blacklisted is not None:
            rec, code, hosts = self.every_host_blacklisted
            print(f"hvd-edl-run: error: every host of the ring is blacklisted "
                  f"({', '.join(hosts)}; --failure-blacklist host): the job ends, as "
                  f"Horovod's does", file=sys.stderr)
            return self._fail_worker(rec, code)
        if self.coord.failure:
            print(f"hvd-edl-run: error: {self.coord.failure}", file=sys.stderr)
            culprit = self.coord.workers.get(self.coord.failed_worker or "")
            if culprit is not None and (culprit.exit_code or 0) > 0:
                return self._fail_worker(culprit, culprit.exit_code)  # the script's own code
            return 1
        if self.spec.elastic:
            if self._failed_at_start():
                rec, code = self.first_failure
                print("hvd-edl-run: error: every worker failed before a ring formed (the "
                      "script fails at start): the job ends", file=sys.stderr)
                return self._fail_worker(rec, code)
            if self.migration is not None and self.migration.active:
                self.migration.advance(self, now)
            self._reconcile(now)
            self._report_wait(now)
            self._enforce_timeouts(now)
            if self.below_min_since is not None and \
                    now - self.below_min_since > self.spec.elastic_timeout_s:
                print(f"hvd-edl-run: error: fewer than --min-np {self.spec.min_np} workers "
                      f"available for {self.spec.elastic_timeout_s:g} s (--elastic-timeout); "
                      f"have {self.coord.usable_count()}"
                      + (f"; {self.checkpoints.describe_newest()}: run the same command again "
                         f"to resume" if self.checkpoints is not None else ""), file=sys.stderr)
                return 1
        straggler_.mitigate(self, self.stragglers, now)
        self.coord.tick(now)
        return self._exit_code_if_done()

    # ---- decisions -----------------------------------------------------------------------------

    def _usable_slots(self, now: float, drained: Optional[Set[str]] = None,
                      budget: Optional[int] = None) -> Dict[str, List[int]]:
        """The slot book's usable slots per host (:meth:`SlotBook.usable`), capped to ``budget``
        (default the target world size)."""
        return self.slots.usable(now, self._target() if budget is None else budget, drained)

    def _capacity(self) -> int:
        return sum(len(v) for v in self._usable_slots(time.monotonic()).values())

    def usable_slot_count(self, budget: int) -> int:
        """Slots usable now (blacklist, drains and cooldowns applied), at most ``budget``."""
        return self.slots.capacity(time.monotonic(), budget)

    def _target(self) -> int:
        with self._lock:
            return self.spec.max_np if self.target_np is None else self.target_np

    def _reconcile(self, now: float) -> None:
        usable = self._usable_slots(now)
        drained = self.slots.drained()
        allowed = self.slots.allowed()
        # the replacements are spawned before anyone is asked to leave: a ring whose every
        # member leaves trains on while a replacement builds, and the coordinator must never
        # see the leavers without the pending replacement (it would switch to no one)
        active = [w for w in self.coord.live_workers() if w.state != WorkerState.LEAVING]
        # host gone or drained, slots shrank, or the slot's GPU changed (gpus=)
        leavers = [(w, self._leave_reason(w, drained)) for w in active
                   if (w.host, w.slot) not in allowed
                   or not self.slots.keeps(w.host, w.slot, w.gpu)]
        if self.coord.finishing:
            for w, reason in leavers:
                self.ask_to_leave(w, reason)
            return
        gone = {w.worker_id for w, _ in leavers}
        active = [w for w in active if w.worker_id not in gone]
        members = set(self.coord.current.members) if self.coord.current else set()
        # scale-in to the target: workers not yet in a ring first, then the youngest members
        # (the highest ranks: the others keep their ranks, rank 0 keeps the state)
        # (workers reserved for a migration's swap replace others: not counted)
        excess = sorted((w for w in active if w.worker_id not in self.coord.reserved),
                        key=lambda w: (w.worker_id in members, -w.order))
        for w in excess[:max(0, len(excess) - self._target())]:
            leavers.append((w, f"scale: above the target world size {self._target()}"))
            gone.add(w.worker_id)
        active = [w for w in active if w.worker_id not in gone]
        want = sum(len(v) for v in usable.values())
        for _ in range(max(0, want - len(active))):
            if not self._spawn_one(initial=False, usable=usable):
                break
        for w, reason in leavers:
            self.ask_to_leave(w, reason)
        usable_now = self.coord.usable_count()
        if usable_now < self.spec.min_np:
            self.below_min_since = self.below_min_since or now
        else:
            self.below_min_since = None

    def _report_wait(self, now: float) -> None:
        """Below ``--min-np``: say what the job waits for (``waiting for 3 usable slots, 2
        offered: localhost:2``) at once, then every ``WAIT_REPORT_S`` seconds until the ring
        forms or ``--elastic-timeout`` ends the job."""
        if self.below_min_since is None:
            self._wait_said_at = None
            return
        if self._wait_said_at is not None and now - self._wait_said_at < WAIT_REPORT_S:
            return
        from launcher.discovery import describe_hosts
        self._wait_said_at = now
        offered = self.slots.hosts
        n_offered = sum(offered.values())
        usable = self.slots.capacity(now)
        out = n_offered - usable
        left = self.spec.elastic_timeout_s - (now - self.below_min_since)
        print(f"hvd-edl-run: waiting for {self.spec.min_np} usable slots (--min-np), "
              f"{n_offered} offered: {describe_hosts(offered) or 'no host'}"
              + (f" ({out} of them resting, blacklisted or drained)" if out > 0 else "")
              + f"; the job ends in {max(left, 0):.0f} s (--elastic-timeout) unless more come",
              file=sys.stderr, flush=True)

    def _enforce_timeouts(self, now: float) -> None:
        for w in self.coord.live_workers():
            if w.state == WorkerState.PENDING and now - w.spawned_at > self.spec.start_timeout_s:
                print(f"hvd-edl-run: {w.label} not ready within --start-timeout "
                      f"{self.spec.start_timeout_s:g} s: dropped", file=sys.stderr)
                self.procs[w.worker_id].signal(signal.SIGKILL)
        for w in self.coord.overdue_reporters(now, SWITCH_TIMEOUT_S):
            print(f"hvd-edl-run: {w.label} did not reach the step boundary: killed",
                  file=sys.stderr)
            self.procs[w.worker_id].signal(signal.SIGKILL)

    def _settled(self, now: float) -> bool:
        """Nothing for a pass to do before an event wakes the loop: the coordinator is settled,
        the job is not below ``--min-np`` and no slot cooldown or host blacklisting ends at a
        time a pass would have to notice."""
        if self.below_min_since is not None or not self.coord.settled():
            return False
        return not self.slots.change_pending(now)

    def _exit_code_if_done(self) -> Optional[int]:
        live = self.coord.live_workers()
        if self.coord.finishing:
            # the job ends: once every member is gone, send away workers that never joined
            members = set(self.coord.current.members) if self.coord.current else set()
            if any(w.worker_id in members for w in live):
                return None
            stragglers = [self.procs[w.worker_id] for w in live]
            if stragglers and not self.spec.elastic:
                # a static job is every rank's, as under horovodrun: a worker that never joined
                # (a command without hvd.init(), or one still starting) runs to its own end
                return None
            if stragglers:
                terminate_all(stragglers, grace_s=5.0)
                return None
            # a member's script finished: a peer killed by a signal after that (a preemption
            # in the job's last seconds) did not fail the training; an error of the script did
            ended = [self.coord.workers[m] for m in members]
            for w in ended:
                if (w.exit_code or 0) < 0:
                    print(f"hvd-edl-run: {w.label} ended by signal {-w.exit_code} after the "
                          f"training finished: not a failure of the job", file=sys.stderr)
            failed = [w for w in ended if (w.exit_code or 0) > 0]
            if failed:
                return self._fail_worker(failed[0], failed[0].exit_code)
            return 0
        if live:
            return None
        if self.checkpoints is not None and self.spec.elastic \
                and self.below_min_since is not None:
            # every worker gone, no slot to respawn them: hosts may come back within
            # --elastic-timeout, and new workers resume from the checkpoint
            return None
        if self.first_failure is not None:
            rec, code = self.first_failure
            return self._fail_worker(rec, code)
        return 0

    def _failed_at_start(self) -> bool:
        """No ring ever formed and every worker started so far exited with an error of its
        own (code > 0): the script fails at start (a typo, a missing module), a replacement
        would fail alike, and waiting ``--elastic-timeout`` for hosts would only hold them."""
        if self.first_failure is None or self.coord.ring().generation > 0:
            return False
        workers = list(self.coord.workers.values())
        return bool(workers) and all(not w.state.alive and (w.exit_code or 0) > 0
                                     for w in workers)

    def _fail_worker(self, rec: WorkerRecord, code: int) -> int:
        rank = f"rank {rec.rank}" if rec.rank is not None else f"worker {rec.worker_id}"
        how = f"exit code {code}" if code >= 0 else f"signal {-code}"
        proc = self.procs.get(rec.worker_id)
        said = getattr(proc, "last_error_line", "") if code > 0 else ""
        print(f"hvd-edl-run: error: {rank} on host {rec.host} ({rec.label}) failed with {how}"
              + (f": {said.strip()[:300]}" if said else ""), file=sys.stderr)
        return code if code > 0 else 128 - code

    # ---- control API (HTTP threads; the loop acts on the next pass) ------------------------------

    def telemetry_snapshot(self) -> dict:
        """The heartbeats' figures (``launcher.observe.telemetry``), JSON-ready: ``job`` (world size,
        generation, target world size, steps/s, samples/s, mean step / compute / wait seconds,
        last stall, whether the job is finishing), ``workers`` (one row per worker: step /
        compute / wait seconds per step, rates, state; members first by rank), ``counters``
        (failures, evictions, stragglers, migrations, autoscale decisions) and ``resting``
        (host -> slots that rest for the rest of the job, :meth:`SlotBook.resting_for_good`:
        the cluster service gives them back).  Cheap: asks the workers nothing
        (``hvd-edl-ctl top`` polls it)."""
        tel = self.coord.telemetry
        job = tel.job()
        job["target_world_size"] = self._capacity()  # usable slots up to the target
        states, job["finishing"] = self.coord.worker_states()
        return {"job": job, "counters": tel.counters(), "window_s": tel.window_s,
                "gradient_noise": tel.gradient_noise(), "adaptive_batch": tel.adaptive_batch(),
                "workers": [dict(w.as_dict(), state=states.get(w.worker_id, "unknown"))
                            for w in tel.workers()],
                "resting": self.slots.resting_for_good()}

    def status(self) -> dict:
        """The job as ``hvd-edl-ctl status`` shows it (see :meth:`Coordinator.snapshot`), plus
        the target world size, bounds, hosts, drained and blacklisted hosts, and the training
        command.  Asks the members for fresh progress first (at most half a second)."""
        if self.spec.elastic:  # static workers keep no long poll open (nothing to ask)
            self.coord.fresh_progress(wait_s=0.5)
        now = time.monotonic()
        out = self.coord.snapshot()
        out["usable_slots"] = self._capacity()  # up to the target world size
        out["telemetry"] = self.telemetry_snapshot()
        # McCandlish's noise scale (hvd_edl.gradient_noise) and the adaptive batch, if any
        out["gradient_noise"] = out["telemetry"]["gradient_noise"]
        out["adaptive_batch"] = out["telemetry"]["adaptive_batch"]
        out["batch_request"] = self.coord.batch_request or None
        out["batch_pinned"] = self.batch_pinned
        if self.checkpoints is not None:  # the newest complete one (sidecar read, not verified)
            newest = self.checkpoints.newest()
            out["checkpoint"] = None if newest is None else {
                "path": str(newest[0]), "step": newest[1].get("steps"),
                "age_s": round(time.time() - (newest[1].get("time") or time.time()), 1)}
        with self._lock:
            out.update(target_np=self.target_np, min_np=self.spec.min_np,
                       max_np=self.spec.max_np, elastic=self.spec.elastic,
                       hosts=self.slots.hosts, drained=sorted(self.slots.drained()),
                       blacklisted=self.slots.blacklisted_hosts(now),
                       command=list(self.spec.command))
        out["profile"] = {k: v for k, v in self.profiler.status().items()
                          if k in ("state", "sizes", "size", "error", "json")}
        if self.autoscaler is not None:
            out["autoscale"] = self.autoscaler.status()
        if self.batch_adapter is not None:
            out["adapt_batch"] = self.batch_adapter.status()
        out["migration"] = migration_.status(self.migration)
        return out

    def set_target(self, np_: int) -> dict:
        """Make ``np_`` workers the target world size (EDL's scale_out / scale_in): the loop
        spawns joiners or asks the youngest workers to leave, through the stop-free protocol.

        Raises:
            ValueError: a static job, or ``np_`` outside [min_np, max_np]; nothing changes.
        """
        if not self.spec.elastic:
            raise ValueError(f"a static job keeps -np {self.spec.np} workers; start it with "
                             f"--min-np/--max-np to scale it")
        if not self.spec.min_np <= np_ <= self.spec.max_np:
            raise ValueError(f"np {np_} is outside [--min-np {self.spec.min_np}, "
                             f"--max-np {self.spec.max_np}]; the job is unchanged")
        with self._lock:
            previous, self.target_np = self.target_np, np_
        print(f"hvd-edl-run: control: target world size {np_} "
              f"(was {previous if previous is not None else 'every usable slot'})", flush=True)
        self.wake.set()
        capacity = self._capacity()
        return {"target_np": np_, "previous_target_np": previous,
                "usable_slots": capacity,
                "warning": None if capacity >= np_ else
                f"only {capacity} usable slots now: the job grows when discovery offers more"}

    def set_batch(self, batch, pin: bool = True) -> dict:
        """Ask for global batch ``batch`` (samples per optimizer step over all ranks) from the
        next generation on (the cluster service passes its chosen batch this way; ``hvd-edl-run
        --adapt-batch`` too).  A script that opted in (``hvd.elastic.AdaptiveBatchSampler``)
        applies it at the next switch, clamped to its bounds; when only the batch changes, the
        ring switches to itself for it (nothing synced).  A script that did not opt in keeps
        its batch: the answer says so (``adaptive`` false).

        ``pin`` (the control API's ``/ctl/batch``, i.e. an operator or the cluster service):
        the batch stays until the next ``set_batch``; ``--adapt-batch``'s chooser does not
        change a pinned batch.  ``batch`` ``"auto"`` lifts the pin (the chooser decides again;
        nothing else changes).  The chooser itself asks with ``pin`` False.

        Returns ``{"requested_batch", "batch", "adaptive", "bounds", "switch", "warning",
        "pinned"}``: ``batch`` the global batch in force now (None unknown), ``bounds`` the
        script's (min_batch, max_batch, max_local_batch, base_batch), ``switch`` whether a
        switch was asked for it, ``pinned`` the pinned batch (None: the chooser's, if any).

        Raises:
            ValueError: ``batch`` not an integer >= 1 nor ``"auto"``, or a static job (no switch
                to apply it).
        """
        if batch == "auto":
            with self._lock:
                self.batch_pinned = None
            print("hvd-edl-run: control: batch back to "
                  + ("--adapt-batch's choice" if self.batch_adapter is not None
                     else "the last one asked for (no --adapt-batch: nothing chooses it)"),
                  flush=True)
            plan = self.coord.telemetry.adaptive_batch()
            return {"requested_batch": "auto", "batch": None if plan is None else plan.get(
                "batch"), "adaptive": plan is not None, "switch": False, "pinned": None,
                "warning": None if self.batch_adapter is not None else
                "the job runs without --adapt-batch: its batch stays as it is"}
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"'batch' must be an integer >= 1 or \"auto\", got {batch!r}")
        if not self.spec.elastic:
            raise ValueError("a static job has no switch to change its batch at; start it with "
                             "--min-np/--max-np")
        with self._lock:
            if pin:
                self.batch_pinned = batch
            pinned = self.batch_pinned
        plan = self.coord.telemetry.adaptive_batch()
        if not pin and pinned is not None:  # the chooser lost a race with an operator
            return {"requested_batch": batch, "batch": None if plan is None else plan.get(
                "batch"), "adaptive": plan is not None, "switch": False, "pinned": pinned,
                "warning": f"batch pinned at {pinned}: unchanged"}
        previous = self.coord.batch_request
        switch = self.coord.request_batch(batch)
        out = {"requested_batch": batch, "previous_request": previous or None,
               "batch": None if plan is None else plan.get("batch"),
               "adaptive": plan is not None, "switch": switch, "warning": None,
               "pinned": self.batch_pinned,
               "bounds": None if plan is None else {k: plan.get(k) for k in (
                   "base_batch", "min_batch", "max_batch", "max_local_batch")}}
        if plan is None:
            out["warning"] = ("no worker reported an adaptive batch: a script that did not opt "
                              "in (hvd.elastic.AdaptiveBatchSampler) keeps its batch")
        elif not plan["min_batch"] <= batch <= plan["max_batch"]:
            out["warning"] = (f"outside the script's bounds [{plan['min_batch']}, "
                              f"{plan['max_batch']}]: clamped when applied")
        print(f"hvd-edl-run: control: global batch {batch} asked for"
              + (" (pinned: --adapt-batch leaves it until 'batch auto')"
                 if pin and self.batch_adapter is not None else "")
              + ("" if plan is not None else " (the script did not opt in: it keeps its batch)"),
              flush=True)
        self.wake.set()
        return out

    def restore_target(self, target: Optional[int]) -> None:
        """Set the target world size back to ``target`` (None: every usable slot up to
        ``max_np``), as a profile does when it ends; the loop resizes stop-free."""
        with self._lock:
            self.target_np = target
        print(f"hvd-edl-run: control: target world size back to "
              f"{target if target is not None else 'every usable slot'}", flush=True)
        self.wake.set()

    def request_checkpoint(self, wait_s: float = 60.0) -> dict:
        """``hvd-edl-ctl checkpoint``: rank 0 writes a checkpoint at its next commit; waits up
        to ``wait_s`` seconds (at most 600) for it to be complete in the directory.

        Returns ``{"path", "step", "request"}``, ``path`` None (with a ``warning``) when none
        was written in time (the request stays: the next commit of rank 0 writes it).

        Raises:
            ValueError: no ``--checkpoint-dir``, or a static job (its workers keep no watch
                poll that could carry the request; they write at the interval only).
        """
        if self.checkpoints is None:
            raise ValueError("this job runs without --checkpoint-dir: nothing to write to")
        if not self.spec.elastic:
            raise ValueError("a static job writes checkpoints at --checkpoint-every only; "
                             "start it with --min-np/--max-np to force one")
        request = self.coord.request_checkpoint()
        deadline = time.monotonic() + min(max(wait_s, 0.0), 600.0)
        while True:
            newest = self.checkpoints.newest()
            if newest is not None and newest[1].get("request", 0) >= request:
                print(f"hvd-edl-run: control: checkpoint {newest[0]} written (step "
                      f"{newest[1]['steps']})", flush=True)
                return {"path": str(newest[0]), "step": newest[1]["steps"], "request": request}
            if time.monotonic() > deadline:
                return {"path": None, "step": None, "request": request,
                        "warning": f"no checkpoint written within {wait_s:g} s (rank 0 writes "
                                   f"it at its next commit once no write is in flight)"}
            time.sleep(0.1)

    def drain(self, host: str, drain: bool) -> dict:
        """Drain ``host`` (its workers leave at the next commit, no new ones are placed there)
        or, with ``drain`` False, make it usable again.

        Raises:
            ValueError: a static job; ``host`` neither discovered, drained nor running workers
                (also for undrain: a mistyped name must not pass for done); or the
                other hosts' usable slots fall short of ``min_np`` (the members would have no
                ring to hand their state to).  Nothing changes then.
        """
        if not self.spec.elastic:
            raise ValueError("a static job cannot drain hosts")
        known = set(self.slots.hosts) | {w.host for w in self.coord.live_workers()}
        with self._drain_lock:  # one drain at a time: the capacity check and the change agree
            drained = self.slots.drained()
            after = drained | {host} if drain else drained - {host}
            if host not in known and host not in drained:
                raise ValueError(f"unknown host {host!r} (not discovered, not drained, no "
                                 f"worker on it); the job knows {sorted(known)}")
            if drain:
                left = self.slots.capacity(time.monotonic(), self._target(), after)
                if left < self.spec.min_np:
                    raise ValueError(f"draining {host} leaves {left} usable slots, fewer than "
                                     f"--min-np {self.spec.min_np}; the job is unchanged")
            changed = self.slots.set_drained(host, drain)
        if changed:
            print(f"hvd-edl-run: control: host {host} {'drained' if drain else 'usable again'}",
                  flush=True)
        self.wake.set()
        return {"drained": sorted(after), "usable_slots": self._capacity()}

    def migrate(self, source: str, target: str, wait_s: float = 120.0) -> dict:
        """``hvd-edl-ctl migrate``: move every worker on ``source`` to ``target`` in one
        stop-free switch (:mod:`launcher.apps.migration`); waits up to ``wait_s`` seconds (at most
        600) for it to end.  Returns :meth:`Migration.result` (``phase`` "building" or
        "swapping" when the wait ran out: the migration goes on).

        Raises:
            ValueError (:class:`MigrationError`): refused, see :func:`migration.plan`; the job
                is unchanged.
        """
        with self._drain_lock:
            m = migration_.plan(self, source, target, time.monotonic())
            self.migration = m
        self.events.note("migration", f"{len(m.leavers)} worker"
                         f"{'s' if len(m.leavers) != 1 else ''} ({', '.join(m.leavers)}) move "
                         f"from {source} to {target}: starting their replacements",
                         phase="start", source=source, target=target, leavers=m.leavers)
        telemetry = getattr(self.coord, "telemetry", None)
        if telemetry is not None:
            telemetry.count("migration")
        self.wake.set()
        deadline = time.monotonic() + min(max(wait_s, 0.0), 600.0)
        while m.active and time.monotonic() < deadline:
            time.sleep(0.1)
        return m.result()

    # ---- actions -------------------------------------------------------------------------------

    # ---- the public interface -------------------------------------------------------------------
    # What the applications (launcher/apps/migration.py, straggler.py, profiler.py, autoscale.py) and
    # the control API use of a running job; nothing else of the driver or the coordinator is
    # touched across rooms.  Besides these: set_target / restore_target, drain, migrate,
    # status, telemetry_snapshot, request_checkpoint (above), the slot book (``slots``,
    # launcher/job/slot_book.py), ``spec``, ``profiler`` and ``migration``.

    @property
    def telemetry(self):
        """The heartbeats' figures (a :class:`launcher.observe.telemetry.Telemetry`; thread-safe)."""
        return self.coord.telemetry

    def ring(self, since: Optional[int] = None):
        """The membership now (:meth:`Coordinator.ring`: a frozen ``RingSnapshot``)."""
        return self.coord.ring(since)

    def rank0_progress(self, fresh_wait_s: float = 0.5):
        """Rank 0's progress (``at`` monotonic seconds, ``step``, ``samples``) after asking the
        members for fresh figures (at most ``fresh_wait_s`` seconds); None when unknown."""
        self.coord.fresh_progress(wait_s=fresh_wait_s)
        return self.coord.rank0_progress()

    def worker(self, worker_id: str) -> Optional[WorkerRecord]:
        """The record of ``worker_id`` (its state, host, slot, rank, exit code), None if
        unknown.  Read its fields; change nothing."""
        return self.coord.workers.get(worker_id)

    def live_workers(self) -> List[WorkerRecord]:
        return self.coord.live_workers()

    def taken_slots(self) -> Set[Tuple[str, int]]:
        """``(host, slot)`` of every live worker."""
        return {(w.host, w.slot) for w in self.coord.live_workers()}

    def note(self, kind: str, text: str, **fields) -> dict:
        """A decision in the event log and on the output (:meth:`EventLog.note`)."""
        return self.events.note(kind, text, **fields)

    def swap(self, leavers: List[str], joiners: List[str]) -> None:
        """One stop-free switch in which ``leavers`` leave and the reserved ``joiners`` join
        (:meth:`Coordinator.swap`); leavers not yet in a ring are terminated now."""
        for w in self.coord.swap(leavers, joiners):
            proc = self.procs.get(w)
            if proc is not None:
                proc.signal(signal.SIGTERM)
        self.wake.set()

    def release_reserved(self, worker_id: str) -> None:
        """A reserved worker (see :meth:`start_worker`) becomes an ordinary joiner, or is
        forgotten if gone (:meth:`Coordinator.unreserve`)."""
        self.coord.unreserve(worker_id)

    def ask_to_leave(self, w: WorkerRecord, reason: str) -> None:
        """Scale-in one worker: a member leaves at the next commit; any other exits now.  Prints
        one line saying which worker and why."""
        rank = f"rank {w.rank}" if w.rank is not None and w.state == WorkerState.MEMBER \
            else "not in a ring yet"
        print(f"hvd-edl-run: worker {w.worker_id} ({rank}) on {w.host} slot {w.slot} leaves: "
              f"{reason}", flush=True)
        if self.coord.request_leave(w.worker_id):
            self.procs[w.worker_id].signal(signal.SIGTERM)

    def _on_notice(self, host: str) -> None:
        """Discovery announced ``host``'s end (``ends=``): its workers leave at their next
        commit (the slot book sends them away); with ``--checkpoint-dir``, rank 0 is asked for a
        durable checkpoint at its next commit first, so that the job's progress survives even if
        more hosts go with it."""
        ends = self.slots.ends_of(host)
        left_s = None if ends is None else round(ends - time.time(), 1)
        workers = [w for w in self.coord.live_workers() if w.host == host]
        request = None
        if workers and self.checkpoints is not None and self.spec.elastic:
            request = self.coord.request_checkpoint()
        print(f"hvd-edl-run: host {host} ends in {left_s} s (discovery's notice): "
              f"{len(workers)} worker{'s' if len(workers) != 1 else ''} leave at their next "
              f"commit" + (", a checkpoint first" if request else ""), file=sys.stderr,
              flush=True)
        self.events.note("notice", f"host {host} ends in {left_s} s", host=host, ends=ends,
                         workers=[w.worker_id for w in workers], checkpoint_request=request)

    def _leave_reason(self, w: WorkerRecord, drained: Set[str]) -> str:
        """Why ``w``'s slot is no longer allowed: a drain, a spot / preemption notice (the reason
        a discovery script gave, see :attr:`HostDiscoveryScript.reasons`), its host gone from
        discovery, or its host's slots shrank."""
        if w.host in drained:
            return f"drain: host {w.host} drained (hvd-edl-ctl drain)"
        ends = self.slots.ends_of(w.host)
        if ends is not None:
            return f"notice: host {w.host} ends in {ends - time.time():.1f} s"
        n = self.slots.slots_of(w.host)
        if n is not None and w.slot < n:
            return (f"discovery: slot {w.slot} of host {w.host} is now on GPU "
                    f"{(self.slots.gpus_of(w.host) or ('?',) * n)[w.slot]}, not {w.gpu}")
        if n is not None:
            return f"discovery: host {w.host} now offers {n} slot{'s' if n != 1 else ''}"
        why = getattr(self.spec.discovery, "reasons", {}).get(w.host)
        if why:
            return f"discovery: host {w.host} left out ({why})"
        return f"discovery: host {w.host} no longer listed"

    def _spawn_one(self, initial: bool, usable: Optional[Dict[str, List[int]]] = None) -> bool:
        """Start one worker on the first slot of ``usable`` (default: the slot book's now) that
        is still free.  ``usable`` may be stale (the liveness thread can fence a worker, and a
        failure can rest a slot or blacklist a host, after it was computed), so each slot is
        asked again: the slots taken are read first (live workers, and fenced ones whose slot
        the driver has not rested yet), then the book, so a slot is never handed out between a
        fence and its rest."""
        usable = usable if usable is not None else self._usable_slots(time.monotonic())
        taken = self.coord.occupied_slots()
        now = time.monotonic()
        for host, slots in usable.items():
            free = set(self.slots.free_slots(host, now, taken))
            for slot in slots:
                if slot in free:
                    self.start_worker(host, slot, initial=initial)
                    return True
        return False

    def start_worker(self, host: str, slot: int, reserve: bool = False,
                     initial: bool = False) -> WorkerRecord:
        """Start one worker on ``host``:``slot``; ``reserve``: held back from joining until a
        swap releases it (:meth:`Coordinator.reserve`, :meth:`swap`, :mod:`launcher.apps.migration`);
        ``initial``: one of the job's first workers (the driver's own start)."""
        self._seq += 1
        worker_id = f"w{self._seq}"
        rec = WorkerRecord(worker_id, host, slot, self._seq, time.monotonic(), initial=initial)
        gpus = self.slots.gpus_of(host)
        if gpus is not None and slot < len(gpus):
            rec.gpu = gpus[slot]
        self.coord.add_worker(rec)
        if reserve:
            self.coord.reserve(worker_id)
        env = {messages.ENV_WORKER_ID: worker_id, messages.ENV_HOST: host,
               messages.ENV_SLOT: str(slot)}
        env.update(self._horovod_env(rec))
        if rec.gpu is not None:
            # the host line's GPUs in slot order: the worker's own at its local rank, so
            # torch.cuda.set_device(hvd.local_rank()) selects it (docs/gpus.md)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)

        def label() -> str:
            return str(rec.rank) if rec.rank is not None else worker_id

        def on_exit(code: int) -> None:
            self._on_exit(rec, code)

        self.procs[worker_id] = spawn(self.worker_spec, host, env, label, on_exit,
                                      output_dir=self.spec.output_dir)
        print(f"hvd-edl-run: worker {worker_id} started on {host} slot {slot}"
              + (f" (GPU {rec.gpu})" if rec.gpu is not None else "")
              + (" (reserved: it builds, then replaces a worker in one switch)" if reserve
                 else ""), flush=True)
        return rec

    def _on_fence(self, rec: WorkerRecord, silent_s: float) -> None:
        """The coordinator declared ``rec`` dead (no heartbeat for ``silent_s`` while its peers
        beat: frozen, its host gone, or cut off from the launcher): kill it where we can (a
        remote worker's supervisor also ends it when its ssh session goes), rest its slot as
        for any failure, and let the loop re-form the ring without it."""
        print(f"hvd-edl-run: {rec.label} fell silent (no heartbeat for {silent_s:g} s while "
              f"its peers beat): declared dead and fenced; the others are released",
              file=sys.stderr, flush=True)
        proc = self.procs.get(rec.worker_id)
        if proc is not None:
            proc.signal(signal.SIGKILL)
        self.slots.note_fenced(rec.host, rec.slot)  # its process may live on: not given back
        self._record_failure(rec, -signal.SIGKILL)
        rec.fence_pending = False  # its slot rests (or its host is out): no longer held
        self.wake.set()

    def _on_end_silent(self, rec: WorkerRecord, silent_s: float) -> None:
        """Training is over and ``rec`` has not beaten for ``silent_s`` (frozen, or its host
        gone, in the script's last lines or its teardown): kill it so that the job can end; not
        a failure of the job (:meth:`_exit_code_if_done` says so)."""
        print(f"hvd-edl-run: {rec.label} fell silent for {silent_s:g} s after the training "
              f"finished: killed", file=sys.stderr, flush=True)
        proc = self.procs.get(rec.worker_id)
        if proc is not None:
            proc.signal(signal.SIGKILL)
        self.wake.set()

    def _horovod_env(self, rec: WorkerRecord) -> Dict[str, str]:
        """The ``HOROVOD_*`` variables horovodrun sets before a script starts, as they stand at
        spawn: ``HOROVOD_HOSTNAME`` and ``HOROVOD_LOCAL_RANK`` (the slot) are the worker's for
        its life, ``HOROVOD_LOCAL_SIZE`` is its host's slot count; rank, size and the cross
        figures are provisional (what they would be if the next generation formed now).  The
        worker sets every one to its ring's values at each join (``hvd_edl.runtime``)."""
        rank, size = self.coord.provisional(rec.worker_id, self._initial_np if rec.initial else 0)
        offered = self.slots.hosts
        hosts = list(offered) or [rec.host]
        if rec.host not in hosts:
            hosts.append(rec.host)
        return {"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size),
                "HOROVOD_LOCAL_RANK": str(rec.slot),
                "HOROVOD_LOCAL_SIZE": str(max(offered.get(rec.host, 1), rec.slot + 1)),
                "HOROVOD_CROSS_RANK": str(hosts.index(rec.host)),
                "HOROVOD_CROSS_SIZE": str(len(hosts)),
                "HOROVOD_HOSTNAME": rec.host}

    def _on_exit(self, rec: WorkerRecord, code: int) -> None:
        was = rec.state
        # a worker the launcher asked to leave and SIGTERMed before its handler existed, or
        # any worker once the launcher itself was told to stop: not a failure
        terminated = (was == WorkerState.LEAVING and code == -signal.SIGTERM) \
            or self.coord.stopping
        if code != 0 and was.alive and not self.coord.finishing and not terminated:
            with self._lock:
                if self.first_failure is None:
                    self.first_failure = (rec, code)
            if self.spec.elastic:
                self._record_failure(rec, code)
        verdict = self.coord.on_exit(rec.worker_id, 0 if terminated else code)
        if verdict == "ended_early":
            print(f"hvd-edl-run: {rec.label} (rank {rec.rank}), the last member, exited with "
                  f"code 0 before its training function returned: the script ended training "
                  f"itself; the job ends (training may be incomplete)", file=sys.stderr,
                  flush=True)
        if verdict == "left":
            print(f"hvd-edl-run: {rec.label} (rank {rec.rank}) exited with code 0 before "
                  f"training ended: taken as a leave, the others go on without it (its work "
                  f"since the last commit is redone)", file=sys.stderr, flush=True)
        self.wake.set()

    def _record_failure(self, rec: WorkerRecord, code: int) -> None:
        self.coord.telemetry.count("failure")  # a crash or a fence (metrics, status)
        now = time.monotonic()
        if code in ECHO_CODES and now - self.last_failure_at < COLLATERAL_WINDOW_S:
            # A peer's crash can abort a healthy process inside Horovod's Gloo loop
            # (gloo::EnforceNotMet, signal 6): its slot is reused, its host not blamed.  An
            # exit status > 0 is the script's own error and never an echo: taking it for one
            # respawned a script that failed everywhere at once, forever (issue 13).
            print(f"hvd-edl-run: {rec.label} ended (code {code}) right after another worker's "
                  f"failure: taken as its echo, the slot stays usable", file=sys.stderr)
            return
        self.last_failure_at = now
        if self.spec.failure_blacklist == "host":
            self._blacklist_host(rec, code, now)
            return
        rest = self.slots.record_failure(rec.host, rec.slot, now,
                                         self.spec.blacklist_cooldown_range)
        cooldown = rest.cooldown_s
        print(f"hvd-edl-run: {rec.label} failed ({'exit code ' + str(code) if code > 0 else 'signal ' + str(-code)}); "
              f"its slot rests {'for the rest of the job' if cooldown == float('inf') else f'{cooldown:.0f} s'}",
              file=sys.stderr)
        if rest.blacklisted:
            print(f"hvd-edl-run: host {rec.host} blacklisted after {rest.failures} failures",
                  file=sys.stderr)

    def _blacklist_host(self, rec: WorkerRecord, code: int, now: float) -> None:
        """``--failure-blacklist host``, Horovod's rule (``horovod/runner/elastic/
        registration.py``, ``discovery.py``): ``rec``'s failure blacklists its host (for the rest
        of the job, or Horovod's back-off within ``--blacklist-cooldown-range``), the host's
        other workers are stopped at once and leave the ring with the failed one, and when
        every host of the ring is blacklisted the job fails (:meth:`_step`)."""
        rest = self.slots.blacklist_host(rec.host, now, self.spec.blacklist_cooldown_range)
        how = "for the rest of the job" if rest.cooldown_s == float("inf") else \
            f"for {rest.cooldown_s:.1f} s (blacklisting {rest.failures})"
        what = f"exit code {code}" if code > 0 else f"signal {-code}"
        print(f"hvd-edl-run: {rec.label} failed ({what}); host {rec.host} blacklisted {how} "
              f"(--failure-blacklist host)", file=sys.stderr)
        for w in self.coord.fence_host(rec.host, but=rec.worker_id):
            w.fence_pending = False  # its host is blacklisted already
            print(f"hvd-edl-run: {w.label} stopped: its host {rec.host} is blacklisted",
                  file=sys.stderr)
            proc = self.procs.get(w.worker_id)
            if proc is not None:
                proc.signal(signal.SIGKILL)
        ring = self.coord.ring()
        hosts = sorted({self.coord.workers[m].host for m in ring.members})
        if hosts and all(self.slots.blacklisted(h, now) for h in hosts) \
                and self.every_host_blacklisted is None:
            self.every_host_blacklisted = (rec, code, hosts)
        self.wake.set()

    def _discovery_loop(self) -> None:
        """Asks discovery every ``discovery_interval_s``.  A failed call keeps the last good
        host set; each distinct problem is printed once (not once per call), and so is the
        recovery.  Nothing a discovery call raises ends this thread."""
        from launcher.discovery import describe_hosts
        problem = None
        while True:
            time.sleep(self.spec.discovery_interval_s)
            try:
                hosts = self.spec.discovery.find_available_hosts_and_slots()
            except Exception as e:  # noqa: BLE001 - discovery must never kill the job
                key = getattr(e, "key", None) or f"{type(e).__name__}: {e}"
                if key != problem:
                    problem = key
                    what = e if isinstance(e, DiscoveryError) else f"host discovery failed: {e!r}"
                    print(f"hvd-edl-run: {what}; keeping the last good host set "
                          f"{describe_hosts(self.slots.hosts)}", file=sys.stderr)
                continue
            if problem is not None:
                problem = None
                print(f"hvd-edl-run: host discovery recovered: {describe_hosts(hosts)}",
                      file=sys.stderr)
            before = self.slots.hosts
            noticed = {h for h in getattr(self.spec.discovery, "ends", {})
                       if self.slots.ends_of(h) is None}
            if self.slots.set_hosts(hosts, getattr(self.spec.discovery, "gpus", None),
                                    getattr(self.spec.discovery, "ends", None)):
                log.info("hosts changed: %s -> %s", before, hosts)
                for host in sorted(noticed):
                    self._on_notice(host)
                self.wake.set()

    def _install_signal_handlers(self) -> None:
        def handler(signum, frame):
            if self.stop_signal is None:  # the first signal decides what the workers get
                self.stop_signal = signum
            self.wake.set()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                signal.signal(sig, handler)
            except ValueError:  # not the main thread (tests)
                pass
