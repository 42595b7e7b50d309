"""Helpers that drive real ``hvd-edl-run`` jobs: real processes, real Horovod over Gloo on
loopback, real kills.  Tests wait on events (lines in the event log, processes appearing), each
with a deadline, never on fixed sleeps."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

import pytest

# One intra-op thread per process (torchrun's default for several processes a host): the tests'
# models are tiny, and torch's default pool (one OpenMP thread per core) spin-waits after each
# op, so every worker, and every test process that imports torch, burned a second core that the
# other tests' processes needed (Horovod's elastic script, one worker, 250 steps, load 20-28 on 2
# cores: 11.3 CPU-s and 111-123 s with the default pool, 5.0 CPU-s and 34-59 s with one thread).
# Set before torch is imported here, and inherited by every process a test starts; a value
# already in the environment wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every process a test starts (launchers, zygotes, hvd-edl-ctl, cluster services) imports this
# checkout's modules; where PYTHONDONTWRITEBYTECODE is set (some CI and sandbox images set it)
# each compiled them again: about 0.1 CPU-s of a launcher's 0.4 (46 modules, 540 kB), 60 ms
# of a zygote's start.  Their bytecode goes to __pycache__ beside the sources (ignored by git),
# written atomically, so concurrent test processes share it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
LAUNCHER = str(VENV_BIN / "hvd-edl-run")
DIGITS = str(ROOT / "examples" / "train_digits.py")


def wait_for(what: str, pred: Callable[[], object], timeout_s: float = 60.0,
             explain: Callable[[], str] = lambda: ""):
    """``pred()``'s first true value, asked every 0.2 s; AssertionError naming ``what`` (and
    ``explain()``) after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}\n{explain()}")


class Job:
    """One ``hvd-edl-run`` process with an event log and, for elastic jobs, a hosts file that
    ``cat`` serves as the host discovery script."""

    def __init__(self, tmp: Path, launcher_args: List[str], command: List[str],
                 hosts: Optional[str] = None):
        self.tmp = tmp
        self.events_path = tmp / "events.jsonl"
        self.hosts_path = tmp / "hosts.txt"
        self.out_path = tmp / "launcher.out"
        args = [LAUNCHER, "--event-log", str(self.events_path)] + launcher_args
        if hosts is not None:
            self.set_hosts(hosts)
            args += ["--host-discovery-script", f"cat {self.hosts_path}"]
        self.out = open(self.out_path, "w")
        self.proc = subprocess.Popen(args + command, stdout=self.out, stderr=subprocess.STDOUT,
                                     cwd=str(ROOT))

    def end_training(self) -> None:
        """Ask a :func:`long_digits` job to finish at its next epoch boundary."""
        (self.tmp / STOP_FILE).touch()

    def set_hosts(self, text: str) -> None:
        tmp = self.hosts_path.with_suffix(".new")
        tmp.write_text(text.strip() + "\n")
        os.replace(tmp, self.hosts_path)  # atomic: discovery never reads half a file

    def events(self) -> List[dict]:
        from launcher.observe.events import read
        return read(self.events_path)[0]  # the generations (EventLog.note lines are not)

    def notes(self, kind: str) -> List[dict]:
        """The event log's :meth:`EventLog.note` lines of ``kind`` ("migration", "profile" ...)."""
        from launcher.observe.events import read
        return [n for n in read(self.events_path)[1] if n.get("event") == kind]

    def wait_for(self, what: str, pred: Callable[[], object], timeout_s: float = 90.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = pred()
            if value:
                return value
            if self.proc.poll() is not None:
                value = pred()
                if value:
                    return value
                raise AssertionError(f"job ended (rc {self.proc.returncode}) before {what}:\n"
                                     + self.output()[-4000:])
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}:\n" + self.output()[-4000:])

    def wait_generation(self, number: int, timeout_s: float = 90.0) -> dict:
        return self.wait_for(f"generation {number}", lambda: next(
            (e for e in self.events() if e["generation"] == number), None), timeout_s)

    def worker_pid(self, worker_id: str) -> Optional[int]:
        """PID of the training process the launcher started as ``worker_id`` (from its env):
        the launcher's child, or under a zygote (docs/zygote.md) the zygote's child, not the
        stub that stands for it with the same environment (a kept zygote's: not under the
        launcher at all, :func:`forked_worker`)."""
        import psutil
        stubs = []
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if child.environ().get("HVD_EDL_WORKER_ID") != worker_id:
                    continue
                if any(a.endswith("zygote_client.py") for a in child.cmdline()):
                    stubs.append(child)
                else:
                    return child.pid
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return next((pid for pid in map(forked_worker, stubs) if pid is not None), None)

    def kill_worker(self, worker_id: str, sig: int = signal.SIGKILL) -> None:
        pid = self.wait_for(f"pid of {worker_id}", lambda: self.worker_pid(worker_id), 60)
        os.kill(pid, sig)

    def finish(self, timeout_s: float = 240.0) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=30)
            self.out.flush()

    def output(self) -> str:
        self.out.flush()
        return self.out_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.out.close()


def forked_worker(stub) -> Optional[int]:
    """The worker a stub (a ``psutil.Process``) stands for, forked by a kept zygote (its socket:
    the stub's argument; the zygote: its pid file's): the zygote's child with the stub's
    ``HVD_EDL_WORKER_ID`` and ``HVD_EDL_SECRET``; None if there is none (yet)."""
    import psutil
    from launcher.spawn import zygote_client
    try:
        cmd, env = stub.cmdline(), stub.environ()
        sock = cmd[cmd.index("--") - 2]
        pid = zygote_client.kept_pid(sock, stub.uids().real) if sock.endswith(".sock") else None
        for child in psutil.Process(pid).children() if pid else ():
            theirs = child.environ()
            if all(theirs.get(k) == env.get(k) for k in ("HVD_EDL_WORKER_ID", "HVD_EDL_SECRET")):
                return child.pid
    except (psutil.Error, ValueError, IndexError):
        pass
    return None


@pytest.fixture
def job_factory(tmp_path):
    jobs: List[Job] = []

    def make(launcher_args, command, hosts=None) -> Job:
        job = Job(tmp_path, launcher_args, command, hosts)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.stop()


def digits(tmp: Path, *extra: str) -> List[str]:
    """The main job's command, writing its summary to tmp/summary.json."""
    return [sys.executable, DIGITS, "--summary", str(tmp / "summary.json"), *extra]


STOP_FILE = "stop"


def long_digits(tmp: Path, *extra: str) -> List[str]:
    """The main job, long enough to outlast any membership change a test makes: it trains until
    :meth:`Job.end_training` is called (then to the end of that epoch)."""
    return digits(tmp, "--epochs", "200", "--step-delay", "0.01",
                  "--stop-file", str(tmp / STOP_FILE), *extra)


def summary(tmp: Path) -> dict:
    return json.loads((tmp / "summary.json").read_text())


@pytest.fixture
def rdv():
    """A real :class:`launcher.job.rendezvous.GenerationRendezvous` on 127.0.0.1 (in this process),
    closed after the test."""
    from launcher.job.rendezvous import GenerationRendezvous
    r = GenerationRendezvous("127.0.0.1")
    yield r
    r.close()


# make test runs on two pytest-xdist workers (--dist loadgroup, Makefile): a test drives
# processes that use about 1.3 of the 2 cores on average (mostly each worker's torch import
# and Gloo set-up), so two at a time keep both cores busy.  The tests that build a namespace
# cluster (sshd per host, Ray's daemons) share one group: they run one after another on one
# xdist worker, never two clusters at once.
NAMESPACE_CLUSTER_FILES = {"test_cluster.py", "test_ray.py"}


@pytest.fixture(scope="session")
def shared_cluster():
    """One namespace cluster of 3 hosts (tests/cluster.py) for the namespace-cluster group's
    tests that need no other shape (test_cluster.py's module, test_cluster_faults.py's
    vanished host): they run one after another on one xdist worker, and a host's remote zygote
    (docs/zygote.md: one per user and key on each host, kept 60 s after its last worker) serves
    the next file's jobs too, instead of each new cluster paying 3 imports (issue 38).  A test
    that changes a host (cut, partition, frozen, refused key) puts it back before it ends.
    Skips where no namespace cluster can be built; closed when the session ends."""
    from cluster import Cluster, ClusterUnavailable
    try:
        c = Cluster(hosts=3)
    except ClusterUnavailable as e:
        pytest.skip(f"no namespace cluster: {e}")
    yield c
    c.close()


def pytest_configure(config):
    """The run's first process (xdist's controller, or the only one) marks the session: what
    it left behind is said at its end (tests/leftovers.py)."""
    if not hasattr(config, "workerinput"):
        import leftovers
        leftovers.start()
    else:
        _enter_own_costs_cgroup(config.workerinput["workerid"])


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):
        import leftovers
        lines = leftovers.report()
        if lines:
            print("\n" + "\n".join(lines), file=sys.stderr, flush=True)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The namespace-cluster files' tests join one xdist group, and every ``xdist_group`` mark
    takes effect.  xdist's worker tells its scheduler a test's group by the node id's ``@GROUP``
    suffix, which xdist 3.8 sets as ``item._nodeid``; pytest 9 reads a node id from ``item._id``
    (a ``NodeId``), so no suffix reached the scheduler and ``--dist loadgroup`` grouped nothing:
    test_cluster.py, test_ray.py and test_cluster_users.py ran on both workers, each building
    its own cluster (sshd per host, Ray's daemons, a remote zygote per host and user), two
    clusters at once.  Last (after xdist's own hook): the suffix is added only where xdist's
    did not."""
    for item in items:
        if item.path.name in NAMESPACE_CLUSTER_FILES:
            item.add_marker(pytest.mark.xdist_group("namespace-cluster"))
    if not getattr(config.option, "loadgroup", False):   # an xdist worker under loadgroup
        return
    for item in items:
        # the closest mark (a test's own over its module's), not xdist's join of all of them:
        # test_cluster_faults.py's vanished-host test joins the namespace-cluster group
        mark = item.get_closest_marker("xdist_group")
        if mark is not None and "@" not in item.nodeid:
            group = mark.args[0] if mark.args else mark.kwargs.get("name", "default")
            _set_node_id(item, f"{item.nodeid}@{group}")


def _set_node_id(item, nodeid: str) -> None:
    """What xdist's ``item._nodeid = ...`` did before pytest 9 (see above)."""
    if isinstance(getattr(item, "_id", None), str) or not hasattr(item, "_id"):
        item._nodeid = nodeid
    else:
        item._id = type(item._id).parse(nodeid)


# Where the suite's time goes (issue 38): with HVD_EDL_TEST_COSTS=PATH set, every test appends
# one JSON line to PATH: its node id, wall seconds, and CPU seconds (user + system) of the test
# process plus the children it waited for (getrusage RUSAGE_SELF + RUSAGE_CHILDREN deltas over
# set-up, call and tear-down; a daemon nobody waits for is not counted).  CPU seconds move less
# with the machine's load than wall seconds do, so they compare runs on a shared machine.
# A job that outlives its waiter (the cluster service's runs, sshd's sessions, orphans) is not in
# RUSAGE_CHILDREN: with HVD_EDL_TEST_COSTS_CGROUP=DIR (a cgroup v1 cpuacct folder this process
# and every descendant sit in, as benchmarks/suite/test_costs.py sets up), ``tree_cpu_s`` is that
# cgroup's CPU seconds over the test, every process it started included.
# Summed per file by benchmarks/suite/test_costs.py.
TEST_COSTS_ENV = "HVD_EDL_TEST_COSTS"
TEST_COSTS_CGROUP_ENV = "HVD_EDL_TEST_COSTS_CGROUP"
TEST_COSTS_CGROUPS_ENV = "HVD_EDL_TEST_COSTS_CGROUPS"


def _enter_own_costs_cgroup(worker: str) -> None:
    """With HVD_EDL_TEST_COSTS_CGROUPS=DIR (a cgroup v1 cpuacct folder; root), this xdist worker
    moves into a cpuacct cgroup DIR/<worker> of its own, so every test's ``tree_cpu_s`` counts
    what that test started (kept zygotes' forks, services, sshd sessions in namespace hosts)
    under make test's own schedule, not mixed with the other worker's."""
    parent = os.environ.get(TEST_COSTS_CGROUPS_ENV)
    if not parent:
        return
    folder = os.path.join(parent, worker)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    os.environ[TEST_COSTS_CGROUP_ENV] = folder


def _tree_cpu_s() -> Optional[float]:
    folder = os.environ.get(TEST_COSTS_CGROUP_ENV)
    if not folder:
        return None
    with open(os.path.join(folder, "cpuacct.usage")) as f:
        return int(f.read()) / 1e9


def _cpu_s() -> float:
    import resource
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get(TEST_COSTS_ENV)
    if not path:
        yield
        return
    wall0, cpu0, tree0 = time.monotonic(), _cpu_s(), _tree_cpu_s()
    yield
    row = {"test": item.nodeid, "wall_s": round(time.monotonic() - wall0, 3),
           "cpu_s": round(_cpu_s() - cpu0, 3),
           "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "end": round(time.time(), 1)}
    if tree0 is not None:
        row["tree_cpu_s"] = round(_tree_cpu_s() - tree0, 3)
    line = json.dumps(row)
    with open(path, "a") as out:  # one short line per write: appends from xdist workers interleave whole
        out.write(line + "\n")


# Every job of make test starts its Python workers through a zygote (the default, docs/zygote.md);
# these tests check what the launcher's own child process is and shows (its environment and
# argv, that it dies with the launcher, that a signal ends it), so they keep the exec path covered
EXEC_PATH_TESTS = {
    "test_security.py::test_local_workers_get_the_secret_in_their_environment_not_their_argv",
    "test_checkpoint.py::test_launcher_killed_and_rerun_resumes_at_another_world_size",
    "test_elastic.py::test_sigterm_to_the_launcher_stops_the_workers_without_blaming_them",
    # a killed launcher's exec'd workers leave their own children behind for a while (orphans
    # holding the job's GPUs); under a zygote the stub's death kills the worker's whole process
    # group at once, so no orphan window exists to test there
    "test_cluster_faults.py::test_a_killed_launchers_orphans_keep_its_slots_until_they_are_gone",
}


# One kept zygote per key for the whole session of each xdist worker (docs/zygote.md, issue 38):
# every launcher a test starts forks its local Python workers from it, so a job pays no
# `import hvd_edl.torch` of its own; ended (SIGTERM, then SIGKILL by pid) when the session ends.
# HVD_EDL_TEST_KEPT_ZYGOTE=0 turns it off (each launcher its own zygote, as a user's run).
# Its idle life outlasts the longest stretch a worker runs without a local job (the
# namespace-cluster group: minutes of remote workers only); at 120 s it had exited by then and
# the next local job paid a second import (issue 38).  A killed session's zygotes end by it.
KEPT_ZYGOTE_IDLE_S = 600.0


@pytest.fixture(scope="session", autouse=True)
def _kept_zygotes():
    import shutil
    import tempfile
    from launcher.spawn import zygote_client
    if os.environ.get("HVD_EDL_TEST_KEPT_ZYGOTE", "1") == "0" or \
            zygote_client.KEEP_ENV in os.environ:
        yield None
        return
    import leftovers
    # 0700, short (a socket path's limit), named by the run (tests/leftovers.py)
    folder = tempfile.mkdtemp(prefix=leftovers.kept_folder_prefix())
    os.environ[zygote_client.KEEP_ENV] = f"{KEPT_ZYGOTE_IDLE_S:g}"
    os.environ[zygote_client.KEEP_DIR_ENV] = folder
    try:
        yield folder
    finally:
        os.environ.pop(zygote_client.KEEP_ENV, None)
        os.environ.pop(zygote_client.KEEP_DIR_ENV, None)
        end_kept_zygotes(folder)
        shutil.rmtree(folder, ignore_errors=True)


def end_kept_zygotes(folder: str, timeout_s: float = 30.0) -> None:
    """End the kept zygotes in ``folder``: SIGTERM (each exits once its workers have), then
    SIGKILL, by pid, what is still there after ``timeout_s``."""
    import psutil
    from launcher.spawn import zygote_client
    procs = []
    for pid in zygote_client.end_kept(folder):
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    _gone, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


@pytest.fixture(autouse=True)
def _exec_path_for_process_contracts(request, monkeypatch):
    if f"{request.node.path.name}::{request.node.originalname}" in EXEC_PATH_TESTS:
        monkeypatch.setenv("HVD_EDL_ZYGOTE", "0")
