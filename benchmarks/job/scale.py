"""Switch cost against world size: hvd_edl and Horovod Elastic at 2, 4, 8 and 16 real ranks on
this machine, in the same run (``make scale``; issue 17, item 1).

Each system runs one job of ``benchmarks/common/workload.py`` (the digits CNN, 38k parameters,
batch 16, ``torch.set_num_threads(1)``, commit every 10 steps) under its own launcher, with the
harness of ``benchmarks/common/jobs.py`` (its ``Job``, ``change_stall`` and ``kill_outcome``: the
same hosts file rewritten for discovery, the same per-step timelines, the same stall
definition).  Each step computes for about 1.5 ms and then sleeps ``--step-delay`` seconds (0.1 by default), so that
16 workers keep the 2 cores mostly idle: what is measured is the switch, not a queue for the
CPUs.  The harness checks it: at every size it samples the job's CPU time (launcher and every
process under it, psutil) over a steady window and the workers' median step time, and records
both next to the stalls (``steady``: ``cores_used`` against the machine's cores, ``step_s``
against the sleep floor).

The job walks, for N = 2, 4, 8, 16 (the sizes in between reached in one unmeasured change):
N-1 -> N (scale-out, the joiner starts at once), N -> N-1 (graceful scale-in: the discovery
output shrinks), N-1 -> N again (a second scale-out), then ``kill -9`` of the highest rank (failure; hvd_edl respawns a
replacement into the free slot 1 s later, ``--blacklist-cooldown-range 1 1``, and goes on).  Horovod Elastic blacklists the only host after a
kill (the job ends), so its kill comes once, at the largest size.  For hvd_edl every change also
carries the event log's ``phases`` of the slowest continuing worker: boundary, shutdown, wait,
init (Horovod's Gloo set-up in ``hvd.init()``), sync, rest.

Writes the key "switch" of ``benchmarks/results/scale.json`` (read-modify-write under a file
lock: benchmarks/job/control_plane.py writes "control_plane" of the same file) and redraws
``benchmarks/results/scale.png`` (switch cost per kind against world size for both systems; a
second panel with the control plane's rows when that key is there).

    .venv/bin/python benchmarks/job/scale.py                      # both systems, 2 4 8 16
    .venv/bin/python benchmarks/job/scale.py --systems hvd_edl --sizes 2,8,16
    .venv/bin/python benchmarks/job/scale.py --plot-only          # redraw scale.png from scale.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import filelock
import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common.jobs import (RESULTS, Job, change_stall, kill_outcome,  # noqa: E402
                                    machine_info)
from benchmarks.common.ring_env import CountingRendezvous, rank_env  # noqa: E402

OUT = RESULTS / "scale.json"
KINDS = ("scale_out", "scale_in", "failure")
VARIANTS = {  # name in the results: (jobs.Job's system, environment for the launcher)
    "hvd_edl": ("hvd_edl", {}),
    # hvd_edl on Horovod's own Gloo set-up: our patches 0004, 0006 and 0007 off (six rendezvous per
    # init, a 10 ms loop tick per connect)
    "hvd_edl_upstream_init": ("hvd_edl", {"HVD_EDL_GLOO_FAST_INIT": "0"}),
    # hvd_edl with patch 0009's idle loop at every size (hvd_edl's workers use it only with a
    # core per rank: here at 2 workers, not at 4-16)
    "hvd_edl_idle_wait": ("hvd_edl", {"HVD_EDL_IDLE_WAIT_MS": "200"}),
    "horovod_elastic": ("horovod_elastic", {}),
}


# ---- measuring ----------------------------------------------------------------------------------

def steady(job: Job, size: int, window_s: float) -> dict:
    """How busy the machine is while ``job`` trains at ``size`` workers: the job's CPU cores in
    use over ``window_s`` seconds (a sum over processes alive at both ends, so processes that
    come or go in between are left out), the machine's CPU use (percent of all cores) and the
    median step time of the steps in the window (seconds)."""
    procs = job.processes()

    def cpu_of() -> Dict[int, float]:
        out = {}
        for p in procs:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return out
    psutil.cpu_percent(None)
    c0, t0, w0 = cpu_of(), time.monotonic(), time.time()
    time.sleep(window_s)
    c1, t1 = cpu_of(), time.monotonic()
    machine = psutil.cpu_percent(None)
    used = sum(c1[p] - c0[p] for p in c1 if p in c0)
    dts = [r["dt"] for recs in job.timelines().values() for r in recs
           if r["t"] >= w0 and r["size"] == size]
    return {"workers": size, "cores_used": round(used / (t1 - t0), 3),
            "machine_cpu_percent": machine,
            "step_s_median": round(statistics.median(dts), 4) if dts else None,
            "steps": len(dts)}


def event_for(job: Job, kind: str, old: int, new: int, after: float) -> Optional[dict]:
    """hvd_edl's event-log line of the generation ``old -> new`` of ``kind`` formed after ``after``
    (unix time), or None."""
    for e in job.events():
        if e["kind"] == kind and e.get("previous_world_size") == old and \
                e["world_size"] == new and e["time"] >= after:
            return e
    return None


class Walk:
    """One system's job walking through the sizes (see the module docstring)."""

    def __init__(self, system: str, a, tmp: Path):
        self.system, self.a = system, a
        self.kind, env = VARIANTS[system]
        # hvd_edl: a killed worker's slot rests 1 s (not the whole job), so the walk goes on
        extra = ("--blacklist-cooldown-range", "1", "1") if self.kind == "hvd_edl" else ()
        saved = dict(os.environ)
        # inherited by the launcher and its workers; PYTHONSAFEPATH: a script's folder is not
        # put first on sys.path, so a benchmarks/ module named like the standard library's
        # cannot shadow it in the workers
        os.environ.update({"PYTHONSAFEPATH": "1", **env})
        try:
            self.job = Job(self.kind, tmp, 1, step_delay=a.step_delay, max_np=max(a.sizes),
                           launcher_args=extra)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        self.rows: List[dict] = []
        self.steady: List[dict] = []
        self.size = 1
        self.t0 = time.time()

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:6.0f} s] {self.system}: {msg}", flush=True)

    def settle(self, size: int, after: float, timeout_s: float) -> bool:
        return self.job.wait_settled(size, self.a.settle_steps, after, timeout_s)

    def move(self, new: int, kind: Optional[str]) -> bool:
        """Rewrite discovery to ``new`` workers; wait until the ring trained at that size.  A
        ``kind`` records the change's stall as a row."""
        old, t = self.size, self.job.change(new)
        ok = self.settle(new, t, self.a.change_timeout)
        self.size = new
        if kind is not None:
            self.record(kind, old, new, t,
                        change_stall(self.job.timelines(), old, new, t) or {"stall_s": None},
                        ok)
        return ok

    def record(self, kind: str, old: int, new: int, t: float, measured: dict, ok: bool) -> None:
        measured = dict(measured)
        continuing = measured.pop("workers", None)   # change_stall: workers it measured
        row = {"system": self.system, "kind": kind, "workers": max(old, new), "from": old,
               "to": new, "time": round(t, 3), "settled": ok, "continuing": continuing,
               **measured}
        if self.kind == "hvd_edl":
            e = event_for(self.job, kind, old, new, t)
            if e is not None:
                row["event_stall_s"] = e["stall_s"]
                row["phases"] = e.get("phases", {})
            else:  # say which generations formed instead
                row["generations_after"] = [
                    f'{x["kind"]} {x.get("previous_world_size")}->{x["world_size"]}'
                    for x in self.job.events() if x["time"] >= t]
        self.rows.append(row)
        stall = row.get("stall_s", row.get("recovery_s"))
        self.log(f"{kind} {old}->{new}: {stall} s {row.get('phases', '')}")

    def kill(self) -> bool:
        """kill -9 of the highest rank at the current size; True if the job went on."""
        n = self.size
        t = self.job.kill_highest_rank()
        if t is None:
            return False
        # survivors at n-1, then (hvd_edl) the replacement brings the ring back to n
        if not self.settle(n - 1, t, self.a.change_timeout):
            self.log(f"kill at {n}: no ring of {n - 1} trained {self.a.settle_steps} steps")
        back = self.settle(n, t, self.a.change_timeout)
        out = kill_outcome(self.job.timelines(), self.job.killed_pid, t, n)
        if not out["survives"]:
            out["reason"] = self.job.output_tail(4)
        self.record("failure", n, n - 1, t, out, out["survives"])
        return out["survives"] and back

    def run(self) -> None:
        if not self.settle(1, 0, self.a.start_timeout):
            raise RuntimeError(f"{self.system}: the job never trained: {self.job.output_tail()}")
        sizes = self.a.sizes
        for n in sizes:
            if self.size != n - 1 and not self.move(n - 1, None):
                self.log(f"never reached {n - 1} workers: {self.job.output_tail(4)}")
                return
            self.move(n, "scale_out")
            self.move(n - 1, "scale_in")
            if not self.move(n, "scale_out"):   # a second scale-out sample
                self.log(f"never came back to {n} workers: {self.job.output_tail(4)}")
                return
            self.steady.append(steady(self.job, n, self.a.steady_window_s))
            self.log(f"steady at {n}: {self.steady[-1]}")
            if self.kind == "hvd_edl" or n == sizes[-1]:
                if not self.kill():
                    self.log(f"ended after the kill at {n}: {self.job.output_tail(4)}")
                    return


# ---- Gloo set-up alone, patches 0004 + 0006 + 0007 on and off ---------------------------------

def init_ab(n: int, rounds: int) -> List[dict]:
    """``n`` ranks of ``benchmarks/job/scale_worker.py`` on this host initialise Horovod ``2 *
    rounds`` times (after one unrecorded warm-up), each against a fresh generation of our rendezvous server, patches 0004 + 0006 + 0007 on and
    off in turn (ABAB...: both see the same load).  Per init: the slowest rank's ``hvd.init()``
    (seconds), the requests the rendezvous answered, this process's CPU seconds (the
    rendezvous server's event loop runs here, as in the launcher) and the ranks' CPU seconds in
    ``hvd.init()`` together (against 2 cores: whether the set-up is CPU-bound).

    Raises:
        RuntimeError: a rank ended or answered a wrong allreduce.
    """
    rdv = CountingRendezvous("127.0.0.1")
    procs = []
    rows = []
    try:
        for rank in range(n):
            procs.append(subprocess.Popen([sys.executable, str(Path(__file__).with_name(
                "scale_worker.py"))], env=rank_env(rank, n), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True))
        for i in range(-1, 2 * rounds):   # -1: a first init, not recorded (warm-up)
            fast = i % 2 == 0
            port = rdv.open(i + 2, ["localhost"])
            cmd = json.dumps({"port": port, "token": rdv.token(i + 2), "fast": fast}) + "\n"
            cpu0 = time.process_time()
            for p in procs:
                p.stdin.write(cmd)
                p.stdin.flush()
            answers = []
            for p in procs:
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError(f"init_ab: a rank of {n} ended (code {p.wait()})")
                answers.append(json.loads(line))
            if not all(x["ok"] for x in answers):
                raise RuntimeError(f"init_ab: a wrong allreduce at {n} ranks: {answers}")
            if i < 0:
                continue
            rows.append({"workers": n, "fast_init": fast, "round": i // 2,
                         "init_s": round(max(x["init_s"] for x in answers), 4),
                         "shutdown_s": round(max(x["shutdown_s"] for x in answers), 4),
                         "ranks_init_cpu_s": round(sum(x["init_cpu_s"] for x in answers), 4),
                         "rendezvous_requests": rdv.requests.get(port, 0),
                         "rendezvous_cpu_s": round(time.process_time() - cpu0, 4)})
    finally:
        for p in procs:
            try:
                p.stdin.write("\n")
                p.stdin.close()
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        rdv.close()
    return rows


def init_table(rows: List[dict]) -> List[dict]:
    """Medians per (workers, patch on/off) of :func:`init_ab`'s rows."""
    out = []
    for n in sorted({r["workers"] for r in rows}):
        for fast in (False, True):
            rs = [r for r in rows if r["workers"] == n and r["fast_init"] == fast]
            if rs:
                out.append({"workers": n, "fast_init": fast, **{
                    k: round(statistics.median(r[k] for r in rs), 4)
                    for k in ("init_s", "shutdown_s", "rendezvous_requests",
                              "rendezvous_cpu_s", "ranks_init_cpu_s")}, "n": len(rs)})
    return out


# ---- summary, results file, picture -----------------------------------------------------------

def table(rows: List[dict]) -> List[dict]:
    """Median stall per (system, kind, workers) over the repetitions: the rows of the figure."""
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        groups.setdefault((r["system"], r["kind"], r["workers"]), []).append(r)
    out = []
    for (system, kind, n), rs in sorted(groups.items()):
        vals = [r.get("stall_s", r.get("recovery_s")) for r in rs]
        vals = [v for v in vals if v is not None]
        row = {"system": system, "kind": kind, "workers": n,
               "stall_s": round(statistics.median(vals), 4) if vals else None,
               "values": vals, "survived": [r.get("survives", True) for r in rs]}
        phases = [r["phases"] for r in rs if r.get("phases")]
        if phases:
            row["phases_median_s"] = {k: round(statistics.median(p.get(k, 0.0) for p in phases),
                                               4) for k in sorted({k for p in phases for k in p})}
        out.append(row)
    return out


def update_results(key: str, value: dict, path: Path = OUT) -> dict:
    """Update ``key`` of the JSON file ``path`` with the entries of ``value`` (the others stay),
    under ``path``.lock (other benchmarks write other keys of the same file); returns the whole
    file's content."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(path) + ".lock", timeout=60):
        data = json.loads(path.read_text()) if path.exists() else {}
        old = data.get(key)
        data[key] = {**(old if isinstance(old, dict) else {}), **value}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    return data


def plot(data: dict, path: Path) -> None:
    """scale.png: stall against world size per system and kind; the control plane's rows (key
    "control_plane") in a second panel when present."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cp = data.get("control_plane", {})
    cp_rows = cp.get("rows", cp) if isinstance(cp, dict) else cp
    cp_rows = cp_rows if isinstance(cp_rows, list) else []
    fig, axes = plt.subplots(1, 2 if cp_rows else 1, figsize=(13 if cp_rows else 7.5, 4.8),
                             squeeze=False)
    ax = axes[0, 0]
    styles = {"hvd_edl": "-", "hvd_edl_upstream_init": "-.", "hvd_edl_idle_wait": ":",
              "horovod_elastic": "--"}
    markers = {"scale_out": "o", "scale_in": "s", "failure": "x"}
    for system in VARIANTS:
        for kind in KINDS:
            pts = [(r["workers"], r["stall_s"]) for r in data.get("switch", {}).get("table", [])
                   if r["system"] == system and r["kind"] == kind and r["stall_s"] is not None]
            if pts:
                ax.plot(*zip(*sorted(pts)), styles.get(system, "-"), marker=markers[kind],
                        label=f"{system} {kind.replace('_', '-')}")
    ab = data.get("switch", {}).get("gloo_init_ab", {}).get("table", [])
    for fast, label in ((False, "hvd.init() alone, upstream"), (True, "hvd.init() alone, patches 0004+0006+0007")):
        pts = [(r["workers"], r["init_s"]) for r in ab if r["fast_init"] == fast]
        if pts:
            ax.plot(*zip(*sorted(pts)), ":", color="grey" if not fast else "black",
                    marker="." , label=label)
    ax.axhline(0.3, color="grey", lw=0.8, ls=":", label="goal 0.3 s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers (world size, the larger side of the change)")
    ax.set_ylabel("stall of the continuing workers (s)")
    ax.set_title("switch cost against world size (one host, 2 cores)")
    ax.legend(fontsize=7)
    if cp_rows:
        ax2 = axes[0, 1]
        ws = [r["workers"] for r in cp_rows]
        for k, label in (("formation_s", "generation formed (s)"),
                         ("launcher_cpu_s_per_switch", "launcher CPU per switch (s)")):
            ys = [r.get(k) for r in cp_rows]
            if any(y is not None for y in ys):
                ax2.plot(ws, ys, marker="o", label=label)
        ax2.set_xscale("log", base=2)
        ax2.set_yscale("log")
        ax2.set_xlabel("simulated workers")
        ax2.set_ylabel("seconds")
        ax2.set_title("control plane (simulated workers)")
        ax3 = ax2.twinx()
        ax3.plot(ws, [r.get("launcher_rss_mb") for r in cp_rows], "k:", marker="^",
                 label="launcher RSS (MB)")
        ax3.set_ylabel("MB")
        h1, l1 = ax2.get_legend_handles_labels()
        h2, l2 = ax3.get_legend_handles_labels()
        ax2.legend(h1 + h2, l1 + l2, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(rows: List[dict]) -> None:
    print(f"{'system':16} {'kind':9} {'N':>3} {'stall s':>8}  phases (hvd_edl, median s)")
    for r in rows:
        ph = " ".join(f"{k[:-2]} {v:.3f}" for k, v in r.get("phases_median_s", {}).items())
        s = "-" if r["stall_s"] is None else f"{r['stall_s']:.3f}"
        if not all(r["survived"]):
            s = "job ends"
        print(f"{r['system']:16} {r['kind']:9} {r['workers']:>3} {s:>8}  {ph}")


def print_init_table(rows: List[dict]) -> None:
    print(f"{'N':>3} {'Gloo set-up':12} {'init s':>7} {'requests':>9} {'server CPU s':>12} "
          f"{'ranks CPU s':>11}")
    for r in rows:
        print(f"{r['workers']:>3} {'patched' if r['fast_init'] else 'upstream':12} "
              f"{r['init_s']:>7.3f} {r['rendezvous_requests']:>9} {r['rendezvous_cpu_s']:>12.3f} "
              f"{r['ranks_init_cpu_s']:>11.3f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2,4,8,16", help="world sizes N (comma-separated, >= 2)")
    p.add_argument("--systems", default="hvd_edl,horovod_elastic",
                   help=f"walk: comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--reps", type=int, default=1, help="walks per system (alternated)")
    p.add_argument("--step-delay", type=float, default=0.1,
                   help="seconds each step sleeps (the workers' idle floor)")
    p.add_argument("--settle-steps", type=int, default=12)
    p.add_argument("--steady-window-s", type=float, default=2.0)
    p.add_argument("--change-timeout", type=float, default=120.0)
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--parts", default="init,walk",
                   help="init: Gloo set-up alone, patch 0004 on/off in turn (init_ab); walk: "
                   "the jobs' switches (comma-separated)")
    p.add_argument("--init-rounds", type=int, default=5,
                   help="init: inits per size with the patch on, and as many off")
    p.add_argument("--plot-only", action="store_true")
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args()
    out = Path(a.out)
    try:
        a.sizes = sorted({int(x) for x in a.sizes.split(",") if x.strip()})
        systems = [s for s in a.systems.split(",") if s.strip()]
    except ValueError:
        p.error("--sizes: integers, comma-separated")
    if not a.sizes or a.sizes[0] < 2:
        p.error("--sizes: every size must be at least 2")
    if any(s not in VARIANTS for s in systems):
        p.error(f"--systems: of {', '.join(VARIANTS)}")
    if a.reps < 1 or a.step_delay < 0 or a.init_rounds < 1:
        p.error("--reps >= 1, --init-rounds >= 1 and --step-delay >= 0")
    parts = {x.strip() for x in a.parts.split(",") if x.strip()}
    if not parts or not parts <= {"init", "walk"}:
        p.error("--parts: init, walk or both")
    if a.plot_only:
        if not out.exists():
            p.error(f"--plot-only: no {out}")
        plot(json.loads(out.read_text()), out.with_suffix(".png"))
        return 0
    t_start = time.time()
    machine = machine_info()
    if "init" in parts:
        ab: List[dict] = []
        for n in a.sizes:
            ab += init_ab(n, a.init_rounds)
            print(f"Gloo set-up at {n} ranks: " + "; ".join(
                f"{'patched' if r['fast_init'] else 'upstream'} {r['init_s']} s "
                f"{r['rendezvous_requests']} requests" for r in ab if r["workers"] == n),
                flush=True)
        data = update_results("switch", {"gloo_init_ab": {
            "table": init_table(ab), "rows": ab,
            "machine": {**machine, "load_average_at_end": [round(x, 2) for x in
                                                           os.getloadavg()]},
            "method": "benchmarks/job/scale_worker.py: N ranks on this host, hvd.init() against "
                      "a fresh generation of launcher.job.rendezvous, one allreduce, "
                      "hvd.shutdown(); HVD_EDL_GLOO_FAST_INIT=1/0 alternated per init; "
                      "init_s is the slowest rank's"}}, out)
        print_init_table(init_table(ab))
        if "walk" not in parts:
            plot(data, out.with_suffix(".png"))
            return 0
    rows: List[dict] = []
    steadies: Dict[str, List[dict]] = {s: [] for s in systems}

    def write() -> dict:
        """The walks so far into the results file (after each walk, and when interrupted: a
        run cut short keeps what it measured); rows and steady figures of systems or sizes this
        run did not walk stay (``--systems``, ``--sizes`` run by run)."""
        machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        machine["wall_s"] = round(time.time() - t_start, 1)
        old = {}
        if out.exists():
            with filelock.FileLock(str(out) + ".lock", timeout=60):
                old = json.loads(out.read_text()).get("switch", {})
        kept = [r for r in old.get("rows", [])
                if r["system"] not in systems or r["workers"] not in a.sizes]
        kept_steady = {k: [x for x in v if k not in systems or x["workers"] not in a.sizes]
                       for k, v in old.get("steady", {}).items()}
        return update_results("switch", {
            "table": table(kept + rows), "rows": kept + rows,
            "steady": {**kept_steady, **{k: kept_steady.get(k, []) + v
                                         for k, v in steadies.items()}}, "machine": machine,
            "method": {"sizes": a.sizes, "step_delay_s": a.step_delay,
                       "settle_steps": a.settle_steps, "reps": a.reps,
                       "workload": "benchmarks/common/workload.py (digits CNN, batch 16, 1 thread, "
                                   "commit every 10 steps)",
                       "stall": "jobs.change_stall / jobs.kill_outcome (recovery_s) from "
                                "the workers' step timelines"}}, out)
    for rep in range(a.reps):
        for system in systems:
            with tempfile.TemporaryDirectory() as tmp:
                walk = Walk(system, a, Path(tmp))
                interrupted = False
                try:
                    walk.run()
                except KeyboardInterrupt:
                    interrupted = True
                    walk.log("interrupted: keeping what was measured")
                finally:
                    walk.job.finish()
                for r in walk.rows:
                    r["rep"] = rep
                rows += walk.rows
                steadies[system] += walk.steady
            data = write()
            if interrupted:
                break
        else:
            continue
        break
    plot(data, out.with_suffix(".png"))
    print_table(table(rows))
    for system, st in steadies.items():
        print(f"{system} steady: " + ", ".join(
            f"N={s['workers']}: {s['cores_used']} cores, step {s['step_s_median']} s"
            for s in st))
    print(f"wrote {out} and {out.with_suffix('.png')} ({machine['wall_s']} s, load "
          f"{machine['load_average_at_start']} -> {machine['load_average_at_end']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
