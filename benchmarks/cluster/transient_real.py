"""Transient servers of two emulated GPU types, for real (issue 42 s5): which type and number
the ``typed`` policy chooses for each job's objective, its predicted vs measured time and cost,
exactly-once audits through every move and revocation, the same stream under the type-blind
``edl`` policy, and the notice-to-leave times.

    sudo .venv/bin/python benchmarks/cluster/transient_real.py [--jobs 8]   # 16-18 min, 2 cores

The pool: 4 namespace hosts of the test cluster (tests/cluster.py), one slot each, reached over
ssh.  h1, h2 are type ``fast`` (on-demand, $3.06 per GPU-hour: Bamboo's p3 on-demand price);
h3, h4 type ``slow`` and ``spot`` ($0.91: Bamboo's spot price).

The GPU: a GPU type changes how fast the device computes, not how fast the host imports torch
or runs Python and Gloo.  Each worker (tests/horovod_style/ledger_main.py ``--device-dir``)
does its step's ``--busy-s`` CPU seconds in one thread, its emulated GPU, which this script
moves (its thread id, cgroup v1 ``tasks``) into its host's group
``/sys/fs/cgroup/cpu/hvdedl-t42-gpu-<host>``: period 20,000 us, quota fast 5,000 us, slow 2,500
(0.25 and 0.125 CPU: a step's device work takes 4x / 8x its CPU time).  The hosts' other
processes (sshd and all it starts: imports, the ring) and the head's (service, launchers) share
one group without a quota (``hvdedl-t42-machines``).  The last design put whole hosts under
the quota, so a worker's imports (2.2 CPU-s of torch) took 9-18 s and a start 22-39 s.  On a
machine loaded by other work every group gets ``cpu.shares`` 16384 (16 processes' weight), so
that the quotas, not the load, bind.  Price table: fast 3.06 on demand, slow 0.91 spot, TFLOPS
2 and 1.

Calibration, in the same run (the machine is shared): one job per (type, size), two at a time
(fast and slow at one size), gives the job's speed per type and size (samples over its first to
last batch, from the step log); a start (the rest of its run: to the first batch, after the
last) depends on how many workers start at once, across jobs (their imports share the CPUs),
so it is measured for 1 worker alone (one short job per type, one at a time) and for 2 and 4
at once (the pairs at sizes 1 and 2) and given per number starting at once (``start_s``
``{"1": .., "2": .., "4": ..}``: the policy reads it at the job's workers plus those of other
jobs starting with it, :mod:`launcher.cluster.goal_program`); the stream's jobs are submitted
with that speed profile, the service with the mean start as ``--start-cost``.  The revocation risk the service is told
(``--revocation-risk``) is the stream's own: two revocations of the two spot hosts in about
``--window`` seconds, a replacement host back after 20 s.

The stream: ``--jobs`` jobs, one every ``--gap`` seconds, each with an objective and a limit
that make the typed policy's choice on a free pool (the same ``choose``, the same costs) one of
2 x fast, 1 x slow, 2 x slow, 1 x fast in turn (:func:`stream`), ``--min-np 1 --max-np 2``.
During the stream a script revokes a spot host with a notice (``ends=now+30`` on its pool line,
the line removed and the host cut off the bridge at the deadline, back 20 s later) and then
another without one (cut off and its line removed at once, back 20 s later); each time the spot
host whose running job started first.  The same stream and revocations then run under ``edl``
(type-blind).

Written to benchmarks/results/transient_real.json (``--out``) and printed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hvd_edl import audit  # noqa: E402

LEDGER = str(ROOT / "tests" / "horovod_style" / "ledger_main.py")
CLI = [sys.executable, "-m", "launcher.cluster.cli"]
RESULTS = ROOT / "benchmarks" / "results"
CGROUP = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 20_000
QUOTA_US = {"fast": 5_000, "slow": 2_500}   # 0.25 and 0.125 CPU per emulated GPU
SHARES = 16384          # each GPU group against the machine's other work (quota binds, not load)
PRICES = {"fast": (3.06, None, 2.0), "slow": (None, 0.91, 1.0)}  # on demand, spot, tflops
TYPES = {"h1": "fast", "h2": "fast", "h3": "slow", "h4": "slow"}
BUSY_S = 0.03           # CPU seconds of the emulated GPU's work per step
DATASET, BATCH = 256, 8
CAL_SAMPLES = DATASET * 8
BACK_S = 20.0           # a revoked host is back (a fresh VM) this long after it went


# ---- outside: the cluster and the cgroups --------------------------------------------------------

def outer(a, script: str = __file__) -> int:
    """Build the cluster and the cgroups, run ``script`` ``--inner`` in the launcher's
    namespace (its own benchmark: this one's or one that imports it), tear down."""
    sys.path.insert(0, str(ROOT / "tests"))
    from cluster import Cluster
    groups = {h: CGROUP / f"hvdedl-t42-gpu-{h}" for h in TYPES}
    machines = CGROUP / "hvdedl-t42-machines"
    devices = Path(tempfile.mkdtemp(prefix="t42-devices-"))
    try:
        with Cluster(hosts=4) as c:
            for h, g in groups.items():
                g.mkdir(exist_ok=True)
                (g / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (g / "cpu.cfs_quota_us").write_text(str(QUOTA_US[TYPES[h]]))
                (g / "cpu.shares").write_text(str(SHARES))
            machines.mkdir(exist_ok=True)  # the emulated machines' CPUs (no quota)
            (machines / "cpu.shares").write_text(str(SHARES))
            for name in c.hosts:
                for pid in c.pids(name):  # its sshd: everything the host starts inherits it
                    (machines / "cgroup.procs").write_text(str(pid))
            inner = [sys.executable, str(Path(script).resolve()), *sys.argv[1:], "--inner",
                     json.dumps({"ssh": ["-i", c.identity_file, "--network-interface", c.nic],
                                 "devices": str(devices)})]
            ctl = Control(c, devices, groups)
            ctl.start()
            try:
                return subprocess.run(  # the head machine's processes: the same group
                    c.exec_argv("launcher", inner), cwd=str(ROOT),
                    env=dict(os.environ, T42_CONTROL=ctl.path),
                    preexec_fn=lambda: (machines / "cgroup.procs").write_text(
                        str(os.getpid()))).returncode
            finally:
                ctl.stop()
                shutil.rmtree(Path(ctl.path).parent, ignore_errors=True)
    finally:
        shutil.rmtree(devices, ignore_errors=True)
        for g in [*groups.values(), machines]:
            if g.exists():
                for tid in (g / "tasks").read_text().split():
                    try:
                        (CGROUP / "tasks").write_text(tid)
                    except OSError:
                        pass
                try:
                    g.rmdir()
                except OSError as e:
                    print(f"transient_real: cannot remove {g}: {e}", file=sys.stderr)


class Control:
    """The inner benchmark (in the launcher namespace) asks the outer one, which owns the
    cluster, to cut / reconnect a host: one command a line in a FIFO-like file, polled.  It
    also moves each emulated GPU (a worker's device thread, ledger_main ``--device-dir``: it
    names itself ``<host>.<thread id>`` in ``devices``) into its host's quota group: the
    namespace hosts see no cgroup file system (``ip netns exec`` mounts a sysfs of their own)."""

    def __init__(self, c, devices: Path, groups: dict):
        self.c, self.devices, self.groups = c, devices, groups
        self.moved: set = set()
        self.path = str(Path(tempfile.mkdtemp(prefix="t42-ctl-")) / "commands")
        Path(self.path).write_text("")
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def start(self):
        self.thread.start()

    def stop(self):
        self.done.set()
        self.thread.join(5)

    def move_devices(self):
        for f in self.devices.iterdir():
            if f.name in self.moved:
                continue
            self.moved.add(f.name)
            host, _, tid = f.name.rpartition(".")
            if host in self.groups:
                try:
                    (self.groups[host] / "tasks").write_text(tid)
                except OSError:
                    pass  # the thread is gone already

    def loop(self):
        seen = 0
        while not self.done.is_set():
            self.move_devices()
            lines = Path(self.path).read_text().splitlines()
            for line in lines[seen:]:
                verb, host = line.split()
                if verb == "cut":
                    self.c.cut(host)
                elif verb == "back":  # a fresh VM: nothing but its sshd, on the bridge again
                    sshd = {self.c._sshd[host].pid}  # the cluster's own record of it
                    for pid in self.c.pids(host):
                        if pid not in sshd:
                            try:
                                os.kill(pid, signal.SIGKILL)
                            except OSError:
                                pass
                    self.c.reconnect(host)
                Path(self.path + ".ack").write_text(str(len(lines)))
            seen = len(lines)
            time.sleep(0.05)


def ask(verb: str, host: str) -> None:
    """Ask the outer process to ``cut`` / bring ``back`` a host, and wait for it (10 s)."""
    path = os.environ["T42_CONTROL"]
    with open(path, "a") as f:
        f.write(f"{verb} {host}\n")
    n = len(Path(path).read_text().splitlines())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ack = Path(path + ".ack")
        if ack.exists() and ack.read_text().strip() and int(ack.read_text()) >= n:
            return
        time.sleep(0.05)
    raise RuntimeError(f"{verb} {host}: no answer from the cluster's owner")


# ---- inside: the service, the jobs ---------------------------------------------------------------

class Pool:
    """The pool file the service's discovery script prints (``cat``)."""

    def __init__(self, path: Path, hosts=None):
        self.path = path
        self.lines = {h: f"{h}:1 type={t}" + (" spot" if t == "slow" else "")
                      for h, t in TYPES.items() if hosts is None or h in hosts}
        self.write()

    def write(self):
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("\n".join(self.lines.values()) + "\n")
        os.replace(tmp, self.path)


class Service:
    def __init__(self, tmp: Path, policy: str, ssh, prices: Path, start_cost: float,
                 risk: Path, devices: str, hosts=None):
        self.tmp, self.state, self.cluster = tmp, tmp / "state", tmp / "cluster.json"
        self.devices = devices
        tmp.mkdir(parents=True, exist_ok=True)
        self.pool = Pool(tmp / "pool", hosts)
        self.proc = subprocess.Popen(
            CLI + ["serve", "--host-discovery-script", f"cat {self.pool.path}",
                   "--discovery-interval", "0.3", *ssh, "--state-dir", str(self.state),
                   "--cluster-file", str(self.cluster), "--policy", policy, "--prices",
                   str(prices), "--revocation-risk", str(risk),
                   "--start-cost", f"{start_cost:.2f}", "--round", "2",
                   "--assume-gpus"]  # emulated GPUs: one a slot (no nvidia-smi probe by ssh)
            + (["--hold", "5"] if policy == "edl" else []),
            stdout=open(tmp / "serve.log", "w"), stderr=subprocess.STDOUT, cwd=str(ROOT))
        deadline = time.monotonic() + 60
        while not self.cluster.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("serve did not start: " + (tmp / "serve.log").read_text())
            time.sleep(0.1)

    def call(self, route, **args):
        from launcher.cluster import cluster_file
        from launcher.cluster.server import ClusterClient
        return ClusterClient(cluster_file.read(self.cluster), timeout_s=15).call(route, **args)

    def submit(self, name, samples, *args) -> str:
        epochs = max(1, round(samples / DATASET))
        adir = self.tmp / "audit" / name
        for _ in range(5):  # "the service is busy": its loop answers within 10 s, or asked again
            r = self._submit(name, adir, epochs, args)
            if r.returncode == 0 or "busy" not in r.stderr:
                break
        if r.returncode != 0:
            raise RuntimeError(f"submit {name}: {r.stderr.strip()}")
        return r.stdout.strip().splitlines()[-1]

    def _submit(self, name, adir, epochs, args):
        return subprocess.run(CLI + ["--cluster", str(self.cluster), "submit", "--name", name,
                                  "--env", f"{audit.ENV_AUDIT_DIR}={adir}", *args, "--",
                                  sys.executable, LEDGER, "--dataset-size", str(DATASET),
                                  "--batch-size", str(BATCH), "--epochs", str(epochs),
                                  "--busy-s", str(BUSY_S), "--device-dir", self.devices,
                                  "--commit-every", "4",
                                  "--step-log", str(self.tmp / f"{name}.steps"),
                                  "--done-log", str(self.tmp / f"{name}.done")],
                           capture_output=True, text=True, timeout=60, cwd=str(ROOT))

    def wait_all(self, timeout_s: float) -> list:
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.call("status")
            if st["jobs"] and all(j["state"] in ("done", "failed", "cancelled")
                                  for j in st["jobs"]):
                return st["jobs"]
            if time.monotonic() > deadline:
                raise RuntimeError(f"jobs not done within {timeout_s:.0f} s: "
                                   + json.dumps([(j["id"], j["state"]) for j in st["jobs"]]))
            time.sleep(0.5)

    def events(self) -> list:
        return [json.loads(x) for x in (self.state / "events.jsonl").read_text().splitlines()]

    def speed(self) -> dict:
        import sqlite3
        db = sqlite3.connect(str(self.state / "cluster.db"))
        return {r[0]: json.loads(r[1]) for r in db.execute("SELECT id, speed FROM jobs")}

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


def steps(path: Path) -> list:
    """The unix times of a job's batches (every process's, ledger_main ``--step-log``)."""
    return sorted(float(x) for x in path.read_text().split()) if path.exists() else []


def calibrate(tmp: Path, ssh, prices: Path, risk: Path, devices: str, samples: int) -> tuple:
    """The job's samples/s per (type, size) and its start per type and number of workers
    starting at once, from six real runs: fast and slow at one size two at a time (sizes 2
    and 1: 4 and 2 workers starting at once), then one short job of one worker per type alone
    (1 at once).  Speed: the samples over the time from the job's first batch to its last
    (its step log: joins and commits included, as a job lives them), from the pairs; start:
    the rest of the run (from the run's start to the first batch: the launcher, ssh, the
    workers' imports, the first ring; after the last batch: the workers' and launcher's exit),
    which is what the choice adds to samples / speed."""
    svc = Service(tmp / "calibration", "typed", ssh, prices, 10.0, risk, devices)
    profile, runs = {}, []
    rounds = [((("fast", 2), ("slow", 2)), samples), ((("fast", 1), ("slow", 1)), samples),
              ((("fast", 1),), samples // 4), ((("slow", 1),), samples // 4)]
    try:
        for which, m in rounds:
            at_once = sum(n for _, n in which)
            ids = {svc.submit(f"cal-{t}-{n}-{at_once}", m, "--objective", "time", "--samples",
                              str(m), "--types", t, "--min-np", str(n), "--max-np",
                              str(n)): (t, n) for t, n in which}
            jobs = {j["id"]: j for j in svc.wait_all(900)}
            sp = svc.speed()
            for jid, (t, n_) in ids.items():
                j = jobs[jid]
                st = steps(svc.tmp / f"cal-{t}-{n_}-{at_once}.steps")
                if len(st) < 2 or j["state"] != "done":
                    raise RuntimeError(f"calibration {t} x {n_}: {j['state']}, {len(st)} steps")
                thr = m / (st[-1] - st[0])
                tel = [p for p in sp[jid].values() if p.get("type") == t
                       and p["world_size"] == n_]
                if len(which) > 1:  # the speeds: from the full-length pairs
                    profile.setdefault(t, {})[str(n_)] = round(thr, 2)
                runs.append({"type": t, "n": n_, "starting_at_once": at_once, "samples": m,
                             "samples_per_s": round(thr, 2),
                             "telemetry_samples_per_s": round(max(
                                 tel, key=lambda p: p["at"])["samples_per_s"], 2) if tel else None,
                             "queue_s": round(j["started_at"] - j["submitted_at"], 2),
                             "to_first_batch_s": round(st[0] - j["started_at"], 2),
                             "training_s": round(st[-1] - st[0], 2),
                             "after_last_batch_s": round(j["finished_at"] - st[-1], 2),
                             "time_s": round(j["finished_at"] - j["started_at"], 2)})
    finally:
        svc.stop()
        stop_jobs(svc)
    for r in runs:  # the start per type and number of workers starting at once (imports share
        profile[r["type"]].setdefault("start_s", {})[str(r["starting_at_once"])] = round(
            r["to_first_batch_s"] + r["after_last_batch_s"], 2)  # the CPUs)
    every = [v for t in profile for v in profile[t]["start_s"].values()]
    return profile, sum(every) / len(every), runs


def stop_jobs(svc: Service) -> None:
    from launcher.cluster.runs import JobFiles, Run
    for pid_file in svc.state.glob("jobs/*/run*.pid"):
        run = Run(JobFiles(svc.state, pid_file.parent.name), int(pid_file.stem[3:]))
        run.stop(signal.SIGTERM)


TARGETS = [("time", "fast", 2), ("cost", "slow", 1), ("cost", "slow", 2),
           ("time", "fast", 1), ("time", "slow", 2), ("cost", "fast", 1)]


def offers(rate_per_h: float) -> list:
    """The pool as the typed policy sees it when it is free (launcher.cluster.choice.Offer)."""
    from launcher.cluster.choice import Offer
    return [Offer("fast", 2, PRICES["fast"][0], 0.0, 72.0, False),
            Offer("slow", 2, PRICES["slow"][1], rate_per_h, BACK_S, True)]


def stream(n_jobs: int, profile: dict, rate_per_h: float, seed: int = 42) -> list:
    """[(name, samples, submit args, target)]: jobs whose objective and limit make the typed
    policy's choice on a free pool (the same :func:`launcher.cluster.choice.choose`, the same
    costs: commit 2 s, switch 0.5 s, the calibrated starts, the risk table) each of
    :data:`TARGETS` in turn: type and number.  A limit is the middle (geometric) of the widest
    range of limits that choose the target (30 % above its lower edge when it has no upper
    one); a target no limit chooses for that job is skipped for the next."""
    import random
    from launcher.cluster.choice import Goal, choose
    rng = random.Random(seed)
    start = {t: profile[t]["start_s"] for t in profile}

    def speed(t, n):
        v = profile.get(t, {}).get(str(n))
        return v if n >= 1 else 0.0

    def pick(objective, samples, limit):
        g = Goal(objective, samples, deadline_at=1e9 + limit if objective == "cost" else None,
                 budget_usd=limit if objective == "time" else None)
        p = choose(g, samples, speed, offers(rate_per_h), 1e9, 1, 2, commit_s=2.0,
                   switch_s=0.5, start_s=dict(start))
        return (objective, p.gpu_type, p.n) if p and p.fits else None

    out, k = [], 0
    for i in range(n_jobs):
        samples = DATASET * rng.choice((12, 16, 20))
        for _ in range(len(TARGETS)):
            target = TARGETS[k % len(TARGETS)]
            k += 1
            objective = target[0]
            # limits: times 10 s .. 2000 s, budgets $0.0005 .. $0.5, on a geometric grid
            lo, hi = (10.0, 2000.0) if objective == "cost" else (0.0005, 0.5)
            grid = [lo * (hi / lo) ** (x / 599) for x in range(600)]
            hits = [pick(objective, samples, x) == target for x in grid]
            best, run_from = None, None
            for x, hit in enumerate(hits + [False]):
                if hit and run_from is None:
                    run_from = x
                elif not hit and run_from is not None:
                    if best is None or x - run_from > best[1] - best[0]:
                        best = (run_from, x)
                    run_from = None
            if best is None:
                continue
            limit = (grid[best[0]] * 1.3 if best[1] == len(grid)  # no upper edge: 30 % over
                     else (grid[best[0]] * grid[best[1] - 1]) ** 0.5)
            args = (["--objective", "time", "--budget", f"{limit:.6f}"] if objective == "time"
                    else ["--objective", "cost", "--deadline", f"{limit:.0f}"])
            out.append((f"{objective[0]}{i}", samples, args, f"{target[2]} x {target[1]}"))
            break
    return out


def busiest_spot(svc: Service, default: str, but: str = "") -> str:
    """The spot host holding the running job that started first (training by now: a slow
    worker's start takes ~40 s here), else ``default``."""
    try:
        st = svc.call("status")
    except Exception:  # noqa: BLE001 - a busy service: revoke the default host
        return default
    started = {j["id"]: j["started_at"] or 0 for j in st["jobs"] if j["state"] == "running"}
    best = None
    for host, holders in st["holders"].items():
        if TYPES.get(host) != "slow" or host == but:
            continue
        for jid, _ in holders:
            if jid in started and (best is None or started[jid] < best[1]):
                best = (host, started[jid])
    return best[0] if best else default


def revocations(svc: Service, t0: float, at_notice: float, at_cut: float, log: list) -> None:
    """A spot host revoked with a 30 s notice at ``at_notice`` and another without one at
    ``at_cut`` (seconds after t0; each the spot host whose job started first, :func:`busiest_spot`);
    each back 20 s after it went."""
    def at(t):
        wait = t0 + t - time.time()
        if wait > 0:
            time.sleep(wait)
    at(at_notice)
    h = busiest_spot(svc, "h4")
    ends = time.time() + 30
    line = svc.pool.lines[h]
    svc.pool.lines[h] = line + f" ends={ends:.1f}"
    svc.pool.write()
    log.append({"host": h, "notice": True, "notice_at_s": round(time.time() - t0, 2),
                "ends_in_s": 30})
    at(ends - t0)
    del svc.pool.lines[h]
    svc.pool.write()
    ask("cut", h)
    log[-1]["revoked_at_s"] = round(time.time() - t0, 2)
    at(ends - t0 + BACK_S)
    ask("back", h)
    svc.pool.lines[h] = line
    svc.pool.write()
    at(max(at_cut, ends - t0 + 25))
    h2 = busiest_spot(svc, "h3" if h != "h3" else "h4")
    line2 = svc.pool.lines[h2]
    ask("cut", h2)
    del svc.pool.lines[h2]
    svc.pool.write()
    log.append({"host": h2, "notice": False, "revoked_at_s": round(time.time() - t0, 2)})
    at(time.time() - t0 + BACK_S)
    ask("back", h2)
    svc.pool.lines[h2] = line2
    svc.pool.write()


def watch_choices(svc: Service, seen: dict, done: threading.Event) -> None:
    """Every second, each job's current choice (``status``'s ``goal.choice``); kept in
    ``seen[job]`` as ``(unix s, choice)`` whenever its type or number changes (a move)."""
    while not done.wait(1.0):
        try:
            jobs = svc.call("status")["jobs"]
        except Exception:  # noqa: BLE001 - a busy service: ask again next second
            continue
        for j in jobs:
            c = (j.get("goal") or {}).get("choice")
            if j["state"] != "running" or not c:
                continue
            last = seen.get(j["id"], [])
            if not last or (last[-1][1]["type"], last[-1][1]["n"]) != (c["type"], c["n"]):
                seen.setdefault(j["id"], []).append((time.time(), c))


def switches(folder: Path) -> dict:
    """A job's generation changes over its runs: how many, steps rolled back, the longest
    stall, and the lines where workers left (what a revocation cost it)."""
    gens, left = [], []
    for f in sorted(folder.glob("run*.events.jsonl")):
        for line in f.read_text().splitlines():
            e = json.loads(line)
            if "generation" in e and e.get("kind") not in (None, "start"):
                gens.append(e)
    for f in sorted(folder.glob("run*.log")):
        left += [x.split("hvd-edl-run: ", 1)[1][:160] for x in f.read_text().splitlines()
                 if x.startswith("hvd-edl-run:") and (" leaves: " in x or " lost " in x
                                                     or "from its checkpoint" in x
                                                     or "resum" in x)]
    return {"switches": len(gens),
            "rolled_back_steps": sum(e.get("rolled_back_steps") or 0 for e in gens),
            "max_stall_s": round(max((e.get("stall_s") or 0 for e in gens), default=0), 3),
            "leave_lines": left}


def run_stream(policy: str, tmp: Path, ssh, prices: Path, risk: Path, devices: str,
               start_s: float, jobs, profile_path, gap_s: float, notice_at: float,
               cut_at: float) -> dict:
    svc = Service(tmp / policy, policy, ssh, prices, start_s, risk, devices)
    t0 = time.time()
    revs: list = []
    rev = threading.Thread(target=revocations, args=(svc, t0, notice_at, cut_at, revs),
                           daemon=True)
    rev.start()
    ids = {}
    seen: dict = {}  # job -> [(unix s, choice)] each time its chosen type or number changed
    watching = threading.Event()
    watch = threading.Thread(target=watch_choices, args=(svc, seen, watching), daemon=True)
    watch.start()
    try:
        for i, (name, samples, args, target) in enumerate(jobs):
            wait = t0 + i * gap_s - time.time()
            if wait > 0:
                time.sleep(wait)
            ids[svc.submit(name, samples, *args, "--samples", str(samples), "--speed-profile",
                           str(profile_path), "--min-np", "1", "--max-np", "2",
                           "--np", "2")] = (name, samples, target)
        final = {j["id"]: j for j in svc.wait_all(1500)}
        rev.join(120)
        events = svc.events()
    finally:
        watching.set()
        watch.join(10)
        svc.stop()
        stop_jobs(svc)
    rows = []
    for jid, (name, samples, target) in ids.items():
        j = final[jid]
        g = j.get("goal") or {}
        c = g.get("first_choice") or {}
        rep = audit.check(svc.tmp / "audit" / name, DATASET)
        hosts = sorted({h for e in events if e.get("job") == jid and e.get("hosts")
                        for h in e["hosts"]})
        changes = seen.get(jid, [])[1:]  # the first seen is its first choice
        then = changes[-1] if changes else None  # its last move: what ran to the end
        rows.append({
            "job": jid, "name": name, "objective": g.get("objective"),
            "moved_to": f"{then[1]['n']} x {then[1]['type']}" if then else None,
            "pred_time_after_move_s": round(then[0] - j["started_at"] + then[1]["time_s"], 2)
            if then else None,
            "limit": (f"budget ${g['budget_usd']:.4f}" if g.get("budget_usd") is not None else
                      f"deadline {g['deadline_at'] - j['submitted_at']:.0f} s"),
            "samples": samples, "state": j["state"],
            "target": target, "chosen": f"{c['n']} x {c['type']}" if c else None,
            "hosts_used": hosts, "pred_time_s": c.get("time_s"),
            "time_s": round(j["finished_at"] - j["started_at"], 2),
            "jct_s": round(j["finished_at"] - j["submitted_at"], 2),
            "pred_cost_usd": c.get("cost_usd"), "cost_usd": j["cost_usd"],
            "fits_pred": c.get("fits"),
            "met": j["state"] == "done" and (
                (j["cost_usd"] <= g["budget_usd"]) if g.get("budget_usd") is not None else
                (j["finished_at"] <= g["deadline_at"])),
            "repeated": rep.repeated, "missing": rep.missing, "audit_ok": rep.ok,
            "runs": j["runs"], **switches(svc.state / "jobs" / jid)})
        for k in ("time", "cost"):
            p, m = rows[-1][f"pred_{k}_s" if k == "time" else "pred_cost_usd"], \
                rows[-1]["time_s" if k == "time" else "cost_usd"]
            rows[-1][f"{k}_error"] = round(abs(p - m) / m, 4) if p and m else None
        last = rows[-1]["pred_time_after_move_s"] or rows[-1]["pred_time_s"]  # what ran to the end
        rows[-1]["time_error_final"] = round(abs(last - rows[-1]["time_s"]) / rows[-1]["time_s"],
                                             4) if last else None
    drains = [{k: e.get(k) for k in ("host", "took_s", "spare_s")} for e in events
              if e["kind"] == "drained"]
    late = [e.get("host") for e in events if e["kind"] == "drain_late"]
    return {"policy": policy, "jobs": rows, "revocations": revs, "drained": drains,
            "drain_late": late,
            "mean_jct_s": round(sum(r["jct_s"] for r in rows) / len(rows), 2),
            "total_cost_usd": round(sum(r["cost_usd"] for r in rows), 6),
            "makespan_s": round(max(final[j]["finished_at"] for j in ids) - t0, 2),
            "limits_met": sum(bool(r["met"]) for r in rows),
            "time_within_20pct": sum(1 for r in rows if r["time_error_final"] is not None
                                     and r["time_error_final"] <= 0.2),
            "load_1min_at_end": round(os.getloadavg()[0], 1)}


def write_prices(tmp: Path) -> Path:
    """:data:`PRICES` as a price table (docs/transient.md: ``type,on_demand,spot,tflops``; a
    blank cell: not offered that way) in ``tmp/prices.csv``; returns its path."""
    prices = tmp / "prices.csv"
    prices.write_text("type,on_demand,spot,tflops\n" + "".join(
        f"{t},{'' if od is None else od},{'' if sp is None else sp},{tf}\n"
        for t, (od, sp, tf) in PRICES.items()))
    return prices


def inner(a) -> int:
    ctx = json.loads(a.inner)
    tmp = Path(tempfile.mkdtemp(prefix="transient-real-"))
    prices = write_prices(tmp)
    # the risk the stream runs: two revocations of the two spot hosts within about
    # --window seconds, each host back BACK_S after it went (the replacement's start-up)
    rate = 3600.0 * 2 / (2 * a.window)
    risk = tmp / "risk.csv"
    risk.write_text("type,zone,revocations_per_hour,replacement_start_s\n"
                    f"slow,,{rate:.4f},{BACK_S:g}\n")
    t_cal = time.time()
    profile, start_s, cal = calibrate(tmp, ctx["ssh"], prices, risk, ctx["devices"],
                                      CAL_SAMPLES)
    print(f"calibration ({time.time() - t_cal:.0f} s): samples/s and start {profile}", flush=True)
    for r in cal:
        print(f"  {r}", flush=True)
    profile_path = tmp / "profile.json"
    profile_path.write_text(json.dumps(profile))
    jobs = stream(a.jobs, profile, rate)
    for j in jobs:
        print(f"  stream: {j}", flush=True)
    out = {"command": "sudo .venv/bin/python benchmarks/cluster/transient_real.py "
                      + " ".join(sys.argv[1:sys.argv.index("--inner")]),
           "machine": f"2 cores shared with other sessions' work (load {os.getloadavg()[0]:.1f} "
                      "at the start); calibrated in the same run",
           "emulated_gpu": "a worker thread doing --busy-s CPU seconds per step under its "
                           "host's cgroup v1 CPU quota; imports, Python and Gloo unthrottled",
           "quotas_us": {"period": PERIOD_US, **QUOTA_US}, "cpu_shares": SHARES,
           "prices": PRICES, "revocations_per_h_slow": round(rate, 3),
           "replacement_start_s": BACK_S,
           "busy_s_per_step": BUSY_S, "dataset": DATASET, "batch": BATCH,
           "calibration": {"profile": profile, "start_cost_s": round(start_s, 2), "runs": cal,
                           "samples": CAL_SAMPLES},
           "stream": [{"name": n, "samples": s, "args": x, "target": t}
                      for n, s, x, t in jobs], "runs": {}}
    for policy in ("typed", "edl"):
        r = run_stream(policy, tmp, ctx["ssh"], prices, risk, ctx["devices"], start_s, jobs,
                       profile_path, a.gap, a.notice_at, a.cut_at)
        out["runs"][policy] = r
        print_run(r)
        RESULTS.mkdir(exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"written to {a.out}")
    return 0


def print_run(r: dict) -> None:
    print(f"\n== {r['policy']}: mean JCT {r['mean_jct_s']:.1f} s, makespan {r['makespan_s']:.1f} "
          f"s, cost ${r['total_cost_usd']:.4f}, limits met {r['limits_met']}/{len(r['jobs'])}")
    print(f"{'job':<4}{'name':<5}{'state':<7}{'objective':<10}{'limit':<18}{'target':<10}"
          f"{'chosen':<10}{'moved to':<10}{'hosts':<12}"
          f"{'pred s':>7}{'meas s':>7}{'err':>6}{'pred $':>9}{'meas $':>9}"
          f"{'err':>6}"
          f"{'met':>5}{'rep/miss':>9}")
    for x in r["jobs"]:
        print(f"{x['job']:<4}{x['name']:<5}{x['state']:<7}{x['objective']:<10}{x['limit']:<18}"
              f"{x['target'] or '-':<10}{x['chosen'] or '-':<10}{x['moved_to'] or '-':<10}"
              f"{','.join(x['hosts_used']):<12}{x['pred_time_s'] or 0:>7.1f}"
              + (f"({x['pred_time_after_move_s']:.0f})" if x["pred_time_after_move_s"] else "")
              + f"{x['time_s']:>7.1f}"
              f"{(x['time_error'] or 0) * 100:>5.0f}%{x['pred_cost_usd'] or 0:>9.5f}"
              f"{x['cost_usd']:>9.5f}{(x['cost_error'] or 0) * 100:>5.0f}%"
              f"{'yes' if x['met'] else 'no':>5}{x['repeated']:>5}/{x['missing']}")
    print(f"revocations: {r['revocations']}; drained: {r['drained']}; late: {r['drain_late']}")
    print(f"time predicted within 20 % (the prediction that ran to the end): "
          f"{r['time_within_20pct']}/{len(r['jobs'])}; load {r['load_1min_at_end']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--gap", type=float, default=25.0, help="seconds between submissions")
    ap.add_argument("--notice-at", type=float, default=70.0,
                    help="seconds into a stream when h4 gets its 30 s notice")
    ap.add_argument("--cut-at", type=float, default=140.0,
                    help="seconds into a stream when h3 is revoked without notice")
    ap.add_argument("--window", type=float, default=400.0,
                    help="seconds a stream is expected to last: the revocation rate the "
                         "service is told is two revocations of two spot hosts in it")
    ap.add_argument("--out", default=str(RESULTS / "transient_real.json"))
    ap.add_argument("--inner", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    return inner(a) if a.inner else outer(a)


if __name__ == "__main__":
    sys.exit(main())
