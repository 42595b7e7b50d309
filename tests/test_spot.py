"""Ready discovery scripts for spot / preemptible nodes and clusters (launcher/discovery/): GCE
and AWS against a fake per-host metadata server on loopback, Kubernetes against a fake kubectl,
a plain hosts file; and one elastic job whose host gets a preemption notice and leaves
gracefully."""
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT, long_digits, summary
from fake_cloud import FakeCloud

DISCOVERY = ROOT / "launcher" / "discovery"
SCRIPTS = ["gce", "aws", "k8s", "hostsfile"]


@pytest.fixture
def cloud():
    c = FakeCloud()
    yield c
    c.close()


def run_script(name, *args, env=None):
    return subprocess.run([sys.executable, "-m", f"launcher.discovery.{name}", *map(str, args)],
                          capture_output=True, text=True, cwd=str(ROOT), timeout=60, env=env)


def hosts_file(tmp_path, text):
    path = tmp_path / "candidates.txt"
    path.write_text(textwrap.dedent(text).strip() + "\n")
    return path


def ends_of(stdout):
    """{host: ends= unix seconds or None} of a discovery script's output."""
    from launcher.discovery.hosts import parse_host_specs
    return {h: e.ends for h, e in parse_host_specs(stdout, None).items()}


def test_gce_prints_preempted_and_maintenance_hosts_with_their_end_in_30_s(tmp_path, cloud):
    path = hosts_file(tmp_path, """
        127.0.0.1:2
        127.0.0.2
        127.0.0.3:1
        127.0.0.4:4
    """)
    cloud.set("127.0.0.1")
    cloud.set("127.0.0.2", preempted="TRUE")
    cloud.set("127.0.0.3", maintenance_event="TERMINATE_ON_HOST_MAINTENANCE")
    cloud.set("127.0.0.4")
    before = time.time()
    r = run_script("gce", "--hosts-file", path, "--metadata-url", cloud.gce_url)
    after = time.time()
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()  # order and slots kept; the noticed hosts with their end
    assert [x.split()[0] for x in lines] == ["127.0.0.1:2", "127.0.0.2", "127.0.0.3:1",
                                             "127.0.0.4:4"], lines
    ends = ends_of(r.stdout)
    assert ends["127.0.0.1"] is None and ends["127.0.0.4"] is None, lines
    for host in ("127.0.0.2", "127.0.0.3"):  # GCE's 30 s from when the notice was seen
        assert before + 30 <= ends[host] <= after + 30, (host, ends, before, after)
    assert "127.0.0.2 ends in 30 s: instance/preempted is TRUE" in r.stderr
    assert "127.0.0.3 ends in 30 s: instance/maintenance-event is " \
        "TERMINATE_ON_HOST_MAINTENANCE" in r.stderr
    assert all(headers.get("Metadata-Flavor") == "Google" for _, _, headers in cloud.requests)


def test_gce_unreachable_metadata_keeps_the_host_unless_drop(tmp_path, cloud):
    path = hosts_file(tmp_path, "127.0.0.1\n127.0.0.2\n")
    cloud.set("127.0.0.1")
    cloud.set("127.0.0.2", down=True)
    r = run_script("gce", "--hosts-file", path, "--metadata-url", cloud.gce_url)
    assert r.returncode == 0 and r.stdout.split() == ["127.0.0.1", "127.0.0.2"], r.stderr
    assert "127.0.0.2 metadata unreachable (ConnectionError): kept" in r.stderr
    r = run_script("gce", "--hosts-file", path, "--metadata-url", cloud.gce_url,
                   "--unreachable", "drop")
    assert r.returncode == 0 and r.stdout.split() == ["127.0.0.1"], r.stderr
    # nothing answers: most likely a wrong URL, so the launcher should hear about it
    cloud.set("127.0.0.1", down=True)
    r = run_script("gce", "--hosts-file", path, "--metadata-url", cloud.gce_url)
    assert r.returncode == 1 and r.stdout == ""
    assert "metadata of all 2 hosts unreachable (is --metadata-url right?)" in r.stderr


def test_aws_spot_notice_prints_the_notice_end_with_imdsv2_or_v1(tmp_path, cloud):
    path = hosts_file(tmp_path, "127.0.0.1:2\n127.0.0.2:2\n127.0.0.3:2\n")
    cloud.set("127.0.0.1", imds="v2")
    cloud.set("127.0.0.2", imds="v2",
              instance_action='{"action": "terminate", "time": "2026-11-30T08:22:00Z"}')
    cloud.set("127.0.0.3", imds="v1", instance_action='{"action": "stop"}')
    before = time.time()
    r = run_script("aws", "--hosts-file", path, "--metadata-url", cloud.aws_url)
    after = time.time()
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[:2] == ["127.0.0.1:2", "127.0.0.2:2 ends=1796026920"], r.stdout
    ends = ends_of(r.stdout)  # the notice's own time; without one, AWS's two minutes
    assert ends["127.0.0.1"] is None and ends["127.0.0.2"] == 1796026920.0
    assert before + 120 <= ends["127.0.0.3"] <= after + 120, (ends, before, after)
    assert "127.0.0.2 ends in" in r.stderr and \
        "spot/instance-action: terminate at 2026-11-30T08:22:00Z" in r.stderr
    assert "127.0.0.3 ends in 120 s: spot/instance-action: stop" in r.stderr  # v1 fallback
    gets = [(p, h) for m, p, h in cloud.requests if m == "GET" and "/127.0.0.2/" in p]
    assert gets and all("X-aws-ec2-metadata-token" in h for _, h in gets)  # IMDSv2 token used


FAKE_KUBECTL = """\
#!{python}
import json, sys
with open({argv_log!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
with open({pods!r}) as f:
    pods = json.load(f)
if pods is None:
    sys.stderr.write("error: You must be logged in to the server (Unauthorized)\\n")
    sys.exit(1)
print(json.dumps({{"kind": "List", "items": pods}}))
"""


def _pod(name, ip, phase="Running", ready="True", deleting=False, created="2026-01-01T00:00:0"):
    meta = {"name": name, "creationTimestamp": created + name[-1] + "Z"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T01:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "podIP": ip,
                                         "conditions": [{"type": "Ready", "status": ready}]}}


@pytest.fixture
def kubectl(tmp_path):
    pods, argv_log = tmp_path / "pods.json", tmp_path / "kubectl-argv.jsonl"
    exe = tmp_path / "kubectl"
    exe.write_text(FAKE_KUBECTL.format(python=sys.executable, pods=str(pods),
                                       argv_log=str(argv_log)))
    exe.chmod(0o755)
    return exe, pods, argv_log


def test_k8s_lists_running_ready_pods_not_being_deleted(kubectl):
    exe, pods, argv_log = kubectl
    pods.write_text(json.dumps([
        _pod("train-3", "10.0.0.3"),
        _pod("train-1", "10.0.0.1"),
        _pod("train-2", "10.0.0.2", deleting=True),          # preempted / evicted
        _pod("train-4", "10.0.0.4", ready="False"),
        _pod("train-5", "10.0.0.5", phase="Pending"),
        _pod("train-6", "fd00::6"),
    ]))
    r = run_script("k8s", "-l", "app=train", "-n", "ml", "--kubectl", exe, "--slots", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["10.0.0.1:2", "10.0.0.3:2", "[fd00::6]:2"]  # oldest first
    argv = json.loads(argv_log.read_text().splitlines()[-1])
    assert argv[:6] == ["get", "pods", "-l", "app=train", "-o", "json"]
    assert argv[-2:] == ["-n", "ml"]
    r = run_script("k8s", "-l", "app=train", "--kubectl", exe, "--address", "name")
    assert r.stdout.split() == ["train-1", "train-3", "train-6"]


def test_k8s_kubectl_failure_exits_1_with_its_message(kubectl):
    exe, pods, _ = kubectl
    pods.write_text("null")
    r = run_script("k8s", "-l", "app=train", "--kubectl", exe)
    assert r.returncode == 1 and r.stdout == ""
    assert "exited with code 1: error: You must be logged in to the server" in r.stderr
    pods.write_text(json.dumps([_pod("train-1", "10.0.0.1", deleting=True)]))
    r = run_script("k8s", "-l", "app=train", "--kubectl", exe)
    assert r.returncode == 1 and "no Running, Ready pod matches -l app=train" in r.stderr


def test_hostsfile_validates_and_is_reread_every_call(tmp_path):
    path = hosts_file(tmp_path, "a:2\n# comment\nb slots=3\n[::1]\n")
    r = run_script("hostsfile", path)
    assert r.returncode == 0 and r.stdout.split() == ["a:2", "b:3", "[::1]"], r.stderr
    path.write_text("a:2\nb:zero\n")
    r = run_script("hostsfile", path)
    assert r.returncode == 1 and r.stdout == ""
    assert f"{path}: line 2: slots of host 'b' must be a positive integer (at most 1024)" in r.stderr
    path.write_text("c\n")
    assert run_script("hostsfile", path).stdout.split() == ["c"]


def test_scripts_are_executable_files_too(tmp_path):
    for name in SCRIPTS:
        f = DISCOVERY / f"{name}.py"
        assert os.access(f, os.X_OK), f"{f} is not executable"
        assert f.read_text().startswith("#!/usr/bin/env python3\n")
    path = hosts_file(tmp_path, "a:2\n")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    r = subprocess.run([str(DISCOVERY / "hostsfile.py"), str(path)], capture_output=True,
                       text=True, env=env, cwd=str(tmp_path), timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["a:2"], r.stderr


def test_spot_notice_drains_its_host_gracefully(tmp_path, job_factory, cloud):
    """GCE preemption notice on one of three hosts (listed on with ``ends=``, 30 s ahead): its
    worker leaves at a commit boundary (scale_in, nothing rolled back, no failure) and the job
    finishes on the other two.
    Prints notice-to-exit: from setting the notice to the worker process's exit."""
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    for h in hosts:
        cloud.set(h)
    candidates = hosts_file(tmp_path, "\n".join(hosts))
    script = (f"{sys.executable} -m launcher.discovery.gce --hosts-file {candidates} "
              f"--metadata-url {cloud.gce_url} --request-timeout 1")
    job = job_factory(["-np", "3", "--min-np", "1", "--max-np", "3", "--discovery-interval",
                       "0.5", "--host-discovery-script", script], long_digits(tmp_path))
    ev1 = job.wait_generation(1, timeout_s=120)
    assert [m.split(":")[0] for m in ev1["members"]] == \
        ["w1@127.0.0.1", "w2@127.0.0.2", "w3@127.0.0.3"]
    job.wait_for("a progress line", lambda: "sample/s]" in job.output(), 60)
    pid = job.wait_for("pid of w3", lambda: job.worker_pid("w3"), 60)
    worker = psutil.Process(pid)
    noticed_at, noticed_wall = time.monotonic(), time.time()
    cloud.set("127.0.0.3", preempted="TRUE")
    worker.wait(timeout=120)
    notice_to_exit_s = time.monotonic() - noticed_at
    ev = job.wait_generation(2)
    print(f"\nnotice-to-exit: {notice_to_exit_s:.2f} s from the GCE preemption notice on "
          f"127.0.0.3 to its worker's exit; it had left the ring (generation 2 formed) after "
          f"{ev['time'] - noticed_wall:.2f} s (discovery interval 0.5 s)")
    assert ev["kind"] == "scale_in" and ev["rolled_back_steps"] == 0
    assert [m.split("@")[0] for m in ev["members"]] == ["w1", "w2"]
    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]
    out = job.output()
    kinds = [e["kind"] for e in job.events()]
    assert "w3@127.0.0.3:0 failed" not in out and "failure" not in kinds
    notice = job.notes("notice")  # the host listed on with ends=, not dropped
    assert [e["host"] for e in notice] == ["127.0.0.3"], notice
    assert noticed_wall + 30 <= notice[0]["ends"] <= noticed_wall + 31, notice
    assert summary(tmp_path)["world_size"] == 2
