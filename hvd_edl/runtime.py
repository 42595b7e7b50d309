"""The worker side of the membership protocol: one :class:`WorkerRuntime` per training process.

Life of a worker (see ../shared/DESIGN.md, "The membership protocol"):

* ``init()`` registers with the coordinator as *pending* and returns at once with the worker's
  local rank (its slot on the host) known, so the script can pin its device and build its model
  while the current ring trains.
* ``join()`` (called when the script enters ``hvd.elastic.run``, or by the first collective)
  reports *ready* and waits for the generation that includes it, then sets Horovod's environment
  and calls ``horovod.torch.init()``.
* A watcher thread long-polls the coordinator (``POST /watch``, blocked in a receive: no CPU
  while nothing changes) and raises a local flag when a switch is wanted.  At
  ``state.commit()`` the members agree through one small allreduce of that flag (pipelined:
  see ``hvd_edl.switch_agreement.agree``) whether to switch; :meth:`rejoin` then shuts Horovod
  down and initialises it for the next generation, or exits 0 when this worker is scaled in.

Outside ``hvd-edl-run`` (no coordinator in the environment) everything falls back to plain Horovod.
"""
from __future__ import annotations

import atexit
import collections
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Dict, Optional, Tuple

from hvd_edl import messages
from hvd_edl.client import CoordinatorClient, CoordinatorUnreachable
from hvd_edl.heartbeat import Heartbeat
from hvd_edl.process_exit import die, die_fenced
from hvd_edl import step_timer, switch_agreement

log = logging.getLogger(__name__)

ENV_STOP_BEFORE_INIT = "HVD_EDL_TEST_STOP_BEFORE_INIT"
"""Fault injection for tests: the worker with this id stops itself (SIGSTOP) right before its
``hvd.init()`` for a ring, so that ring's set-up waits on a silent member."""
ENV_DIE_AFTER_READY = "HVD_EDL_TEST_DIE_AFTER_READY"
"""Fault injection for tests, ``WORKER_ID[:SECONDS]``: the worker with this id kills itself
(SIGKILL) that long after it reported ready (a joiner lost between READY and its ring)."""
ENV_NCCL_ELASTIC = "HVD_EDL_NCCL_ELASTIC"
"""Set to 1 before every ``hvd.init()`` of an elastic worker.  Read only by a Horovod built with
NCCL (cmake/patches/nccl/0001): its NCCL communicators are then aborted at shutdown, never
destroyed (``ncclCommDestroy`` waits for operations in flight: forever when a peer is gone), and a
NCCL error while a GPU operation completes fails that operation (``HorovodInternalError``), as
under Horovod Elastic's ``HOROVOD_ELASTIC=1``, which we cannot set (it makes the Gloo set-up ask
Horovod's own rendezvous for rank and size)."""
IDLE_WAIT_MS = "200"
"""``HVD_EDL_IDLE_WAIT_MS``'s default (milliseconds; cmake/patches/0009): the longest an idle
background loop sleeps before its next cycle.  A tensor enqueued or ``hvd.shutdown()`` wakes it at
once; only a collective that needs a rank with nothing queued (a peer's shutdown seen by a rank
that does not call it, a tensor that rank never submits) waits up to this long."""


def idle_wait_ms(local_size: int, cores: Optional[int] = None) -> str:
    """``HVD_EDL_IDLE_WAIT_MS`` for a worker whose host runs ``local_size`` ranks on ``cores``
    CPUs (default: the CPUs this process may run on): :data:`IDLE_WAIT_MS` with a core or more per
    rank, "0" (upstream's busy loop) with fewer.  Measured here (2 cores, cmake/patches/0009):
    2 and 8 ranks kept their step time (103 and 123-128 ms) with the idle loops' CPU down from
    0.36 to 0.05 and from 1.1-1.2 to 0.30-0.35 cores; 16 ranks (8 a core) stepped slower (0.22-0.23
    -> 0.26 s in benchmarks/job/scale.py), their wake-ups costing more than the busy loops' CPU."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
    return IDLE_WAIT_MS if local_size <= cores else "0"


_USER_IDLE_WAIT_MS = os.environ.get("HVD_EDL_IDLE_WAIT_MS")  # as the user set it, if at all
FINISHED_TIMEOUT_S = 10.0  # longest the end of training is reported for (seconds)
EXITING_TIMEOUT_S = 2.0    # longest a process's exit waits to report it (seconds)
LEAVER_WAIT_S = 10.0  # longest a scaled-in worker waits for the next generation to train (s)


class WorkerRuntime:
    """State of this process in the elastic job.

    Attributes:
        worker_id: the launcher's name for this process (stable for its life).
        host, local_rank: where it runs; ``local_rank`` is its slot on the host (device index).
        generation: the generation it is a member of, 0 before it joined.
        assignment: the :class:`messages.Assignment` of that generation.
        steps: optimizer steps taken (counted by the DistributedOptimizer wrapper, committed and
            restored with the state); ``last_step_end`` their monotonic end time (seconds).
        timer: the :class:`hvd_edl.step_timer.StepTimer` of the steps' compute and wait seconds.
    """

    def __init__(self, env=os.environ):
        self.worker_id = env[messages.ENV_WORKER_ID]
        self.elastic = env.get(messages.ENV_ELASTIC, "0") == "1"
        self.client = CoordinatorClient(env[messages.ENV_COORD_ADDR],
                                        int(env[messages.ENV_COORD_PORT]),
                                        env[messages.ENV_SECRET])
        self.secret = env[messages.ENV_SECRET]  # the state sync's keys derive from it
        stream = None
        # HVD_EDL_SYNC_HEADER_BROADCAST=1: no listener, the sync's header goes in a Horovod
        # broadcast as before (benchmarks/job/sync.py compares the two)
        if env.get("HVD_EDL_SYNC_STREAM", "1") != "0" \
                and env.get("HVD_EDL_SYNC_HEADER_BROADCAST", "0") != "1":
            from hvd_edl import state_stream
            stream = state_stream.open_listener()  # for the syncs it serves as rank 0
        reg = self.client.post("/register", messages.Register(
            self.worker_id, stream_addr=stream.address if stream else "",
            stream_port=stream.port if stream else 0), messages.Registered)
        self.host = reg.host
        self.local_rank = reg.local_rank
        self.provisional_rank = reg.provisional_rank
        self.provisional_size = reg.provisional_size
        self.generation = 0
        self.assignment: Optional[messages.Assignment] = None
        self.syncs = 0  # state syncs in this generation (their keys: state_stream.sync_keys)
        self.sync_parts: Dict[str, float] = {}  # the last sync's parts (messages.Started)
        self.steps = 0
        self.last_step_end: Optional[float] = None
        self.timer = step_timer.StepTimer()  # per-step compute / wait s (the heartbeat sends them)
        self.progress = (-1, -1)  # (epoch, samples) as of the last commit (TorchState.save)
        self.checkpoint_request = 0  # checkpoints asked for (hvd-edl-ctl checkpoint; watcher)
        self._change = threading.Event()  # the coordinator wants a switch after this generation
        self._generation_changed = threading.Event()
        self._generation_lock = threading.Lock()  # generation and _change change together
        self._watcher: Optional[threading.Thread] = None
        self._switch_started: Optional[float] = None
        # where the current switch's time goes (seconds; see messages.Started.phases)
        self._phases: Dict[str, float] = {}
        self._init_done: Optional[float] = None
        self._removal_only = False
        # the switch agreement (hvd_edl.switch_agreement.agree): the in-flight Horovod handle,
        # whether the next commit waits for its own agreement, the last commit's monotonic time,
        # the last few commit periods (seconds; kept across generations)
        self.pending_agreement = None
        self.agree_now = False
        self.last_commit_at: Optional[float] = None
        self.commit_periods: collections.deque = collections.deque(maxlen=8)
        self._ring: Dict[int, str] = {}  # Gloo's sockets of this generation (fd: inode)
        # the ring being set up (hvd.init() in progress): its generation, the sockets that
        # existed before, the ports not to release (coordinator, its rendezvous)
        self.joining_generation = 0
        self._ring_generation = 0  # the generation whose sockets _ring holds
        self._init_before: Optional[Dict[int, str]] = None
        self._joining_ports: Tuple[int, ...] = ()
        self._ring_lock = threading.Lock()
        self._leaving = False
        self._ready_reported = False
        self._finished_reported = False
        self._finishing_seen = False  # a peer's training function returned (coordinator)
        self._install_sigterm()
        self._install_excepthook()
        atexit.register(self._exiting)  # before Horovod's own shutdown at exit (atexit: LIFO)
        Heartbeat(self, CoordinatorClient(env[messages.ENV_COORD_ADDR],
                                          int(env[messages.ENV_COORD_PORT]),
                                          env[messages.ENV_SECRET], retry_s=0.0)).start()

    # ---- liveness (hvd_edl.heartbeat) ---------------------------------------------------------

    def beat_generation(self) -> int:
        """The generation a heartbeat speaks for: the ring being set up, else the current one."""
        return self.joining_generation or self.generation

    def release_ring(self, generation: int) -> bool:
        """The coordinator says a member of ``generation`` is gone: shut down this process's
        sockets of that ring (or of the ring ``hvd.init()`` is setting up), so that a collective
        or set-up blocked on it fails now (see :func:`_release_ring`).  Called by the heartbeat
        thread; the training thread then sees ``HorovodInternalError`` (or a failed init)."""
        with self._ring_lock:
            if generation == self.joining_generation and self._init_before is not None:
                sockets = {fd: ino for fd, ino in _socket_fds().items()
                           if self._init_before.get(fd) != ino}
                exclude = self._joining_ports
            elif generation in (self.generation, self._ring_generation) and self._ring:
                sockets, exclude = dict(self._ring), self._service_ports()
            else:
                return False  # not (yet, or no longer) in that ring: the heartbeat asks again
        log.warning("worker %s: a member of generation %d is gone: releasing its ring",
                    self.worker_id, generation)
        _release_ring(sockets, exclude_ports=exclude)
        from hvd_edl import state_stream
        state_stream.release()  # a state sync's transfer in progress fails now, too
        return True

    def fenced(self) -> None:
        """The coordinator declared this worker dead: exit without touching a ring again."""
        die_fenced(self.worker_id)

    # ---- joining ------------------------------------------------------------------------------

    @property
    def joined(self) -> bool:
        return self.assignment is not None

    def join(self, elastic_run: bool = False) -> None:
        """Report ready and block until a generation includes this worker, then ``hvd.init()``.
        ``elastic_run``: called by ``hvd.elastic.run`` (its exit 0 before the training function
        returned is then a leave; see :class:`messages.Ready`).

        Exits the process with code 0 when the coordinator says this worker is not needed (the
        job ended or the worker was scaled in before it joined).
        """
        if self.joined:
            return
        self._ready_reported = True
        self.client.post("/ready", messages.Ready(self.worker_id, elastic_run=elastic_run),
                         messages.WatchReply)
        who, _, after_s = os.environ.get(ENV_DIE_AFTER_READY, "").partition(":")
        if who == self.worker_id:  # fault injection (tests): lost once READY
            threading.Timer(float(after_s or 0), os.kill, (os.getpid(), signal.SIGKILL)).start()
        self._switch("join", step=self.steps, steps_before_restore=self.steps)

    def training_finished_elsewhere(self) -> bool:
        """Whether a peer's training function already returned (the coordinator's
        ``WatchReply.finishing``; one request of at most ``FINISHED_TIMEOUT_S`` seconds, then
        remembered).  Asked when a collective fails at a commit: a peer that finished after
        the same commit shut Horovod down, which is the end of training, not a failure."""
        if not self._finishing_seen:
            try:
                epoch, samples = self.progress
                r = self.client.post("/watch", messages.WatchRequest(
                    self.worker_id, self.generation, wait_s=0.0, step=self.steps, epoch=epoch,
                    samples=samples), messages.WatchReply, timeout_s=FINISHED_TIMEOUT_S)
                self._finishing_seen = bool(r.finishing)
            except (CoordinatorUnreachable, RuntimeError) as e:
                log.warning("worker %s: could not ask whether training finished: %s",
                            self.worker_id, e)
        return self._finishing_seen

    def _exiting(self) -> None:
        """At interpreter exit: tell the coordinator (``POST /exiting``, at most
        ``EXITING_TIMEOUT_S`` seconds) that this process is ending, so that the silence of its
        teardown is not taken for a frozen member (see :class:`messages.Exiting`)."""
        try:  # one attempt on a connection of its own: a gone launcher must not hold the exit
            CoordinatorClient(self.client.addr, self.client.port, self.client.secret,
                              retry_s=0.0).post(
                "/exiting", messages.Exiting(self.worker_id, self.generation),
                messages.WatchReply, timeout_s=EXITING_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - never in the way of the process's exit
            log.debug("worker %s: could not report its exit: %s", self.worker_id, e)

    def entered_again(self) -> None:
        """The script entered an elastic function after one had returned (a second phase):
        training goes on (``Finished(done=False)``)."""
        if not self._finished_reported:
            return
        self._finished_reported = False
        self._finishing_seen = False
        try:
            self.client.post("/finished", messages.Finished(self.worker_id, self.generation,
                                                            self.steps, done=False),
                             messages.WatchReply, timeout_s=FINISHED_TIMEOUT_S)
        except (CoordinatorUnreachable, RuntimeError) as e:
            log.warning("worker %s: could not report the new elastic function: %s",
                        self.worker_id, e)

    def finished(self) -> None:
        """The training function returned: tell the coordinator (``POST /finished``, at most
        ``FINISHED_TIMEOUT_S`` seconds) that training is over, so that the end of the job is
        never taken for a failure (this process's silence in its teardown, a peer's collective
        failing as this one shuts Horovod down).  A launcher that does not answer is logged,
        not raised: the script's own code after training runs on."""
        if self._finished_reported:
            return
        self._finished_reported = True
        try:
            self.client.post("/finished", messages.Finished(self.worker_id, self.generation,
                                                            self.steps),
                             messages.WatchReply, timeout_s=FINISHED_TIMEOUT_S)
        except (CoordinatorUnreachable, RuntimeError) as e:
            log.warning("worker %s: could not report the end of training: %s",
                        self.worker_id, e)

    def rejoin(self, reason: str, steps_before_restore: int) -> None:
        """Leave the current ring at a step boundary and enter the next generation.

        ``reason`` is "update" (agreed switch) or "failure" (a collective failed).  Shuts
        Horovod down, asks the coordinator for the next assignment (exit 0 if scaled in) and
        initialises Horovod again.  After an agreed switch every member is at the same step
        boundary already, so the assignment is asked for while Horovod shuts down (the
        coordinator forms the next generation meanwhile); after a failure only once this
        worker has left the broken ring.  Raises :class:`CoordinatorUnreachable` if the
        launcher died.
        """
        import horovod.torch as _hvd
        t0 = time.monotonic()
        if self._switch_started is None:
            self.mark_switch_start()
        self._phases = {"boundary_s": t0 - self._switch_started}
        request = messages.SwitchRequest(self.worker_id, self.generation, reason, self.steps,
                                         steps_before_restore)
        early = _Background(self._next_assignment, request) if reason == "update" else None
        try:
            _hvd.shutdown()
        except BaseException:
            if early is not None:
                try:
                    early.result()
                except Exception:  # noqa: BLE001 - the shutdown's error is the one to report
                    pass
            raise
        if reason == "failure":
            # peers still blocked in a collective with us see EOF now, not after Gloo's timeout
            _release_ring(self._ring, exclude_ports=self._service_ports())
        self._ring = {}
        t1 = time.monotonic()
        self._phases["shutdown_s"] = t1 - t0
        a = early.result() if early is not None else self._next_assignment(request)
        self._phases["wait_s"] = time.monotonic() - t1
        self._enter(a)

    def _next_assignment(self, request: messages.SwitchRequest) -> messages.Assignment:
        """Report this worker at a step boundary; block until the coordinator answers with the
        next generation (or "exit")."""
        while True:
            a = self.client.post("/switch", request, messages.Assignment)
            if a.action != "wait":
                return a

    def _await_successor(self, generation: int) -> None:
        """A member scaled in has left the ring; before its interpreter's teardown (about a
        CPU-second of torch and CUDA) competes with the remaining members' Gloo initialisation
        on a shared host, wait (blocked, no CPU) until ``generation`` trains, at most
        ``LEAVER_WAIT_S``.  On the 2-core bench host, holding the leaver back cut the scale-in
        stall from 0.18-0.19 to 0.15 s (5 scale-ins each)."""
        try:
            self.client.post("/watch", messages.WatchRequest(
                self.worker_id, generation, wait_s=LEAVER_WAIT_S, until_started=True),
                messages.WatchReply, timeout_s=LEAVER_WAIT_S + 5)
        except (CoordinatorUnreachable, RuntimeError) as e:
            log.debug("worker %s: not waiting for generation %d: %s", self.worker_id,
                      generation, e)

    def _service_ports(self) -> Tuple[int, ...]:
        ports = [self.client.port]
        if self.assignment is not None:
            ports.append(self.assignment.rendezvous_port)
        return tuple(ports)

    def _switch(self, reason: str, step: int, steps_before_restore: int) -> None:
        t0 = time.monotonic()
        a = self._next_assignment(messages.SwitchRequest(
            self.worker_id, self.generation, reason, step, steps_before_restore))
        self._phases["wait_s"] = time.monotonic() - t0
        self._enter(a)

    def _enter(self, a: messages.Assignment) -> None:
        """Act on an assignment: exit 0 when scaled in, else initialise Horovod for its
        generation."""
        import horovod.torch as _hvd
        if a.action == "exit":
            log.info("worker %s leaves: %s", self.worker_id, a.reason)
            sys.stdout.flush()
            if self.generation > 0 and a.generation > self.generation:
                self._await_successor(a.generation)
            # the teardown runs at the worker's own priority, not niced: until this process
            # has exited its slot (its GPU's memory) is not free, and in a shared cluster the
            # next job waits on it (at nice 19 beside a loaded host's other work one leaver's
            # teardown took 144 s where nice 0 took 17 s; the successor already trains)
            sys.exit(0)
        t1 = time.monotonic()
        env = os.environ
        env["HOROVOD_RANK"] = str(a.rank)
        env["HOROVOD_SIZE"] = str(a.size)
        env["HOROVOD_LOCAL_RANK"] = str(a.local_rank)
        env["HOROVOD_LOCAL_SIZE"] = str(a.local_size)
        env["HOROVOD_CROSS_RANK"] = str(a.cross_rank)
        env["HOROVOD_CROSS_SIZE"] = str(a.cross_size)
        env["HOROVOD_HOSTNAME"] = a.hostname
        env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] = a.rendezvous_addr
        env["HOROVOD_GLOO_RENDEZVOUS_PORT"] = str(a.rendezvous_port)
        env["HOROVOD_GLOO_RENDEZVOUS_TOKEN"] = a.rendezvous_token  # patched HTTPStore sends it
        env.setdefault("HOROVOD_CONTROLLER", "gloo")
        env.setdefault("HOROVOD_CPU_OPERATIONS", "gloo")
        # our patched Horovod (cmake/patches/0004): no second rendezvous of the same processes
        env.setdefault("HVD_EDL_GLOO_FAST_INIT", "1")
        # (cmake/patches/0005): synchronize() sleeps until its handle is done, no sched_yield spin
        env.setdefault("HVD_EDL_BLOCKING_WAIT", "1")
        # (cmake/patches/0008): a Gloo message that does not fit its posted receive (a ring
        # breaking) fails that pair, not the whole process
        env.setdefault("HVD_EDL_GLOO_PAIR_ERRORS", "1")
        # (cmake/patches/0009): with a core per local rank, an idle background loop sleeps until
        # a tensor is enqueued or IDLE_WAIT_MS pass, instead of a ring collective every 1 ms
        # (Horovod reads it at every hvd.init(): each ring gets its own host's rule, unless the
        # user set the variable)
        env["HVD_EDL_IDLE_WAIT_MS"] = _USER_IDLE_WAIT_MS or idle_wait_ms(a.local_size)
        # NCCL communicators belong to one ring: shutdown aborts them, and the next ring's first
        # GPU collective creates its own (ncclUniqueId sent over that ring's Gloo controller)
        if self.elastic:
            env[ENV_NCCL_ELASTIC] = "1"
        with self._ring_lock:
            before = _socket_fds()
            self._init_before = before
            self._joining_ports = (self.client.port, a.rendezvous_port)
            self.joining_generation = a.generation
        if os.environ.get(ENV_STOP_BEFORE_INIT) == self.worker_id:
            os.kill(os.getpid(), signal.SIGSTOP)  # fault injection (tests): frozen in set-up
        try:
            _hvd.init()
        except ValueError as e:
            # our patched Horovod: the Gloo set-up failed (a member was lost while the rings
            # formed; the coordinator released us): leave this generation as after a failed
            # collective and enter the next one
            with self._ring_lock:
                self.joining_generation, self._init_before = 0, None
            log.warning("worker %s: hvd.init() for generation %d failed (%s): asking for the "
                        "next generation", self.worker_id, a.generation, e)
            try:
                _hvd.shutdown()
            finally:
                _release_ring({fd: ino for fd, ino in _socket_fds().items()
                               if before.get(fd) != ino},
                              exclude_ports=(self.client.port, a.rendezvous_port))
            self._enter(self._next_assignment(messages.SwitchRequest(
                self.worker_id, a.generation, "failure", self.steps, self.steps)))
            return
        with self._ring_lock:
            self._ring = {fd: ino for fd, ino in _socket_fds().items() if before.get(fd) != ino}
            self._ring_generation = a.generation  # before self.generation is set, below
            self.joining_generation, self._init_before = 0, None
        self._init_done = time.monotonic()
        self._phases["init_s"] = self._init_done - t1
        # an agreed switch that only removed members: every member already holds the state
        # committed at the same step boundary, so sync has nothing to send (samplers still
        # repartition in state.on_reset); the coordinator decides, the same for all members
        self._removal_only = not a.sync
        with self._generation_lock:
            self.generation = a.generation
            self.assignment = a
            self.syncs = 0
            self.sync_parts = {}
            self._change.clear()
        self._generation_changed.set()
        if self.elastic and self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="hvd_edl-watch",
                                             daemon=True)
            self._watcher.start()
        switch_agreement.new_ring_agreement(self)

    # ---- the script's own error: exit at once ------------------------------------------------

    def _install_excepthook(self) -> None:
        """An exception that ends the script ends the worker at once, after its traceback, with
        Python's exit status (1; 130 for KeyboardInterrupt, without a traceback): the
        interpreter's normal teardown runs Horovod's shutdown, which can block on peers that
        wait in a collective with this process, and a worker that hangs there stops beating
        and would be taken for a silent (frozen) one.  The launcher and the peers then see
        the script's error within milliseconds.  Scripts lose their ``atexit`` handlers in
        that case."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = sys.excepthook

        def hook(etype, value, tb):
            if issubclass(etype, KeyboardInterrupt):
                print(f"worker {self.worker_id}: interrupted", file=sys.stderr)
                die(signal.SIGINT)
            try:
                previous(etype, value, tb)
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(1)

        sys.excepthook = hook

    # ---- SIGTERM: leave gracefully ------------------------------------------------------------

    def _install_sigterm(self) -> None:
        """SIGTERM (a preemption notice from Kubernetes, a scheduler, ``kill``) makes this worker
        leave gracefully: a member at the next commit through the stop-free protocol, others at
        once.  A script that installed its own SIGTERM handler keeps it."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if self._leaving:  # a second SIGTERM: die now
            die(signum)
        self._leaving = True
        if not self._ready_reported:  # still building: no ring can be waiting for it
            log.warning("worker %s got SIGTERM before joining: exiting", self.worker_id)
            raise SystemExit(0)
        threading.Thread(target=self._leave, args=(signum,), name="hvd_edl-leave",
                         daemon=True).start()

    def _leave(self, signum: int) -> None:
        try:
            a = self.client.post("/leave", messages.Leave(self.worker_id), messages.Assignment,
                                 timeout_s=5)
        except (CoordinatorUnreachable, RuntimeError) as e:
            log.warning("worker %s: SIGTERM and no coordinator (%s): exiting", self.worker_id, e)
            die(signum)
            return
        if a.action == "exit":  # the launcher is stopping the job
            die(signum)
        log.warning("worker %s got SIGTERM: leaving at the next commit", self.worker_id)

    # ---- step boundaries ----------------------------------------------------------------------

    def sync_needed(self) -> bool:
        """False after an agreed switch that only removed members (nothing to broadcast)."""
        return not self._removal_only

    def change_pending(self) -> bool:
        """True when the coordinator has asked for a switch after this generation (the watcher's
        flag: no request, a few hundred nanoseconds)."""
        return self._change.is_set()

    def _watch(self) -> None:
        """The watcher thread: long-polls ``POST /watch`` (``WatchRequest.wait_s`` seconds per
        request, on its own keep-alive connection) and sets the change flag when a switch is
        wanted after the current generation; then waits for the next generation before it
        asks again.

        Why a blocked thread and not a request from the training thread at agreement commits:
        in a 2-worker job on a 2-core host (digits CNN, commit every 10 steps of ~4.6 ms), that
        request took 2.5 ms median and 8.3 ms mean of the training thread when asked at every
        commit (the launcher answers only when it gets a CPU), and with one request per quarter
        second the job trained at 0.85-0.91 of static Horovod against 0.96-1.01 with one per
        second (interleaved runs); the blocked thread costs no CPU between switches.

        Ends the process when the launcher is gone (the coordinator did not answer for
        ``CoordinatorClient.retry_s``): nothing could switch this ring again.
        """
        while True:
            gen = self.generation
            try:
                epoch, samples = self.progress
                r = self.client.post("/watch", messages.WatchRequest(
                                         self.worker_id, gen, step=self.steps, epoch=epoch,
                                         samples=samples),
                                     messages.WatchReply,
                                     timeout_s=messages.WatchRequest.wait_s + 30)
            except CoordinatorUnreachable as e:
                log.error("worker %s: the launcher is unreachable (%s): exiting",
                          self.worker_id, e)
                die(signal.SIGTERM)
                return
            except RuntimeError as e:
                log.warning("watch failed: %s", e)
                time.sleep(1.0)  # a refused request: back off before asking again
                continue
            self.checkpoint_request = max(self.checkpoint_request, r.checkpoint_request)
            with self._generation_lock:
                if gen != self.generation:
                    continue  # a switch happened meanwhile: ask about the new generation
                if not r.change_pending and r.latest_generation <= gen:
                    continue  # the long poll timed out: ask again
                # a switch is wanted, or the ring moved on without this worker (it learns its
                # fate at the switch): raise the flag, ask again once in the next generation
                self._change.set()
                self._generation_changed.clear()
            while gen == self.generation:
                self._generation_changed.wait()
                self._generation_changed.clear()

    def mark_switch_start(self) -> None:
        """Remember when this worker stopped training in the old ring (for ``stall_s``)."""
        self._switch_started = self.last_step_end or time.monotonic()

    def mark_first_step(self) -> None:
        """Called when the user's function is (re-)entered after a switch: reports ``stall_s``."""
        self.timer.restart()  # the switch is no step's time
        if self._switch_started is None:
            return
        now = time.monotonic()
        stall_s = now - self._switch_started
        self._switch_started = None
        phases = dict(self._phases)
        if self._init_done is not None:
            phases["sync_s"] = now - self._init_done
        phases["rest_s"] = stall_s - sum(phases.values())
        phases = {k: round(v, 4) for k, v in phases.items()}
        msg = messages.Started(self.worker_id, self.generation, stall_s, self.steps, phases,
                               sync_parts=dict(self.sync_parts))
        threading.Thread(target=self._report, args=(msg,), daemon=True).start()

    def _report(self, msg) -> None:
        try:
            self.client.post("/started", msg, messages.WatchReply)
        except (CoordinatorUnreachable, RuntimeError) as e:
            log.warning("could not report start of generation %s: %s", msg.generation, e)

    def on_step_end(self) -> None:
        self.steps += 1
        self.last_step_end = time.monotonic()
        self.timer.step_end()


class _Background:
    """``fn(*args)`` in a daemon thread; :meth:`result` joins it and returns its value or
    raises its exception."""

    def __init__(self, fn, *args):
        self._value = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(fn, args),
                                        name="hvd_edl-switch", daemon=True)
        self._thread.start()

    def _run(self, fn, args) -> None:
        try:
            self._value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller of result()
            self._error = e

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _socket_fds() -> Dict[int, str]:
    """This process's socket descriptors as {fd: "socket:[inode]"}, read from /proc/self/fd
    (a fraction of a millisecond; empty where /proc is missing, which only costs the fast
    release of :func:`_release_ring`)."""
    out: Dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out[int(name)] = target
    return out


def _release_ring(ring: Dict[int, str], exclude_ports: Tuple[int, ...] = ()) -> None:
    """``shutdown(SHUT_RDWR)`` (not close: the descriptors stay Horovod's) the TCP connections
    the failed generation's Gloo context opened (``ring``: the sockets that appeared during its
    ``hvd.init()``), if they still are the same sockets; connections to ``exclude_ports`` (the
    coordinator, the rendezvous) are left alone.

    After a failure Horovod's shutdown keeps its Gloo context, and with it the sockets, alive;
    a peer blocked in a receive from this process would wait for Gloo's timeout (30 s by
    default).  Shutting the sockets down gives it an EOF at once, so every survivor fails fast
    and reaches the next generation.
    """
    for fd, inode in ring.items():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != inode:
                continue  # closed, and the number reused since
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) \
                    and sock.type == socket.SOCK_STREAM \
                    and sock.getpeername()[1] not in exclude_ports:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # a listening or already closed socket
        finally:
            sock.detach()


_runtime: Optional[WorkerRuntime] = None
_lock = threading.Lock()


def under_launcher() -> bool:
    """True when this process was started by ``hvd-edl-run``."""
    return messages.ENV_WORKER_ID in os.environ


def get() -> Optional[WorkerRuntime]:
    """The process's runtime, or None outside ``hvd-edl-run`` / before ``init()``."""
    return _runtime


def position(step_done: bool = False) -> Dict[str, int]:
    """``{"gen", "step"}`` of this worker: its generation and optimizer-step count under
    ``hvd-edl-run``, as the audit ledger records it (:mod:`hvd_edl.audit`).  Outside it:
    generation 0 and a count of recorded steps (``step_done=True`` counts one more)."""
    rt = _runtime
    if rt is None:
        if step_done:
            _local_steps[0] += 1
        return {"gen": 0, "step": _local_steps[0]}
    return {"gen": rt.generation, "step": rt.steps}


_local_steps = [0]


def start() -> Optional[WorkerRuntime]:
    """Create the runtime once (registering with the coordinator); None outside the launcher."""
    global _runtime
    with _lock:
        if _runtime is None and under_launcher():
            _runtime = WorkerRuntime()
            step_timer.install(_runtime.timer)
        return _runtime
