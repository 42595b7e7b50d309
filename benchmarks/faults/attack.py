"""Attacks on a running job from this machine (loopback only, bounded in count and time), and
what they cost it.

One ``hvd-edl-run`` job (``benchmarks/common/workload.py``, 2 workers, elastic up to 3) trains
while four attacks run one after the other, each by a client without the job's secret:

* ``none``: nothing for ``ROUND_S`` seconds (the control: how much the figures move anyway);
* ``oversized_headers``: 40 connections each sending 6.4 MB of request headers (the issue's),
  again and again for ``ROUND_S`` seconds;
* ``idle_connections``: 1,000 connections held open, half sending nothing, half half a request
  head (slowloris), for ``HOLD_S`` seconds;
* ``unsigned_burst``: 5,000 unsigned ``POST /ctl/scale`` requests from 8 threads (raw sockets);
* ``rendezvous_planting``: garbage Gloo keys PUT into every rendezvous port of the launcher, from
  before a legitimate ``hvd-edl-ctl scale --np 3`` until the new ring trained, then scale back.

For each: the launcher's peak RSS (psutil) and threads against its baseline and its RSS after;
training throughput (samples/s from the workers' per-step timelines) during the attack against
the same length of time just before; the CPU seconds the launcher and the attacking client (this
process: on a small machine it competes with the workers for the same cores) spent; whether
the job's state changed (generations in the event log beyond the expected ones, failures,
rolled-back steps); and a probe sending signed ``/ctl/status`` every 0.5 s throughout (answers,
failures, slowest).  Prints one line per attack
and writes ``benchmarks/results/attack.json``.

    .venv/bin/python benchmarks/faults/attack.py [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List

import psutil
import requests

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common.jobs import WORKLOAD, stop_launcher  # noqa: E402
from hvd_edl import messages  # noqa: E402
from launcher.observe.events import read as read_events  # noqa: E402

VENV_BIN = Path(sys.executable).parent
BATCH = 16
HOLD_S = 8.0          # idle connections are held this long (the header timeout is 5 s)
BEFORE_MIN_S = 4.0    # shortest "before" window for throughput
LIMIT_S = 60.0        # no attack runs longer
ROUND_S = 5.0         # the control and the oversized-headers rounds last this long


class Job:
    """The job under attack."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.timelines = tmp / "timelines"
        self.timelines.mkdir()
        self.job_file = tmp / "job.json"
        self.events_path = tmp / "events.jsonl"
        (tmp / "hosts.txt").write_text("localhost:3\n")
        self.out = open(tmp / "launcher.out", "w")
        self.proc = subprocess.Popen(
            [str(VENV_BIN / "hvd-edl-run"), "-np", "2", "--min-np", "1", "--max-np", "3",
             "--target-np", "2", "--discovery-interval", "0.5", "--job-file", str(self.job_file),
             "--event-log", str(self.events_path),
             "--host-discovery-script", f"cat {tmp / 'hosts.txt'}",
             sys.executable, WORKLOAD, "--system", "hvd_edl",
             "--timeline-dir", str(self.timelines), "--step-delay", "0.01",
             "--stop-file", str(tmp / "stop")],
            stdout=self.out, stderr=subprocess.STDOUT, cwd=str(ROOT))
        self.ps = psutil.Process(self.proc.pid)
        self.wait_for("generation 1", lambda: self.events(), 120)
        self.wait_for("the job file", self.job_file.exists, 30)
        info = json.loads(self.job_file.read_text())
        self.url, self.secret = info["url"], info["secret"]
        host, port = self.url[len("http://"):].rsplit(":", 1)
        self.host, self.port = host, int(port)

    def wait_for(self, what: str, pred: Callable[[], object], timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = pred()
            if value:
                return value
            if self.proc.poll() is not None:
                raise RuntimeError(f"job ended before {what}")
            time.sleep(0.05)
        raise RuntimeError(f"timed out waiting for {what}")

    def events(self) -> List[dict]:
        return read_events(self.events_path)[0]  # not EventLog.note lines

    def signed_status(self) -> requests.Response:
        path = "/ctl/status"
        return requests.post(self.url + path, data=b"{}", timeout=10, headers={
            messages.AUTH_HEADER: messages.sign(self.secret, "POST", path, b"{}")})

    def ctl(self, *args: str) -> int:
        return subprocess.run([str(VENV_BIN / "hvd-edl-ctl"), "--job", str(self.job_file), *args],
                              capture_output=True, text=True, timeout=60).returncode

    def rendezvous_ports(self) -> List[int]:
        return sorted(c.laddr.port for c in self.ps.net_connections("inet")
                      if c.status == psutil.CONN_LISTEN and c.laddr.port != self.port)

    def samples_per_s(self, t0: float, t1: float) -> float:
        """Samples trained per second between unix times t0 and t1 (every rank's steps)."""
        steps = 0
        for f in self.timelines.glob("timeline-*.jsonl"):
            for line in f.read_text().splitlines():
                try:
                    t = json.loads(line)["t"]
                except (ValueError, KeyError):
                    continue
                steps += t0 <= t < t1
        return steps * BATCH / max(t1 - t0, 1e-9)

    def stop(self) -> None:
        stop_launcher(self.proc, self.tmp / "stop", self.out, timeout_s=120)


class Sampler(threading.Thread):
    """Samples the launcher's RSS and threads, and probes the control API with signed requests."""

    def __init__(self, job: Job):
        super().__init__(daemon=True)
        self.job, self.stop = job, threading.Event()
        self.rss_peak = self.threads_peak = 0
        self.probes = self.probe_failures = 0
        self.probe_slowest_s = 0.0
        self._next_probe = 0.0

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.rss_peak = max(self.rss_peak, self.job.ps.memory_info().rss)
                self.threads_peak = max(self.threads_peak, self.job.ps.num_threads())
            except psutil.Error:
                return
            now = time.monotonic()
            if now >= self._next_probe:
                self._next_probe = now + 0.5
                threading.Thread(target=self._probe, daemon=True).start()
            time.sleep(0.02)

    def _probe(self) -> None:
        t0 = time.monotonic()
        try:
            ok = self.job.signed_status().status_code == 200
        except requests.RequestException:
            ok = False
        self.probes += 1
        self.probe_failures += not ok
        self.probe_slowest_s = max(self.probe_slowest_s, time.monotonic() - t0)


# ---- the attacks -------------------------------------------------------------------------------

def no_attack(job: Job) -> Dict:
    """The control: the same measurement with nothing going on (the noise of the figures)."""
    time.sleep(ROUND_S)
    return {}


def oversized_headers(job: Job) -> Dict:
    answers: List[bytes] = []
    rounds = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < ROUND_S and rounds < 25:  # rounds of 40 (bounded)
        rounds += 1
        _oversized_round(job, answers)
    return {"connections": 40 * rounds, "rounds": rounds, "header_bytes_each": 6_400_000,
            "answered_431": sum(a.startswith(b"HTTP/1.1 431") for a in answers),
            "other_answers": sorted({a.decode("latin-1") for a in answers
                                     if not a.startswith(b"HTTP/1.1 431")})}


def _oversized_round(job: Job, answers: List[bytes]) -> None:

    def one():
        try:
            with socket.create_connection((job.host, job.port), timeout=20) as c:
                c.sendall(b"POST /register HTTP/1.1\r\n")
                # 64 kB lines, 100 of them: the most http.server accepted
                line = b"X-Pad: " + b"a" * 64000 + b"\r\n"
                try:
                    for _ in range(6_400_000 // len(line)):
                        c.sendall(line)
                except OSError:
                    pass
                answers.append(c.recv(64).split(b"\r\n")[0])
        except OSError as e:
            answers.append(type(e).__name__.encode())
    threads = [threading.Thread(target=one) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LIMIT_S)


def idle_connections(job: Job) -> Dict:
    conns = []
    for i in range(1000):
        c = socket.create_connection((job.host, job.port), timeout=15)
        if i % 2:
            c.sendall(b"POST /ctl/status HTTP/1.1\r\nContent-Le")
        conns.append(c)
    t0 = time.monotonic()
    ended, answered_408 = 0, 0
    while time.monotonic() - t0 < HOLD_S:
        time.sleep(0.25)
    for c in conns:
        c.setblocking(False)
        try:
            data = c.recv(64)
            ended += 1
            answered_408 += data.startswith(b"HTTP/1.1 408")
        except BlockingIOError:
            pass
        except OSError:
            ended += 1
        c.close()
    return {"connections": 1000, "held_s": HOLD_S, "closed_by_server": ended,
            "answered_408": answered_408}


def unsigned_burst(job: Job) -> Dict:
    codes: Dict[int, int] = {}
    lock = threading.Lock()
    t0 = time.monotonic()

    request = (b"POST /ctl/scale HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n"
               b"Content-Type: application/json\r\n\r\n{\"np\": 1}")

    def worker(n):
        for _ in range(n):
            try:  # raw sockets: the cheapest client, so the launcher's share shows
                with socket.create_connection((job.host, job.port), timeout=10) as c:
                    c.sendall(request)
                    code = int(c.recv(64).split(b" ")[1])
            except (OSError, ValueError, IndexError):
                code = -1
            with lock:
                codes[code] = codes.get(code, 0) + 1
            if time.monotonic() - t0 > LIMIT_S:
                return
    threads = [threading.Thread(target=worker, args=(625,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LIMIT_S + 10)
    return {"requests": sum(codes.values()), "codes": {str(k): v for k, v in codes.items()},
            "seconds": round(time.monotonic() - t0, 2)}


def rendezvous_planting(job: Job) -> Dict:
    before = len(job.events())
    ports = job.rendezvous_ports()
    stop, codes = threading.Event(), {}
    lock = threading.Lock()

    def plant():
        s = requests.Session()
        keys = ["/global/0", "/global/1", "/global/2", "/global/rank_0", "/global/rank_2",
                "/local/0", "/cross0/0"]
        while not stop.is_set():
            for port in list(ports):
                for key in keys:
                    try:
                        code = s.put(f"http://127.0.0.1:{port}{key}", data=b"\0garbage" * 8,
                                     timeout=2).status_code
                    except requests.RequestException:
                        code = -1
                    with lock:
                        codes[code] = codes.get(code, 0) + 1
    planters = [threading.Thread(target=plant, daemon=True) for _ in range(2)]
    for t in planters:
        t.start()
    try:
        rc_out = job.ctl("scale", "--np", "3")
        job.wait_for("the scale-out", lambda: len(job.events()) > before, LIMIT_S)
        ports.extend(set(job.rendezvous_ports()) - set(ports))
        planted = sum(codes.values())
        job.wait_for("more plants", lambda: sum(codes.values()) > planted + 300, LIMIT_S)
        rc_in = job.ctl("scale", "--np", "2")
        job.wait_for("the scale-in", lambda: len(job.events()) > before + 1, LIMIT_S)
    finally:
        stop.set()
        for t in planters:
            t.join(10)
    new = job.events()[before:]
    return {"plants": sum(codes.values()), "codes": {str(k): v for k, v in codes.items()},
            "ctl_rc": [rc_out, rc_in], "events": [e["kind"] for e in new],
            "rolled_back_steps": [e.get("rolled_back_steps") for e in new],
            "state_lost": any(e.get("state_lost") for e in new),
            "expected_events": ["scale_out", "scale_in"]}


ATTACKS = [("none", no_attack), ("oversized_headers", oversized_headers),
           ("idle_connections", idle_connections),
           ("unsigned_burst", unsigned_burst), ("rendezvous_planting", rendezvous_planting)]


def measure(job: Job, name: str, attack) -> Dict:
    events_before = len(job.events())
    sampler = Sampler(job)
    time.sleep(0.5)  # the job's memory and threads at rest (a baseline, not a wait for an event)
    baseline_rss, baseline_threads = job.ps.memory_info().rss, job.ps.num_threads()
    sampler.start()
    me = psutil.Process()
    cpu0 = sum(job.ps.cpu_times()[:2]), sum(me.cpu_times()[:2])
    t0 = time.time()
    result = attack(job)
    t1 = time.time()
    cpu1 = sum(job.ps.cpu_times()[:2]), sum(me.cpu_times()[:2])
    settle = time.monotonic()
    while job.ps.memory_info().rss > baseline_rss + (8 << 20) and time.monotonic() - settle < 10:
        time.sleep(0.2)  # memory given back (bounded wait)
    after_rss = job.ps.memory_info().rss
    sampler.stop.set()
    sampler.join(5)
    window = max(t1 - t0, BEFORE_MIN_S)
    before_tp = job.samples_per_s(t0 - window, t0)
    during_tp = job.samples_per_s(t0, t1)
    expected = result.pop("expected_events", [])
    new_events = [e["kind"] for e in job.events()[events_before:]]
    result.update(
        seconds=round(t1 - t0, 2),
        rss_baseline_mb=round(baseline_rss / 2**20, 1),
        rss_peak_mb=round(max(sampler.rss_peak, baseline_rss) / 2**20, 1),
        rss_after_mb=round(after_rss / 2**20, 1),
        threads_baseline=baseline_threads, threads_peak=sampler.threads_peak,
        launcher_cpu_s=round(cpu1[0] - cpu0[0], 2), attacker_cpu_s=round(cpu1[1] - cpu0[1], 2),
        throughput_before=round(before_tp, 1), throughput_during=round(during_tp, 1),
        throughput_ratio=round(during_tp / before_tp, 3) if before_tp else None,
        state_changed=new_events != expected, new_events=new_events,
        probes=sampler.probes, probe_failures=sampler.probe_failures,
        probe_slowest_s=round(sampler.probe_slowest_s, 3))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "attack.json"))
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hvd-edl-attack-"))
    job = Job(tmp)
    results = {}
    try:
        job.wait_for("steady training", lambda: job.samples_per_s(time.time() - 3, time.time()),
                     60)
        time.sleep(BEFORE_MIN_S)  # a full "before" window of training
        for name, attack in ATTACKS:
            results[name] = r = measure(job, name, attack)
            print(f"{name}: {json.dumps(r)}", flush=True)
            time.sleep(BEFORE_MIN_S)  # the next attack's "before" window is free of this one
    finally:
        job.stop()
        results["job_exit_code"] = job.proc.returncode
        results["failures"] = [e for e in job.events() if e["kind"] == "failure"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"job exit code {job.proc.returncode}; wrote {args.out}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
