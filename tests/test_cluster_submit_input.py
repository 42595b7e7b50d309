"""What a ``submit`` may hand to ``execve`` (issue 40): the checks of
:mod:`launcher.cluster.exec_input` (pure), a real service started over stored jobs no run of
which can start (a ``=`` in an environment name, a NUL, a non-string argument: what a store
written before those checks may hold) that fails each with its reason and keeps serving, and a
request the busy loop did not take in time answered "nothing was done" and never carried out.
Waits poll conditions with deadlines, never fixed sleeps."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from test_cluster_service import CLI, ROOT, service, wait_for  # noqa: F401


def test_exec_input_refuses_what_execve_cannot_take_in_one_line():
    from launcher.cluster.exec_input import (MAX_STRING_BYTES, BadExecInput, check_argv,
                                             check_environ, check_name, check_path)
    from launcher.cluster.runs import environment
    assert check_argv(["python3", "t.py", "--lr", "0.1"]) == ["python3", "t.py", "--lr", "0.1"]
    assert check_environ({"PATH": "/usr/bin", "_x1": "", "a": "b=c"}, "environ")
    assert check_environ(None, "env") == {}
    assert check_path("/home/u/é", "cwd") == "/home/u/é"
    bad = [
        (lambda: check_argv([]), "no training command"),
        (lambda: check_argv("python3 t.py"), "no training command"),
        (lambda: check_argv(["python3", "t.py", "x\x00y"]), "argv[2] contains a NUL"),
        (lambda: check_argv(["python3", 5]), "argv[1] must be a string"),
        (lambda: check_argv(["python3", "\ud800"]), "argv[1] is not encodable"),
        (lambda: check_argv(["python3", "x" * (MAX_STRING_BYTES + 1)]), "bytes long"),
        (lambda: check_argv(["x"] * 5000), "5000 words"),
        (lambda: check_argv([""]), "argv[0] is empty"),
        (lambda: check_environ({"A=B": "x"}, "environ"), "'A=B' is not a variable name"),
        (lambda: check_environ({"1A": "x"}, "environ"), "'1A' is not a variable name"),
        (lambda: check_environ({"": "x"}, "environ"), "'' is not a variable name"),
        (lambda: check_environ({"BASH_FUNC_f%%": "() {}"}, "environ"), "not a variable name"),
        (lambda: check_environ({"A\x00": "x"}, "environ"), "not a variable name"),
        (lambda: check_environ({"A": "x\x00"}, "env"), "env 'A' contains a NUL"),
        (lambda: check_environ({"A": 1}, "env"), "env 'A' must be a string"),
        (lambda: check_environ(["A=1"], "env"), "env must map names to strings"),
        (lambda: check_environ({f"V{i}": "" for i in range(5000)}, "environ"), "5000 variables"),
        (lambda: check_path("/tmp\x00x", "cwd"), "cwd contains a NUL"),
        (lambda: check_path(["/tmp"], "cwd"), "cwd must be a path"),
        (lambda: environment(["A=B=C", "1X=y"]), "--env '1X=y': expected NAME=VALUE"),
        (lambda: check_name("x\x1b]0;pwned\x07"), "has a control character"),
        (lambda: check_name("a\nj9 fake row"), "has a control character"),
        (lambda: check_name("n" * 65), "at most 64"),
    ]
    assert check_name("résumé run 1") == "résumé run 1"
    for fn, words in bad:
        with pytest.raises(ValueError) as e:
            fn()
        assert words in str(e.value) and "\n" not in str(e.value), (words, str(e.value))
        assert getattr(e.value, "status", 400) == 400
    assert isinstance(BadExecInput("x"), ValueError)


def test_a_restarted_service_fails_stored_jobs_that_cannot_start_and_keeps_serving(
        service, tmp_path):
    """Three jobs stored (as a service before these checks took them) whose runs cannot start:
    the service started over them ends each ``failed`` with why in its reason, frees their
    slots, stays up and answers; the same input sent to ``submit`` now is one 400 line."""
    from launcher.cluster import cluster_file
    from launcher.cluster.policies import make_policy
    from launcher.cluster.server import ClusterClient, ClusterRefused
    from launcher.cluster.service import Service as InProcess
    from launcher.cluster.store import JobRecord
    from launcher.discovery import FixedHosts
    script = tmp_path / "long.py"
    script.write_text("import time\ntime.sleep(60)\n")
    bad = {"env": dict(argv=[sys.executable, str(script)],
                       environ={"PATH": "/usr/bin:/bin", "A=B": "x"}),
           "nul": dict(argv=[sys.executable, str(script), "x\x00y"]),
           "int": dict(argv=[sys.executable, str(script), 5])}
    old = InProcess(tmp_path / "state", FixedHosts({"localhost": 3}), make_policy("fifo"),
                    fixed_pool=True)
    old.open()
    ids = {}
    try:
        for what, fields in bad.items():
            ids[what] = old.store.add_job(JobRecord(
                id="", name=what, cwd=str(tmp_path), env={}, np=1, min_np=1, max_np=1,
                priority=0, checkpoint_dir="", state="queued", submitted_at=time.time(),
                **fields)).id
    finally:
        old.close()

    svc = service("--policy", "fifo", "-H", "localhost:3")
    jobs = svc.wait_jobs(lambda j: all(j[i]["state"] == "failed" for i in ids.values()),
                         "the three stored jobs failed", timeout_s=30)
    said = {what: jobs[i]["reason"] for what, i in ids.items()}
    assert "cannot start its run 1: ValueError: illegal environment variable name" \
        in said["env"], said
    assert "ValueError: embedded null byte" in said["nul"], said
    assert "TypeError" in said["int"], said
    assert svc.proc.poll() is None, svc.output()
    client = ClusterClient(cluster_file.read(svc.cluster))
    status = client.call("status")
    assert status["slots"]["used"] == 0 and status["holders"] == {"localhost": []}, status
    for fields, words in [(dict(argv=[sys.executable, str(script)],
                                environ={"PATH": "/usr/bin:/bin", "A=B": "x"}),
                           "environ: 'A=B' is not a variable name"),
                          (dict(argv=[sys.executable, str(script), "x\x00y"]),
                           "argv[2] contains a NUL")]:
        with pytest.raises(ClusterRefused) as e:
            client.call("submit", cwd=str(tmp_path), np=1, **fields)
        assert e.value.status == 400 and words in str(e.value), str(e.value)
    r = svc.cli("submit", "--env", "A=B=x", "--env", "1X=y", "--", sys.executable,
                str(script))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "'1X=y': expected NAME=VALUE" in r.stderr, r.stderr
    assert len(client.call("status")["jobs"]) == 3 and svc.proc.poll() is None


def test_a_request_the_busy_loop_did_not_take_is_withdrawn_and_says_so(tmp_path,
                                                                          monkeypatch):
    """The loop blocked (here: in a request that waits for a gate): a submit answers 503 "nothing
    was done" (through the API and the command: one line, exit 1) and is never carried out once
    the loop goes on; a request the loop took but did not finish in time says so instead."""
    from launcher.cluster import cluster_file
    from launcher.cluster import service as service_mod
    from launcher.cluster.policies import make_policy
    from launcher.cluster.server import ClusterClient, ClusterRefused, ClusterServer, routes
    from launcher.discovery import FixedHosts
    monkeypatch.setattr(service_mod, "REQUEST_TIMEOUT_S", 0.5)
    svc = service_mod.Service(tmp_path / "state", FixedHosts({"localhost": 1}),
                              make_policy("fifo"), fixed_pool=True)
    svc.open()
    loop = threading.Thread(target=svc.run, name="loop", daemon=True)
    loop.start()
    server = ClusterServer(routes(svc), "127.0.0.1")
    port = server.start()
    path = cluster_file.write(tmp_path / "cluster.json", f"http://127.0.0.1:{port}",
                              str(svc.state_dir))
    client = ClusterClient(cluster_file.read(path))
    gate, entered = threading.Event(), threading.Event()

    def block():
        entered.set()
        gate.wait(30)
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    try:
        svc.post(block)
        svc.wake.set()
        assert entered.wait(10), "the loop did not take the blocking request"
        with pytest.raises(ClusterRefused) as e:
            client.call("submit", argv=[sys.executable, str(script)], cwd=str(tmp_path), np=1)
        assert e.value.status == 503 and str(e.value) == service_mod.BUSY_NOT_DONE, e.value
        r = subprocess.run(CLI + ["--cluster", str(path), "submit", "--", sys.executable,
                                  str(script)], capture_output=True, text=True, timeout=60,
                           cwd=str(tmp_path))
        assert r.returncode == 1 and r.stderr.strip().splitlines() == [
            f"hvd-edl-cluster: error: {service_mod.BUSY_NOT_DONE}"], (r.returncode, r.stderr)
        gate.set()
        assert svc.call(lambda: "passed") == "passed"  # the loop passed the withdrawn ones
        assert client.call("status")["jobs"] == [] and svc.store.jobs() == []

        gate.clear()  # taken, not finished within twice the wait: "under way"
        with pytest.raises(TimeoutError) as e:
            svc.call(lambda: gate.wait(30))
        assert str(e.value) == service_mod.BUSY_UNDER_WAY
        gate.set()
        assert svc.call(lambda: "passed") == "passed"
    finally:
        gate.set()
        server.stop()
        svc.close()
        loop.join(10)
