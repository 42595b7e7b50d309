"""Several users on one cluster, for real (issue 40's "must show"): a stream of elastic jobs of
two Unix users made for the run, on localhost plus namespace hosts of the test cluster, under a
root service; who ran as whom on every host (every process of every run sampled every 0.2 s:
its owner, its host, its role; on a remote host also the worker's supervisor and its sshd
session), each user's refusals (cancel, logs of the other's job: one
line, exit 1), each user's own logs, and no GPU used twice (every worker's own environment
sampled every 0.1 s, benchmarks/common/gpu_sampler.py; ``--assume-gpus``).

    .venv/bin/python benchmarks/cluster/users.py            # as root; about 2-4 minutes, 2 cores

The pool is ``localhost:2,h1:1,h2:1`` (``--hosts K`` namespace hosts, tests/cluster.py: sshd
each, a bridge; ``serve -i`` is root's key, each user reaches the hosts over ssh with a key of
their own, as docs/cluster.md's "A team's head host" says an operator sets up).  The users
(tests/unix_users.py: ``useradd``, removed at the end) run the clients from a team install
every user can run (a venv of the system's Python naming the installed packages), and submit
tests/horovod_style/ledger_main.py jobs (Horovod's API, audited exactly-once) from their own
shells, their own environment carried (a variable of each user's shell is checked in every
worker).  Policy ``edl --hold 2``: jobs are lent idle GPUs and give them back stop-free.

Written to benchmarks/results/users.json (``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from benchmarks.common.gpu_sampler import GpuSampler, environ  # noqa: E402
from cluster import Cluster  # noqa: E402
from unix_users import TeamUsers, team_install  # noqa: E402

from hvd_edl import audit  # noqa: E402
from launcher.cluster.runs import MARKER_ENV  # noqa: E402

LEDGER = ROOT / "tests" / "horovod_style" / "ledger_main.py"
# (user index, name, bounds, samples) in submission order, one every STAGGER_S seconds
STREAM = [(0, "a1", ["--min-np", "1", "--max-np", "4"], 1536),
          (1, "b1", ["--np", "2"], 512),
          (0, "a2", ["--np", "1"], 384),
          (1, "b2", ["--min-np", "1", "--max-np", "2"], 768),
          (0, "a3", ["--min-np", "1", "--max-np", "2"], 512)]
STAGGER_S = 4.0


class OwnerSampler:
    """Every ``period_s``: every process whose environment carries a run marker of
    ``state_dir`` (the run's wrapper, launcher, ssh clients, local and remote workers): its
    job, owner, host (by network namespace) and role.  ``seen``: (job, host, role) -> {uids}."""

    def __init__(self, state_dir: Path, netns_hosts: Dict[int, str], period_s: float = 0.2):
        import threading
        self.state_dir = str(state_dir)
        self.netns_hosts = netns_hosts
        self.seen: Dict[tuple, set] = {}
        self.shells: Dict[str, set] = {}  # job -> SHELL_OF of its workers' environments
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def role(env: dict, cmdline: List[str]) -> str:
        text = " ".join(cmdline)
        if "HVD_EDL_WORKER_ID" in env and "remote_worker" not in text \
                and "hvd-edl-worker" not in text:
            return "worker"
        if "launcher.cluster.wrapper" in text:
            return "wrapper"
        if "hvd-edl-run" in text or "launcher.cli" in text:
            return "launcher"
        if cmdline[:1] and os.path.basename(cmdline[0]) == "ssh":
            return "ssh client"
        if "hvd-edl-worker" in text:
            return "remote supervisor"
        if "allocation.py" in text:
            return "host discovery"
        if cmdline[:1] and os.path.basename(cmdline[0]) in ("sh", "bash"):
            return "discovery shell"
        return os.path.basename(cmdline[0]) if cmdline else "(exiting)"

    def _run(self) -> None:
        import psutil
        while not self._stop.is_set():
            for pid in psutil.pids():
                env = environ(pid)
                marker = (env or {}).get(MARKER_ENV, "")
                if not marker.startswith(self.state_dir):
                    continue
                try:
                    p = psutil.Process(pid)
                    uid, cmd = p.uids().real, p.cmdline()
                    ns = os.stat(f"/proc/{pid}/ns/net").st_ino
                except (psutil.Error, OSError):
                    continue
                job = Path(marker).parent.name
                host = self.netns_hosts.get(ns, f"netns:{ns}")
                role = self.role(env, cmd)
                self.seen.setdefault((job, host, role), set()).add(uid)
                if role == "worker" and host != "localhost":
                    # its remote supervisor and ssh session on that host carry no marker
                    # (their environment is sshd's): found as the worker's parents
                    try:
                        sup = p.parent()
                        for proc, what in ((sup, "remote supervisor"),
                                           (sup.parent() if sup else None, "sshd session")):
                            if proc is not None:
                                self.seen.setdefault((job, host, what), set()).add(
                                    proc.uids().real)
                    except psutil.Error:
                        pass
                if role == "worker":
                    self.shells.setdefault(job, set()).add(env.get("SHELL_OF"))
            self.samples += 1
            self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def one_line(r: subprocess.CompletedProcess) -> dict:
    return {"exit": r.returncode, "stderr": r.stderr.strip(), "stdout_lines":
            len(r.stdout.splitlines()), "one_line": len(r.stderr.strip().splitlines()) == 1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=2, help="namespace hosts (default 2)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "users.json"))
    ap.add_argument("--timeout", type=float, default=420.0, help="the stream's bound, s")
    a = ap.parse_args()
    t_start = time.monotonic()
    shared = Path(tempfile.mkdtemp(prefix="hvdedl-users-"))
    os.chmod(shared, 0o755)
    marker = f"users-{os.getpid()}"
    team = TeamUsers(2)
    users = team.users
    try:
        bin_dir = team_install(shared / "prefix")
        with Cluster(hosts=a.hosts) as c:
            for u in users:
                c.authorize(u.name, u.public_key())
            netns_hosts = {os.stat(f"/run/netns/{h.netns}").st_ino: name
                           for name, h in c.hosts.items()}
            netns_hosts[os.stat(f"/run/netns/{c.launcher.netns}").st_ino] = "localhost"
            state, cluster = shared / "state", shared / "cluster.json"
            pool = ",".join(["localhost:2"] + [f"{h}:1" for h in c.hosts])
            serve_argv = [str(bin_dir / "python"), "-m", "launcher.cluster.cli", "serve",
                          "-H", pool, "-i", c.identity_file, "--network-interface", c.nic,
                          "--assume-gpus", "--policy", "edl", "--hold", "2",
                          "--state-dir", str(state), "--cluster-file", str(cluster)]
            serve = c.popen("launcher", serve_argv, stdout=open(shared / "serve.log", "w"),
                            stderr=subprocess.STDOUT, cwd="/")
            try:
                deadline = time.monotonic() + 60
                while not cluster.exists():
                    if serve.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("the service did not start: "
                                           + (shared / "serve.log").read_text()[-2000:])
                    time.sleep(0.1)
                works = {}
                for u in users:
                    w = shared / u.name
                    w.mkdir(mode=0o755)
                    os.chown(w, u.uid, u.gid)
                    works[u.name] = w

                def cli(u, *args, **env):
                    """``hvd-edl-cluster ARGS`` as user ``u`` from its shell (its environment:
                    ``env`` added) in its folder."""
                    argv = c.exec_argv("launcher", u.argv(
                        [str(bin_dir / "hvd-edl-cluster"), "--cluster", str(cluster), *args]))
                    return subprocess.run(argv, env=u.env([str(bin_dir)], HVD_EDL_TEST_MARKER=
                                          marker, SHELL_OF=u.name, **env),
                                          cwd=str(works[u.name]), capture_output=True,
                                          text=True, timeout=60)

                owners = OwnerSampler(state, netns_hosts)
                gpus = GpuSampler(marker)
                jobs: Dict[str, dict] = {}
                t0 = time.monotonic()
                for i, (ui, name, bounds, samples) in enumerate(STREAM):
                    while time.monotonic() < t0 + i * STAGGER_S:
                        time.sleep(0.05)
                    u = users[ui]
                    ledger = works[u.name] / f"audit-{name}"
                    ledger.mkdir(mode=0o755)
                    os.chown(ledger, u.uid, u.gid)
                    r = cli(u, "submit", "--name", name, *bounds, "--", str(bin_dir / "python"),
                            str(LEDGER), "--dataset-size", str(samples), "--batch-size", "8",
                            "--epochs", "1", "--step-delay", "0.03", "--done-log",
                            str(works[u.name] / f"{name}.done"),
                            HVD_EDL_AUDIT_DIR=str(ledger))
                    if r.returncode != 0:
                        raise RuntimeError(f"submit {name} as {u.name}: {r.stderr.strip()}")
                    jid = r.stdout.strip().splitlines()[-1]
                    jobs[jid] = {"name": name, "user": u.name, "samples": samples,
                                 "submitted_s": round(time.monotonic() - t0, 2)}
                    print(f"{time.monotonic() - t0:6.1f} s  {u.name} submitted {name} -> {jid}",
                          flush=True)
                # refusals while the jobs run: each user, the other's first job
                refusals = []
                for u, other in ((users[0], users[1]), (users[1], users[0])):
                    theirs = next(j for j, d in jobs.items() if d["user"] == other.name)
                    for cmd in ("cancel", "logs"):
                        r = cli(u, cmd, theirs)
                        refusals.append({"user": u.name, "command": f"{cmd} {theirs}",
                                         "owner": other.name, **one_line(r)})
                r = cli(users[1], "drain", "h1")
                refusals.append({"user": users[1].name, "command": "drain h1",
                                 "owner": "root", **one_line(r)})
                deadline = time.monotonic() + a.timeout
                while True:
                    r = cli(users[0], "status", "--json")
                    rows = {j["id"]: j for j in json.loads(r.stdout)["jobs"]} \
                        if r.returncode == 0 else {}
                    if rows and all(j["state"] in ("done", "failed", "cancelled")
                                    for j in rows.values()):
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the stream did not end within {a.timeout:g} s: "
                                           + json.dumps({k: v["state"] for k, v in rows.items()}))
                    time.sleep(1.0)
                owners.stop()
                gpus.stop()
                # each user's own logs, and the other's refused once more after the end
                logs = []
                for jid, d in jobs.items():
                    u = next(x for x in users if x.name == d["user"])
                    r = cli(u, "logs", jid)
                    st = os.stat(state / "jobs" / jid / "run1.log")
                    logs.append({"job": jid, "user": u.name, "exit": r.returncode,
                                 "lines": len(r.stdout.splitlines()),
                                 "workers_started": len(re.findall(r"worker w\d+ started",
                                                                   r.stdout)),
                                 "log_owner_uid": st.st_uid, "user_uid": u.uid})
                for jid, d in jobs.items():
                    d.update(workers_environment_from=sorted(map(str, owners.shells.get(
                        jid, ()))), state=rows[jid]["state"], exit_code=rows[jid]["exit_code"],
                             row_user=rows[jid]["user"],
                             exactly_once=audit.check(works[d["user"]] / f"audit-{d['name']}",
                                                      d["samples"]).verdict())
                uid_name = {u.uid: u.name for u in users}
                uid_name[0] = "root"
                who = [{"job": j, "user": jobs.get(j, {}).get("user"), "host": h, "role": r,
                        "ran_as": sorted(uid_name.get(x, str(x)) for x in uids)}
                       for (j, h, r), uids in sorted(owners.seen.items())]
                shared_gpus = gpus.shared_gpus()
            finally:
                serve.terminate()
                serve.wait(30)
    finally:
        team.close()
        shutil.rmtree(shared, ignore_errors=True)
    wrong = [w for w in who if w["ran_as"] != [w["user"]]]
    out = {"command": "benchmarks/cluster/users.py" + "".join(f" {x}" for x in sys.argv[1:]),
           "pool": pool, "users": [u.name for u in users], "jobs": jobs,
           "who_ran_as_whom": who, "processes_not_as_their_user": wrong,
           "owner_samples": owners.samples, "refusals": refusals, "own_logs": logs,
           "gpu_samples": len(gpus.samples), "gpu_workers": len(gpus.seen),
           "gpu_shared": [[g, [list(x) for x in us]] for g, us in shared_gpus[:20]],
           "wall_s": round(time.monotonic() - t_start, 1)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"\npool {pool}, users {', '.join(out['users'])}; {owners.samples} samples of every "
          f"process of every run (0.2 s)")
    print(f"\n{'JOB':<5}{'NAME':<5}{'USER':<11}{'STATE':<7}{'ENV OF':<11}EXACTLY-ONCE")
    for jid, d in jobs.items():
        print(f"{jid:<5}{d['name']:<5}{d['user']:<11}{d['state']:<7}"
              f"{','.join(d['workers_environment_from']):<11}{str(d['exactly_once'])[:60]}")
    print(f"\n{'JOB':<5}{'USER':<11}{'HOST':<10}{'ROLE':<18}RAN AS")
    for w in who:
        print(f"{w['job']:<5}{str(w['user']):<11}{w['host']:<10}{w['role']:<18}"
              f"{', '.join(w['ran_as'])}")
    print(f"\nprocesses not run as their job's user: {len(wrong)}")
    print(f"\n{'USER':<11}{'COMMAND':<13}{'EXIT':<5}MESSAGE (one line: "
          f"{all(r['one_line'] for r in refusals)})")
    for r in refusals:
        print(f"{r['user']:<11}{r['command']:<13}{r['exit']:<5}{r['stderr']}")
    print(f"\n{'JOB':<5}{'USER':<11}{'EXIT':<5}{'LINES':>6} {'WORKERS STARTED':>15}  LOG OWNED "
          f"BY THE USER")
    for x in logs:
        print(f"{x['job']:<5}{x['user']:<11}{x['exit']:<5}{x['lines']:>6} "
              f"{x['workers_started']:>15}  {x['log_owner_uid'] == x['user_uid']}")
    print(f"\nGPUs: {out['gpu_samples']} samples of {out['gpu_workers']} workers' environments "
          f"(0.1 s); a GPU selected by two live workers at once: {len(shared_gpus)} times")
    print(f"written to {a.out} ({out['wall_s']:.0f} s)")
    return 0 if not wrong and not shared_gpus and all(
        r["exit"] == 1 and r["one_line"] for r in refusals) else 1


if __name__ == "__main__":
    sys.exit(main())
