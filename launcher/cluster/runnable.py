"""``submit``'s checks that a job can start at all, as its user: the folder it runs in, its
interpreter (found on the ``PATH`` it was submitted with, and the ``#!`` interpreter of a script
such as a venv's console scripts), its training script, and the service's own interpreter that
starts its launcher (a checkout's ``.venv`` links into its installer's home, 0700 for root: "bad
interpreter" for everybody else; docs/cluster.md, "A team's head host").

Under a root service the checks run as the job's user (``/bin/sh``'s ``test`` in a process with
that user's uid and groups), so the kernel's answer, ACLs included, is the one the job will get;
otherwise they run here with ``os.access`` (the job's user is the service's).  The first failing
check is one line (HTTP 400): what, which path, and as whom.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import List, Mapping, Optional, Sequence, Tuple

from launcher.cluster import users

CHECK_TIMEOUT_S = 5.0
SHEBANG_BYTES = 256  # how much of an interpreter file is read for its ``#!`` line

# one check: (test(1) flag, path, what it is for people)
Check = Tuple[str, str, str]


class NotRunnable(ValueError):
    """The job could not start as its user (HTTP 400), one line."""

    status = 400


def shebang(path: str) -> Optional[str]:
    """The interpreter a ``#!`` file names (``/usr/bin/env X``: None, found on PATH at run
    time), or None when ``path`` is not such a file or cannot be read here."""
    try:
        with open(path, "rb") as f:
            head = f.read(SHEBANG_BYTES)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].decode("utf-8", "replace").split()
    if not words or os.path.basename(words[0]) == "env":
        return None
    return words[0]


def training_script(argv: Sequence[str]) -> Optional[str]:
    """The training script of ``argv``: its first argument after the interpreter ending in
    ``.py`` (None when there is none)."""
    return next((a for a in argv[1:] if a.endswith(".py")), None)


def readable_by(path: str, user: "users.User") -> bool:
    """Whether ``user`` may read ``path`` by its mode bits (owner, group, others; ACLs not
    consulted): the service reads a ``#!`` line for a user only from a file that user could
    read, so that no line of a file of root's reaches a message."""
    import stat
    try:
        st = os.stat(path)
    except OSError:
        return False
    if st.st_uid == user.uid:
        return bool(st.st_mode & stat.S_IRUSR)
    if st.st_gid in user.groups:
        return bool(st.st_mode & stat.S_IRGRP)
    return bool(st.st_mode & stat.S_IROTH)


def checks(argv: Sequence[str], cwd: str, environ: Mapping[str, str],
           user: Optional["users.User"] = None) -> List[Check]:
    """What must hold for ``argv`` to start in ``cwd`` with ``environ`` as ``user`` (None: the
    service's) (module docstring), in order: the folder, the interpreter, its ``#!``
    interpreter, the script, the service's interpreter and its ``hvd-edl-run``.

    Raises:
        NotRunnable: the interpreter is not on the ``PATH`` it was submitted with.
    """
    out: List[Check] = [("-x", cwd, "the folder the job runs in")]
    first = argv[0]
    if "/" in first:
        exe: Optional[str] = os.path.join(cwd, first)
    else:
        exe = shutil.which(first, path=environ.get("PATH", os.defpath))
    if exe is None:
        raise NotRunnable(f"training command {first!r} not found on the PATH it was submitted "
                          f"with")
    out.append(("-x", exe, "the training command"))
    interp = shebang(exe) if user is None or readable_by(exe, user) else None
    if interp:
        out.append(("-x", interp, f"the interpreter of {exe} (its #! line)"))
    script = training_script(argv)
    if script is not None:
        out.append(("-r", os.path.join(cwd, script), f"training script {script!r}"))
    out.append(("-x", sys.executable, "the service's Python (it starts the job's launcher)"))
    from launcher.cluster.runs import launcher_command
    launcher = launcher_command()[0]
    if launcher != sys.executable:
        out.append(("-x", launcher, "the service's hvd-edl-run"))
        interp = shebang(launcher)
        if interp:
            out.append(("-x", interp, f"the interpreter of {launcher} (its #! line)"))
    return out


def _failed_here(todo: Sequence[Check]) -> Optional[int]:
    """Index of the first check ``os.access`` fails here, else None."""
    for i, (flag, path, _) in enumerate(todo):
        mode = os.X_OK if flag == "-x" else os.R_OK
        if not os.access(path, mode) or (flag == "-r" and not os.path.isfile(path)):
            return i
    return None


# each pair "FLAG PATH" in turn; exit N: the N-th failed (N from 1), 0: all hold
_SH_CHECKS = ('n=0; while [ $# -gt 1 ]; do n=$((n+1)); case $1 in -r) test -f "$2" && '
              'test -r "$2";; *) test "$1" "$2";; esac || exit $n; shift 2; done')


def _failed_as(uid: int, todo: Sequence[Check]) -> Optional[int]:
    """Index of the first check that fails for ``uid`` (run as that user), else None.

    Raises:
        NotRunnable: the checks could not run as that user in time.
    """
    args = [x for flag, path, _ in todo for x in (flag, path)]
    try:
        r = subprocess.run(["/bin/sh", "-c", _SH_CHECKS, "sh"] + args, env={"PATH": os.defpath},
                           stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=CHECK_TIMEOUT_S, cwd="/", **users.popen_user(uid))
    except (OSError, subprocess.SubprocessError) as e:
        raise NotRunnable(f"cannot check the job as {users.User.of_uid(uid).name}: {e}") \
            from None
    if r.returncode == 0:
        return None
    if 1 <= r.returncode <= len(todo):
        return r.returncode - 1
    raise NotRunnable(f"cannot check the job as {users.User.of_uid(uid).name}: /bin/sh "
                      f"exited {r.returncode}")


def check(argv: Sequence[str], cwd: str, environ: Mapping[str, str],
          uid: Optional[int]) -> None:
    """That job ``argv`` can start in ``cwd`` with ``environ`` as user ``uid`` (module
    docstring).

    Raises:
        NotRunnable: the first check that fails, one line: what, which path, as whom.
    """
    as_other = users.runs_as_other(uid)
    todo = checks(argv, cwd, environ, users.User.of_uid(uid) if as_other else None)
    bad = _failed_as(uid, todo) if as_other else _failed_here(todo)
    if bad is None:
        return
    flag, path, what = todo[bad]
    who = users.User.of_uid(uid if as_other else os.geteuid()).name
    if as_other:  # what root sees here (does it exist?) is not this user's to learn
        why = (f"no such file, or not a readable file (for {who})" if flag == "-r" else
               f"no such file, or {who} cannot enter or run it")
    elif not os.path.lexists(path):
        why = "no such file"
    elif flag == "-r":
        why = f"not a readable file (for {who})"
    else:
        why = f"{who} cannot {'enter it' if os.path.isdir(path) else 'run it'}"
    hint = "" if "service" not in what else (" (install hvd_edl where every user can run it: "
                                             "docs/cluster.md, 'A team's head host')")
    raise NotRunnable(f"{what} {path}: {why}{hint}")
