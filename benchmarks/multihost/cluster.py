"""hvd_edl against Horovod Elastic on the namespace cluster (tests/cluster.py): 3 hosts with an
sshd each, the launcher in its own namespace, real ssh, Gloo over the bridge.

Both systems run ``benchmarks/common/workload.py`` (the digits CNN, batch 16 per rank, commit
every 10 steps) from a discovery script (``cat`` of a hosts file), one slot per host, and face
the same faults, each in a fresh job:

  scale_out    2 -> 3: host h3 added to discovery
  scale_in     3 -> 2: host h3 leaves discovery (graceful)
  remote_kill  3 workers, kill -9 of the worker on h3
  vanish       3 workers, h3 taken off the bridge (no FIN, no reset)
  freeze       3 workers, every process of h3 SIGSTOPped

Per run: survived (the other workers train again), time from the fault to the start of their
first step in the new ring (scale_out / scale_in: the stall, from common/jobs.py's
change_stall), steps lost (rolled back).  Every run is bounded (``--bound`` seconds after the fault, default 120).
Prints a table and writes benchmarks/results/cluster.json.

    sudo .venv/bin/python benchmarks/multihost/cluster.py       # about 10 minutes on 2 cores
    .venv/bin/python benchmarks/multihost/cluster.py --only hvd_edl --faults vanish --bound 60
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common.jobs import (WorkloadJob, change_stall, kill_outcome,  # noqa: E402
                                    machine_info)
from benchmarks.common.namespace_cluster import (Cluster, ClusterUnavailable,  # noqa: E402
                                                 reset_hosts)

BIN = Path(sys.executable).parent
RESULTS = ROOT / "benchmarks" / "results"
SYSTEMS = ("hvd_edl", "horovod_elastic")
FAULTS = ("scale_out", "scale_in", "remote_kill", "vanish", "freeze")
SETTLE_STEPS = 20


class ClusterJob(WorkloadJob):
    """One launcher in the cluster's launcher namespace running the workload."""

    def __init__(self, c: Cluster, system: str, tmp: Path, hosts: List[str]):
        self.c, self.np = c, len(hosts)
        super().__init__(system, tmp, _lines(hosts), popen=functools.partial(c.popen, "launcher"))

    def _launcher(self, discover: Path) -> List[str]:
        common = ["-np", str(self.np), "--min-np", "1", "--max-np", "3",
                  "--network-interface", self.c.nic, "-i", self.c.identity_file,
                  "--host-discovery-script", str(discover)]
        if self.system == "hvd_edl":
            return [str(BIN / "hvd-edl-run"), *common, "--event-log", str(self.events_path),
                    "--blacklist-cooldown-range", "5", "10"]
        return [str(BIN / "horovodrun"), "--gloo", *common, "--blacklist-cooldown-range", "5", "10"]

    def set_hosts(self, hosts: List[str]) -> None:
        self.write_hosts(_lines(hosts))

    def pid_on(self, host: str) -> Optional[int]:
        on = set(self.c.pids(host))
        return next((p for p in self.timelines() if p in on), None)

    def finish(self, timeout_s: float = 10.0) -> None:
        for h in self.c.hosts:
            self.c.thaw(h)  # a frozen host's workers see the stop file too
        super().finish(timeout_s)

    def _kill_tree(self) -> None:
        """SIGKILL at once: the launcher, every worker and what each started (a remote
        worker's process tree hangs off its host's sshd, not the launcher)."""
        for p in [self.proc.pid, *self.timelines()]:
            try:
                for q in [psutil.Process(p), *psutil.Process(p).children(recursive=True)]:
                    q.kill()
            except psutil.NoSuchProcess:
                pass


def _lines(hosts: List[str]) -> str:
    return "".join(f"{h}:1\n" for h in hosts)


def run_one(c: Cluster, system: str, fault: str, bound_s: float) -> dict:
    start_hosts = ["h1", "h2"] if fault == "scale_out" else ["h1", "h2", "h3"]
    size = len(start_hosts)
    with tempfile.TemporaryDirectory(prefix="hvdedl-bench-") as tmp:
        job = ClusterJob(c, system, Path(tmp), start_hosts)
        res: dict = {"system": system, "fault": fault}
        try:
            if not job.wait_settled(size, SETTLE_STEPS, 0, 120):
                res.update(survived=False,
                           error=f"ring of {size} never formed: {job.output_tail(6)}")
                return res
            victim = job.pid_on("h3")
            t = time.time()
            if fault == "scale_out":
                job.set_hosts(["h1", "h2", "h3"])
                new = 3
            elif fault == "scale_in":
                job.set_hosts(["h1", "h2"])
                new = 2
            elif fault == "remote_kill":
                os.kill(victim, signal.SIGKILL)
            elif fault == "vanish":
                c.cut("h3")
            elif fault == "freeze":
                c.freeze("h3")
            if fault in ("scale_out", "scale_in"):
                ok = job.wait_settled(new, SETTLE_STEPS, t, bound_s)
                st = change_stall(job.timelines(), size, new, t) if ok else None
                res.update(survived=bool(st), recovery_s=st and st["stall_s"],
                           steps_lost=st and st["rolled_back_steps"])
            else:
                def recovered(tl):
                    return kill_outcome(tl, victim, t, size).get("survives")
                job.wait(recovered, bound_s)
                out = kill_outcome(job.timelines(), victim, t, size)
                res.update(survived=out["survives"], recovery_s=out.get("recovery_s"),
                           steps_lost=out.get("steps_lost"), new_size=out.get("new_size"))
            if not res["survived"]:
                res["note"] = (f"no survivor trained again within {bound_s:g} s: "
                               f"{job.output_tail(3)}")
            return res
        finally:
            job.finish()
            reset_hosts(c)


def table(rows: List[dict]) -> str:
    lines = [f"{'fault':<12} {'system':<16} {'survived':<9} {'recovery_s':>10} {'steps_lost':>10}"]
    for r in rows:
        rec = f"{r['recovery_s']:.2f}" if r.get("recovery_s") is not None else "-"
        lost = str(r["steps_lost"]) if r.get("steps_lost") is not None else "-"
        lines.append(f"{r['fault']:<12} {r['system']:<16} {str(r['survived']):<9} {rec:>10} "
                     f"{lost:>10}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=SYSTEMS, action="append")
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    p.add_argument("--bound", type=float, default=120.0,
                   help="seconds after a fault before a run counts as not survived")
    p.add_argument("--out", default=str(RESULTS / "cluster.json"))
    a = p.parse_args()
    try:
        c = Cluster(hosts=3)
    except ClusterUnavailable as e:
        print(f"cluster benchmark skipped: {e}", file=sys.stderr)
        return 0
    rows = []
    with c:
        for fault in a.faults:
            for system in a.only or SYSTEMS:
                t0 = time.monotonic()
                r = run_one(c, system, fault, a.bound)
                r["run_s"] = round(time.monotonic() - t0, 1)
                print(json.dumps(r), flush=True)
                rows.append(r)
    print(table(rows))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"machine": machine_info(), "bound_s": a.bound,
                                       "runs": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
