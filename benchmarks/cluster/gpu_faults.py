"""Every worker of every job on its own GPU on a pool of this machine and namespace test hosts,
through what an operator's pool goes through: jobs growing, shrinking stop-free, preempted by a
drain and resuming from a checkpoint, the service killed (-9) right after a shrink and
restarted, a pool host vanishing (cut off the bridge), a job failing at start.  Prints a table of
every worker (job, run, worker, host, GPU, from - to), the check, by sampling every live
worker's own environment every 0.1 s from outside, that no GPU of a host was ever selected by
two live workers, and that the GPU each worker's ``torch.cuda.set_device(hvd.local_rank())``
selects (``CUDA_VISIBLE_DEVICES[local_rank]``) is the one the service says it gave that worker
(issue 39's "must show"); and the failing job's time to ``failed`` and to its slots being free,
the drain's commit and leave times against its deadline, and each job's exactly-once audit.

    sudo .venv/bin/python benchmarks/cluster/gpu_faults.py      # as root; 3-6 minutes, 2 cores

The namespace test cluster (tests/cluster.py, 2 hosts h1, h2 behind a bridge, sshd each) is built
and torn down by the script; ``hvd-edl-cluster serve --policy edl --hold 2 --assume-gpus -H
localhost:2,h1:2,h2:2`` runs in its launcher namespace (6 GPUs named 0-1 per host: this machine
has none; what is checked is what each real worker process starts with).  The scenario (ledger
jobs of tests/horovod_style/ledger_main.py, Horovod's API, audited exactly-once):

1. j1 (1-4 GPUs) is lent 4; j2 (``--np 2``, 1-2) takes the last 2;
2. j3 (``--np 2``) arrives: j1 shrinks 4 -> 2 and the service is killed (-9) right after that
   shrink is written, then restarted; j3 runs on the 2 GPUs given back once j1's leavers are gone;
3. j3 done: j1 grows back;
4. ``drain HOST --deadline 30`` of j2's host(s): j2 moves stop-free to slots j1 gives back (its
   new workers start elsewhere, the old ones leave at a commit); ``drain --undo``; then every
   host drained: j1 and j2 are checkpointed and preempted; given back, both resume from their
   checkpoints;
5. a host of j1 is cut off the bridge: j1's launcher fences its workers there, the service rests
   the host; reconnected;
6. a job whose script fails at start (``import`` of a missing module): time to ``failed`` and to
   its slots free;
7. j1 stopped; every job done (j2 in two runs), each audit 0 repeated / 0 missing.

Written to benchmarks/results/gpu_faults.json (``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LEDGER = str(ROOT / "tests" / "horovod_style" / "ledger_main.py")
CLI = [sys.executable, "-m", "launcher.cluster.cli"]
DRAIN_DEADLINE_S = 30.0
TIMEOUT_S = 900.0  # the whole scenario


# ---- outside: the namespace cluster, the sampler, cutting a host on request -------------------

def outer(a) -> int:
    from benchmarks.common.gpu_sampler import GpuSampler
    from benchmarks.common.namespace_cluster import Cluster
    tmp = Path(tempfile.mkdtemp(prefix="gpu-faults-"))
    os.chmod(tmp, 0o755)
    marker = f"gpu-faults-{os.getpid()}"
    with Cluster(hosts=2) as c:
        sampler = GpuSampler(marker, period_s=0.1)
        wall0 = time.time() - time.monotonic()  # monotonic -> unix seconds
        ssh = ["-i", c.identity_file, "--network-interface", c.nic]
        env = dict(os.environ, HVD_EDL_TEST_MARKER=marker)
        inner = c.popen("launcher", [sys.executable, str(Path(__file__).resolve()), "--inner",
                                     str(tmp), "--ssh-json", json.dumps(ssh)],
                        cwd=str(ROOT), env=env)
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while inner.poll() is None:
                for req in sorted(tmp.glob("request-*")):
                    what, host = req.read_text().split()
                    (c.cut if what == "cut" else c.reconnect)(host)
                    req.rename(tmp / f"done-{req.name[8:]}")
                if time.monotonic() > deadline:
                    inner.send_signal(signal.SIGTERM)
                    inner.wait(30)
                    raise SystemExit(f"gpu_faults: the scenario took over {TIMEOUT_S:.0f} s")
                time.sleep(0.1)
        finally:
            sampler.stop()
            for name in c.hosts:
                try:
                    c.reconnect(name)
                except RuntimeError:
                    pass
    inner_out = tmp / "inner.json"
    if inner.returncode != 0 or not inner_out.exists():
        print(f"gpu_faults: the scenario failed (exit {inner.returncode}); its files: {tmp}")
        return 1
    res = json.loads(inner_out.read_text())
    return report(a, res, sampler, wall0)


def report(a, res: dict, sampler, wall0: float) -> int:
    """The table, the checks, the figures; written to ``a.out``."""
    t0 = res["t0"]
    given = {(g["job"], g["run"], g["worker"]): g for g in res["given"]}
    rows, mismatched = [], []
    for (run_marker, worker), (host, gpu, first, last, pids) in sampler.runs.items():
        job, run = Path(run_marker).parent.name, Path(run_marker).name
        said = given.get((job, run, worker))
        if said is not None and (said["gpu"] != gpu or said["host"] != host):
            mismatched.append({"job": job, "run": run, "worker": worker, "host": host,
                               "sampled_gpu": gpu, "service_said": said})
        rows.append({"job": job, "run": run, "worker": worker, "host": host, "gpu": gpu,
                     "from_s": round(first + wall0 - t0, 1), "to_s": round(last + wall0 - t0, 1),
                     "service_gpu": None if said is None else said["gpu"]})
    rows.sort(key=lambda r: (r["from_s"], r["job"], r["worker"]))
    shared = sampler.shared_gpus()
    print(f"{'job':<5}{'run':<6}{'worker':<8}{'host':<11}{'GPU':>4}{'service':>9}{'from s':>8}"
          f"{'to s':>8}")
    for r in rows:
        print(f"{r['job']:<5}{r['run']:<6}{r['worker']:<8}{r['host']:<11}{r['gpu']:>4}"
              f"{str(r['service_gpu']):>9}{r['from_s']:>8}{r['to_s']:>8}")
    print("\nwhat happened (seconds from the first submit):")
    for at, what in res["notes"]:
        print(f"  {at:6.1f}  {what}")
    print(f"\n{len(sampler.samples)} samples of every worker's environment, every 0.1 s: "
          + ("no GPU of a host ever selected by two live workers" if not shared else
             f"{len(shared)} samples with a GPU selected by two live workers"))
    shown = [r for r in rows if r["service_gpu"] is not None]
    print(f"{len(shown) - len(mismatched)} of the {len(shown)} workers status showed selected "
          f"(CUDA_VISIBLE_DEVICES[HOROVOD_LOCAL_RANK]) the GPU the service gave them" + (
              "" if not mismatched else f"; not: {mismatched[:5]}")
          + f" ({len(rows) - len(shown)} lived between two status polls)")
    f = res["failing"]
    print(f"\nfailing at start: its run started {f['run_s']:.1f} s after submit; failed "
          f"{f['failed_s']:.1f} s after its start, its slots free {f['free_s']:.1f} s after its "
          f"start ({f['free_after_failed_s']:.1f} s after 'failed'); reason: {f['reason'][:100]}")
    for d in res["drains"]:
        print(f"drain {', '.join(d['hosts'])} --deadline {d['deadline_s']:g}: " + "; ".join(
            f"{j['job']} {j['how']}, off at {j['left_s']} s" for j in d["jobs"])
            + f"; empty at {d['empty_s']:.1f} s ({d['spare_s']:.1f} s before the deadline"
            + (", late" if d["late"] else "") + ")")
    v = res["vanished"]
    print(f"vanished {v['host']}: status showed j1's ring of {v['ring']} {v['shown_s']:.1f} s after "
          f"the cut, the host rested " + (f"{v['rested_s']:.1f} s after it" if v["rested_s"]
                                          is not None else "not within 150 s"))
    for job, audit in res["audits"].items():
        print(f"audit {job}: {audit}")
    print(f"states: {res['states']}  runs: {res['runs']}")
    ok = not shared and not mismatched and res["ok"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "command": "sudo .venv/bin/python benchmarks/cluster/gpu_faults.py", "rows": rows,
        "notes": res["notes"], "samples": len(sampler.samples), "shared": shared[:20],
        "mismatched": mismatched, "failing": f, "drains": res["drains"], "vanished": v,
        "audits": res["audits"], "states": res["states"], "runs": res["runs"], "ok": ok},
        indent=1, default=str))
    return 0 if ok else 1


# ---- inside the launcher namespace: the service and the scenario -------------------------------

class Scenario:
    def __init__(self, tmp: Path, ssh: List[str]):
        from benchmarks.common.cluster_service import Serve
        self.tmp = tmp
        self.svc = Serve(tmp, "edl", {"hosts": {"localhost": 2, "h1": 2, "h2": 2}, "ssh": ssh})
        self.svc.extra = ["--hold", "2", "--assume-gpus"]
        self.notes: List[list] = []
        self.given: Dict[tuple, dict] = {}  # (job, run, worker) -> what status said
        self.t0 = time.time()
        self.requests = 0

    def note(self, what: str) -> None:
        self.notes.append([round(time.time() - self.t0, 1), what])
        print(f"[{time.time() - self.t0:6.1f} s] {what}", flush=True)

    def status(self) -> dict:
        st = self.svc.call("status")
        for j in st["jobs"]:
            for w in j.get("workers") or []:
                if w.get("gpu") is not None:
                    self.given.setdefault((j["id"], f"run{j['runs']}", w["worker"]),
                                          {"job": j["id"], "run": f"run{j['runs']}",
                                           "worker": w["worker"], "host": w["host"],
                                           "slot": w["slot"], "gpu": str(w["gpu"])})
        return st

    def jobs(self) -> dict:
        return {j["id"]: j for j in self.status()["jobs"]}

    def wait(self, what: str, pred, timeout_s: float = 180.0):
        deadline = time.monotonic() + timeout_s
        while True:
            value = pred()
            if value:
                return value
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not within {timeout_s:.0f} s")
            time.sleep(0.3)

    def events(self, job=None, kind=None) -> List[dict]:
        path = self.svc.state / "events.jsonl"
        return [e for e in map(json.loads, path.read_text().splitlines())
                if (job is None or e.get("job") == job) and (kind is None or e["kind"] == kind)]

    def submit(self, *args: str) -> str:
        r = subprocess.run(CLI + ["--cluster", str(self.svc.cluster), "submit", *args],
                           capture_output=True, text=True, timeout=60, cwd=str(ROOT))
        if r.returncode != 0:
            raise RuntimeError(f"submit: {r.stderr.strip()}")
        return r.stdout.strip().splitlines()[-1]

    def cli(self, *args: str) -> str:
        r = subprocess.run(CLI + ["--cluster", str(self.svc.cluster), *args],
                           capture_output=True, text=True, timeout=60, cwd=str(ROOT))
        if r.returncode != 0:
            raise RuntimeError(f"{args[0]}: {r.stderr.strip()}")
        return r.stdout

    def ledger(self, name: str, samples: int, epochs: int = 1, *extra: str) -> List[str]:
        from hvd_edl import audit
        return ["--env", f"{audit.ENV_AUDIT_DIR}={self.tmp / ('audit-' + name)}", "--",
                sys.executable, LEDGER, "--dataset-size", str(samples), "--batch-size", "8",
                "--epochs", str(epochs), "--step-delay", "0.03", "--done-log",
                str(self.tmp / f"{name}.done"), "--linger-s", "1", *extra]

    def ask_outside(self, what: str, host: str) -> None:
        """Have the outer process (root namespace) cut or reconnect ``host``."""
        self.requests += 1
        req = self.tmp / f"request-{self.requests}"
        req.write_text(f"{what} {host}")
        self.wait(f"{what} {host}", lambda: (self.tmp / f"done-{self.requests}").exists(), 30)

    def nworkers(self, job: str) -> int:
        return len(self.jobs()[job].get("workers") or [])

    def hosts_of(self, job: str) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for w in self.jobs()[job].get("workers") or []:
            out[w["host"]] = out.get(w["host"], 0) + 1
        return out

    def run(self) -> dict:
        self.svc.start()
        try:
            return self._scenario()
        finally:
            self.svc.stop()

    def _scenario(self) -> dict:
        w = self.wait
        self.t0 = time.time()
        j1 = self.submit("--name", "j1", "--min-np", "1", "--max-np", "4",
                         *self.ledger("j1", 256, 1000, "--stop-file", str(self.tmp / "stop1")))
        w("j1 on 4 GPUs", lambda: self.nworkers(j1) == 4)
        self.note(f"j1 trains on 4 GPUs: {self.hosts_of(j1)}")
        j2 = self.submit("--name", "j2", "--np", "2", "--min-np", "1", "--max-np", "2",
                         *self.ledger("j2", 128, 1000, "--stop-file", str(self.tmp / "stop2")))
        w("j2 on 2 GPUs", lambda: self.nworkers(j2) == 2)
        self.note(f"j2 trains on 2 GPUs: {self.hosts_of(j2)}")
        # 2. a shrink, and the service killed right after it is written
        j3 = self.submit("--name", "j3", "--np", "2", *self.ledger("j3", 192))
        w("j1's shrink", lambda: self.events(j1, "shrink"), 120)
        self.svc.proc.kill()
        self.svc.proc.wait(10)
        self.note("j3 submitted, j1 shrinks 4 -> 2: the service killed (-9) right after")
        self.svc.start()
        self.note("service restarted")
        w("j3 done", lambda: self.jobs()[j3]["state"] == "done")
        self.note("j3 done")
        w("j1 back on 4", lambda: self.nworkers(j1) == 4)
        self.note(f"j1 grown back to 4: {self.hosts_of(j1)}")
        # 4. drains with a deadline: j2's host(s) (it moves stop-free where the pool has room,
        # j1 giving it some), then every host (every job checkpointed and preempted; given
        # back: they resume from their checkpoints)
        drains = [self.drain(sorted(self.hosts_of(j2)), (j1, j2))]
        w("j2 running", lambda: self.nworkers(j2) >= 1)
        runs = {j: self.jobs()[j]["runs"] for j in (j1, j2)}
        drains.append(self.drain(["localhost", "h1", "h2"], (j1, j2)))
        w("j1 and j2 resumed", lambda: all(
            j["state"] == "running" and j["runs"] > runs[j["id"]] and j.get("workers")
            for j in (self.jobs()[j1], self.jobs()[j2])))
        self.note(f"j1 and j2 resumed from their checkpoints: j1 run {self.jobs()[j1]['runs']} "
                  f"on {self.hosts_of(j1)}, j2 run {self.jobs()[j2]['runs']} on "
                  f"{self.hosts_of(j2)}")
        # 5. a host of j1 vanishes
        def steady(j: dict) -> bool:  # its ring is its allocation, on a namespace host too
            n = sum((j.get("allocation") or {}).values())
            return j["state"] == "running" and j["world_size"] == n == len(j.get("workers") or [])\
                and any(h != "localhost" for h in (j.get("allocation") or {}))
        w("j1 steady on a namespace host", lambda: steady(self.jobs()[j1]))
        gone = sorted(h for h in self.hosts_of(j1) if h != "localhost")[0]
        ring_before = self.jobs()[j1]["world_size"]
        cut_at = time.time()
        self.ask_outside("cut", gone)
        self.note(f"{gone} cut off the bridge (j1's ring of {ring_before})")
        try:
            w("the smaller ring shown", lambda: self.jobs()[j1]["world_size"] < ring_before,
              60)
            shown_s = time.time() - cut_at
            ring = self.jobs()[j1]["world_size"]
            try:
                w(f"{gone} resting", lambda: gone in self.status().get("resting", {}), 150)
                rested_s = time.time() - cut_at
            except RuntimeError:  # a figure, not a precondition of what follows
                rested_s = None
            self.note(f"status shows j1's ring of {ring} after {shown_s:.1f} s; {gone} "
                      + (f"rests after {rested_s:.1f} s" if rested_s is not None
                         else "did not rest within 150 s"))
        finally:
            self.ask_outside("reconnect", gone)
        self.note(f"{gone} reconnected")
        vanished = {"host": gone, "ring": ring, "shown_s": round(shown_s, 2),
                    "rested_s": None if rested_s is None else round(rested_s, 2),
                    "j1_workers_after_cut": self.jobs()[j1].get("workers")}
        # 6. a job failing at start
        typo = self.tmp / "typo.py"
        typo.write_text("print('starting')\nimport no_such_module_xyz\n")
        sub_at = time.time()
        j4 = self.submit("--name", "typo", "--np", "2", "--", sys.executable, str(typo))
        run = w("the failing job's start", lambda: self.events(j4, "run"), 120)[0]
        failed = w("the failing job failed", lambda: (lambda j: j if j["state"] == "failed"
                                                      else None)(self.jobs()[j4]), 60)
        failed_at = time.time()
        w("its slots free", lambda: all(j4 not in [x[0] for x in hs] for hs in
                                        self.status().get("holders", {}).values()), 60,)
        free_at = time.time()
        end = self.events(j4, "end")[0]
        failing = {"run_s": round(run["at"] - sub_at, 2),
                   "failed_s": round(end["at"] - run["at"], 2),
                   "failed_seen_s": round(failed_at - run["at"], 2),
                   "free_s": round(free_at - run["at"], 2),
                   "free_after_failed_s": round(free_at - end["at"], 2),
                   "reason": failed.get("reason", "")}
        self.note(f"typo job failed {failing['failed_s']} s after its start, slots free "
                  f"(seen) {failing['free_s']} s after it")
        # 7. the end
        (self.tmp / "stop1").touch()
        (self.tmp / "stop2").touch()
        w("every job ended", lambda: all(j["state"] in ("done", "failed")
                                         for j in self.jobs().values()), 240)
        self.note("all jobs ended")
        jobs = self.jobs()
        from hvd_edl import audit
        audits, ok = {}, True
        sizes = {"j1": 256, "j2": 128, "j3": 192}
        for name, size in sizes.items():
            rep = audit.check(self.tmp / f"audit-{name}", size)
            audits[name] = f"{rep.repeated} repeated / {rep.missing} missing ({rep.verdict()})"
            ok = ok and rep.ok and rep.repeated == 0 and rep.missing == 0
        names = {j1: "j1", j2: "j2", j3: "j3", j4: "typo"}
        states = {names[k]: v["state"] for k, v in jobs.items()}
        runs = {names[k]: v["runs"] for k, v in jobs.items()}
        ok = ok and states == {"j1": "done", "j2": "done", "j3": "done", "typo": "failed"}
        return {"t0": self.t0, "notes": self.notes, "given": list(self.given.values()),
                "failing": failing, "drains": drains, "vanished": vanished, "audits": audits,
                "states": states, "runs": runs, "ok": ok}

    def drain(self, hosts: List[str], jobs) -> dict:
        """``drain HOST --deadline`` each of ``hosts`` at once; waits for each to be empty; how
        each job with workers there left (the time from the drain) and how long the host took
        against the deadline; then ``drain --undo``.  A job with nowhere else to go is
        checkpointed and preempted: this waits for it to be ``suspended``."""
        holders = {j: {h: n for h, n in self.hosts_of(j).items() if h in hosts} for j in jobs}
        at = time.time()
        for host in hosts:
            self.cli("drain", host, "--deadline", f"{DRAIN_DEADLINE_S:g}")
        at = min(e["at"] for e in self.events(kind="drain") if e["at"] >= at)  # the service's
        self.note(f"drain {', '.join(hosts)} --deadline {DRAIN_DEADLINE_S:g} (workers there: "
                  f"{holders})")
        drained = [self.wait(f"{host} drained", lambda h=host: [
            e for e in self.events(kind="drained") if e["host"] == h and e["at"] >= at], 180)[0]
            for host in hosts]
        late = [e for e in self.events(kind="drain_late") if e["at"] >= at]
        self.note(f"{', '.join(hosts)} empty {max(d['took_s'] for d in drained):.1f} s after the "
                  f"drain ({min(d['spare_s'] for d in drained)} s before the deadline)")
        out = []
        for j in jobs:
            if not holders[j]:
                continue
            asked = [e for e in self.events(j, "suspend") if e["at"] >= at]
            if asked:
                stopped = self.wait(f"{j} suspended", lambda: [
                    e for e in self.events(j, "suspended") if e["at"] >= at], 120)[0]
                last = [e for e in self.events(j, "drain_preempt") if e["at"] >= at]
                out.append({"job": j, "how": "checkpointed, then stopped (preempted" + (
                    ": no ring member elsewhere 10 s before the deadline)" if last else ")"),
                            "left_s": round(stopped["at"] - at, 2)})
                continue
            gens = [g for g in self.generations(j) if g["time"] >= at
                    and g["kind"] in ("scale_in", "migration", "scale_out")]
            left = [g for g in gens if not any(m.split("@")[1].split(":")[0] in hosts
                                               for m in g["members"])]
            moved = [e for e in self.events(j, "move") if e["at"] >= at]
            out.append({"job": j, "how": ("moved stop-free" if moved else "left stop-free")
                        + f" at a commit ({left[0]['rolled_back_steps']} steps rolled back)"
                        if left else "left (no generation without the host seen)",
                        "left_s": round(left[0]["time"] - at, 2) if left else None})
        for host in hosts:
            self.cli("drain", host, "--undo")
        self.note(f"{', '.join(hosts)} given back")
        return {"hosts": hosts, "deadline_s": DRAIN_DEADLINE_S, "jobs": out,
                "empty_s": max(d["took_s"] for d in drained),
                "spare_s": min(d["spare_s"] for d in drained), "late": len(late)}

    def generations(self, job: str) -> List[dict]:
        out = []
        for log in sorted((self.svc.state / "jobs" / job).glob("run*.events.jsonl")):
            out += [g for g in map(json.loads, log.read_text().splitlines())
                    if "generation" in g and g.get("event", "generation") == "generation"]
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_faults.json"),
                    help="where the table, the checks and the figures go (default "
                         "benchmarks/results/gpu_faults.json)")
    ap.add_argument("--inner", help=argparse.SUPPRESS)     # the scenario, in the namespace
    ap.add_argument("--ssh-json", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.inner:
        tmp = Path(a.inner)
        res = Scenario(tmp, json.loads(a.ssh_json)).run()
        (tmp / "inner.json").write_text(json.dumps(res, default=str))
        return 0
    if os.geteuid() != 0:
        print("gpu_faults: needs root (it builds the namespace test cluster)", file=sys.stderr)
        return 2
    return outer(a)


if __name__ == "__main__":
    sys.exit(main())
