"""CPU seconds of the launcher-side processes every job pays (issue 38): the launcher
(``hvd-edl-run``), the zygote stub per local worker, the discovery script's runs (``sh`` and what
it starts), ``hvd-edl-ctl``; beside them the zygote and the workers, for scale.

One small elastic job per run: ``hvd-edl-run -np 2`` over ``localhost:2`` with the cluster
service's discovery (``python -I -S launcher/cluster/allocation.py HOSTS`` every 0.2 s), the
digits example for ``--epochs`` epochs, and ``--ctl`` calls of ``hvd-edl-ctl status`` while it
trains.  Every process is counted from BSD process accounting (root; ``accton``), classified by
the process tree under the run's launcher.  Each ``--tree`` (a checkout: its code is put first
on ``PYTHONPATH``) runs ``--rounds`` times, the trees alternating (A B A B ...), so both see the
same load on a shared machine; the table gives each tree's mean per process.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/suite/launcher_costs.py --tree /work/main \\
        --tree /work/wt1 [--rounds 3] [--epochs 2] [--ctl 3]

A second table, from ``getrusage`` (exact, no accounting): ``--repeat`` fresh processes each of
what a job starts most often, per tree: the discovery call (``sh -c`` the allocation script;
``python -m launcher.discovery.hostsfile``), the imports of ``hvd-edl-run`` and ``hvd-edl-ctl``,
the stub's start (its exec path: no zygote to reach, it becomes ``/bin/true``).

Accounting is one switch for the whole machine: nobody else may use ``accton`` meanwhile (the
script refuses when a run's own launcher is missing from the file).  Figures are per process
CPU seconds (user + system, 1/100 s resolution per process).
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
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

ROLES = ("launcher", "stub", "discovery", "ctl", "zygote", "worker", "other")


def read_accounting(path: Path) -> List[dict]:
    """The records of a BSD accounting file: comm, cpu_s (user + system), pid, ppid, forked
    (no exec after the fork)."""
    out = subprocess.run(["dump-acct", str(path)], capture_output=True, text=True,
                         check=True).stdout
    records = []
    for line in out.splitlines():
        f = [x.strip() for x in line.split("|")]
        if len(f) < 12:
            continue
        records.append({"comm": f[0], "cpu_s": float(f[2]) / 100 + float(f[3]) / 100,
                        "pid": int(f[9]), "ppid": int(f[10]), "forked": "F" in f[11]})
    return records


def classify(records: List[dict], launcher_pid: int, ctl_pids: List[int]) -> Dict[str, List]:
    """{role: [cpu_s of each process]} for the processes under ``launcher_pid`` (and the ctl
    calls).

    Raises:
        RuntimeError: the launcher is not in the records (someone else switched accounting).
    """
    by_pid = {r["pid"]: r for r in records}
    if launcher_pid not in by_pid:
        raise RuntimeError(f"launcher pid {launcher_pid} not in the accounting file: is "
                           "someone else using accton?")
    children = defaultdict(list)
    for r in records:
        children[r["ppid"]].append(r)

    def tree(pid):
        for c in children.get(pid, ()):
            yield c
            yield from tree(c["pid"])

    roles: Dict[str, List] = {k: [] for k in ROLES}
    roles["launcher"].append(by_pid[launcher_pid]["cpu_s"])
    for c in children.get(launcher_pid, ()):
        below = list(tree(c["pid"]))
        if c["comm"] == "sh":
            roles["discovery"].append(c["cpu_s"] + sum(x["cpu_s"] for x in below))
        elif c["comm"].startswith("python") and any(x["forked"] for x in below):
            roles["zygote"].append(c["cpu_s"])
            roles["worker"].extend(x["cpu_s"] for x in below)
        elif c["comm"].startswith("python"):
            roles["stub"].append(c["cpu_s"] + sum(x["cpu_s"] for x in below))
        else:
            roles["other"].append(c["cpu_s"] + sum(x["cpu_s"] for x in below))
    roles["ctl"].extend(by_pid[p]["cpu_s"] for p in ctl_pids if p in by_pid)
    return roles


def one_run(tree: Path, work: Path, epochs: int, ctl_calls: int,
            extra_env: Dict[str, str]) -> Dict[str, List]:
    """One job of ``tree``'s code under accounting: its processes' CPU by role."""
    bin_dir = Path(sys.executable).parent
    hosts = work / "hosts"
    hosts.write_text("localhost:2\n")
    hosts.chmod(0o600)
    job_file = work / "job.json"
    env = dict(os.environ, PYTHONPATH=str(tree), HVD_EDL_QUIET="1", OMP_NUM_THREADS="1")
    env.pop("HVD_EDL_JOB", None)
    for name, value in extra_env.items():  # "": unset
        if value:
            env[name] = value
        else:
            env.pop(name, None)
    acct = work / "pacct"
    acct.touch()
    discovery = f"{sys.executable} -I -S {tree / 'launcher/cluster/allocation.py'} {hosts}"
    cmd = [str(bin_dir / "hvd-edl-run"), "-np", "2", "--min-np", "1", "--max-np", "2",
           "--host-discovery-script", discovery, "--discovery-interval", "0.2",
           "--job-file", str(job_file), sys.executable, str(tree / "examples/train_digits.py"),
           "--epochs", str(epochs)]
    subprocess.run(["accton", str(acct)], check=True, capture_output=True)
    ctl_pids = []
    try:
        job = subprocess.Popen(cmd, cwd=str(tree), env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while len(ctl_pids) < ctl_calls and job.poll() is None and time.monotonic() < deadline:
            if job_file.exists():
                ctl = subprocess.Popen([str(bin_dir / "hvd-edl-ctl"), "--job", str(job_file),
                                        "status"], cwd=str(tree), env=env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                if ctl.wait(timeout=60) != 0 and job.poll() is None:
                    raise RuntimeError(f"{tree}: hvd-edl-ctl status exited {ctl.returncode}")
                ctl_pids.append(ctl.pid)
            else:
                time.sleep(0.2)  # the job file appears once the launcher listens
        job.wait(timeout=300)
        # the zygote exits once the launcher's pipe closes: its record comes a moment later
        time.sleep(1.0)
    finally:
        subprocess.run(["accton", "off"], capture_output=True)
    if job.returncode != 0:
        raise RuntimeError(f"{tree}: the job exited {job.returncode}")
    return classify(read_accounting(acct), job.pid, ctl_pids)


def micro(tree: Path, work: Path, repeat: int, extra_env: Dict[str, str]) -> Dict[str, float]:
    """CPU milliseconds per fresh process (``getrusage`` of the reaped children, so what they
    start counts too) of each of the commands a job starts most often, ``tree``'s code."""
    import resource
    env = dict(os.environ, PYTHONPATH=str(tree))
    for name, value in extra_env.items():
        if value:
            env[name] = value
        else:
            env.pop(name, None)
    hosts = work / "hosts"
    hosts.write_text("localhost:2\n")
    hosts.chmod(0o600)
    py = sys.executable
    commands = {
        "discovery allocation.py": ["sh", "-c", f"{py} -I -S "
                                    f"{tree / 'launcher/cluster/allocation.py'} {hosts}"],
        "discovery hostsfile": [py, "-m", "launcher.discovery.hostsfile", str(hosts)],
        "import hvd-edl-run": [py, "-c", "import launcher.cli"],
        "import hvd-edl-ctl": [py, "-c", "import launcher.ctl"],
        "stub start (exec path)": [py, "-I", "-S", str(tree / "launcher/spawn/zygote_client.py"),
                                   str(work / "none.sock"), "0", "--", "/bin/true"],
    }
    out = {}
    for name, cmd in commands.items():
        subprocess.run(cmd, env=env, cwd=str(work), stdout=subprocess.DEVNULL, check=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        for _ in range(repeat):
            subprocess.run(cmd, env=env, cwd=str(work), stdout=subprocess.DEVNULL, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        out[name] = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) \
            / repeat * 1000
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True,
                   help="a checkout whose code runs, optionally with environment changes: "
                        "PATH[,NAME=VALUE...] (an empty VALUE unsets NAME); repeat: the "
                        "trees alternate")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--ctl", type=int, default=3, help="hvd-edl-ctl status calls per run")
    p.add_argument("--repeat", type=int, default=20,
                   help="fresh processes per command in the getrusage table (0: none)")
    p.add_argument("--out", type=Path, help="also write the figures as JSON")
    a = p.parse_args()
    if os.geteuid() != 0:
        print("launcher_costs.py: BSD accounting (accton) needs root", file=sys.stderr)
        return 2
    per_tree = {str(t): defaultdict(list) for t in a.tree}
    runs = {str(t): [] for t in a.tree}
    for r in range(a.rounds):
        for t in a.tree:
            path, *changes = t.split(",")
            extra_env = dict(c.split("=", 1) for c in changes)
            with tempfile.TemporaryDirectory(prefix="launcher-costs-") as d:
                roles = one_run(Path(path).resolve(), Path(d), a.epochs, a.ctl, extra_env)
            for k, v in roles.items():
                per_tree[str(t)][k].extend(v)
            runs[str(t)].append({k: round(sum(v), 2) for k, v in roles.items()})
            print(f"round {r + 1} {t}: " + ", ".join(f"{k} {sum(v):.2f} s/{len(v)}"
                                                  for k, v in roles.items() if v), flush=True)
    print("\n" + "\n".join(f"tree {chr(65 + i)}: {t}" for i, t in enumerate(a.tree)))
    print(f"CPU seconds per process, mean over {a.rounds} runs a tree (n: processes)")
    print(f"{'role':<10}" + "".join(f"{chr(65 + i):>20}" for i in range(len(a.tree))))
    table = {}
    for k in ROLES:
        cells = []
        for t in a.tree:
            v = per_tree[str(t)][k]
            table.setdefault(str(t), {})[k] = {"mean_s": statistics.mean(v) if v else None,
                                               "n": len(v), "total_s": sum(v)}
            cells.append(f"{statistics.mean(v):.3f} (n {len(v)})" if v else "-")
        print(f"{k:<10}" + "".join(f"{c:>20}" for c in cells))
    micro_ms = {str(t): defaultdict(list) for t in a.tree}
    for r in range(a.rounds if a.repeat > 0 else 0):
        for t in a.tree:
            path, *changes = t.split(",")
            with tempfile.TemporaryDirectory(prefix="launcher-costs-") as d:
                for k, v in micro(Path(path).resolve(), Path(d), a.repeat,
                                  dict(c.split("=", 1) for c in changes)).items():
                    micro_ms[str(t)][k].append(v)
    if a.repeat > 0:
        print(f"\nCPU ms per fresh process, getrusage, {a.repeat} each, mean of {a.rounds} "
              f"rounds a tree")
        print(f"{'command':<26}" + "".join(f"{chr(65 + i):>20}" for i in range(len(a.tree))))
        for k in next(iter(micro_ms.values())):
            print(f"{k:<26}" + "".join(f"{statistics.mean(micro_ms[str(t)][k]):>20.1f}"
                                       for t in a.tree))
    if a.out:
        a.out.write_text(json.dumps({"per_process": table, "runs": runs,
                                     "fresh_process_ms": {t: {k: statistics.mean(v)
                                                              for k, v in m.items()}
                                                          for t, m in micro_ms.items()}},
                                    indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
