"""The worker fork server keeps Horovod's contract (issue 38, ``docs/zygote.md``): a worker forked
by a zygote sees what an exec'd one sees (environment with the ``HOROVOD_*`` variables, argv,
working directory, ``sys.path[0]``, ``__file__``, its own ``/proc/PID/environ`` and ``cmdline``,
standard streams), ends with the same exit codes (a death by signal included), gets the signals
its stub gets, dies with its stub (even a SIGKILLed one), and a kill -9 of it reaches the
launcher as -9; commands a zygote does not run take the exec path.  Real processes: one zygote
for the module (it imports ``hvd_edl.torch`` once), stubs run as the launcher runs them, and
two ``hvd-edl-run`` jobs for the switch."""
from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import LAUNCHER, ROOT, wait_for
from launcher.spawn import zygote_client
from launcher.spawn.local_zygotes import LocalZygotes

PROBE = '''
import json, os, sys, signal, time
mode = sys.argv[1] if len(sys.argv) > 1 else ""
def proc(name):
    return open(f"/proc/{os.getpid()}/{name}", "rb").read().split(b"\\0")[:-1]
if mode == "term":
    def on_term(sig, frame):
        print("got", sig, flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, on_term)
out = {"argv": sys.argv, "orig_argv": sys.orig_argv, "path0": sys.path[0], "cwd": os.getcwd(),
       "file": globals().get("__file__"), "name": __name__, "spec": __spec__ and __spec__.name,
       "env": {k: v for k, v in os.environ.items() if k.startswith(("HOROVOD_", "PROBE_"))},
       "c_env": os.getenv("PROBE_C") and __import__("ctypes").CDLL(None).getenv is not None,
       "proc_cmdline": [a.decode() for a in proc("cmdline")],
       "proc_env": sorted(a.decode() for a in proc("environ") if a.startswith((b"HOROVOD_", b"PROBE_"))),
       "line_buffering": sys.stdout.line_buffering, "write_through": sys.stdout.write_through,
       "stdin": sys.stdin.read(), "main_names": sorted(k for k in globals() if not k.startswith("__"))[:3],
       "pgid_is_pid": os.getpgid(0) == os.getpid(),
       "dunders": sorted(k for k in globals() if k.startswith("__")),
       "fds": sorted(int(f) for f in os.listdir("/proc/self/fd"))}
print(json.dumps(out), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if mode == "exit":
    sys.exit(7)
if mode == "raise":
    raise ValueError("boom")
if mode == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
if mode == "interrupt":
    raise KeyboardInterrupt
if mode in ("term", "wait"):
    open(sys.argv[2], "w").write(str(os.getpid()))
    time.sleep(120)
'''


# The tests that share the module's zygote run on one xdist worker: each worker that ran one
# of them started its own (its import: about 3.5 CPU-s of make test, issue 38).
ONE_ZYGOTE = pytest.mark.xdist_group("test-zygote-module-zygote")


@pytest.fixture(scope="module")
def zygotes():
    z = LocalZygotes()
    yield z
    z.close()


@pytest.fixture
def probe(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    (tmp_path / "probe_mod.py").write_text(PROBE)
    return path


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HOROVOD_RANK="1", HOROVOD_SIZE="2",
               HOROVOD_LOCAL_RANK="1", HOROVOD_HOSTNAME="localhost", PROBE_X="x y=z")
    env.pop("PYTHONUNBUFFERED", None)
    env.update(extra)
    return env


def _start(zygotes, command, cwd, env, **kw):
    """Start ``command`` as the launcher does: through a stub when ``zygotes`` is given."""
    argv = zygotes.stub_command(command, env, {"HOROVOD_RANK": "1"}) if zygotes else command
    if zygotes:
        assert argv is not None and argv[-len(command):] == command
    return subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, **kw)


def _run(zygotes, command, cwd, env):
    p = _start(zygotes, command, cwd, env)
    out, err = p.communicate(timeout=120)
    return p.returncode, out.decode(), err.decode()


def _seen(out):
    return json.loads(out.splitlines()[0])


@ONE_ZYGOTE
def test_a_forked_worker_sees_what_an_execd_one_sees(zygotes, probe, tmp_path):
    env = _env()
    for command in ([sys.executable, "probe.py", "a", "b c"],
                    [sys.executable, "-u", "probe.py"],
                    [sys.executable, "-m", "probe_mod", "x"]):
        execd = _run(None, command, str(tmp_path), env)
        forked = _run(zygotes, command, str(tmp_path), env)
        assert execd[0] == forked[0] == 0, (execd, forked)
        assert _seen(forked[1]) == _seen(execd[1]), (command, forked[1], execd[1])
        assert forked[1] == execd[1] and forked[2] == execd[2] == "to stderr\n"
    seen = _seen(forked[1])
    assert seen["env"]["HOROVOD_RANK"] == "1" and "HOROVOD_RANK=1" in seen["proc_env"]
    assert seen["proc_cmdline"] == [sys.executable, "-m", "probe_mod", "x"]


@ONE_ZYGOTE
def test_exit_codes_and_output_match_the_exec_path(zygotes, probe, tmp_path):
    env = _env()
    for mode, code in (("exit", 7), ("raise", 1), ("signal", -signal.SIGTERM),
                       ("interrupt", -signal.SIGINT)):
        command = [sys.executable, "probe.py", mode]
        execd = _run(None, command, str(tmp_path), env)
        forked = _run(zygotes, command, str(tmp_path), env)
        assert execd[0] == forked[0] == code, (mode, execd, forked)
        assert forked[2] == execd[2], (mode, forked[2], execd[2])   # the same traceback


EXIT_PROBE = '''
import atexit, ctypes, gzip, os, sys, tempfile, threading, time, zipfile
out, mode = sys.argv[1], sys.argv[2]


class Noted:
    def __init__(self, path):
        self.path = path

    def __del__(self, open=open):   # an exec'd interpreter's teardown may have lost builtins
        with open(self.path, "w") as f:
            f.write("del ran")


noted = Noted(os.path.join(out, "del"))
left_open = open(os.path.join(out, "left_open.txt"), "w")
left_open.write("buffered, never closed")
gz = gzip.open(os.path.join(out, "left.gz"), "wt")
gz.write("gzip, never closed")
zf = zipfile.ZipFile(os.path.join(out, "left.zip"), "w")
zf.writestr("a.txt", "zip, never closed")
tmp = tempfile.NamedTemporaryFile(dir=out, prefix="tmp-")
atexit.register(lambda: open(os.path.join(out, "atexit"), "w").write("atexit ran"))
main_done = threading.Event()


def outlive_main():
    main_done.wait(30)
    time.sleep(0.2)   # still running well after the main thread ended
    open(os.path.join(out, "thread"), "w").write("thread ran")


threading.Thread(target=outlive_main).start()
ctypes.CDLL(None).printf(b"from C's stdio, buffered")
print("from Python, no newline", end="")
main_done.set()
if mode == "code":
    sys.exit(3)
if mode == "message":
    sys.exit("a message")
'''


@ONE_ZYGOTE
def test_a_forked_workers_exit_does_what_an_execd_ones_does(zygotes, tmp_path):
    """A forked worker skips the inherited modules' teardown (``hvd_edl/forked_exit.py``), yet
    ends as an exec'd one: exit status, output (C's buffered stdio too), non-daemon threads
    waited for, ``atexit`` run, the script's objects dropped (an open file flushed, gzip and
    zip files completed, a temporary file removed, ``__del__`` run)."""
    import gzip
    import zipfile
    (tmp_path / "exit_probe.py").write_text(EXIT_PROBE)
    env = _env()
    for mode, code in (("end", 0), ("code", 3), ("message", 1)):
        seen = {}
        for how, z in (("execd", None), ("forked", zygotes)):
            out = tmp_path / f"{mode}-{how}"
            out.mkdir()
            rc, stdout, stderr = _run(z, [sys.executable, "exit_probe.py", str(out), mode],
                                      str(tmp_path), env)
            with gzip.open(out / "left.gz", "rt") as f:
                gz_text = f.read()
            with zipfile.ZipFile(out / "left.zip") as f:
                zip_text = f.read("a.txt").decode()
            seen[how] = (rc, stdout, stderr, gz_text, zip_text, sorted(
                (p.name, p.read_text() if p.suffix not in (".gz", ".zip") else "")
                for p in out.iterdir()))
        assert seen["forked"] == seen["execd"], (mode, seen)
        rc, stdout, stderr, gz_text, zip_text, files = seen["forked"]
        assert rc == code and stdout == "from Python, no newlinefrom C's stdio, buffered"
        assert stderr == ("a message\n" if mode == "message" else "")
        assert (gz_text, zip_text) == ("gzip, never closed", "zip, never closed")
        assert dict(files) == {"del": "del ran", "left_open.txt": "buffered, never closed",
                               "atexit": "atexit ran", "thread": "thread ran",
                               "left.gz": "", "left.zip": ""}


FRAME_PROBE = '''
import atexit, sys
atexit.register(lambda: print("atexit", flush=True))


class Noted:
    def __del__(self):
        print("del", flush=True)


def main():
    local = Noted()
    if sys.argv[1] == "exit":
        sys.exit(4)
    raise ValueError("uncaught")


main()
'''


@ONE_ZYGOTE
def test_a_forked_worker_drops_the_frames_its_exit_held(zygotes, tmp_path):
    """The locals of the function that called ``sys.exit`` (or raised the uncaught exception)
    are dropped at a forked worker's exit as at an exec'd one's: the exception held them."""
    (tmp_path / "frame_probe.py").write_text(FRAME_PROBE)
    env = _env()
    for mode, code in (("exit", 4), ("raise", 1)):
        seen = {how: _run(z, [sys.executable, "frame_probe.py", mode], str(tmp_path), env)
                for how, z in (("execd", None), ("forked", zygotes))}
        assert seen["forked"] == seen["execd"], (mode, seen)
        assert seen["forked"][0] == code and "del" in seen["forked"][1].split(), seen



GLOBALS_PROBE = '''
import os, threading
lock = threading.Lock()


class Cleaner:
    def __init__(self, path):
        self.path = path
        open(path, "w").close()

    def __del__(self):   # the module's globals (os, lock, a function) as an exec'd exit sees them
        with lock:
            os.remove(self.path)
        say("removed")


def say(what):
    print(what, flush=True)


cleaner = Cleaner(os.path.abspath("scratch"))
'''


@ONE_ZYGOTE
def test_a_forked_workers_objects_find_their_globals_at_exit(zygotes, tmp_path):
    """The script's objects are dropped at a forked worker's exit with the script's modules,
    functions and earlier objects still there: ``__del__`` calling ``os.remove`` works (a cleared
    ``__main__`` made it a NameError and left the file)."""
    (tmp_path / "globals_probe.py").write_text(GLOBALS_PROBE)
    env = _env()
    for how, z in (("execd", None), ("forked", zygotes)):
        assert _run(z, [sys.executable, "globals_probe.py"], str(tmp_path), env) == \
            (0, "removed\n", ""), how
        assert not (tmp_path / "scratch").exists(), how


@ONE_ZYGOTE
@pytest.mark.parametrize("script, code", [("import sys; print('x'); sys.stdout.close()", 0),
                                          ("import sys; sys.exit(2 ** 70)", 255),
                                          ("import sys; sys.exit(2 ** 32 + 3)", 3)])
def test_a_forked_workers_exit_status_edges(zygotes, tmp_path, script, code):
    """A script that closed ``sys.stdout`` ends with 0 (CPython flushes no closed stream, not
    120), an exit code beyond a C long is 255, one beyond a C int its low byte: as exec'd."""
    (tmp_path / "edge.py").write_text(script + "\n")
    env = _env()
    seen = {how: _run(z, [sys.executable, "edge.py"], str(tmp_path), env)
            for how, z in (("execd", None), ("forked", zygotes))}
    assert seen["forked"] == seen["execd"] and seen["forked"][0] == code, seen


@ONE_ZYGOTE
def test_signals_reach_the_worker_and_it_dies_with_its_stub(zygotes, probe, tmp_path):
    env = _env()
    pid_file = tmp_path / "pid"
    stub = _start(zygotes, [sys.executable, "probe.py", "term", str(pid_file)], str(tmp_path),
                  env)
    pid = int(wait_for("the worker's pid", lambda: pid_file.exists() and pid_file.read_text(),
                       60))
    assert pid != stub.pid and psutil.Process(pid).environ()["PROBE_X"] == "x y=z"
    stub.send_signal(signal.SIGTERM)   # the launcher's terminate_all: forwarded to the worker
    out, _ = stub.communicate(timeout=60)
    assert stub.returncode == 3 and b"got 15" in out

    pid_file.unlink()
    stub = _start(zygotes, [sys.executable, "probe.py", "wait", str(pid_file)], str(tmp_path),
                  env)
    pid = int(wait_for("the worker's pid", lambda: pid_file.exists() and pid_file.read_text(),
                       60))
    worker = psutil.Process(pid)
    stub.kill()   # a stub killed -9: its worker must not outlive it
    stub.wait(timeout=30)
    psutil.wait_procs([worker], timeout=30)
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE

    pid_file.unlink()
    stub = _start(zygotes, [sys.executable, "probe.py", "wait", str(pid_file)], str(tmp_path),
                  env)
    pid = int(wait_for("the worker's pid", lambda: pid_file.exists() and pid_file.read_text(),
                       60))
    os.kill(pid, signal.SIGKILL)   # kill -9 of the worker: the launcher sees -9
    assert stub.wait(timeout=60) == -signal.SIGKILL


@ONE_ZYGOTE
def test_commands_a_zygote_does_not_run_take_the_exec_path(zygotes, probe, tmp_path):
    env = _env()
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\necho shell $HOROVOD_RANK\n")
    script.chmod(0o755)
    assert not zygote_client.eligible([str(script)], env)
    assert not zygote_client.eligible([sys.executable, "-c", "print(1)"], env)
    assert not zygote_client.eligible(["perl", "x.pl"], env)
    assert not zygote_client.eligible([sys.executable, "probe.py"], dict(env, PYTHONPATH="rel"))
    assert zygote_client.eligible([sys.executable, "-u", "-m", "probe_mod"], env)
    assert zygotes.stub_command([str(script)], env, {}) is None
    # the zygote refuses what it cannot run as exec would (no such script): the stub execs
    stub = [sys.executable, "-I", "-S", zygote_client.__file__]
    missing = subprocess.run([*zygotes.stub_command([sys.executable, "probe.py"], env, {})[:-2],
                              sys.executable, "missing.py"], cwd=str(tmp_path), env=env,
                             capture_output=True, text=True, timeout=120)
    execd = subprocess.run([sys.executable, "missing.py"], cwd=str(tmp_path), env=env,
                           capture_output=True, text=True, timeout=60)
    assert missing.returncode == execd.returncode == 2 and missing.stderr == execd.stderr
    # no zygote at all (it failed to start): the stub execs at once
    dead = tmp_path / "dead.sock"
    (tmp_path / "dead.sock.failed").write_text("ImportError: no hvd_edl\n")
    t0 = time.monotonic()
    fell_back = subprocess.run(stub + [str(dead), "60", "--", sys.executable, "probe.py"],
                               cwd=str(tmp_path), env=env, capture_output=True, text=True,
                               timeout=60)
    assert time.monotonic() - t0 < 30 and fell_back.returncode == 0
    assert _seen(fell_back.stdout)["proc_cmdline"] == [sys.executable, "probe.py"]


@ONE_ZYGOTE
def test_a_script_directory_with_its_own_copy_of_a_loaded_package_takes_the_exec_path(
        zygotes, tmp_path):
    """An exec'd worker imports the ``hvd_edl`` (or ``numpy``, ``tqdm``) next to its script, not
    the zygote's already-loaded one: a checkout of hvd_edl run without PYTHONPATH got the
    installed hvd_edl when forked."""
    (tmp_path / "hvd_edl").mkdir()
    (tmp_path / "hvd_edl" / "__init__.py").write_text("WHO = 'the script directory'\n")
    (tmp_path / "who.py").write_text("import hvd_edl\nprint(hvd_edl.WHO)\n")
    (tmp_path / "who_mod.py").write_text("import hvd_edl\nprint(hvd_edl.WHO)\n")
    env = _env()
    for command in ([sys.executable, "who.py"], [sys.executable, "-m", "who_mod"]):
        execd = _run(None, command, str(tmp_path), env)
        forked = _run(zygotes, command, str(tmp_path), env)
        assert execd == forked == (0, "the script directory\n", ""), (command, execd, forked)
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "where.py").write_text("import sys\nprint(sys.path[0], __file__)\n")
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / "where.py").symlink_to(tmp_path / "real" / "where.py")
    (tmp_path / "sigs.py").write_text(
        "import signal\nprint([signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGINT,"
        " signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM)])\n")
    ignore = [signal.SIGINT, signal.SIGHUP, signal.SIGQUIT]   # ``nohup cmd &`` in a script

    def ignoring():
        for sig in ignore:
            signal.signal(sig, signal.SIG_IGN)
    for z in (None, zygotes):
        p = _start(z, [sys.executable, "sigs.py"], str(tmp_path), env, preexec_fn=ignoring)
        out = p.communicate(timeout=120)[0].decode()
        assert p.returncode == 0 and out == "[True, True, True, False]\n", (z, out)
    command = [sys.executable, "where.py"]   # sys.path[0]: the link's target's directory
    execd = _run(None, command, str(tmp_path / "link"), env)
    assert execd == _run(zygotes, command, str(tmp_path / "link"), env) and \
        execd[1].startswith(str(tmp_path / "real") + " "), execd


def test_a_zygote_killed_9_takes_what_its_workers_started_with_them(tmp_path):
    """The zygote's death kills its workers (PDEATHSIG); the stub then kills the worker's group,
    so a process the worker started (a DataLoader worker, a ``sleep``) is no orphan."""
    (tmp_path / "spawner.py").write_text(
        "import subprocess, sys, time\n"
        "p = subprocess.Popen(['sleep', '300'])\n"
        "open(sys.argv[1], 'w').write(str(p.pid))\n"
        "time.sleep(300)\n")
    own = LocalZygotes()
    try:
        pid_file = tmp_path / "pid"
        stub = _start(own, [sys.executable, "spawner.py", str(pid_file)], str(tmp_path), _env())
        child = psutil.Process(int(wait_for(
            "the worker's child", lambda: pid_file.exists() and pid_file.read_text(), 120)))
        zygote = next(iter(own._zygotes.values()))[1]
        zygote.kill()
        assert stub.wait(timeout=60) == -signal.SIGKILL
        psutil.wait_procs([child], timeout=30)
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    finally:
        own.close()


def test_a_zygote_whose_modules_are_shadowed_or_changed_on_disk_leaves_workers_to_exec(
        tmp_path):
    """An exec'd worker imports the code on disk now; a zygote holds what it imported at its
    start: once a new file in a ``sys.path`` entry before the one a loaded module came from
    shadows it (a fresh interpreter would import that one), or once one of its modules' files
    changed, it refuses (the exec path).  An unrelated new file in that entry changes nothing;
    the shadow removed, it forks again (breaker i8: job 2 kept the old module)."""
    lib, early = tmp_path / "lib", tmp_path / "early"
    lib.mkdir()
    early.mkdir()
    (lib / "sitecustomize.py").write_text("VERSION = 1\n")   # imported by every interpreter
    (tmp_path / "pid.py").write_text("import os, sitecustomize\n"
                                     "print(os.getpid(), sitecustomize.VERSION)\n")
    env = _env(PYTHONPATH=os.pathsep.join([str(early), str(ROOT), str(lib)]))
    own = LocalZygotes()

    def job():
        stub = _start(own, [sys.executable, "pid.py"], str(tmp_path), env)
        out = stub.communicate(timeout=120)[0].decode().split()
        assert stub.returncode == 0, out
        return ("exec'd" if out[0] == str(stub.pid) else "forked"), out[1]
    try:
        assert job() == ("forked", "1")
        (early / "unrelated.py").write_text("")   # a new file that shadows nothing
        (early / "sitecustomize_notes").mkdir()
        assert job() == ("forked", "1")
        (early / "sitecustomize.py").write_text("VERSION = 3\n")   # shadows lib's
        assert job() == ("exec'd", "3")
        (early / "sitecustomize.py").unlink()
        assert job() == ("forked", "1")
        time.sleep(0.05)
        (lib / "sitecustomize.py").write_text("VERSION = 2\n")
        assert job() == ("exec'd", "2")   # the new code
    finally:
        own.close()


def test_the_import_time_environment_keys_the_zygote():
    env = _env()
    key = zygote_client.zygote_key(sys.executable, env)
    assert zygote_client.zygote_key(sys.executable, dict(env, HOROVOD_RANK="5")) == key
    assert zygote_client.zygote_key(sys.executable, dict(env, OMP_NUM_THREADS="3")) != key
    assert zygote_client.zygote_key("/usr/bin/python3", env) != key
    # every variable hvd_edl reads at import time (module level) is part of the key
    read = set()
    for path in (ROOT / "hvd_edl").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            for call in ast.walk(node):
                if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                    break
                if isinstance(call, ast.Call) and ast.unparse(call.func) in (
                        "os.environ.get", "os.getenv") and call.args and \
                        isinstance(call.args[0], ast.Constant):
                    read.add(call.args[0].value)
    assert read and all(zygote_client.IMPORT_ENV.fullmatch(name) for name in read), read


DYNAMO_READS = """
import os, sys
import hvd_edl.torch
reads = set()   # the names read while torch._dynamo is imported
cls = type(os.environ)
get, getitem, contains = cls.get, cls.__getitem__, cls.__contains__
cls.get = lambda self, k, d=None: (reads.add(k), get(self, k, d))[1]
cls.__getitem__ = lambda self, k: (reads.add(k), getitem(self, k))[1]
cls.__contains__ = lambda self, k: (reads.add(k), contains(self, k))[1]
os.environ["TORCHINDUCTOR_CACHE_DIR"] = sys.argv[1]   # as the preload does
import torch._dynamo
cls.get, cls.__getitem__, cls.__contains__ = get, getitem, contains
print(" ".join(sorted(str(k) for k in reads)))
"""


DEBUG_DIR = """
import json, os, sys
import torch   # TORCH_COMPILE_DEBUG=1: imports torch._dynamo.config, makes the trace handler
from hvd_edl import zygote
os.chdir(sys.argv[1])   # a worker's own working directory, as _become makes it
zygote._rebase_dynamo_debug_dir()
import torch._dynamo.config as config, torch._logging._internal as internal
print(json.dumps([config.debug_dir_root, internal.LOG_TRACE_HANDLER.root_dir]))
"""


def test_a_workers_compile_debug_folder_is_under_its_own_working_directory(tmp_path):
    """``torch._dynamo.config.debug_dir_root`` (and, with ``TORCH_COMPILE_DEBUG=1``, the trace
    log's folder) is read from the working directory at import: in a zygote, ``/``, where a user
    cannot write (a script setting ``torch._inductor.config.trace.enabled`` failed).  A worker
    moves them to its own, as an exec'd worker has them."""
    out = subprocess.run([sys.executable, "-c", DEBUG_DIR, str(tmp_path)], cwd="/",
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), TORCH_COMPILE_DEBUG="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    root = os.path.join(str(tmp_path), "torch_compile_debug")
    assert json.loads(out.stdout.splitlines()[-1]) == [root, os.path.join(root, "tlparse")]


def test_a_zygote_killed_during_its_preload_leaves_a_scratch_folder_the_next_one_removes(
        tmp_path):
    """A zygote killed while it imports torch._dynamo leaves its scratch cache folder in its
    (kept) folder; the next zygote's preload removes those of dead pids, not a live one's."""
    from hvd_edl import zygote
    dead = subprocess.Popen(["true"])
    dead.wait()
    for pid in (dead.pid, os.getpid()):
        (tmp_path / f"{zygote.SCRATCH_PREFIX}{pid}" / "dynamo").mkdir(parents=True)
    (tmp_path / "other.sock.log").write_text("")
    assert zygote.sweep_dead_scratch(str(tmp_path)) == [f"{zygote.SCRATCH_PREFIX}{dead.pid}"]
    assert sorted(os.listdir(tmp_path)) == sorted([f"{zygote.SCRATCH_PREFIX}{os.getpid()}",
                                                   "other.sock.log"])


def test_what_the_preloaded_dynamo_reads_at_import_keys_the_zygote(tmp_path):
    """The zygote preloads ``torch._dynamo`` (hvd_edl.zygote.preload_dynamo): every environment
    variable its import reads is part of the key, but the temporary folder's (whose traces the
    preload removes); a torch that reads a new one fails here."""
    out = subprocess.run([sys.executable, "-c", DYNAMO_READS, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-3000:]
    reads = set(out.stdout.split())
    assert "TORCHINDUCTOR_CACHE_DIR" in reads, reads   # the import was watched
    unkeyed = {k for k in reads if not zygote_client.IMPORT_ENV.fullmatch(k)}
    assert unkeyed <= {"TMPDIR", "TEMP", "TMP"}, unkeyed


def _as_nobody():
    """``preexec_fn``: the child runs as user and group nobody (65534; the caller is root)."""
    os.setgid(65534)
    os.setuid(65534)


def _launch(tmp_path, flag, probe, **env):
    out = subprocess.run([LAUNCHER, flag, "-np", "2", sys.executable, str(probe)],
                         capture_output=True, text=True, timeout=240, cwd=str(tmp_path),
                         env={k: v for k, v in dict(os.environ, PYTHONPATH=str(ROOT), **env).items()
                              if k not in (zygote_client.KEEP_ENV, zygote_client.KEEP_DIR_ENV)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [json.loads(line.split(">:", 1)[1]) for line in out.stdout.splitlines()
            if "<stdout>:{" in line]


def test_the_launcher_forks_workers_from_a_zygote_unless_told_not_to(tmp_path):
    probe = tmp_path / "who.py"
    probe.write_text("import json, os, sys, tempfile, psutil\n"
                     "p = psutil.Process(os.getppid())\n"
                     "print(json.dumps({'rank': os.environ['HOROVOD_RANK'],"
                     " 'parent': p.cmdline()[:3], 'ppid': p.pid,"
                     " 'dynamo': 'torch._dynamo' in sys.modules, 'tmp': tempfile.gettempdir(),"
                     " 'cache': os.environ.get('TORCHINDUCTOR_CACHE_DIR'), 'cwd': os.getcwd(),"
                     " 'debug': getattr(sys.modules.get('torch._dynamo.config'),"
                     " 'debug_dir_root', None)}))\n")
    import tempfile
    tmpdir = tempfile.mkdtemp(prefix="hz")   # short: a socket's path has a limit
    try:
        forked = _launch(tmp_path, "--zygote", probe, TMPDIR=tmpdir)
        # issue 38: the launcher's own zygote left nothing in the temporary folder (its preload
        # of torch._dynamo made its cache folder in a scratch folder of its own, removed)
        assert os.listdir(tmpdir) == [], os.listdir(tmpdir)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    # torch._dynamo preloaded (an optimizer's first use imports it), without its traces: the
    # worker's temporary folder is its own, no cache folder set in its environment
    # (the test process's own, if an in-process test imported torch._dynamo: cache_dir() puts
    # it in os.environ, and the launcher hands its environment on)
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    assert all(w["dynamo"] and w["tmp"] == tmpdir and w["cache"] == cache for w in forked), forked
    # its debug folder (TORCH_COMPILE_DEBUG=1) is under the worker's working directory, as an
    # exec'd worker's import makes it, not under the zygote's ("/torch_compile_debug")
    assert all(w["debug"] == os.path.join(w["cwd"], "torch_compile_debug") for w in forked), forked
    execd = _launch(tmp_path, "--no-zygote", probe)
    assert sorted(w["rank"] for w in forked) == sorted(w["rank"] for w in execd) == ["0", "1"]
    assert all(zygote_client.ZYGOTE_BOOT in w["parent"] for w in forked), forked
    # not asked to keep it (the default), the launcher's zygote ended with the launcher
    assert not any(psutil.pid_exists(w["ppid"]) and psutil.Process(w["ppid"]).status() !=
                   psutil.STATUS_ZOMBIE for w in forked), forked
    assert all("hvd-edl-run" in " ".join(w["parent"]) for w in execd), execd


def test_a_launcher_killed_9_leaves_no_zygote_folder(tmp_path):
    """Issue 38: a launcher killed by SIGKILL cannot remove its zygotes' mkdtemp folder; its
    zygote, seeing the launcher's pipe close, kills the workers and removes the folder."""
    import tempfile
    probe = tmp_path / "wait.py"
    probe.write_text("import os, sys, time\n"
                     "open(sys.argv[1] + os.environ['HOROVOD_RANK'], 'w').write(str(os.getpid()))\n"
                     "time.sleep(600)\n")
    tmpdir = tempfile.mkdtemp(prefix="hz")   # short: a socket's path has a limit
    env = {k: v for k, v in dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=tmpdir).items()
           if k not in (zygote_client.KEEP_ENV, zygote_client.KEEP_DIR_ENV)}
    launcher = subprocess.Popen([LAUNCHER, "--zygote", "-np", "1", sys.executable, str(probe),
                                 str(tmp_path / "pid")], cwd=str(tmp_path), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pid_file = tmp_path / "pid0"
        wait_for("the worker", lambda: pid_file.exists() and pid_file.read_text(), 120)
        worker = int(pid_file.read_text())
        assert os.listdir(tmpdir), "the launcher's zygote folder is where the test looks"
        launcher.kill()
        launcher.wait(timeout=30)
        wait_for("the worker gone", lambda: not psutil.pid_exists(worker)
                 or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE, 30)
        wait_for("the zygote folder gone", lambda: os.listdir(tmpdir) == [], 30,
                 lambda: str(os.listdir(tmpdir)))
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        shutil.rmtree(tmpdir, ignore_errors=True)


def test_an_interpreter_whose_zygote_fails_runs_its_workers_by_exec(tmp_path, probe):
    """A zygote that cannot start (here: an interpreter without torch) leaves its workers to the
    exec path, visible to nobody, and is not started again for the next worker."""
    python = "/usr/bin/python3"
    if not os.path.exists(python) or subprocess.run(
            [python, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("needs a Python without torch")
    zygotes = LocalZygotes()
    try:
        env = _env()
        code, out, err = _run(zygotes, [python, "probe.py"], str(tmp_path), env)
        assert code == 0 and err == "to stderr\n", (out, err)
        assert _seen(out)["proc_cmdline"] == [python, "probe.py"]
        assert zygotes.stub_command([python, "probe.py"], env, {}) is None
    finally:
        zygotes.close()


# ---- kept zygotes: one per user and key, shared by launchers (docs/zygote.md) -----------------

def _kept_folder(monkeypatch):
    import tempfile
    import leftovers
    # short (a socket path's limit), named by the run (tests/leftovers.py)
    folder = tempfile.mkdtemp(prefix=leftovers.kept_folder_prefix() + "t")
    monkeypatch.setenv(zygote_client.KEEP_DIR_ENV, folder)
    monkeypatch.delenv(zygote_client.KEEP_ENV, raising=False)
    return folder


def _end_kept(folder):
    from conftest import end_kept_zygotes
    import shutil
    end_kept_zygotes(folder)
    shutil.rmtree(folder, ignore_errors=True)


STATE_PROBE = """
import json, os, resource
print(json.dumps({"ppid": os.getppid(), "umask": os.umask(0),
                  "nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
                  "nice": os.getpriority(os.PRIO_PROCESS, 0),
                  "affinity": sorted(os.sched_getaffinity(0))}))
"""


def test_a_kept_zygote_forks_for_the_next_job_what_an_exec_would(monkeypatch, probe, tmp_path):
    """Two launchers (two LocalZygotes) asking to keep one use the same zygote; job 2's worker
    sees what its exec'd twin sees and nothing of job 1's environment; the zygote's own
    environment holds nothing of job 1's (no secret, no cluster run marker); a stub of another
    user is refused (SO_PEERCRED).

    The zygote's umask, resource limits, nice value and CPU affinity are job 1's launcher's:
    each later worker gets its own stub's, as an exec would; a limit above the zygote's, which
    an unprivileged process cannot raise, takes the exec path (breaker i8: job 1 under ``umask
    000; ulimit -n 777; nice -n 7; taskset -c 0`` made every later job's workers create
    world-writable files, pinned to CPU 0).

    Once a module it loaded is replaced on disk, even by a file with an older mtime (``cp -p``,
    ``tar x``, ``rsync -a``: the change time is read too; breaker i8: job 2 ran job 1's code),
    it refuses (the exec path, the code on disk) and gives up its socket, so the next launcher
    starts a fresh one; it exits when its last worker has.  One zygote for all of it: each
    kept zygote's import costs seconds of make test."""
    import resource
    folder = _kept_folder(monkeypatch)
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "sitecustomize.py").write_text("VERSION = 1\n")   # imported by every interpreter
    (tmp_path / "version.py").write_text("import sitecustomize\nprint(sitecustomize.VERSION)\n")
    (tmp_path / "state.py").write_text(STATE_PROBE)
    cpus = sorted(os.sched_getaffinity(0))
    low = min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 4096)
    try:
        lib_path = f"{ROOT}{os.pathsep}{lib}"
        job1 = _env(PROBE_JOB1="secret-of-job-1", HVD_EDL_SECRET="s1", HVD_EDL_CLUSTER_RUN="r1",
                    PYTHONPATH=lib_path)
        job2 = _env(PROBE_JOB2="two", PYTHONPATH=lib_path)
        first, second = LocalZygotes(), LocalZygotes()
        command = [sys.executable, "probe.py", "a"]
        for z, env in ((first, job1), (second, job2)):
            mask = os.umask(0o000)   # job 1's launcher starts the zygote under umask 000
            try:
                argv = z.stub_command(command, env, {"HOROVOD_RANK": "1"}, keep_s=60)
            finally:
                os.umask(mask)
            assert argv is not None and argv[4].startswith(folder), argv
            forked = _run(None, argv, str(tmp_path), env)
            execd = _run(None, command, str(tmp_path), env)
            assert forked == execd, (forked, execd)
        seen = _seen(forked[1])
        assert "PROBE_JOB1" not in json.dumps(seen) and seen["env"]["PROBE_JOB2"] == "two"
        (pid_file,) = Path(folder).glob("*.pid")
        sock = str(pid_file)[:-4] + ".sock"
        zygote = psutil.Process(int(pid_file.read_text()))
        assert zygote.uids().real == os.getuid() and zygote_client.ZYGOTE_BOOT in zygote.cmdline()
        assert not {"PROBE_JOB1", "HVD_EDL_SECRET", "HVD_EDL_CLUSTER_RUN", "HOROVOD_RANK"} & \
            set(zygote.environ()), zygote.environ()
        # the test run's mark, kept for tests/leftovers.py (the session marker is dropped)
        assert zygote.environ().get(zygote_client.KEPT_MARK_ENV) == zygote_client.mark()
        assert zygote.children() == [] and first._zygotes == second._zygotes == {}

        # job 1's limits, nice value and affinity, given to the zygote once its import is done
        # (the same as starting it under them, without a slow import pinned to one CPU)
        zygote.rlimit(psutil.RLIMIT_NOFILE, (low - 10, low - 5))
        zygote.nice(7)
        zygote.cpu_affinity(cpus[:1])

        def under(mask, nofile, nice, affinity):
            def preexec():
                os.umask(mask)
                resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
                os.nice(nice - os.nice(0))
                os.sched_setaffinity(0, affinity)
            return preexec

        def job(*state):
            argv = second.stub_command([sys.executable, "state.py"], job2, {}, keep_s=60)
            p = subprocess.run(argv, cwd=str(tmp_path), env=job2, capture_output=True,
                               text=True, preexec_fn=under(*state), timeout=180)
            assert p.returncode == 0, p
            return json.loads(p.stdout)
        forkable = under(0o022, (low - 30, low - 20), 9, cpus)   # within the zygote's limits
        state = job(0o000, (low - 10, low - 5), 7, cpus[:1])   # the zygote's own
        assert state == dict(state, ppid=zygote.pid, umask=0, nofile=[low - 10, low - 5], nice=7,
                             affinity=cpus[:1]), state
        state = job(0o077, (low - 30, low - 20), 9, cpus)
        assert state == dict(state, ppid=zygote.pid, umask=0o077, nofile=[low - 30, low - 20],
                             nice=9, affinity=cpus), state
        state = job(0o022, (low - 10, low), 9, cpus)   # above the zygote's hard limit
        assert state == dict(state, umask=0o022, nofile=[low - 10, low]), state
        assert (state["ppid"] == zygote.pid) == zygote_client_capable(24), state   # else exec'd

        if os.getuid() == 0 and os.path.exists("/usr/bin/python3"):
            # another user's stub is refused, even with the socket open to it (the venv may not
            # be theirs to run: the system's interpreter)
            os.chmod(folder, 0o711)
            os.chmod(sock, 0o777)
            asked = subprocess.run(
                ["/usr/bin/python3", "-I", "-S", "-c",
                 "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]);"
                 " print(s.recv(100).decode())", sock],
                preexec_fn=_as_nobody, capture_output=True, text=True, timeout=60)
            assert asked.stdout.strip() == "refused not this user's zygote", asked
            os.chmod(folder, 0o700)   # a folder open to others is not used (own zygote then)
        # a worker of job 2 runs on; then a module the zygote loaded is replaced on disk by a
        # file with an older mtime
        pid_path = tmp_path / "pid"
        stub = _start(None, second.stub_command([sys.executable, "probe.py", "wait",
                                                 str(pid_path)], job2, {}, keep_s=60),
                      str(tmp_path), job2, preexec_fn=forkable)
        worker = psutil.Process(int(wait_for("the worker's pid", lambda: pid_path.exists()
                                             and pid_path.read_text(), 60)))
        assert worker.ppid() == zygote.pid
        new = lib / "new.py"
        new.write_text("VERSION = 2\n")
        old = time.time() - 3600
        os.utime(new, (old, old))
        time.sleep(0.05)   # a later change time than the zygote's start (coarse clocks)
        os.replace(new, lib / "sitecustomize.py")
        version = _start(None, second.stub_command([sys.executable, "version.py"], job2, {},
                                                   keep_s=60), str(tmp_path), job2,
                         preexec_fn=forkable)
        assert version.communicate(timeout=120)[0] == b"2\n" and version.returncode == 0
        # refused: exec'd, the code on disk; stale, not for its limits: it gave up its socket
        wait_for("the stale zygote's socket removed", lambda: not os.path.exists(sock), 30)
        assert not pid_file.exists()   # the next launcher starts a fresh one, not waiting
        assert zygote.is_running() and worker.is_running()   # it waits for its worker
        worker.kill()
        assert stub.wait(timeout=60) == -signal.SIGKILL
        psutil.wait_procs([zygote], timeout=30)
        assert not zygote.is_running() or zygote.status() == psutil.STATUS_ZOMBIE
    finally:
        _end_kept(folder)



@pytest.mark.skipif(os.getuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="needs root: a server of another user")
def test_a_stub_hands_nothing_to_a_socket_another_user_serves():
    """A folder swapped under the stub (a parent another user can write: the link check was
    the launcher's, before the stub connected) must not get the worker's environment or its
    standard streams: the stub checks the server's ``SO_PEERCRED`` and takes the exec path
    (breaker i8: user B's socket got A's secret and A's worker's stdout)."""
    import shutil
    import tempfile
    from launcher.spawn.zygote_client import Session
    folder = tempfile.mkdtemp(prefix="hvd-edl-peer-test-")   # one the other user can reach
    os.chmod(folder, 0o777)
    sock = os.path.join(folder, "k.sock")
    server = subprocess.Popen(
        ["/usr/bin/python3", "-I", "-S", "-c",
         "import os, socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]);"
         " os.chmod(sys.argv[1], 0o777); s.listen(5); time.sleep(60)", sock],
        preexec_fn=_as_nobody)
    try:
        wait_for("the other user's socket", lambda: os.path.exists(sock), 30)
        assert zygote_client.listening(sock)
        assert not Session().connect(sock, 5)
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_swapped_kept_zygote_folder_cannot_redirect_the_launchers_files(tmp_path):
    """The launcher opens the kept-zygote folder once, checked (its own, 0700, not a link), and
    every file in it relative to that descriptor without following links: a folder swapped
    after the check (a parent another user can write, not sticky) cannot make the launcher
    create or append files that user picks (breaker i8: ``KEY.lock`` and ``KEY.sock.log``
    were opened by path).  Nothing is started: each case is refused before a zygote."""
    import shutil
    env = _env()
    key = zygote_client.zygote_key(sys.executable, env)
    parent = tmp_path / "parent"
    parent.mkdir()
    os.chmod(parent, 0o777)   # writable by others, not sticky
    folder = parent / "kz"
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    victims = [tmp_path / "victim-lock", tmp_path / "victim-log"]
    for name, victim in zip((f"{key}.lock", f"{key}.sock.log"), victims):
        os.symlink(victim, theirs / name)   # files the other user picks
    cases = [("the folder swapped for a link", lambda: os.symlink(theirs, folder))]
    if os.getuid() == 0:
        def swapped_for_theirs():
            shutil.copytree(theirs, folder, symlinks=True)
            os.chown(folder, 65534, 65534)
        cases.append(("another user's folder", swapped_for_theirs))

    def links_in_my_folder():
        shutil.copytree(theirs, folder, symlinks=True)
    cases.append(("links in the user's own folder", links_in_my_folder))
    for what, swap in cases:
        folder.mkdir(mode=0o700)
        zygote_client.private_dir(str(folder))   # the check passes; then the swap
        shutil.rmtree(folder)
        swap()
        with pytest.raises(OSError):
            zygote_client.kept_zygote(sys.executable, env, str(folder), 60)
        assert not any(v.exists() or v.is_symlink() for v in victims), what
        assert not list(folder.glob("*.pid")), what   # nothing started
        folder.unlink() if folder.is_symlink() else shutil.rmtree(folder)


def zygote_client_capable(cap):
    from hvd_edl.zygote import _capable
    return _capable(cap)


@pytest.mark.long   # its own zygote's import; the idle loop is the remote zygotes' as before
def test_a_kept_zygote_ends_after_its_idle_time_or_on_sigterm_once_its_workers_have(
        monkeypatch, probe, tmp_path):
    folder = _kept_folder(monkeypatch)
    z = LocalZygotes()
    env = _env()
    try:
        assert _run(None, z.stub_command([sys.executable, "probe.py"], env, {}, keep_s=60),
                    str(tmp_path), env)[0] == 0
        (pid_file,) = Path(folder).glob("*.pid")
        zygote = psutil.Process(int(pid_file.read_text()))
        pid_path = tmp_path / "pid"
        stub = _start(None, z.stub_command([sys.executable, "probe.py", "wait", str(pid_path)],
                                           env, {}, keep_s=60), str(tmp_path), env)
        worker = psutil.Process(int(wait_for("the worker's pid", lambda: pid_path.exists()
                                             and pid_path.read_text(), 60)))
        assert zygote_client.end_kept(folder) == [zygote.pid]
        wait_for("the socket removed", lambda: not list(Path(folder).glob("*.sock")), 30)
        assert zygote.is_running() and worker.is_running()   # it waits for its worker
        worker.kill()
        assert stub.wait(timeout=60) == -signal.SIGKILL
        psutil.wait_procs([zygote], timeout=30)
        assert not zygote.is_running() or zygote.status() == psutil.STATUS_ZOMBIE
        assert _run(None, z.stub_command([sys.executable, "probe.py"], env, {}, keep_s=1),
                    str(tmp_path), env)[0] == 0   # a fresh one, 1 s of idle life
        fresh = psutil.Process(int(pid_file.read_text()))
        assert fresh.pid != zygote.pid
        psutil.wait_procs([fresh], timeout=30)
        assert not fresh.is_running() or fresh.status() == psutil.STATUS_ZOMBIE
        # issue 38: a kept zygote that exits cleanly removes its files (the log was empty)
        assert os.listdir(folder) == [], os.listdir(folder)
    finally:
        _end_kept(folder)


def test_a_dead_kept_zygotes_files_are_swept_and_a_live_ones_are_untouched(
        monkeypatch, tmp_path):
    folder = _kept_folder(monkeypatch)
    try:
        sock = zygote_client.kept_zygote(sys.executable, _env(), folder, 60)
        wait_for("the live zygote's socket", lambda: zygote_client.listening(sock), 120)
        live = {n: os.stat(os.path.join(folder, n)).st_ino for n in os.listdir(folder)}
        assert {n.split(".", 1)[1] for n in live} == {"sock", "sock.log", "lock", "pid"}, live
        dead = subprocess.Popen([sys.executable, "-c", ""])
        dead.wait()   # a pid that named a zygote killed -9 (reaped: no longer live)
        old = time.time() - zygote_client.SWEEP_AFTER_S - 60
        for key in ("dead0000000000aa", "dead0000000000bb"):
            for suffix in (".sock", ".pid", ".sock.log", ".lock"):
                Path(folder, key + suffix).write_text(str(dead.pid) if suffix == ".pid" else "")
        for name in os.listdir(folder):   # all old: only liveness can spare the live one
            if not name.startswith("dead0000000000bb"):   # ... and youth this one
                os.utime(os.path.join(folder, name), (old, old))
        dir_fd = zygote_client.open_private_dir(folder)
        try:
            assert zygote_client.sweep_dead(dir_fd, folder) == ["dead0000000000aa"]
        finally:
            os.close(dir_fd)
        names = set(os.listdir(folder))
        assert {n for n in names if n.startswith("dead")} == {
            "dead0000000000bb" + s for s in (".sock", ".pid", ".sock.log", ".lock")}, names
        assert {n: os.stat(os.path.join(folder, n)).st_ino for n in names
                if not n.startswith("dead")} == live
    finally:
        _end_kept(folder)


RECORD = """\
import json, os, sys
import hvd_edl.torch as hvd
hvd.init()
with open(sys.argv[1], "w") as f:
    json.dump({"ppid": os.getppid(), "job1": os.environ.get("PROBE_JOB1"),
               "ours": sorted(k for k in os.environ if k.startswith("HVD_EDL_ZYGOTE")),
               "proc_env": "PROBE_JOB1" in open("/proc/self/environ").read()}, f)
"""


def test_the_cluster_services_jobs_share_its_kept_zygote_until_it_ends(monkeypatch, tmp_path):
    """``hvd-edl-cluster serve``'s jobs of one user fork their workers from one zygote the
    service keeps (launcher/cluster/kept_zygotes.py): job 2's worker is forked by job 1's
    zygote, sees none of job 1's environment, and the zygote carries no job's marker; when the
    service ends, so does the zygote, and its folder is removed."""
    from test_cluster_service import Service
    for name in (zygote_client.KEEP_ENV, zygote_client.KEEP_DIR_ENV):
        monkeypatch.delenv(name, raising=False)   # the submitters name no folder of their own
    (tmp_path / "record.py").write_text(RECORD)
    svc = Service(tmp_path, "--policy", "fifo", "-H", "localhost:1")
    try:
        seen = []
        for n, extra in ((1, ["--env", "PROBE_JOB1=one"]), (2, [])):
            job = svc.submit(*extra, "--np", "1", "--", sys.executable,
                             str(tmp_path / "record.py"), str(tmp_path / f"job{n}.json"))
            svc.wait_jobs(lambda j: j[job]["state"] == "done", f"job {n} done", 120)
            seen.append(json.loads((tmp_path / f"job{n}.json").read_text()))
        assert seen[0]["job1"] == "one" and seen[0]["proc_env"], seen
        assert seen[1]["job1"] is None and not seen[1]["proc_env"], seen
        assert seen[0]["ours"] == seen[1]["ours"] == [], seen   # told in flags, not variables
        assert seen[0]["ppid"] == seen[1]["ppid"], seen   # one zygote for both jobs
        zygote = psutil.Process(seen[0]["ppid"])
        assert zygote_client.ZYGOTE_BOOT in zygote.cmdline(), zygote.cmdline()
        (sock,) = [a for a in zygote.cmdline() if a.endswith(".sock")]
        folder = Path(sock).parent
        assert folder.name.startswith("hvd-edl-kz-") and folder.stat().st_mode & 0o777 == 0o700
        assert not {"HVD_EDL_CLUSTER_RUN", "PROBE_JOB1", "HVD_EDL_SECRET"} & \
            set(zygote.environ()), zygote.environ()
        svc.proc.terminate()   # the service ends: its kept zygotes with it
        assert svc.proc.wait(30) == 0, svc.output()
        psutil.wait_procs([zygote], timeout=30)
        assert not zygote.is_running() or zygote.status() == psutil.STATUS_ZOMBIE
        assert not folder.exists()
    finally:
        svc.stop()


def test_keeping_a_zygote_is_opt_in_and_its_flag_takes_an_optional_value(capsys):
    from launcher.cli import parse_spec
    assert zygote_client.keep_seconds(None, {}) is None   # hvd-edl-run keeps none by default
    assert zygote_client.keep_seconds(None, {zygote_client.KEEP_ENV: "30"}) == 30.0
    assert zygote_client.keep_seconds(0, {zygote_client.KEEP_ENV: "30"}) is None   # =0: none
    for bad in ("abc", "-1", "inf", "0"):
        assert zygote_client.keep_seconds(None, {zygote_client.KEEP_ENV: bad}) is None
    spec = parse_spec(["--keep-zygote", "-np", "1", sys.executable, "x.py"])
    assert spec.keep_zygote == 600.0 and spec.command == (sys.executable, "x.py")
    spec = parse_spec(["--keep-zygote=5", "--zygote-dir", "/tmp/k", "-np", "1", "--",
                       sys.executable, "x.py", "--keep-zygote"])   # the script's own flag
    assert (spec.keep_zygote, spec.zygote_dir) == (5.0, "/tmp/k")
    assert spec.command[-1] == "--keep-zygote"
    with pytest.raises(SystemExit) as ended:
        parse_spec(["--keep-zygote=abc", "-np", "1", sys.executable, "x.py"])
    assert ended.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == \
        "hvd-edl-run: error: argument --keep-zygote: expected a number from 0, got 'abc'"


def test_the_services_kept_zygote_folders_are_private_recorded_and_ended(tmp_path,
                                                                        monkeypatch):
    """The service's folder per user: fresh, 0700, the user's; recorded, so that a service
    restarted after a kill -9 ends what the last one kept; told to a run in its launcher's
    flags unless the submitter named its own folder; none with HVD_EDL_ZYGOTE_KEEP=0."""
    from launcher.cluster.kept_zygotes import KeptZygotes
    from launcher.cluster.runs import RunSpec
    monkeypatch.delenv(zygote_client.KEEP_ENV, raising=False)
    kept = KeptZygotes(tmp_path)
    kept.open()
    args = kept.launcher_args(None)
    assert args[:2] == ("--keep-zygote=300", "--zygote-dir") and kept.launcher_args(None) == args
    folder = Path(args[2])
    assert folder.stat().st_uid == os.geteuid() and folder.stat().st_mode & 0o777 == 0o700
    assert json.loads((tmp_path / "kept_zygotes.json").read_text()) == [str(folder)]
    spec = RunSpec(argv=("python", "x.py"), cwd="/", env=(), np=1, min_np=1, max_np=1,
                   checkpoint_dir="/ck", environ=(("PATH", "/bin"),), kept_zygote=args)
    assert spec.kept_zygote_args() == list(args)
    own = RunSpec(**{**spec.__dict__, "environ": (("PATH", "/bin"),
                                                  (zygote_client.KEEP_DIR_ENV, "/mine"))})
    assert own.kept_zygote_args() == []
    assert kept.launcher_args(None, {zygote_client.KEEP_DIR_ENV: "/mine"}) == ()   # no folder
    KeptZygotes(tmp_path).open()   # a service restarted after a kill -9 of this one
    assert not folder.exists()
    monkeypatch.setenv(zygote_client.KEEP_ENV, "0")
    assert KeptZygotes(tmp_path).launcher_args(None) == ()
