"""``hvd-edl-cluster serve``: one pool of hosts shared by many elastic jobs (EDL's multi-tenant
cluster, Wu et al., arXiv 1909.11985), each job an ordinary ``hvd-edl-run`` steered from
outside.

The service's loop (:meth:`Service.run`) reads top to bottom: take the requests (submit,
cancel), the pool's host set, the runs that ended; every ``round_s`` seconds, and at once on a
submit, an end or a pool change, ask the policy for an allocation (a pure function of a
:class:`launcher.cluster.policy.Snapshot`); then bring every job towards it.  Applying an
allocation:

* a job that is to hold fewer slots (on a host) gets its allocation file rewritten at once: its
  launcher's host discovery (every 0.2 s) sees the shrink and its workers there leave
  stop-free at the next commit; the slots count as free only once the job's telemetry shows
  those workers gone (so a slot is never used by two jobs at once);
* a job that is to hold more grows (file rewritten) or starts (a new ``hvd-edl-run`` under
  :mod:`launcher.cluster.wrapper`) only on slots that are free by that measure;
* a job that is to hold none while it runs is preempted: ``/ctl/checkpoint`` (its rank 0
  writes a checkpoint), then SIGTERM; it resumes later as a new run with the same
  ``--checkpoint-dir``.

Jobs are steered only through the control API (:class:`launcher.serve.control.ControlClient`)
and their allocation files.  Every decision is an event in the store and in
``STATE_DIR/events.jsonl`` with its reason.  ``kill -9`` of the service loses nothing: the jobs
run in sessions of their own, every state change is in the store before it is acted on, and a
restarted service re-adopts the runs from their files (:meth:`launcher.cluster.runs.Run.probe`).

This module keeps :class:`Service`, the owner: its state, start and stop, and the loop (one pass:
requests, ends, a round when due: snapshot -> policy -> allocation, then apply).  The rest lives
beside it, as functions that take the service explicitly (the event log: a small class):

=================================  ==============================================================
:mod:`launcher.cluster.handlers`   the API's requests: submit, cancel, status, logs
:mod:`launcher.cluster.reasons`    why a job waits (each round's one line per job left out)
:mod:`launcher.cluster.apply`      applying an allocation: start, grow/shrink/move, release,
                                   preempt
:mod:`launcher.cluster.gpus`       which GPUs: the pool's per host, each job's list, held ones
:mod:`launcher.cluster.ends`       a run's end -> the job's state (done, failed, cancelled,
                                   suspended) and reason
:mod:`launcher.cluster.orphans`    an ended run's processes still alive: its slots held until
                                   they are gone (bounded)
:mod:`launcher.cluster.adoption`   re-adopting the runs after a restart
:mod:`launcher.cluster.pool`       the pool's discovery thread, hosts leaving the pool
:mod:`launcher.cluster.reach`      hosts no job reaches (telemetry): they rest for a cooldown
:mod:`launcher.cluster.rested`     slots a job's launcher rests (a worker failed): given back
:mod:`launcher.cluster.drains`     drained hosts (``drain HOST``, a pool line's ``ends=``)
:mod:`launcher.cluster.telemetry`  the jobs' telemetry thread, speed points
:mod:`launcher.cluster.events`     the event log (store + ``events.jsonl``), decision counts
=================================  ==============================================================
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import filelock

from launcher.cluster import adoption, apply, ends, handlers, orphans, reasons, rested, telemetry
from launcher.cluster import drains as drains_
from launcher.cluster import gpus as gpus_
from launcher.cluster import pool as pool_
from launcher.cluster import reach as reach_
from launcher.cluster import speed as speed_
from launcher.cluster.events import EventLog
from launcher.cluster.job_goodput import JobGoodput
from launcher.cluster.kept_zygotes import KeptZygotes
from launcher.cluster.pool_notes import pool_notes
from launcher.cluster.handlers import RequestError  # noqa: F401 - importable here as before
from launcher.cluster.policy import (AllocationError, JobView, Policy, Snapshot,
                                     check_allocation)
from launcher.cluster.runs import Run
from launcher.cluster.store import Store, StoreError

log = logging.getLogger(__name__)

ROUND_S = 5.0            # a scheduling round at least this often
BUSY_TICK_S = 0.05       # the loop's period while a change is being applied
IDLE_TICK_S = 0.5        # ... and while nothing is
REQUEST_TIMEOUT_S = 10.0 # an HTTP request's wait for the loop
# the answers (503) to a request the loop did not take in time (withdrawn: retrying is safe), or
# took but did not finish (it may still be carried out: look before retrying)
BUSY_NOT_DONE = "the service is busy: nothing was done (the request was withdrawn); try again"
BUSY_UNDER_WAY = ("the service is busy: the request was taken and is still under way; check "
                  "with hvd-edl-cluster queue / status before retrying")
# a stop-free switch (the stall of a scale-in/out, make bench) and a (re)start from a
# checkpoint (a launcher, its workers' imports and the restore, on 2 cores): what the policies
# are told a change costs
CHANGE_COST_S = 0.5
RESTART_COST_S = 10.0


class ServiceError(RuntimeError):
    """The service cannot start (state directory taken, unusable store): one line, exit 2."""


class Service:
    """The cluster service (module docstring).

    Its state, which the modules beside it read and change (on the loop's thread unless said):
    ``store``; ``pool`` (host -> slots; :meth:`set_pool`); ``runs`` (job id -> its live
    :class:`Run`); ``written`` (job id -> its allocation file now); ``occupied`` (job id -> the
    slots it still uses, :meth:`set_occupied`); ``releasing`` (job id -> when a shrink was
    written); ``waiting_since`` (job id -> when it was first allocated slots it has not got);
    ``waiting_reasons`` (job id -> why the last round gave it no slots, :mod:`.reasons`);
    ``telemetry`` (job id -> its last answer, from the telemetry thread); ``decide_now`` (a
    round at the next pass); ``events`` (:class:`EventLog`); ``decisions`` and ``jct_s``
    (metrics).

    Args:
        state_dir: its folder (database, job folders, event log, lock): 0700, or 0711 under
            root (each job's folder in it is its user's, 0700).
        discovery: the pool (``find_available_hosts_and_slots()``: FixedHosts or a script).
        policy: the scheduling policy.
        discovery_interval_s: seconds between pool discovery calls (scripts only).
        round_s: seconds between scheduling rounds when nothing happens.
        fixed_pool: the pool never changes (-H / --hostfile): a job that can never fit is
            refused at submit.
        launcher_args: ``hvd-edl-run`` flags every job's run gets, how to reach the pool's
            hosts (``-p PORT``, ``-i FILE``, ``--network-interface NIC``).
        assume_gpus: every slot is GPU ``0..slots-1`` of its host, nothing asked
            (``serve --assume-gpus``); otherwise a host's GPUs are its line's ``gpus=`` or what
            ``nvidia-smi`` there says (:mod:`launcher.cluster.gpus`).
        prices: the price table (type -> ``launcher.discovery.prices.TypePrice``; ``--prices``).
        risk: the revocation-risk table (``launcher.discovery.prices.RiskTable``; default GCE's).
        unreached_s: seconds a pool host must look unreached by every job allocated there
            before it rests (``serve --unreachable-after``; :mod:`launcher.cluster.reach`).
    """

    def __init__(self, state_dir: Path, discovery, policy: Policy,
                 discovery_interval_s: float = 1.0, round_s: float = ROUND_S,
                 fixed_pool: bool = False, change_cost_s: float = CHANGE_COST_S,
                 restart_cost_s: float = RESTART_COST_S, launcher_args: Sequence[str] = (),
                 assume_gpus: bool = False, prices: Optional[Dict[str, object]] = None,
                 risk=None, unreached_s: float = reach_.UNREACHED_S):
        self.state_dir = Path(state_dir)
        self.discovery = discovery
        self.policy = policy
        self.discovery_interval_s = discovery_interval_s
        self.round_s = round_s
        self.fixed_pool = fixed_pool
        self.change_cost_s = change_cost_s
        self.restart_cost_s = restart_cost_s
        self.launcher_args = tuple(launcher_args)
        self.assume_gpus = assume_gpus
        self.prices = dict(prices or {})
        self.risk = risk
        self.host_terms: Dict[str, object] = {}  # host -> HostTerms (type, price, spot, risk)
        self.pool_told: set = set()  # the pool notes already logged (:mod:`.pool_notes`)
        self.pool: Dict[str, int] = {}
        self.discovered: Dict[str, int] = {}  # the pool as discovery last gave it
        self.host_gpus: Dict[str, Tuple[str, ...]] = {}  # host -> its GPUs (GPU hosts only)
        self.cpu_hosts: Dict[str, float] = {}  # host -> when it answered "no GPUs" (gpus.pool_gpus)
        self.job_gpus: Dict[str, Dict[str, Tuple[str, ...]]] = {}  # job -> host -> its list
        self.held_gpus: Dict[str, Dict[str, set]] = {}  # job -> host -> GPUs it may still use
        self.drains: Dict[str, dict] = {}  # host -> its drain (launcher.cluster.drains)
        self.runs: Dict[str, Run] = {}           # job id -> its live run
        self.written: Dict[str, Dict[str, int]] = {}  # job id -> its allocation file now
        self.written_at: Dict[str, float] = {}   # job id -> when that file was written (monotonic)
        # job id -> (run number, host -> most slots that run can use): slots it gave back (rested)
        self.caps: Dict[str, Tuple[int, Dict[str, int]]] = {}
        self.occupied: Dict[str, Dict[str, int]] = {}  # job id -> slots it still uses
        self.telemetry: Dict[str, Tuple[float, dict]] = {}  # job id -> (monotonic, answer)
        self.goodput: Dict[str, JobGoodput] = {}  # job id -> its goodput model (adaptive batch)
        self.batch_asked: Dict[Tuple[str, int], int] = {}  # (job, run) -> batch passed to it
        self.releasing: Dict[str, float] = {}    # job id -> when its shrink was written
        self.leftovers: Dict[str, "orphans.Drain"] = {}  # job id -> its ended run's processes
        self.reach = reach_.Reach(unreached_s)   # hosts no job reaches: they rest (a cooldown)
        self.waiting_since: Dict[str, float] = {}  # job id -> when it was first allocated
        self.waiting_reasons: Dict[str, str] = {}  # job id -> why the last round left it out
        self.requests: "queue.Queue[Tuple[Callable[[], object], Future]]" = queue.Queue()
        self.wake = threading.Event()
        self.stopping = False
        self.decide_now = True
        self.last_round = 0.0
        self.last_attained = time.monotonic()
        self.decisions: Dict[str, int] = {}      # kind -> count (metrics)
        self.jct_s: List[float] = []             # completion times of jobs ended here
        self._lock = threading.Lock()            # guards pool, occupied for status's readers
        self._flock: Optional[filelock.FileLock] = None
        self.store: Optional[Store] = None
        self.events_path = self.state_dir / "events.jsonl"
        self.events: Optional[EventLog] = None   # the event log (once the store is open)
        self.kept_zygotes = KeptZygotes(self.state_dir)  # its jobs' zygotes, per user

    # ---- start and stop ------------------------------------------------------------------------

    def open(self) -> None:
        """Take the state directory (its lock), open the store, find the pool, re-adopt.

        Raises:
            ServiceError: another service holds the directory, the store is unusable, or the
                first pool discovery failed.
        """
        # a root service's jobs run as their users, who must reach their own folders (0700,
        # theirs) through it: 0711 (enter, not list); its database and files stay 0600
        mode = 0o711 if os.geteuid() == 0 else 0o700
        try:
            self.state_dir.mkdir(mode=mode, parents=True, exist_ok=True)
            os.chmod(self.state_dir, mode)
            (self.state_dir / "jobs").mkdir(mode=mode, exist_ok=True)
            os.chmod(self.state_dir / "jobs", mode)
        except OSError as e:
            raise ServiceError(f"--state-dir {self.state_dir}: {e.strerror or e}") from None
        self._flock = filelock.FileLock(str(self.state_dir / "service.lock"))
        try:
            self._flock.acquire(timeout=0)
        except filelock.Timeout:
            raise ServiceError(f"--state-dir {self.state_dir} is in use by another "
                               f"hvd-edl-cluster serve (its lock {self.state_dir}/service.lock "
                               f"is held); stop that one or give another directory") from None
        old = os.umask(0o077)
        try:
            self.store = Store(self.state_dir / "cluster.db")
        except StoreError as e:
            raise ServiceError(str(e)) from None
        finally:
            os.umask(old)
        self.events = EventLog(self.store, self.events_path, self.decisions)
        self.kept_zygotes.open()
        self.drains = drains_.load(self)
        try:
            self.set_pool(dict(self.discovery.find_available_hosts_and_slots()))
        except Exception as e:  # noqa: BLE001 - DiscoveryError, OSError: one line
            raise ServiceError(f"first pool discovery failed: {e}") from None
        self.events.note(None, "pool", "the service started", pool=self.pool,
                         gpus=self.host_gpus, policy=getattr(self.policy, "name", "?"))
        adoption.adopt(self)

    def close(self) -> None:
        """Stop the loop and its threads, close the store, release the state directory; the
        jobs keep running (the next service re-adopts them)."""
        self.stopping = True
        self.wake.set()
        self.kept_zygotes.close()
        if self.store is not None:
            self.store.close()
        if self._flock is not None:
            self._flock.release()

    # ---- the pool and the slots in use (shared with status's readers) -------------------------

    def set_pool(self, hosts: Dict[str, int]) -> None:
        """The pool is now ``hosts`` (host -> slots): the one write of ``pool``, under the lock
        (:meth:`open`, :mod:`.pool`).  The GPUs of hosts new to it are found now
        (:func:`launcher.cluster.gpus.pool_gpus`); a GPU host's slots are its GPUs."""
        from launcher.discovery.hosts import is_local
        args = list(self.launcher_args)
        ssh = [x for i in range(0, len(args) - 1, 2) if args[i] in ("-p", "-i")
               for x in args[i:i + 2]]  # how the jobs reach the hosts: how to ask them too
        found = gpus_.pool_gpus(hosts, getattr(self.discovery, "gpus", {}), self.assume_gpus,
                                self.host_gpus,
                                lambda h: gpus_.probe(h, is_local(h), ssh), self.cpu_hosts)
        pool = {h: (min(k, len(found[h])) if h in found else k)
                for h, k in drains_.effective(self, hosts).items()}
        from launcher.discovery.prices import host_terms
        lines = getattr(self.discovery, "lines", {}) or {}
        terms = host_terms(lines, self.prices, self.risk)
        for key, note in pool_notes(lines, terms, time.time()).items():
            if key not in self.pool_told:  # once each: a line taken that does not do the obvious
                self.pool_told.add(key)
                log.warning("%s", note)
        with self._lock:
            self.discovered = dict(hosts)
            self.pool = pool
            self.host_gpus = found
            self.host_terms = terms

    def known_types(self) -> set:
        """The GPU types the pool's lines and the price table name."""
        return {t.gpu_type for t in self.host_terms.values() if t.gpu_type} | set(self.prices)

    def type_of(self, hosts) -> Optional[str]:
        """The one GPU type of all of ``hosts`` (None: untyped or mixed)."""
        types = {getattr(self.host_terms.get(h), "gpu_type", None) for h in hosts}
        return next(iter(types)) if len(types) == 1 else None

    def set_occupied(self, job_id: str, hosts: Dict[str, int]) -> None:
        """The slots ``job_id`` still uses ({} none): the one write of ``occupied``, under the
        lock (:mod:`.apply`, :mod:`.ends` and :mod:`.adoption` call it)."""
        with self._lock:
            if hosts:
                self.occupied[job_id] = {h: k for h, k in hosts.items() if k > 0}
            else:
                self.occupied.pop(job_id, None)
        if not hosts:  # its processes are gone: it holds no GPU either
            gpus_.drop(self, job_id)

    def gpu_view(self) -> Tuple[Dict[str, Tuple[str, ...]], Dict[str, Dict[str, Tuple[str, ...]]]]:
        """Copies of ``host_gpus`` and ``job_gpus`` (job -> host -> its GPUs in slot order) for
        a thread other than the loop's (:func:`.handlers.status`); the loop replaces a job's
        lists whole, so a copy taken while it writes is retried."""
        for _ in range(5):
            try:
                return (dict(self.host_gpus),
                        {j: dict(h) for j, h in list(self.job_gpus.items())})
            except RuntimeError:  # changed size while copied
                continue
        return dict(self.host_gpus), {}

    def slots_in_use(self) -> Tuple[Dict[str, int], Dict[str, Dict[str, int]]]:
        """Copies of ``pool`` and ``occupied`` (job id -> host -> slots) taken together under
        the lock: what a thread other than the loop's reads (:func:`.handlers.status`)."""
        with self._lock:
            return dict(self.pool), {k: dict(v) for k, v in self.occupied.items()}

    # ---- requests (HTTP threads hand them to the loop: one writer) ----------------------------

    def call(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the loop's thread and return its result (its exception raised here);
        at most ``REQUEST_TIMEOUT_S`` seconds for the loop to take it.  A request the loop has
        not taken by then is withdrawn (never run: a client may retry without doing it twice);
        one it took just then is waited for as long again.

        Raises:
            TimeoutError: the loop did not take it in time (its message says it was not done),
                or did not finish it in twice that (its message says to check before retrying).
        """
        fut: Future = Future()
        self.requests.put((fn, fut))
        self.wake.set()
        try:
            return fut.result(timeout=REQUEST_TIMEOUT_S)
        except FutureTimeout:
            if fut.cancel():  # the loop skips it (_step): it never runs
                raise TimeoutError(BUSY_NOT_DONE) from None
        try:  # the loop took it as the wait ended
            return fut.result(timeout=REQUEST_TIMEOUT_S)
        except FutureTimeout:
            raise TimeoutError(BUSY_UNDER_WAY) from None

    def post(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the loop's thread at its next pass, not waiting (the background
        threads' way to change the store: it has one writer)."""
        self.requests.put((fn, Future()))

    def submit(self, req: dict, caller=None) -> dict:
        """A ``submit`` request of ``caller`` (a :class:`launcher.cluster.users.User`; None:
        the service's user) (:func:`launcher.cluster.handlers.submit`; the loop's thread
        only)."""
        return handlers.submit(self, req, caller)

    def cancel(self, job_id: str, caller=None) -> dict:
        """A ``cancel`` request of ``caller`` (:func:`launcher.cluster.handlers.cancel`; the
        loop's thread only)."""
        return handlers.cancel(self, job_id, caller)

    def status(self, job_id: Optional[str] = None) -> dict:
        """What ``status``/``queue``/``top`` show (:func:`launcher.cluster.handlers.status`;
        any thread: reads only)."""
        return handlers.status(self, job_id)

    # ---- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        """The loop (module docstring) until :meth:`close`."""
        threading.Thread(target=telemetry.poll, args=(self,), name="telemetry",
                         daemon=True).start()
        if not hasattr(self.discovery, "hosts"):  # a script: hosts come and go
            threading.Thread(target=pool_.watch, args=(self,), name="discovery",
                             daemon=True).start()
        while not self.stopping:
            self._step()
            busy = bool(self.releasing or self.waiting_since or self.decide_now
                        or self.leftovers)
            self.wake.wait(BUSY_TICK_S if busy else IDLE_TICK_S)
            self.wake.clear()

    def _step(self) -> None:
        """One pass: requests, ends, attained service, a round when due, apply."""
        while True:
            try:
                fn, fut = self.requests.get_nowait()
            except queue.Empty:
                break
            if not fut.set_running_or_notify_cancel():
                continue  # withdrawn: its caller was answered "not done" (call)
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
        ends.check_runs(self)
        drains_.check(self)
        orphans.check(self)
        reach_.check(self)
        rested.check(self)
        self._account()
        now = time.monotonic()
        if self.decide_now or now - self.last_round >= self.round_s:
            self.decide_now = False
            self.last_round = now
            self._round()
        apply.apply_allocations(self)

    def _account(self) -> None:
        """Add each running job's slots x seconds to its attained service (Tiresias's), its
        slots x their hosts' prices x hours to its cost, and (a job with an objective) its
        samples/s x seconds to its samples done, about once a second."""
        now = time.monotonic()
        dt = now - self.last_attained
        if dt < 1.0:
            return
        self.last_attained = now
        for job_id in list(self.runs):
            held = self.occupied.get(job_id) or self.written.get(job_id, {})
            n = sum(self.written.get(job_id, {}).values())
            job = self.store.job(job_id)
            if job is None or not n:
                continue
            cost = sum(k * (getattr(self.host_terms.get(h), "price", None) or 0.0)
                       for h, k in held.items()) * dt / 3600.0
            fields = {"attained_gpu_s": job.attained_gpu_s + n * dt,
                      "cost_usd": job.cost_usd + cost}
            if job.goal:
                tel = (self.telemetry.get(job_id) or (0, None))[1] or {}
                rate = (tel.get("job") or {}).get("samples_per_s") or 0.0
                goal = dict(job.goal)
                goal["done_samples"] = float(goal.get("done_samples") or 0.0) + rate * dt
                fields["goal"] = goal
            self.store.update(job_id, **fields)

    # ---- the round ------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The policy's view now: the pool less the slots of jobs being stopped, every job not
        ended and not being stopped."""
        allocs = self.store.allocations()
        pool = {h: k for h, k in self.pool.items() if h not in self.reach.resting_hosts()}
        from launcher.cluster.speed_types import GPU_TFLOPS  # the published figures
        tflops = dict(GPU_TFLOPS, **{t: p.tflops for t, p in self.prices.items()
                                     if getattr(p, "tflops", None)})
        views = []
        for job in self.store.jobs(("queued", "running", "suspended")):
            if job.stopping:  # its slots stay its own until its run ended
                for h, k in self.occupied.get(job.id, {}).items():
                    if h in pool:
                        pool[h] = max(0, pool[h] - k)
                continue
            held = {h: k for h, k in allocs.get(job.id, {}).items() if h in self.pool}
            gone = sum(k for h, k in self.written.get(job.id, {}).items()
                       if h not in self.pool) if job.id in self.runs else 0
            model = self.goodput.get(job.id)
            gview = model.view() if model is not None and job.id in self.runs else None
            views.append(JobView(
                id=job.id, submitted_at=job.submitted_at, np=job.np, min_np=job.min_np,
                max_np=job.max_np, priority=job.priority, allocation=held,
                attained_gpu_s=job.attained_gpu_s, started=job.run > 0,
                last_change_at=job.last_change_at,
                throughput=gview.speed if gview is not None else speed_.throughput(job.speed),
                goodput=gview, elastic=job.min_np < job.max_np, goal=job.goal or None,
                speed_of=speed_.typed_speed(job.speed, tflops), spent_usd=job.cost_usd,
                user=job.user, displaced=gone))
        per_user: Dict[str, float] = {}  # fair share: every job's service, ended ones too
        for job in self.store.jobs():
            per_user[job.user] = per_user.get(job.user, 0.0) + job.attained_gpu_s
        return Snapshot(now=time.time(), pool=pool, jobs=tuple(views),
                        change_cost_s=self.change_cost_s, restart_cost_s=self.restart_cost_s,
                        hosts={h: t for h, t in self.host_terms.items() if h in pool},
                        user_attained_gpu_s=per_user)

    def _round(self) -> None:
        """Ask the policy for an allocation of :meth:`snapshot` and record each job's change
        (kind, reason: the policy's ``explain`` or a default) in the store, for
        :func:`launcher.cluster.apply.apply_allocations` to act on."""
        snap = self.snapshot()
        try:
            alloc = self.policy.allocate(snap)
            check_allocation(snap, alloc, getattr(self.policy, "user_quota", None))
        except AllocationError as e:
            self.events.note(None, "refused", f"the policy's allocation was refused: {e}")
            return
        alloc = rested.clamp(self, alloc)  # never more than a run's launcher can use
        self.waiting_reasons = reasons.waiting(snap, alloc, self.policy, sum(self.pool.values()))
        explain = getattr(self.policy, "explain", None)
        self._note_choices(snap, alloc)
        self._pass_batches(snap, alloc)
        for view in snap.jobs:
            new = {h: k for h, k in alloc.get(view.id, {}).items() if k > 0}
            old = dict(view.allocation)
            if new == old:
                continue
            n_old, n_new = sum(old.values()), sum(new.values())
            kind = ("start" if not view.started else "resume") if not n_old else \
                "preempt" if not n_new else "grow" if n_new > n_old else \
                "shrink" if n_new < n_old else "move"
            why = explain(view.id) if callable(explain) else None
            reason = why or _default_reason(kind, n_old, n_new, self.policy)
            if not n_old and view.id in self.runs:  # its hosts left the pool in this very pass
                kind, old = "move", dict(self.written.get(view.id, {}))  # it still runs there
                reason = (f"{getattr(self.policy, 'name', 'policy')}: its hosts left the pool: "
                          f"its run moves stop-free to {n_new} slots instead of a preemption")
            self.store.update(view.id, allocation=new, last_change_at=snap.now, reason=reason,
                              event={"kind": kind, "reason": reason, "hosts": new,
                                     "from": old})
            self.events.write({"at": snap.now, "job": view.id, "kind": kind, "reason": reason,
                               "hosts": new, "from": old})
            self.events.count(kind)
            if n_new and not n_old and view.id not in self.runs:
                self.waiting_since.setdefault(view.id, time.monotonic())


    def _pass_batches(self, snap: Snapshot, alloc) -> None:
        """Pass each running job that adapts its batch the global batch the policy chose with
        its allocation (``Policy.batch_sizes``; Pollux's co-adaptation), through its control
        API's ``/ctl/batch`` on a thread (the job applies it at its next switch, the allocation's
        own when there is one); a batch already passed to this run is not passed again."""
        for job_id, batch in self.policy.batch_sizes(snap, alloc).items():
            run = self.runs.get(job_id)
            if run is None or self.batch_asked.get((job_id, run.number)) == batch:
                continue
            self.batch_asked[(job_id, run.number)] = batch
            self.events.write({"at": snap.now, "job": job_id, "kind": "batch", "batch": batch,
                               "reason": f"{getattr(self.policy, 'name', 'policy')}: global "
                                         f"batch {batch} (best goodput at its allocation)"})
            job_file, owners = run.files.job_file, run.files.uids()

            def ask(job_id=job_id, job_file=job_file, owners=owners, batch=batch):
                from launcher.serve.control import ControlClient, ControlError
                try:
                    ControlClient(job_file, timeout_s=5.0, owners=owners).call("batch",
                                                                               batch=batch)
                except ControlError as e:
                    log.info("job %s: batch %d not passed: %s", job_id, batch, e)
            threading.Thread(target=ask, daemon=True).start()

    def _note_choices(self, snap: Snapshot, alloc) -> None:
        """Keep the policy's choice per job with an objective (``typed``: type, number,
        predicted time and cost) in its ``goal``: ``choice`` the latest, ``first_choice`` the
        one it started with (its first round with slots: a choice to wait for busy slots is
        ``choice`` while it waits, never ``first_choice``) (``status`` shows the latest beside the cost so far, and the first
        where it differs); ``measuring`` (``"1 x t4 on demand"``) where the policy started it
        to measure its speed, before any choice."""
        for job_id, pred in (getattr(self.policy, "choices", None) or {}).items():
            job = self.store.job(job_id)
            if job is None or not job.goal:
                continue
            goal = dict(job.goal)
            d = pred.as_dict()
            d["at"] = snap.now
            if goal.get("choice", {}).get("why") == d["why"] and \
                    goal.get("choice", {}).get("n") == d["n"]:
                continue
            goal["choice"] = d
            if "first_choice" not in goal and alloc.get(job_id) and job_id in {
                    v.id for v in snap.jobs if not v.allocation}:
                goal["first_choice"] = d
            self.store.update(job_id, goal=goal)
        for job_id, what in (getattr(self.policy, "measuring", None) or {}).items():
            job = self.store.job(job_id)  # started to measure its speed: status says where
            if job is not None and job.goal and job.goal.get("measuring") != what:
                self.store.update(job_id, goal=dict(job.goal, measuring=what))


def _default_reason(kind: str, n_old: int, n_new: int, policy) -> str:
    name = getattr(policy, "name", "policy")
    return {"start": f"{name}: starts on {n_new} slots",
            "resume": f"{name}: resumes on {n_new} slots from its checkpoint",
            "preempt": f"{name}: preempted (its {n_old} slots go to others)",
            "grow": f"{name}: grows {n_old} -> {n_new} (spare slots lent)",
            "shrink": f"{name}: shrinks {n_old} -> {n_new} (slots taken back)",
            "move": f"{name}: moves its {n_new} slots"}[kind]

