"""tests/leftovers.py: what a test run left behind is said at its end, kept zygotes and their
folders included (breaker i8: a kept zygote's environment drops the session marker, and empty
``hvd-edl-kz-*`` folders were never mentioned)."""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile

import leftovers
from launcher.cluster.kept_zygotes import KeptZygotes
from launcher.spawn import zygote_client


def _ours(lines, *needles):
    return [line.rstrip() for line in lines if any(n in line for n in needles)]


def test_a_runs_kept_zygotes_and_their_folders_are_reported_left_behind(tmp_path, monkeypatch):
    """A process started with a kept zygote's environment (``kept_env`` of the run's: the
    session marker dropped, the run's mark kept) and the run's kept-zygote folders (the
    conftest's, and the cluster service's named under the mark), empty or not, are reported;
    once gone, not; another run's are not."""
    token, other = secrets.token_hex(8), secrets.token_hex(8)
    monkeypatch.setattr(leftovers, "GRACE_S", 0.0)
    run_env = {"PATH": os.environ["PATH"], leftovers.SESSION_ENV: token,
               leftovers.MARK_ENV: token, "HVD_EDL_SECRET": "s"}
    kept = zygote_client.kept_env(run_env)
    assert leftovers.SESSION_ENV not in kept and "HVD_EDL_SECRET" not in kept
    zygote = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                              stdin=subprocess.PIPE, env=kept)   # stands for the zygote
    folders = [tempfile.mkdtemp(prefix=leftovers.kept_folder_prefix(token))]
    monkeypatch.setenv(zygote_client.KEPT_MARK_ENV, token)   # the service started by the run
    monkeypatch.delenv(zygote_client.KEEP_ENV, raising=False)
    service = KeptZygotes(tmp_path)
    service.open()
    folders.append(service.launcher_args(None)[2])
    theirs = tempfile.mkdtemp(prefix=leftovers.kept_folder_prefix(other))
    try:
        lines = _ours(leftovers.report(token), f"process {zygote.pid}:", *folders, theirs)
        assert lines == [f"left behind: process {zygote.pid}: {sys.executable} -c "
                         "import sys; sys.stdin.read()"] + \
            [f"left behind: kept-zygote folder {f}" for f in sorted(folders)], lines
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=30)
        for folder in folders + [theirs]:
            shutil.rmtree(folder, ignore_errors=True)
    assert _ours(leftovers.report(token), f"process {zygote.pid}:", *folders) == []


def test_a_mark_is_a_short_label_or_nothing():
    assert zygote_client.mark({zygote_client.KEPT_MARK_ENV: "ab12"}) == "ab12"
    for bad in ("", "../x", "a" * 33, "a b"):
        assert zygote_client.mark({zygote_client.KEPT_MARK_ENV: bad}) == ""
        assert zygote_client.KEPT_MARK_ENV not in zygote_client.kept_env(
            {zygote_client.KEPT_MARK_ENV: bad})
