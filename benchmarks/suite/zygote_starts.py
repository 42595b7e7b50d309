"""Which tests start a zygote (issue 38): every start of ``hvd_edl.zygote`` (a launcher's own,
a kept one, a remote one on a namespace host, a user's) while a test runs, with the test, the
user, whether it is in a namespace host, and its parent's command line; then counts per file.
Each start costs its ``import hvd_edl.torch`` (about 3.5 CPU-s on the idle machine).

A pytest plugin (run it beside ``HVD_EDL_TEST_COSTS``, whose per-worker cgroups let it keep each
xdist worker's zygotes apart: as root, ``HVD_EDL_TEST_COSTS_CGROUPS=DIR``), then a summary:

    HVD_EDL_TEST_COSTS=/tmp/c.jsonl HVD_EDL_TEST_COSTS_CGROUPS=/sys/fs/cgroup/cpuacct/zs \\
      ZYGOTE_STARTS_OUT=/tmp/z.jsonl PYTHONPATH=$PWD:$PWD/benchmarks/suite \\
      .venv/bin/python -m pytest -p zygote_starts -n 2 --dist loadgroup tests/test_zygote.py ...
    .venv/bin/python benchmarks/suite/zygote_starts.py /tmp/z.jsonl

The plugin looks every 0.4 s (a zygote's import takes seconds, so none is missed) at processes
whose command line is the zygote's boot and that started after the session did.
"""
from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time

OUT_ENV = "ZYGOTE_STARTS_OUT"
BOOT = "hvd_edl.zygote as z"   # launcher.spawn.zygote_client.ZYGOTE_BOOT's module part
_current = {"test": "<session>"}
_seen = set()
_start = time.time()


def _ours(pid: int) -> bool:
    """In this xdist worker's cgroup (tests/conftest.py's, per worker: every zygote a test
    started, remote ones included); without one, a descendant of this process (a namespace
    host's zygote, started by its sshd, is then missed)."""
    folder = os.environ.get("HVD_EDL_TEST_COSTS_CGROUP")
    if not folder:
        import psutil
        return any(p.pid == os.getpid() for p in psutil.Process(pid).parents())
    want = ":" + folder.replace("/sys/fs/cgroup/cpuacct", "")
    with open(f"/proc/{pid}/cgroup") as f:
        return any("cpuacct" in line and line.rstrip().endswith(want) for line in f)


def _watch(out: str) -> None:
    import psutil
    own_netns = os.readlink("/proc/self/ns/net")
    while True:
        for p in psutil.process_iter(["pid", "cmdline", "create_time", "ppid", "uids"]):
            try:
                info = p.info
                if info["pid"] in _seen or info["create_time"] < _start or \
                        not any(BOOT in a for a in info["cmdline"] or ()):
                    continue
                _seen.add(info["pid"])
                if not _ours(info["pid"]):
                    continue
                try:
                    parent = " ".join(psutil.Process(info["ppid"]).cmdline())
                except psutil.Error:
                    parent = ""
                row = {"pid": info["pid"], "test": _current["test"], "uid": info["uids"].real,
                       "namespace_host": os.readlink(f"/proc/{info['pid']}/ns/net") != own_netns,
                       "parent": parent[:400], "at": round(time.time(), 1),
                       "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")
            except (psutil.Error, OSError):
                continue
        time.sleep(0.4)


def pytest_configure(config):
    out = os.environ.get(OUT_ENV)
    if out and (hasattr(config, "workerinput") or config.getoption("numprocesses", None) in
                (None, 0)):
        threading.Thread(target=_watch, args=(out,), daemon=True).start()


def pytest_runtest_logstart(nodeid, location):
    _current["test"] = nodeid


def summary(path: str) -> None:
    """Print the starts per test file and per kind (namespace host or not, user)."""
    rows = [json.loads(line) for line in open(path)]
    files = collections.Counter(r["test"].split("::")[0] for r in rows)
    print(f"{len(rows)} zygote starts")
    for name, n in files.most_common():
        hosts = sum(r["namespace_host"] for r in rows if r["test"].split("::")[0] == name)
        users = sorted({r["uid"] for r in rows if r["test"].split("::")[0] == name})
        print(f"  {name:45s} {n:3d}  (on namespace hosts: {hosts}; uids {users})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: zygote_starts.py STARTS.jsonl", file=sys.stderr)
        sys.exit(2)
    summary(sys.argv[1])
