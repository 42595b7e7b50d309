"""Several users on one cluster (issue 40), with real Unix users made for the test
(tests/unix_users.py: ``useradd``, removed after) and a team install of hvd_edl every user can
run: the service learns who calls from the kernel (no secret: the cluster file is 0644), a root
service runs each job as its submitter on every host (locally and over ssh to the namespace
test cluster, tests/cluster.py) with the environment it was submitted from, everyone sees every
job with its user, and only the job's user may cancel it or read its logs (one line, exit 1).
Waits poll conditions with deadlines, never fixed sleeps."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from cluster import Cluster, ClusterUnavailable
from conftest import wait_for
from unix_users import TeamUsers, UsersUnavailable, team_install

ROOT = Path(__file__).resolve().parent.parent
# one xdist worker runs this file with the other namespace clusters' (tests/conftest.py): never
# two clusters at once, and the users are made once (useradd locks /etc/passwd)
pytestmark = pytest.mark.xdist_group("namespace-cluster")

JOB = """\
import json, os, socket, sys, time
import hvd_edl.torch as hvd
hvd.init()
me = os.environ["HVD_EDL_WORKER_ID"]
with open(os.path.join(sys.argv[1], me + ".json"), "w") as f:
    json.dump({"uid": os.getuid(), "host": socket.gethostname(), "size": hvd.size(),
               "mark": os.environ.get("TEAM_MARK"), "home": os.environ.get("HOME"),
               "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "ppid": os.getppid()}, f)
print(me, "runs as uid", os.getuid(), "on", socket.gethostname(), flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""




@pytest.fixture(scope="module")
def team():
    """Two users (alice, bob), a folder every user can enter, a team install in it (made once
    for this file's tests: each test works in folders of its own)."""
    try:
        users = TeamUsers(2)
    except UsersUnavailable as e:
        pytest.skip(str(e))
    shared = Path(tempfile.mkdtemp(prefix="hvdedl-team-"))
    os.chmod(shared, 0o755)
    try:
        try:
            bin_dir = team_install(shared / "prefix")
        except UsersUnavailable as e:
            pytest.skip(str(e))
        yield users.users, shared, bin_dir
    finally:
        users.close()
        shutil.rmtree(shared, ignore_errors=True)


def _home_work(user, shared: Path) -> Path:
    """A new folder of ``user``'s own under ``shared``, with the job script."""
    work = Path(tempfile.mkdtemp(prefix=user.name + "-", dir=shared))
    os.chmod(work, 0o755)
    (work / "job.py").write_text(JOB)
    (work / "out").mkdir()
    for p in (work, work / "job.py", work / "out"):
        os.chown(p, user.uid, user.gid)
    return work


def _cli(user, bin_dir: Path, cluster: Path, *args: str, where=None, cwd=None, **extra_env):
    """``hvd-edl-cluster --cluster F ARGS`` as ``user`` from the team install (in ``where``'s
    namespace when given: a ``Cluster`` and a host name)."""
    argv = user.argv([str(bin_dir / "hvd-edl-cluster"), "--cluster", str(cluster), *args])
    if where is not None:
        argv = where[0].exec_argv(where[1], argv)
    return subprocess.run(argv, env=user.env([str(bin_dir)], **extra_env), cwd=cwd or "/",
                          capture_output=True, text=True, timeout=60)


def test_a_service_of_an_ordinary_user_refuses_the_others(team):
    """The checkout's .venv (its interpreter under root's 0700 home) cannot run for a second
    user; the team install can.  A service run by alice takes alice's jobs, refuses bob's
    submit in one line (exit 1), and shows bob the queue (every user sees every job): identity
    from the kernel, with a cluster file of mode 0644 and no secret in it.  ``--user-quota 1``
    holds alice's second job back with a slot free; the metrics count per user."""
    (alice, bob), shared, bin_dir = team
    venv_cli = Path(sys.executable).parent / "hvd-edl-cluster"
    closed = [p for p in Path(os.path.realpath(sys.executable)).parents
              if not os.stat(p).st_mode & 0o001]   # e.g. /root, 0700: its venv is root's only
    if venv_cli.exists() and closed:
        r = bob.run([str(venv_cli), "--help"])
        assert r.returncode != 0 and "denied" in r.stderr, r
    work = _home_work(alice, shared)
    state, cluster = work / "state", work / "cluster.json"
    out = work / "serve.log"
    serve = subprocess.Popen(
        alice.argv([str(bin_dir / "hvd-edl-cluster"), "serve", "-H", "localhost:2",
                    "--state-dir", str(state), "--cluster-file", str(cluster),
                    "--metrics-port", "0", "--user-quota", "1", "--policy", "fifo"]),
        env=alice.env([str(bin_dir)]), cwd="/", stdout=open(out, "w"),
        stderr=subprocess.STDOUT)
    try:
        wait_for("alice's service", lambda: cluster.exists() or serve.poll() is not None, 60)
        assert serve.poll() is None, out.read_text()
        metrics_url = wait_for("its metrics' address", lambda: "serving" in out.read_text()
                               and out.read_text().split("metrics: ")[1].split()[0], 30,
                               out.read_text)
        assert os.stat(cluster).st_mode & 0o777 == 0o644
        assert "secret" not in json.loads(cluster.read_text())
        # a worker that only waits (no torch to import: a cheaper start; cancelled below,
        # well within the launcher's 120 s for a worker to register)
        r = _cli(alice, bin_dir, cluster, "submit", "--np", "1", "--", str(bin_dir / "python"),
                 "-c", "import time; time.sleep(120)", cwd=str(work))
        assert r.returncode == 0, r.stderr
        job = r.stdout.strip().splitlines()[-1]
        r = _cli(alice, bin_dir, cluster, "submit", "--np", "1", "--", "/bin/true")
        assert r.returncode == 0, r.stderr
        second = r.stdout.strip().splitlines()[-1]
        if closed:   # a job whose interpreter its user cannot run is refused at once
            r = _cli(alice, bin_dir, cluster, "submit", "--", sys.executable, "job.py",
                     cwd=str(work))
            assert r.returncode == 2 and f"{alice.name} cannot run it" in r.stderr, r
        r = _cli(bob, bin_dir, cluster, "submit", "--np", "1", "--", "/bin/true")
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r
        assert f"runs as {alice.name}: only {alice.name} may submit" in r.stderr, r.stderr
        r = _cli(bob, bin_dir, cluster, "status", "--json")
        assert r.returncode == 0, r.stderr
        rows = {j["id"]: j for j in json.loads(r.stdout)["jobs"]}
        assert list(rows) == [job, second], rows
        assert {j["user"] for j in rows.values()} == {alice.name}, rows
        # Prometheus, per user: alice's first job running on one slot, her second held back
        # by --user-quota 1 although a slot is free
        import requests
        want = [f'hvd_edl_cluster_user_jobs_running{{user="{alice.name}"}} 1.0',
                f'hvd_edl_cluster_user_slots_allocated{{user="{alice.name}"}} 1.0',
                f'hvd_edl_cluster_user_jobs_pending{{user="{alice.name}"}} 1.0',
                'hvd_edl_cluster_slots{state="free"} 1.0']
        wait_for("alice's job running in the metrics", lambda: all(
            w in requests.get(metrics_url, timeout=10).text for w in want), 60,
            lambda: requests.get(metrics_url, timeout=10).text[-3000:])
        for j in (second, job):
            r = _cli(alice, bin_dir, cluster, "cancel", j)
            assert r.returncode == 0, r.stderr
    finally:
        serve.terminate()
        serve.wait(30)


def test_root_service_runs_each_job_as_its_user_locally_and_over_ssh(team):
    """A root service on localhost plus one host of the namespace cluster (sshd): alice's job
    runs as alice on both (its launcher, the local worker, the worker over ssh with her own
    key), with the environment she submitted from; its folder and log are hers; bob sees it in
    status, but cancelling it or reading its logs is refused (one line, exit 1); alice reads
    her own logs; the job's GPUs (--assume-gpus) are one per worker.  A client on another
    machine is refused in one line; so is bob's job with alice's private script."""
    (alice, bob), shared, bin_dir = team
    try:
        c = Cluster(hosts=1)
    except ClusterUnavailable as e:
        pytest.skip(str(e))
    with c:
        c.authorize(alice.name, alice.public_key())
        work = _home_work(alice, shared)
        state = shared / f"state-{work.name}"   # root's, beside the users' folders
        cluster = shared / f"cluster-{work.name}.json"
        log = open(work / "serve.log", "w")
        serve = c.popen("launcher", [
            str(bin_dir / "python"), "-m", "launcher.cluster.cli", "serve", "-H",
            "localhost:1,h1:1", "-i", c.identity_file, "--network-interface", c.nic,
            "--assume-gpus", "--policy", "fifo", "--bind-address", "0.0.0.0",
            "--state-dir", str(state), "--cluster-file",
            str(cluster)], stdout=log, stderr=subprocess.STDOUT, cwd="/")
        where = (c, "launcher")
        try:
            wait_for("the service", lambda: cluster.exists() or serve.poll() is not None, 60)
            assert serve.poll() is None, (work / "serve.log").read_text()
            r = _cli(alice, bin_dir, cluster, "submit", "--np", "2", "--",
                     str(bin_dir / "python"), "job.py", str(work / "out"), str(work / "gate"),
                     where=where, cwd=str(work), TEAM_MARK="from-alice's-shell")
            assert r.returncode == 0, r.stderr
            job = r.stdout.strip().splitlines()[-1]
            folder = state / "jobs" / job

            def explain():
                return (work / "serve.log").read_text()[-2000:] + "".join(
                    p.read_text()[-2000:] for p in folder.glob("run*.log"))
            recs = wait_for("both workers' records", lambda: (
                lambda f: f if len(f) == 2 else None)(list((work / "out").glob("*.json"))),
                90, explain)
            seen = [json.loads(p.read_text()) for p in recs]
            assert {r["uid"] for r in seen} == {alice.uid}, seen
            assert sorted(r["host"] for r in seen)[0] == "h1", seen   # one over ssh
            assert {r["mark"] for r in seen} == {"from-alice's-shell"}, seen
            assert {r["home"] for r in seen} == {str(alice.home)}, seen
            assert all(r["size"] == 2 for r in seen), seen
            assert [r["gpus"] for r in seen] == ["0", "0"], seen  # each its host's one GPU
            # the launcher (the job file names it) and everything of the run: alice's
            launcher_pid = json.loads((folder / "job.json").read_text())["pid"]
            assert psutil.Process(launcher_pid).uids().real == alice.uid
            for p in [folder, folder / "run1.log", folder / "hosts", folder / "job.json"]:
                assert os.stat(p).st_uid == alice.uid, p
            assert os.stat(folder).st_mode & 0o777 == 0o700
            # everyone sees it, with its user; only alice may cancel it or read its logs
            r = _cli(bob, bin_dir, cluster, "status", "--json", where=where)
            row = next(j for j in json.loads(r.stdout)["jobs"] if j["id"] == job)
            assert row["user"] == alice.name and row["state"] == "running", row
            for args, verb in (("cancel", "cancel"), ("logs", "read the logs of")):
                r = _cli(bob, bin_dir, cluster, args, job, where=where)
                assert r.returncode == 1 and not r.stdout, r
                assert r.stderr.strip() == f"hvd-edl-cluster: error: job {job} is " \
                    f"{alice.name}'s: only {alice.name} (or root) may {verb} it", r.stderr
            r = wait_for("alice's logs with both workers", lambda: (
                lambda r: r if r.stdout.count("runs as uid") == 2 else None)(
                    _cli(alice, bin_dir, cluster, "logs", job, where=where)), 30, explain)
            assert r.returncode == 0 and f"runs as uid {alice.uid} on h1" in r.stdout, r
            # a job that could not start as its user is refused at submit, in one line: bob
            # cannot read alice's private script (root, who checks, could)
            private = work / "private.py"
            private.write_text("print('mine')\n")
            os.chown(private, alice.uid, alice.gid)
            private.chmod(0o600)
            r = _cli(bob, bin_dir, cluster, "submit", "--", str(bin_dir / "python"),
                     str(private), where=where, cwd="/")
            assert r.returncode == 2 and f"not a readable file (for {bob.name})" in r.stderr, r
            # a caller on another machine (h1 to the service's address): the kernel cannot
            # name it, so it is refused in one line (no secret to fall back on)
            url = json.loads(cluster.read_text())["url"]
            remote = work / "remote.json"
            remote.write_text(json.dumps({"url": url.replace("0.0.0.0", c.launcher.addr)}))
            r = subprocess.run(c.exec_argv("h1", [str(bin_dir / "hvd-edl-cluster"), "--cluster",
                                                  str(remote), "status"]),
                               capture_output=True, text=True, timeout=60, cwd="/")
            assert r.returncode == 1 and "only processes on its own host" in r.stderr, r
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
            (work / "gate").touch()
            wait_for(f"{job}'s run to end", lambda: (folder / "run1.exit").exists(), 60,
                     explain)
            assert json.loads((folder / "run1.exit").read_text())["exit_code"] == 0
        finally:
            (work / "gate").touch()
            serve.terminate()
            serve.wait(30)


def test_who_may_do_what_and_which_requests_are_refused(tmp_path):
    """The rules of launcher/cluster/users.py and the server's request checks, without
    processes: the job's user, root and the service's user may cancel or read the logs of a
    job, nobody else (one line naming whose job it is); a Host header must be an IP address or
    localhost; a cluster file that is a symbolic link or writable by others is refused."""
    from launcher.cluster import cluster_file, users
    from launcher.cluster.server import host_is_literal
    me = users.service_user()
    stranger = users.User(me.uid + 4242, "mallory", 4242, (4242,), "/")
    owner = users.User(me.uid + 4243, "alice", 4243, (4243,), "/")
    for caller in (owner, me, users.User.of_uid(0)):
        users.may_manage(caller, "j1", "alice", owner.uid, "cancel")
    with pytest.raises(users.Refusal) as e:
        users.may_manage(stranger, "j1", "alice", owner.uid, "cancel")
    assert str(e.value) == "job j1 is alice's: only alice (or root) may cancel it"
    with pytest.raises(users.Refusal):
        users.may_operate(stranger, "drain a host")
    assert all(host_is_literal(h) for h in ("127.0.0.1:8080", "[::1]:80", "localhost:1",
                                            "10.250.0.1"))
    assert not any(host_is_literal(h) for h in ("evil.example:8080", "", "localhost.evil:1"))
    good = cluster_file.write(tmp_path / "c.json", "http://127.0.0.1:1", "/state")
    assert os.stat(good).st_mode & 0o777 == 0o644
    assert cluster_file.read(good)["url"] == "http://127.0.0.1:1"
    (tmp_path / "link.json").symlink_to(good)
    with pytest.raises(cluster_file.ClusterFileError, match="symbolic link"):
        cluster_file.read(tmp_path / "link.json")
    os.chmod(good, 0o664)
    with pytest.raises(cluster_file.ClusterFileError, match="writable by others"):
        cluster_file.read(good)
    # a failed job's reason quotes its log: only those who may read its logs see it
    from types import SimpleNamespace
    store = SimpleNamespace(jobs=lambda: [SimpleNamespace(id="j1", uid=owner.uid)])

    def answer():
        return {"jobs": [{"id": "j1", "state": "failed", "reason": "db password=hunter2"}],
                "events": [{"job": "j1", "kind": "end", "state": "failed",
                            "reason": "db password=hunter2"}]}
    for caller in (owner, me):
        assert "hunter2" in json.dumps(users.hide_output(answer(), caller, store))
    assert "hunter2" not in json.dumps(users.hide_output(answer(), stranger, store))


def _is_worker_of(proc, uid: int, script: str) -> bool:
    """Whether ``proc`` is a worker of ``uid`` running ``script`` (``python SCRIPT ...``: not
    its stub, launcher or wrapper, whose command lines name it further on)."""
    try:
        cmd = proc.cmdline()
        return proc.uids().real == uid and len(cmd) > 1 and cmd[1].endswith(script)
    except psutil.Error:
        return False


def test_root_service_reads_a_users_job_and_its_shrink_frees_slots_for_another_user(team):
    """A root service (``--policy edl`` on localhost:2) reads the files in a user's job folder
    that the user owns (its job file: telemetry; its allocation file: what it holds), and no
    one else's (launcher/cluster/user_files.py): status shows alice's elastic job with its two
    workers in its ring, and when bob's job arrives the slot lent to alice's is taken back by a
    stop-free shrink, counted free from her job's telemetry, and bob's job starts on it.  Each
    user's workers are forked by a zygote the service keeps for that user, run as that user in
    a 0700 folder of theirs: bob's never by alice's (launcher/cluster/kept_zygotes.py)."""
    (alice, bob), shared, bin_dir = team
    work = _home_work(alice, shared)
    script = work / "ledger_main.py"
    shutil.copy(ROOT / "tests" / "horovod_style" / "ledger_main.py", script)
    os.chown(script, alice.uid, alice.gid)
    state = shared / f"state-{work.name}"   # root's, beside the users' folders
    cluster = shared / f"cluster-{work.name}.json"
    out = work / "serve.log"
    serve = subprocess.Popen([str(bin_dir / "python"), "-m", "launcher.cluster.cli", "serve",
                              "-H", "localhost:2", "--policy", "edl", "--hold", "1",
                              "--state-dir", str(state), "--cluster-file", str(cluster)],
                             stdout=open(out, "w"), stderr=subprocess.STDOUT, cwd="/")
    job = None
    try:
        wait_for("the service", lambda: cluster.exists() or serve.poll() is not None, 60)
        assert serve.poll() is None, out.read_text()
        from launcher.cluster import cluster_file
        from launcher.cluster.server import ClusterClient
        client = ClusterClient(cluster_file.read(cluster))

        def jobs():
            return {j["id"]: j for j in client.call("status")["jobs"]}

        def explain():
            return json.dumps(jobs(), indent=1)[-2500:] + out.read_text()[-2000:] + "".join(
                p.read_text()[-1500:] for p in state.glob("jobs/*/run*.log"))
        r = _cli(alice, bin_dir, cluster, "submit", "--min-np", "1", "--max-np", "2", "--",
                 str(bin_dir / "python"), str(script), "--dataset-size", "100000",
                 "--step-delay", "0.05", "--done-log", str(work / "done"), cwd=str(work))
        assert r.returncode == 0, r.stderr
        job = r.stdout.strip().splitlines()[-1]
        row = wait_for("alice's job with both workers in its ring", lambda: (
            lambda j: j if j["world_size"] == 2 and len(j["workers"]) == 2 else None)(
                jobs()[job]), 90, explain)
        assert row["user"] == alice.name and row["allocated"] == 2, row
        assert os.stat(state / "jobs" / job / "job.json").st_uid == alice.uid
        assert {w["host"] for w in row["workers"]} == {"localhost"}, row
        mine = [p for p in psutil.process_iter() if _is_worker_of(p, alice.uid, script.name)]
        assert len(mine) == 2 and len({p.ppid() for p in mine}) == 1, mine
        hers = psutil.Process(mine[0].ppid())
        bob_work = _home_work(bob, shared)
        (bob_work / "gate").touch()   # bob's job records and ends at once
        r = _cli(bob, bin_dir, cluster, "submit", "--np", "1", "--", str(bin_dir / "python"),
                 "job.py", str(bob_work / "out"), str(bob_work / "gate"), cwd=str(bob_work))
        assert r.returncode == 0, r.stderr
        theirs = r.stdout.strip().splitlines()[-1]
        def events():
            return [json.loads(x) for x in (state / "events.jsonl").read_text().splitlines()]

        # the job's state may read running before its `run` event is written (the event says
        # the wrapper started): wait for the event itself
        wait_for("bob's job to run on the slot taken back", lambda: [
            e for e in events() if e.get("job") == theirs and e.get("kind") == "run"], 60, explain)
        events = events()
        released = [e for e in events if e.get("job") == job and e.get("kind") == "released"]
        started = [e for e in events if e.get("job") == theirs and e.get("kind") == "run"]
        assert released and started and started[0]["at"] >= released[0]["at"], events
        assert jobs()[job]["runs"] == 1, jobs()[job]   # shrunk, not restarted
        rec = json.loads(wait_for("bob's record", lambda: next(
            (p.read_text() for p in (bob_work / "out").glob("*.json")), None), 90, explain))
        his = psutil.Process(rec["ppid"])
        for zygote, user in ((hers, alice), (his, bob)):
            from launcher.spawn import zygote_client
            assert zygote_client.ZYGOTE_BOOT in zygote.cmdline() and \
                zygote.uids().real == user.uid, (zygote.cmdline(), zygote.uids())
            folder = Path(next(a for a in zygote.cmdline() if a.endswith(".sock"))).parent
            assert folder.stat().st_uid == user.uid and folder.stat().st_mode & 0o777 == 0o700
        assert hers.pid != his.pid and rec["uid"] == bob.uid, rec
    finally:
        if job is not None:
            _cli(alice, bin_dir, cluster, "cancel", job)
            wait_for(f"{job}'s run to end", lambda: (state / "jobs" / job / "run1.exit")
                     .exists(), 60)
        serve.terminate()
        serve.wait(30)
