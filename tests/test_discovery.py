"""The host discovery contract (Horovod's format, one ``host[:slots]`` a line).  Bad output of
every kind is logged once, naming the script and the offending line or problem, the last good
host set is kept and the job goes on; the first discovery call failing ends the launch."""
import os
import stat
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from conftest import LAUNCHER, ROOT, long_digits, summary
from launcher.cli import parse_spec
from launcher.discovery import MAX_OUTPUT_BYTES, DiscoveryError, HostDiscoveryScript
from launcher.discovery import hosts
from launcher.discovery.hosts import HostSpecError, format_host_entry, parse_host_entry, parse_host_lines


# ---- the format, unit level --------------------------------------------------------------------

@pytest.mark.parametrize("entry, expected", [
    ("node1:4", ("node1", 4)),
    ("node-1.example.com", ("node-1.example.com", 1)),
    ("10.0.0.7:2", ("10.0.0.7", 2)),
    ("[::1]:2", ("::1", 2)),
    ("[::1]", ("::1", 1)),
    ("[fe80::1%eth0]:3", ("fe80::1%eth0", 3)),
    ("[2001:db8::7]:1024", ("2001:db8::7", 1024)),
])
def test_host_entry_parses(entry, expected):
    assert parse_host_entry(entry) == expected
    assert parse_host_entry(format_host_entry(*expected)) == expected  # round trip


@pytest.mark.parametrize("entry, message", [
    ("::1:2", "IPv6 address '::1:2' must be written in brackets"),
    ("[::1", "unknown host syntax '[::1'"),
    ("[1.2.3.4]:1", "'1.2.3.4' is not an IPv6 address"),
    ("not a host!", "unknown host syntax 'not a host!'"),
    ("a:0", "slots of host 'a' must be a positive integer (at most 1024), got '0'"),
    ("a:-1", "got '-1'"),
    ("a:+2", "got '+2'"),
    ("a:2.0", "got '2.0'"),
    ("a:two", "got 'two'"),
    ("a:\u00b2", "got '\u00b2'"),          # a digit to str.isdigit(), not to int()
    ("a:", "got ''"),
    ("a:99999999999999", "got '99999999999999'"),
    ("x" * 500 + ":1:1", "..."),           # a long line is cut in the message
])
def test_host_entry_rejects(entry, message):
    with pytest.raises(HostSpecError) as e:
        parse_host_entry(entry)
    assert message in str(e.value) and len(str(e.value)) < 200


def test_host_listed_twice_is_rejected_not_summed():
    with pytest.raises(HostSpecError, match=r"line 3: host 'a' is listed twice"):
        parse_host_lines("a:1\n# b:2\na:2\n")
    assert parse_host_lines("a:1\n# b:2\n\n[::1]:2\nc slots=3\n") == {"a": 1, "::1": 2, "c": 3}


@pytest.mark.parametrize("entry, expected", [
    ("Node-1.Example.COM:2", ("node-1.example.com", 2)),   # DNS ignores case: one spelling
    ("LOCALHOST", ("localhost", 1)),
    ("[::FFFF:7F00:1]:2", ("::ffff:127.0.0.1", 2)),          # IPv4-mapped, one text
    ("[0:0:0:0:0:0:0:1]", ("::1", 1)),
    ("my_svc:1", ("my_svc", 1)),                              # container service names
    ("a" * 63 + "." + "b" * 63, ("a" * 63 + "." + "b" * 63, 1)),
])
def test_host_names_are_put_in_one_canonical_form(entry, expected):
    assert parse_host_entry(entry) == expected


@pytest.mark.parametrize("entry, message", [
    ("x" * 5000 + ":1", "is 5000 characters long (at most 253)"),
    ("a" * 64 + ".b", "is not a valid host name (RFC 1123"),
    ("a..b", "is not a valid host name"),
    ("-a:1", "is not a valid host name"),
    ("a-.b", "is not a valid host name"),
    ("h\u00e9te", "is not a valid host name"),
    ("0:1", "'0' is neither a host name nor an IPv4 address"),        # inet_aton: 0.0.0.0
    ("127.1:1", "'127.1' is neither a host name nor an IPv4 address"),
    ("0x7f000001", "'0x7f000001' is neither a host name nor an IPv4 address"),
    ("017.0.0.1", "'017.0.0.1' is neither"),                          # octal to inet_aton
    ("10.0.0.256", "'10.0.0.256' is neither"),
    ("0.0.0.0:2", "'0.0.0.0' is the unspecified address, not a host"),
    ("[::]:2", "'::' is the unspecified address, not a host"),
    ("[fe80::1%$(reboot)]", "'$(reboot)' is not an interface name"),
])
def test_invalid_host_names_are_refused_in_one_short_line(entry, message):
    """Before: any run of letters, digits, dots, hyphens and underscores was a host, of any
    length; ``0`` and ``127.1`` (which ssh and the resolver read as 0.0.0.0 and 127.0.0.1)
    were remote names and ssh'd to."""
    with pytest.raises(HostSpecError) as e:
        parse_host_entry(entry)
    assert message in str(e.value) and len(str(e.value)) < 200 and "\n" not in str(e.value)


def test_a_host_listed_twice_in_two_spellings_is_rejected():
    with pytest.raises(HostSpecError, match=r"line 2: host 'node1' is listed twice"):
        parse_host_lines("node1:1\nNODE1:2\n")
    with pytest.raises(HostSpecError, match=r"host '::1' is listed twice"):
        hosts.parse_hosts_arg("[::1]:1,[0::1]:1")


def test_local_hosts_are_told_apart_without_a_network_lookup(tmp_path, monkeypatch):
    """Loopback in any spelling, ``localhost`` and this machine's names (any case; /etc/hosts
    names on a loopback line or beside the hostname) are local; anything else, the cluster's
    10.x namespace hosts included, is remote.  No resolver call is made (one can hang): each
    would raise here.  Before: ``LOCALHOST`` and ``::ffff:127.0.0.1`` were remote, and
    ``socket.getfqdn()`` (a reverse lookup) ran at every spawn."""
    etc_hosts = tmp_path / "hosts"
    etc_hosts.write_text("127.0.0.1 localhost\n127.0.1.1 Box.Example.com box # Debian\n"
                         f"10.1.2.3 {hosts.socket.gethostname()}.corp "
                         f"{hosts.socket.gethostname()} alias-of-me\n"
                         "10.0.0.2 h2\n")
    monkeypatch.setattr(hosts, "HOSTS_FILE", str(etc_hosts))

    def no_lookup(*args, **kwargs):
        raise AssertionError("a network lookup")
    for name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "getfqdn"):
        monkeypatch.setattr(hosts.socket, name, no_lookup)
    me = hosts.socket.gethostname()
    local = ["localhost", "LOCALHOST", "LocalHost", "127.0.0.1", "127.0.0.2", "::1", "[::1]",
             "::ffff:127.0.0.1", "::ffff:7f00:1", me, me.upper(), "box", "BOX.example.com",
             f"{me}.corp", "alias-of-me"]
    remote = ["10.0.0.2", "h2", "10.1.2.3", "example.com", "::ffff:10.0.0.2", "2001:db8::1",
              "localhost.example.com", "127.0.0.1.example.com"]
    assert [h for h in local if not hosts.is_local(h)] == []
    assert [h for h in remote if hosts.is_local(h)] == []


@pytest.mark.parametrize("spelling", ["LOCALHOST", "[::ffff:127.0.0.1]"])
def test_local_host_spellings_start_workers_without_ssh(tmp_path, spelling):
    """The real launcher, a static job on ``-H <spelling>:1``: the worker starts here, no ssh.
    Before: both spellings were taken for remote hosts and ssh'd to (exit 255 without an sshd,
    a second copy of the job's user session with one)."""
    marker = tmp_path / "ran"
    proc = subprocess.run([LAUNCHER, "-np", "1", "-H", f"{spelling}:1", sys.executable, "-c",
                           f"open({str(marker)!r}, 'w')"],
                          capture_output=True, text=True, cwd=str(ROOT), timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker.exists() and "ssh" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("flag, value, message", [
    ("-H", "x" * 5000 + ":1", "is 5000 characters long"),
    ("-H", "localhost:1,0:1", "'0' is neither a host name nor an IPv4 address"),
    ("--hostfile", "localhost:1\n127.1 slots=2\n", "line 2: '127.1' is neither"),
])
def test_invalid_hosts_on_the_command_line_are_a_usage_error(tmp_path, flag, value, message):
    """``-H`` and ``--hostfile`` with a bad host: exit 2 with one short line, nothing started."""
    if flag == "--hostfile":
        (tmp_path / "hostfile").write_text(value)
        value = str(tmp_path / "hostfile")
    marker = tmp_path / "ran"
    proc = subprocess.run([LAUNCHER, "-np", "1", flag, value, sys.executable, "-c",
                           f"open({str(marker)!r}, 'w')"],
                          capture_output=True, text=True, cwd=str(ROOT), timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert message in line and len(line) < 300, proc.stderr
    assert len(proc.stderr) < 2000 and not marker.exists()


def test_discovery_timeout_defaults_to_5_s():
    spec = parse_spec(["--host-discovery-script", "./d.sh", "python", "t.py"])
    assert spec.discovery.timeout_s == 5.0


# ---- the script runner, unit level -------------------------------------------------------------

def test_ipv6_output_is_parsed(tmp_path):
    d = HostDiscoveryScript("printf '[::1]:2\\n[fe80::2]\\n127.0.0.1:1\\n'", slots=3)
    assert d.find_available_hosts_and_slots() == {"::1": 2, "fe80::2": 3, "127.0.0.1": 1}


def test_failing_scripts_messages_are_distinct_problems_digits_aside():
    """Before (issue 18): a failing script's problem was its exit code alone, so a hosts file
    that changed from one bad state to another was reported once.  Now what it says counts, but
    a number in the message (a time, a count) does not make a new problem."""
    keys = []
    for said in ("line 1: bad slots", "line 2: host 'a' listed twice", "lists no hosts",
                 "lists no hosts", "took 12 ms", "took 345 ms"):
        d = HostDiscoveryScript(f"echo \"hostsfile: {said}\" >&2; exit 1")
        with pytest.raises(DiscoveryError, match=f"exited with code 1: hostsfile: {said}") as e:
            d.find_available_hosts_and_slots()
        keys.append(e.value.key)
    assert len(set(keys[:3])) == 3 and keys[2] == keys[3] and keys[4] == keys[5]


def test_reasons_for_left_out_hosts_are_kept():
    """A spot script's "<host> left out: <reason>" stderr lines are what the launcher names when
    the host's workers leave (``HostDiscoveryScript.reasons``); before, stderr of a good call was
    dropped."""
    d = HostDiscoveryScript("echo 'gce: 10.0.0.2 left out: preempted (instance/preempted TRUE)' "
                            ">&2; echo 'gce: 10.0.0.3 metadata timeout: kept' >&2; "
                            "printf '10.0.0.1:2\n10.0.0.3:2\n'")
    assert d.find_available_hosts_and_slots() == {"10.0.0.1": 2, "10.0.0.3": 2}
    assert d.reasons == {"10.0.0.2": "preempted (instance/preempted TRUE)"}


def test_hanging_script_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    d = HostDiscoveryScript(f"sleep 300 & echo $! > {pid_file}; echo a:1; wait", timeout_s=1)
    with pytest.raises(DiscoveryError, match=r"did not finish within 1 s \(--discovery-timeout\)"):
        d.find_available_hosts_and_slots()
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the script's child outlived the timeout"
        time.sleep(0.05)


def test_endless_output_is_cut_at_1_mib():
    d = HostDiscoveryScript("yes localhost:2", timeout_s=60)
    with pytest.raises(DiscoveryError, match=f"printed more than {MAX_OUTPUT_BYTES} bytes"):
        d.find_available_hosts_and_slots()   # not "did not finish": it was cut, not timed out


# ---- the launcher: first call ------------------------------------------------------------------

FIRST_CALL_CASES = {
    "malformed": ("printf 'localhost:2\\nlocalhost 2\\n'", "output line 2: unknown host syntax"),
    "empty": ("true", "printed no hosts"),
    "exit": ("echo scheduler down >&2; exit 4", "exited with code 4: scheduler down"),
    "hang": ("sleep 60", "did not finish within 1 s (--discovery-timeout)"),
    "not executable": (None, "is not executable (chmod +x"),
    "host name too long": (f"printf 'localhost:1\\n{'x' * 5000}:1\\n'",
                           "output line 2: host name 'xxxxxxxx"),
    "shorthand address": ("printf 'localhost:1\\n0:1\\n'",
                          "output line 2: '0' is neither a host name nor an IPv4 address"),
}


@pytest.mark.parametrize("case", FIRST_CALL_CASES)
def test_first_discovery_failure_ends_the_launch(tmp_path, case):
    body, message = FIRST_CALL_CASES[case]
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\n{body or 'echo localhost:1'}\n")
    script.chmod(0o644 if body is None else 0o755)
    started = tmp_path / "worker-started"
    proc = subprocess.run([LAUNCHER, "--discovery-timeout", "1", "--host-discovery-script",
                           str(script), sys.executable, "-c",
                           f"open({str(started)!r}, 'w')"],
                          capture_output=True, text=True, cwd=str(ROOT), timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert (f"hvd-edl-run: error: first host discovery failed, nothing launched: "
            f"host discovery script {script}") in proc.stderr
    assert message in proc.stderr
    assert max(len(line) for line in proc.stderr.splitlines()) < 400, proc.stderr[:2000]
    assert not started.exists()


# ---- the launcher: a running job fed bad output ------------------------------------------------

BAD_OUTPUTS = [  # (case, script body, what the one log line must say)
    ("malformed line", "printf 'localhost:2\\nnot a host!\\n'",
     "output line 2: unknown host syntax 'not a host!'"),
    ("slots zero", "echo localhost:0",
     "output line 1: slots of host 'localhost' must be a positive integer (at most 1024), got '0'"),
    ("slots not a number", "echo localhost:two", "got 'two'"),
    ("duplicate host", "printf 'localhost:2\\nlocalhost:1\\n'",
     "output line 2: host 'localhost' is listed twice"),
    ("host name too long", f"printf 'localhost:2\\n{'y' * 5000}:1\\n'",
     "output line 2: host name 'yyyyyyyy"),
    ("shorthand address", "printf 'localhost:2\\n127.1:1\\n'",
     "output line 2: '127.1' is neither a host name nor an IPv4 address"),
    ("empty output", "true", "printed no hosts"),
    ("over 1 MiB", "yes localhost:2 | head -c 2000000",
     f"printed more than {MAX_OUTPUT_BYTES} bytes (1 MiB limit)"),
    ("non-zero exit", "echo cannot reach the scheduler >&2; exit 3",
     "exited with code 3: cannot reach the scheduler"),
    ("hang", "sleep 60", "did not finish within 1 s (--discovery-timeout): killed"),
]


@pytest.mark.long
def test_bad_discovery_output_is_logged_once_and_the_job_goes_on(tmp_path, job_factory):
    """One job, fed each bad output in turn: each gives exactly one launcher line naming the
    script and the problem (no repeat while it persists), no generation change, and a line
    when discovery recovers; the job finishes at its original world size."""
    script, calls = tmp_path / "discover.sh", tmp_path / "calls"

    def serve(body):
        new = tmp_path / "discover.new"
        new.write_text(f"#!/bin/sh\necho >> {calls}\n{body}\n")
        new.chmod(0o755)
        os.replace(new, script)   # atomic: no call ever runs half a script

    def n_calls():
        return len(calls.read_text()) if calls.exists() else 0

    serve("echo localhost:2")
    job = job_factory(["-np", "2", "--min-np", "1", "--max-np", "4", "--discovery-interval",
                       "0.2", "--discovery-timeout", "1", "--host-discovery-script",
                       str(script)], long_digits(tmp_path))
    job.wait_generation(1)
    prefix = f"hvd-edl-run: host discovery script {script}"
    suffix = "; keeping the last good host set localhost:2"

    def lines_with(text):
        return [ln for ln in job.output().splitlines() if text in ln]

    for case, body, message in BAD_OUTPUTS:
        serve(body)
        line = job.wait_for(f"the line for {case}", lambda: lines_with(message), 60)[0]
        assert line.startswith(prefix) and line.endswith(suffix), line
        seen = n_calls()
        job.wait_for(f"3 more discovery calls ({case})", lambda: n_calls() >= seen + 3, 60)
        assert len(lines_with(message)) == 1, f"{case} logged more than once"
    script.chmod(stat.S_IRUSR | stat.S_IWUSR)   # not executable any more
    job.wait_for("the not-executable line",
                 lambda: lines_with(f"{prefix} is not executable (chmod +x {script})"), 60)
    serve("echo localhost:2")
    job.wait_for("the recovery line",
                 lambda: lines_with("hvd-edl-run: host discovery recovered: localhost:2"), 60)
    job.end_training()
    assert job.finish() == 0, job.output()[-3000:]
    assert [e["generation"] for e in job.events()] == [1]   # no change from bad output
    assert summary(tmp_path)["world_size"] == 2
    assert len(lines_with("host discovery recovered")) == 1


def test_demo_timetable_waits_for_the_job_with_an_event_log(tmp_path):
    """``examples/discover_timetable.py --event-log``: each phase counts from when the job
    reached the previous size, so slow workers do not make the demo skip a phase."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from discover_timetable import current_slots
    finally:
        sys.path.pop(0)
    table, t0 = [(0, 2), (8, 4), (18, 1), (26, 3)], 1000.0
    assert current_slots(table, t0, t0 + 19) == 1  # plain seconds since the first call
    events = []
    assert current_slots(table, t0, t0 + 100, events) == 2  # the job never trained at 2: hold
    events.append({"time": t0 + 16, "world_size": 2})  # workers took 16 s to start
    assert [current_slots(table, t0, t0 + s, events) for s in (23.9, 24.1)] == [2, 4]
    events.append({"time": t0 + 40, "world_size": 4})  # joiners took 16 s to build
    assert [current_slots(table, t0, t0 + s, events) for s in (49.9, 50.1)] == [4, 1]
    events.append({"time": t0 + 51, "world_size": 1})
    assert [current_slots(table, t0, t0 + s, events) for s in (58.9, 59.1)] == [1, 3]
    script = [sys.executable, str(ROOT / "examples" / "discover_timetable.py"), "--schedule",
              "0:2,8:4", "--clock", str(tmp_path / "clock"), "--event-log",
              str(tmp_path / "missing.jsonl")]
    assert subprocess.run(script, capture_output=True, text=True, check=True).stdout == \
        "localhost:2\n"
