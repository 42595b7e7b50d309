"""The control plane at internet scale, by simulation (issue 17, item 2).

The launcher is real: ``launcher.job.driver.Driver`` (its loop, discovery, spawning decisions, the
control API), the ``Coordinator`` and its HTTP server, the per-generation Gloo rendezvous
servers and the event log, in one process of their own.  Only the creation of worker processes
is replaced: ``launcher.job.driver.spawn`` is hooked to ask a load-generator process
(``benchmarks/job/sim_worker.py``) to start a simulated worker, an asyncio task that speaks the
protocol over HTTP with the real messages and signatures, beats, long-polls and reaches step
boundaries like ``hvd_edl.runtime`` (no torch, no Horovod).  Its exit is reported back to the
driver like a process's.

For each size N (default 64, 256, 1,024 workers, 8 per simulated host) one launcher process
runs: the start (N workers register, build ``--build-s``, report ready, generation 1), a steady
state (beats and open watch polls), a scale-in N -> N - 8 and a scale-out back to N (through
``Driver.set_target``, the control API's call), a flood (every worker beats back to back:
the requests per second the launcher sustains), and the Gloo full-mesh key traffic of one
``hvd.init()`` (global, local and cross scopes) against the generation's rendezvous server.

Figures, per size: ``formation_s`` (last report at the boundary to every worker holding its
assignment, the worse of the two switches), ``launcher_cpu_s_per_switch`` (the launcher
process's CPU time from the change request to every member's ``/started``, less the steady
state's rate over that window), ``launcher_rss_mb`` (peak), ``requests_per_s`` (sustained in
the flood), the steady state's CPU share and thread count, and the rendezvous traffic.  With
``--profile`` py-spy samples the launcher during the switches.

Usage::

    .venv/bin/python benchmarks/job/control_plane.py                 # 64, 256, 1024
    .venv/bin/python benchmarks/job/control_plane.py --workers 64 --no-mesh

Writes ``benchmarks/results/scale.json`` key ``"control_plane"`` (read-modify-write under a
file lock) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results" / "scale.json"
SLOTS_PER_HOST = 8
SCALE_STEP = 8           # workers removed and added again (one host's worth)


# ---- in the launcher process ---------------------------------------------------------------------

class SimProcess:
    """What the driver holds for a simulated worker (the parts of ``spawn.WorkerProcess`` it
    uses: ``signal``, ``wait``, ``running``)."""

    remote_pid = None
    last_error_line = ""

    def __init__(self, spawner: "SimSpawner", worker_id: str, on_exit):
        self.spawner, self.worker_id, self.on_exit = spawner, worker_id, on_exit
        self.code: Optional[int] = None
        self.ended = threading.Event()

    def signal(self, sig: int) -> None:
        if not self.ended.is_set():
            self.spawner.send({"op": "signal", "id": self.worker_id, "sig": int(sig)})

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"sim {self.worker_id}", timeout)
        return self.code

    @property
    def running(self) -> bool:
        return not self.ended.is_set()


class SimSpawner:
    """Replaces ``launcher.spawn.spawn``: starts simulated workers in the load generator."""

    def __init__(self, build_s: float, step_s: float, stderr):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.job.sim_worker", "--build-s", str(build_s),
             "--step-s", str(step_s)], cwd=ROOT, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=stderr)
        self.procs: Dict[str, SimProcess] = {}
        self.answers: "queue.Queue[dict]" = queue.Queue()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True, name="sim-reader").start()

    def spawn(self, spec, host, extra_env, label, on_exit, output_dir=None) -> SimProcess:
        from hvd_edl.messages import ENV_WORKER_ID
        wid = extra_env[ENV_WORKER_ID]
        p = self.procs[wid] = SimProcess(self, wid, on_exit)
        self.send({"op": "spawn", "id": wid, "env": {**spec.env, **extra_env}})
        return p

    def send(self, cmd: dict) -> None:
        with self._lock:
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()

    def ask(self, cmd: dict, timeout_s: float = 600.0) -> dict:
        self.send(cmd)
        return self.answers.get(timeout=timeout_s)

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            if msg.get("ev") == "exit":
                p = self.procs.get(msg["id"])
                if p is not None and not p.ended.is_set():
                    p.code = int(msg["code"])
                    p.ended.set()
                    p.on_exit(p.code)
            else:
                self.answers.put(msg)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Sampler:
    """Peak RSS (bytes) and thread count of this process, sampled every ``period_s``."""

    def __init__(self, period_s: float = 0.25):
        import psutil
        self.me = psutil.Process()
        self.period_s = period_s
        self.peak_threads = 0
        self.peak_rss = 0
        self.window_threads = 0
        threading.Thread(target=self._run, daemon=True, name="sampler").start()

    def _run(self) -> None:
        while True:
            n = threading.active_count()
            self.peak_threads = max(self.peak_threads, n)
            self.window_threads = max(self.window_threads, n)
            self.peak_rss = max(self.peak_rss, self.me.memory_info().rss)
            time.sleep(self.period_s)

    def window(self) -> int:
        """Peak threads since the last call."""
        n, self.window_threads = self.window_threads, 0
        return n


def _say(text: str) -> None:
    """A progress line on stderr (the orchestrator passes it through)."""
    print(f"control_plane: {time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


def _wait(pred, timeout_s: float, what: str, period_s: float = 0.05) -> float:
    """Poll ``pred`` until true; returns when (monotonic).  Raises TimeoutError after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(period_s)
    return time.monotonic()


def run_one(n: int, args, out) -> dict:
    """One size in this (launcher) process; returns the row."""
    import launcher.job.driver as driver_mod
    from launcher.discovery import FixedHosts

    tmp = Path(tempfile.mkdtemp(prefix=f"cp{n}-"))
    spawner = SimSpawner(args.build_s, args.step_s, open(tmp / "sim.stderr", "w"))
    driver_mod.spawn = spawner.spawn
    hosts = {f"127.0.{i // 250}.{i % 250 + 1}": SLOTS_PER_HOST
             for i in range(-(-n // SLOTS_PER_HOST))}
    spec = driver_mod.JobSpec(command=("simulated-worker",), np=n, min_np=max(1, n // 2),
                              max_np=n, elastic=True, discovery=FixedHosts(hosts),
                              event_log=str(tmp / "events.jsonl"), job_file=str(tmp / "job"),
                              start_timeout_s=600.0, cwd=str(tmp))
    sampler = Sampler()
    drv = driver_mod.Driver(spec)
    coord = drv.coord
    form_s: Dict[int, float] = {}   # seconds the launcher spent in Coordinator._form, by number
    original_form = coord._form

    def timed_form(participants, previous):
        t = time.perf_counter()
        original_form(participants, previous)
        if coord.current is not None:
            form_s[coord.current.number] = time.perf_counter() - t
    coord._form = timed_form
    import psutil
    sim_proc = psutil.Process(spawner.proc.pid)

    def sim_cpu_s() -> float:
        t = sim_proc.cpu_times()
        return t.user + t.system
    result: List[int] = []
    t_spawn = time.monotonic()
    cpu_spawn = _cpu_s()
    threading.Thread(target=lambda: result.append(drv.run()), daemon=True, name="driver").start()
    timeout = args.timeout_s

    def gen(number: int) -> dict:
        return spawner.ask({"op": "gen", "generation": number})

    def formed(number: int, size: int):
        def done():
            last[0] = gen(number)
            return coord.current is not None and coord.current.number >= number \
                and last[0]["started"] >= size
        return done
    last = [None]

    row: dict = {"workers": n, "hosts": len(hosts)}
    # 1. the start
    try:
        _wait(formed(1, n), timeout, f"generation 1 with {n} workers", 0.2)
    except TimeoutError as e:
        raise TimeoutError(f"{e}; coordinator at generation "
                           f"{coord.current.number if coord.current else 0}, "
                           f"simulator: {last[0]}") from None
    g1 = gen(1)
    row["start_s"] = round(g1["last_assigned"] - t_spawn, 3)
    row["start_formation_s"] = round(g1["last_assigned"] - g1["last_report"], 4)
    row["start_launcher_cpu_s"] = round(_cpu_s() - cpu_spawn, 3)
    _say(f"{n}: generation 1 formed, {row['start_s']} s after the first spawn")
    # 2. steady state
    time.sleep(1.0)
    sampler.window()
    c0, cpu0, t0 = spawner.ask({"op": "counters"}), _cpu_s(), time.monotonic()
    time.sleep(args.steady_s)
    c1, cpu1, t1 = spawner.ask({"op": "counters"}), _cpu_s(), time.monotonic()
    idle_rate = (cpu1 - cpu0) / (t1 - t0)
    row["steady_cpu_share"] = round(idle_rate, 3)
    row["steady_requests_per_s"] = round((c1["total"] - c0["total"]) / (c1["t"] - c0["t"]), 1)
    row["steady_threads"] = sampler.window()
    row["steady_rss_mb"] = round(sampler.me.memory_info().rss / 2**20, 1)

    _say(f"{n}: steady state {row['steady_cpu_share']} CPU, {row['steady_threads']} threads")
    # 3. switches: scale-in by one host's worth, scale-out back
    switches = []
    profile = None
    if args.profile:
        profile = subprocess.Popen(
            [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(os.getpid()),
             "--format", "raw", "--output", str(tmp / "profile.txt"), "--rate", "200",
             "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
    for kind, target in (("scale_in", n - SCALE_STEP), ("scale_out", n)):
        number = coord.current.number + 1
        sampler.window()
        cpu_a, t_a, sim_a = _cpu_s(), time.monotonic(), sim_cpu_s()
        c_a = spawner.ask({"op": "counters"})
        drv.set_target(target)
        _wait(formed(number, target), timeout, f"generation {number} ({kind}, {target})", 0.05)
        cpu_b, t_b, sim_b = _cpu_s(), time.monotonic(), sim_cpu_s()
        c_b = spawner.ask({"op": "counters"})
        g = gen(number)
        switches.append({
            "kind": kind, "generation": number, "size": g["size"], "members": g["members"],
            "formation_s": round(g["last_assigned"] - g["last_report"], 4),
            "boundary_to_assigned_s": round(g["last_assigned"] - g["first_report"], 4),
            "request_to_started_s": round(t_b - t_a, 3),
            "launcher_cpu_s": round(cpu_b - cpu_a, 3),
            "launcher_cpu_share": round((cpu_b - cpu_a) / (t_b - t_a), 3),
            "simulator_cpu_share": round((sim_b - sim_a) / (t_b - t_a), 3),
            "requests": c_b["total"] - c_a["total"],
            "launcher_form_s": round(form_s.get(number, float("nan")), 4),
            "launcher_cpu_s_above_steady": round(max(0.0, cpu_b - cpu_a - idle_rate * (t_b - t_a)), 3),
            "threads_peak": sampler.window()})
        _say(f"{n}: {kind} formed in {switches[-1]['formation_s']} s, launcher CPU "
             f"{switches[-1]['launcher_cpu_s']} s")
        time.sleep(max(args.build_s, 0.5) + 0.5)
    if profile is not None:
        profile.send_signal(signal.SIGINT)
        try:
            profile.wait(30)
        except subprocess.TimeoutExpired:
            profile.kill()
        row["profile_top"] = _profile_top(tmp / "profile.txt")
    row["switches"] = switches
    row["formation_s"] = max(s["formation_s"] for s in switches)
    row["launcher_cpu_s_per_switch"] = max(s["launcher_cpu_s_above_steady"] for s in switches)
    row["switch_threads_peak"] = max(s["threads_peak"] for s in switches)

    # 4. the flood: capacity in requests per second
    if args.flood_s > 0:
        cpu_a = _cpu_s()
        f = spawner.ask({"op": "flood", "seconds": args.flood_s})
        cpu = _cpu_s() - cpu_a
        row["requests_per_s"] = round(f["requests"] / f["seconds"], 1)
        row["flood_cpu_share"] = round(cpu / f["seconds"], 3)
        # what one launcher core could answer: the flood is often the simulator's limit here
        row["launcher_cpu_us_per_request"] = round(1e6 * cpu / max(f["requests"], 1), 1)
        row["requests_per_launcher_cpu_s"] = round(f["requests"] / max(cpu, 1e-9), 1)
        time.sleep(0.5)

        _say(f"{n}: flood {row['requests_per_s']} requests/s")
    # 5. the Gloo rendezvous key traffic of one hvd.init() (global, local, cross)
    if args.mesh:
        sample = None if n <= args.mesh_full_max else args.mesh_sample
        cpu_a = _cpu_s()
        m = spawner.ask({"op": "mesh", "sample": sample})
        cpu = _cpu_s() - cpu_a
        frac = (m["ranks_doing_gets"] / m["size"]) if m.get("size") else 1.0
        row["mesh"] = {**m, "launcher_cpu_s": round(cpu, 3),
                       "launcher_cpu_us_per_request": round(1e6 * cpu / max(m["requests"], 1), 1),
                       "requests_per_s": round(m["requests"] / max(m["wall_s"], 1e-9), 1),
                       "sampled_fraction": round(frac, 4)}
        if sample:  # every rank's GETs: scale the measured traffic up
            row["mesh"]["projected_requests"] = int(m["requests"] / frac)
            row["mesh"]["projected_launcher_cpu_s"] = round(cpu / frac, 1)
            row["mesh"]["projected_bytes"] = int(m["bytes"] / frac)
    row["launcher_rss_mb"] = round(max(sampler.peak_rss,
                                       resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
                                   / 2**20, 1)
    row["launcher_threads_peak"] = sampler.peak_threads
    kinds = [json.loads(line).get("kind") for line in open(tmp / "events.jsonl")
             if '"generation"' in line]
    row["event_kinds"] = kinds
    row["load_avg"] = os.getloadavg()[0]
    return row


def _profile_top(path: Path, top: int = 12) -> List[dict]:
    """Self time per function (share of samples) from py-spy's raw (collapsed) output."""
    counts: Dict[str, int] = {}
    total = 0
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        leaf = stack.split(";")[-1]
        counts[leaf] = counts.get(leaf, 0) + int(count)
        total += int(count)
    best = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return [{"function": k[:120], "share": round(v / max(total, 1), 3)} for k, v in best]


# ---- the orchestrator ---------------------------------------------------------------------------

def _write(rows: List[dict], args) -> None:
    from filelock import FileLock
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        data = json.loads(path.read_text()) if path.exists() and path.stat().st_size else {}
        data["control_plane"] = {
            "rows": rows,
            "command": " ".join(sys.argv),
            "what": "simulated workers (benchmarks/job/sim_worker.py) against the real launcher "
                    "(driver, coordinator, HTTP server, rendezvous, event log); formation_s: "
                    "last report at the boundary to every worker holding its assignment; "
                    "launcher_cpu_s_per_switch: launcher CPU from the change request to every "
                    "/started, less the steady state's rate",
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpus": os.cpu_count(),
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)


def _table(rows: List[dict]) -> str:
    cols = [("workers", "workers"), ("formation_s", "formation s"),
            ("launcher_cpu_s_per_switch", "cpu s/switch"), ("launcher_rss_mb", "RSS MB"),
            ("requests_per_s", "req/s max"), ("requests_per_launcher_cpu_s", "req/cpu-s"),
            ("steady_cpu_share", "steady cpu"),
            ("steady_requests_per_s", "steady req/s"), ("launcher_threads_peak", "threads"),
            ("start_s", "start s")]
    lines = ["  ".join(f"{title:>12}" for _, title in cols)]
    for r in rows:
        lines.append("  ".join(f"{str(r.get(k, '-')):>12}" for k, _ in cols))
    for r in rows:
        m = r.get("mesh")
        if m:
            proj = f", projected {m['projected_requests']} requests / " \
                   f"{m['projected_launcher_cpu_s']} launcher CPU-s" if "projected_requests" in m else ""
            lines.append(f"rendezvous at {r['workers']}: {m['requests']} requests in "
                         f"{m['wall_s']:.1f} s ({m['requests_per_s']:.0f}/s, "
                         f"{m['launcher_cpu_us_per_request']} us launcher CPU each, "
                         f"{m['bytes'] / 2**20:.0f} MiB, {m['errors']} errors; "
                         f"{m['ranks_doing_gets']}/{m['size']} ranks did their GETs{proj})")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Simulated control plane at 64-1,024 workers "
                                            "against the real launcher (issue 17 item 2).")
    p.add_argument("--workers", default="64,256,1024",
                   help="comma-separated sizes (multiples of 8, at least 16)")
    p.add_argument("--build-s", type=float, default=0.5, help="a joiner's build time (s)")
    p.add_argument("--step-s", type=float, default=0.01,
                   help="a member's time from the change to its step boundary (s)")
    p.add_argument("--steady-s", type=float, default=4.0, help="steady state measured (s)")
    p.add_argument("--flood-s", type=float, default=2.0, help="flood length (s); 0: none")
    p.add_argument("--no-mesh", dest="mesh", action="store_false",
                   help="skip the Gloo rendezvous key traffic")
    p.add_argument("--mesh-full-max", type=int, default=64,
                   help="largest size whose every rank does all its GETs")
    p.add_argument("--mesh-sample", type=int, default=4,
                   help="ranks doing their GETs above --mesh-full-max")
    p.add_argument("--profile", action="store_true", help="py-spy the launcher's switches")
    p.add_argument("--timeout-s", type=float, default=240.0, help="bound on every wait (s)")
    p.add_argument("--output", default=str(RESULTS), help="JSON file (key control_plane)")
    p.add_argument("--no-write", dest="write", action="store_false",
                   help="print only, do not update the JSON file")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: the launcher process
    args = p.parse_args(argv)
    try:
        sizes = [int(s) for s in args.workers.split(",") if s.strip()]
    except ValueError:
        p.error(f"--workers: expected comma-separated integers, got {args.workers!r}")
    if not sizes or any(s < 2 * SCALE_STEP or s % SLOTS_PER_HOST for s in sizes):
        p.error(f"--workers: sizes must be multiples of {SLOTS_PER_HOST}, at least "
                f"{2 * SCALE_STEP}")
    if args.one is not None:
        # the load generator shares this machine's CPUs with the launcher: a simulated worker
        # whose beat is late because its own process is busy (the mesh replay) is not the
        # launcher's failure detector at work; silence is declared after 30 s here
        os.environ.setdefault("HVD_EDL_SILENT_AFTER_S", "30")
        out = os.fdopen(os.dup(1), "w")
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # the driver's own lines (one per worker started) go nowhere
        try:
            row = run_one(args.one, args, out)
        except Exception as e:  # noqa: BLE001 - reported to the orchestrator as a row
            row = {"workers": args.one, "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(row) + "\n")
        out.flush()
        os._exit(0)  # the driver's threads and the load generator (its stdin closes) end here
    rows = []
    child_args = [a for a in (argv if argv is not None else sys.argv[1:])]
    for n in sizes:
        cmd = [sys.executable, str(Path(__file__).resolve()), *child_args, "--one", str(n)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True,
                              timeout=args.timeout_s * 4 + 120)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        row = json.loads(lines[-1]) if lines else {"workers": n, "error": f"exit {proc.returncode}"}
        rows.append(row)
        print(f"control_plane: {n} workers: " + (row.get("error") or "done"), flush=True)
    print(_table(rows))
    if args.write:
        _write(rows, args)
        print(f"control_plane: written to {args.output} (key control_plane)")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
