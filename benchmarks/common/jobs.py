"""The job harness the benchmarks share (library, not a benchmark): a launcher running the
benchmark workload (``benchmarks/common/workload.py``: the digits CNN, per-step timelines) from a
discovery script that ``cat``s a hosts file the harness rewrites, and what is measured from the
workers' timelines the same way for every system.

* :class:`WorkloadJob`: the launcher, its hosts file, timelines, event log and output, waits on
  them; :class:`Job`: one on this host (``hvd_edl``, ``horovod_elastic`` or static Horovod);
* :func:`stop_launcher`: end a job the polite way (its stop file, then SIGTERM);
* :func:`change_stall`, :func:`kill_outcome`: a change's stall and rolled-back steps, a kill's
  recovery and steps lost, from the timelines;
* :func:`machine_info`: the machine and load a result was measured on.

Used by the benchmarks that start jobs (``make bench``, ``make scale`` and others) and by
tests/test_kill_large_ring.py.
"""
from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from launcher.observe.events import read as read_events  # noqa: E402

BIN = Path(sys.executable).parent
WORKLOAD = str(ROOT / "benchmarks" / "common" / "workload.py")
RESULTS = ROOT / "benchmarks" / "results"
BATCH = 16


class WorkloadJob:
    """A launcher running the workload from a discovery script (``cat`` of a hosts file): the
    hosts file, the per-step timelines, the event log and the launcher's output, and waits on
    them.  A subclass says which launcher (:meth:`_launcher`, given the discovery script) and
    how it is started (``popen``); ``workload_args``: more flags for the workload."""

    def __init__(self, system: str, tmp: Path, hosts: str, workload_args: Sequence[str] = (),
                 popen: Callable[..., subprocess.Popen] = subprocess.Popen):
        self.system = system
        self.tmp = tmp
        self.timeline_dir = tmp / "timelines"
        self.timeline_dir.mkdir()
        self.hosts_path = tmp / "hosts"
        self.events_path = tmp / "events.jsonl"
        self.stop_path = tmp / "stop"
        self.out_path = tmp / "launcher.out"
        self.write_hosts(hosts)
        discover = tmp / "discover.sh"
        discover.write_text(f"#!/bin/sh\ncat {self.hosts_path}\n")
        discover.chmod(0o755)
        workload = [sys.executable, WORKLOAD, "--system", system,
                    "--timeline-dir", str(self.timeline_dir), "--stop-file", str(self.stop_path),
                    "--batch-size", str(BATCH), "--commit-every", "10", *workload_args]
        self.out = open(self.out_path, "w")
        self.proc = popen(self._launcher(discover) + workload, stdout=self.out,
                          stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True)
        self.started = time.time()

    def _launcher(self, discover: Path) -> List[str]:
        """The launcher's command line, before the workload's."""
        raise NotImplementedError

    def write_hosts(self, text: str) -> None:
        new = self.hosts_path.with_suffix(".new")
        new.write_text(text)
        os.replace(new, self.hosts_path)  # atomic: discovery never reads half a file

    def timelines(self) -> Dict[int, List[dict]]:
        out = {}
        for f in self.timeline_dir.glob("timeline-*.jsonl"):
            recs = []
            for line in f.read_text().splitlines():
                try:
                    recs.append(json.loads(line))
                except ValueError:
                    pass  # a line being written
            out[int(f.stem.split("-")[1])] = recs
        return out

    def events(self) -> List[dict]:
        return read_events(self.events_path)[0]  # not EventLog.note lines

    def wait(self, pred: Callable[[Dict[int, List[dict]]], object], timeout_s: float) -> bool:
        """True once ``pred(self.timelines())`` is; False on timeout, or when the job ended
        and it still is not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pred(self.timelines()):
                return True
            if self.proc.poll() is not None:
                return bool(pred(self.timelines()))
            time.sleep(0.1)
        return False

    def wait_settled(self, size: int, steps: int, after: float, timeout_s: float) -> bool:
        """True once ``size`` workers each recorded ``steps`` steps at world size ``size`` after
        ``after`` (unix time); False on timeout or when the job ended short of it."""
        return self.wait(lambda tl: sum(
            1 for recs in tl.values()
            if sum(1 for r in recs if r["size"] == size and r["t"] > after) >= steps)
            >= size, timeout_s)

    def finish(self, timeout_s: float = 30.0) -> None:
        """Ask the workers to stop (stop file), wait, then end whatever is left of the job."""
        self.stop_path.touch()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self._kill_tree()
        self.out.close()

    def processes(self) -> List[psutil.Process]:
        """The launcher and every process under it (empty once the launcher is gone)."""
        try:
            root = psutil.Process(self.proc.pid)
            return [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def _kill_tree(self) -> None:
        procs = self.processes() if self.proc.poll() is None else []
        procs += [psutil.Process(p) for p in self.timelines() if psutil.pid_exists(p)]
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=5)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass

    def output_tail(self, n: int = 8) -> List[str]:
        self.out.flush()
        lines = self.out_path.read_text(errors="replace").splitlines()
        return [x for x in lines if not x.startswith("[")][-n:]


class Job(WorkloadJob):
    """One launcher process on this host running the workload (``max_np``: the elastic
    launchers' ``--max-np``, workers; ``launcher_args``: more flags for the launcher)."""

    def __init__(self, system: str, tmp: Path, np: int, *, step_delay: float = 0.0,
                 model_mb: float = 0.0, max_np: int = 4, launcher_args: tuple = ()):
        self.np, self.max_np, self.launcher_args = np, max_np, tuple(launcher_args)
        self.delay_path = tmp / "joiner-build-delay"
        self.set_joiner_build_delay(0.0)
        super().__init__(system, tmp, f"localhost:{np}\n", [
            "--step-delay", str(step_delay), "--joiner-build-delay-file", str(self.delay_path),
            "--model-mb", str(model_mb)])

    def _launcher(self, discover: Path) -> List[str]:
        np, max_np = str(self.np), str(self.max_np)
        if self.system == "hvd_edl":
            cmd = [str(BIN / "hvd-edl-run"), "-np", np, "--min-np", "1", "--max-np", max_np,
                   "--event-log", str(self.events_path), "--host-discovery-script", str(discover)]
        elif self.system == "horovod_elastic":
            cmd = [str(BIN / "horovodrun"), "--gloo", "--network-interface", "lo", "-np", np,
                   "--min-np", "1", "--max-np", max_np, "--host-discovery-script", str(discover)]
        else:  # static Horovod
            cmd = [str(BIN / "horovodrun"), "--gloo", "--network-interface", "lo", "-np", np,
                   "-H", f"localhost:{np}"]
        return cmd + list(self.launcher_args)

    def set_hosts(self, slots: int) -> None:
        self.write_hosts(f"localhost:{slots}\n")

    def set_joiner_build_delay(self, seconds: float) -> None:
        self.delay_path.write_text(f"{seconds}\n")

    def change(self, slots: int) -> float:
        t = time.time()
        self.set_hosts(slots)
        return t

    def kill_highest_rank(self) -> Optional[float]:
        latest = {pid: recs[-1] for pid, recs in self.timelines().items() if recs}
        if not latest:
            return None
        newest = max(r["t"] for r in latest.values())
        live = {p: r for p, r in latest.items() if newest - r["t"] < 2.0}
        # highest rank first; a worker that wrote a step within the window may have exited
        # since (Horovod Elastic's reset ends workers): the next one is killed instead
        for pid in sorted(live, key=lambda p: live[p]["rank"], reverse=True):
            t = time.time()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.killed_pid = pid
            return t
        return None


def stop_launcher(proc: subprocess.Popen, stop: Path, out, timeout_s: float = 60.0) -> None:
    """End a job the polite way: its stop file, ``timeout_s`` to exit, else SIGTERM and 30 s
    more; then close ``out``, the file its output went to."""
    stop.touch()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    out.close()


# ---- measuring from timelines -------------------------------------------------------------------

def change_stall(tl: Dict[int, List[dict]], old: int, new: int, after: float) -> Optional[dict]:
    """Stall and rolled-back steps of the change old -> new made at ``after`` (unix time)."""
    gaps, rolled = [], []
    for recs in tl.values():
        for i, r in enumerate(recs):
            if i > 0 and r["t"] > after and r["size"] == new and recs[i - 1]["size"] == old:
                prev = recs[i - 1]
                gaps.append(r["t"] - r["dt"] - prev["t"])
                rolled.append(prev["step"] - (r["step"] - 1))
                break
    if not gaps:
        return None
    return {"stall_s": round(max(gaps), 4), "rolled_back_steps": max(rolled),
            "workers": len(gaps)}


def kill_outcome(tl: Dict[int, List[dict]], killed: int, t_kill: float, size: int) -> dict:
    before = [r["step"] for recs in tl.values() for r in recs if r["t"] <= t_kill]
    firsts = []
    for pid, recs in tl.items():
        if pid == killed:
            continue
        # first step of the new ring: after the kill, at another size or a rolled-back counter
        last = None
        for r in recs:
            if r["t"] <= t_kill:
                last = r
                continue
            if last is None or r["size"] != size or r["step"] <= last["step"]:
                firsts.append(r)
                break
            last = r
    if not firsts:
        return {"survives": False}
    first = min(firsts, key=lambda r: r["t"])
    return {"survives": True,
            "recovery_s": round(first["t"] - first["dt"] - t_kill, 4),
            "steps_lost": max(before) - (first["step"] - 1) if before else 0,
            "new_size": first["size"]}


def machine_info() -> dict:
    import torch
    import horovod
    cpu = ""
    try:
        cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo")
                    if x.startswith("model name")), "")
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "horovod": horovod.__version__,
            "memory_gb": round(psutil.virtual_memory().total / 2 ** 30, 1),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}
