"""Real Unix users for tests and benchmarks of a cluster shared by several people, made with
``useradd`` (as root) and removed with ``userdel -r`` after use, and a team install of hvd_edl
that every one of them can run.  Shared by the tests and the benchmarks (like tests/cluster.py).

    with TeamUsers(2) as (alice, bob):        # as root; UsersUnavailable says why not
        alice.run(["id", "-un"])              # a process as alice, with her environment
        install = team_install(tmp)           # a Python every user can run

Each user gets a home (``useradd -m``), an ed25519 key pair in ``~/.ssh`` (for ssh as that user
to the test cluster's hosts: :meth:`TeamUser.public_key`) and a password field of ``*`` (no
password login, but not locked: sshd with ``UsePAM no`` refuses locked accounts even by key).
Names start with :data:`PREFIX` and a random part; :func:`cleanup_leftovers` removes what a
crashed run left (users whose creating process is gone).
"""
from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

PREFIX = "hvdu"                   # every test user's name starts with it
REGISTRY = Path("/run") / "hvdedl-users"  # <name> -> pid of the process that made it
ROOT = Path(__file__).resolve().parent.parent
SITE_PACKAGES = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" \
    / "site-packages"
RUNUSER = shutil.which("runuser") or "/usr/sbin/runuser"
SHARED_PYTHON = f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"


class UsersUnavailable(RuntimeError):
    """Users cannot be made here (not root, no useradd); the message says why."""


def unavailable_reason() -> Optional[str]:
    if os.geteuid() != 0:
        return "needs root (useradd)"
    for tool in ("useradd", "userdel", RUNUSER):
        if shutil.which(tool) is None:
            return f"no {tool}"
    return None


@dataclass
class TeamUser:
    """One user made for the run: ``name``, ``uid``, ``gid``, ``home``."""
    name: str
    uid: int
    gid: int
    home: Path

    def public_key(self) -> str:
        return (self.home / ".ssh" / "id_ed25519.pub").read_text()

    def env(self, path_dirs: Sequence[str] = (), **extra: str) -> Dict[str, str]:
        """A login-like environment: HOME, USER, LOGNAME, PATH (``path_dirs`` first)."""
        env = {"HOME": str(self.home), "USER": self.name, "LOGNAME": self.name,
               "PATH": ":".join(list(path_dirs) + ["/usr/local/bin", "/usr/bin", "/bin"]),
               "LANG": "C.UTF-8"}
        env.update(extra)
        return env

    def argv(self, argv: Sequence[str]) -> List[str]:
        """``argv`` run as this user (``runuser -u``: its uid, gid and groups, no capability
        left at the exec, the environment given kept; ``setpriv`` still traverses root's 0700
        home on its exec, which would hide the bad-interpreter case)."""
        return [RUNUSER, "-u", self.name, "--", *argv]

    def run(self, argv: Sequence[str], env: Optional[Dict[str, str]] = None,
            cwd: Optional[str] = None, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(argv), env=env or self.env(), cwd=cwd or str(self.home),
                              capture_output=True, text=True, timeout=timeout_s)


def _remove(name: str) -> None:
    subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True, timeout=10)
    subprocess.run(["userdel", "-r", "-f", name], capture_output=True, timeout=30)
    try:
        (REGISTRY / name).unlink()
    except FileNotFoundError:
        pass


def cleanup_leftovers() -> List[str]:
    """Remove users a crashed run left (its process gone); returns their names."""
    gone = []
    if not REGISTRY.is_dir():
        return gone
    for entry in REGISTRY.iterdir():
        try:
            pid = int(entry.read_text())
        except (OSError, ValueError):
            pid = 0
        if pid and Path(f"/proc/{pid}").exists():
            continue
        _remove(entry.name)
        gone.append(entry.name)
    return gone


class TeamUsers:
    """``n`` users made on entry, removed on exit (their processes killed first: only theirs,
    by their uid, which no one else has)."""

    def __init__(self, n: int = 2, stem: str = ""):
        reason = unavailable_reason()
        if reason:
            raise UsersUnavailable(reason)
        cleanup_leftovers()
        self.users: List[TeamUser] = []
        tag = secrets.token_hex(2)
        REGISTRY.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(n):
                name = f"{PREFIX}{tag}{stem}{chr(ord('a') + i)}"
                (REGISTRY / name).write_text(str(os.getpid()))
                subprocess.run(["useradd", "-m", "-s", "/bin/sh", "-p", "*", name], check=True,
                               capture_output=True, timeout=30)
                pw = pwd.getpwnam(name)
                user = TeamUser(name, pw.pw_uid, pw.pw_gid, Path(pw.pw_dir))
                self.users.append(user)
                r = user.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                              str(user.home / ".ssh" / "id_ed25519")], env=user.env())
                if r.returncode != 0:
                    raise RuntimeError(f"ssh-keygen as {name}: {r.stderr.strip()}")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for u in self.users:
            _remove(u.name)
        self.users = []

    def __enter__(self) -> List[TeamUser]:
        return self.users

    def __exit__(self, *exc) -> None:
        self.close()


def team_install(prefix: Path) -> Path:
    """A team install of hvd_edl at ``prefix`` that every user can run, as docs/cluster.md's
    recipe makes it ("A team's head host"): a virtual environment from a Python every user can
    run (the system's :data:`SHARED_PYTHON`, not one under a 0700 home), with the packages and
    this checkout installed.  To save minutes it does not download or build them again: its
    site-packages names this interpreter's (already installed: torch, Horovod, ...) and this
    checkout in a ``.pth`` file, where ``make install`` installs them; console scripts
    ``hvd-edl-cluster``, ``hvd-edl-run`` as pip writes them.  Everything under ``prefix`` is
    readable by all (``chmod -R a+rX``).  Returns ``prefix / "bin"``.

    Raises:
        UsersUnavailable: there is no such Python here, or other users cannot reach this
            checkout or its packages (a folder above them closed to others).
        subprocess.CalledProcessError: the environment cannot be made.
    """
    if not os.path.exists(SHARED_PYTHON):
        raise UsersUnavailable(f"no {SHARED_PYTHON} (a Python every user can run)")
    for needed in (ROOT, SITE_PACKAGES):   # what the install's .pth names
        p = Path(os.path.realpath(needed))
        while p != p.parent:
            if not os.stat(p).st_mode & 0o001:
                raise UsersUnavailable(
                    f"{p} (mode {os.stat(p).st_mode & 0o777:04o}) does not let other users "
                    f"through to {needed}: they cannot import this checkout (a clone under "
                    f"`mktemp -d`; clone it under a folder others can enter)")
            p = p.parent
    prefix = Path(prefix)
    subprocess.run([SHARED_PYTHON, "-m", "venv", "--without-pip", str(prefix)], check=True,
                   capture_output=True, timeout=60)
    site = prefix / "lib" / SITE_PACKAGES.parent.name / "site-packages"
    (site / "hvd_edl_team.pth").write_text(f"{ROOT}\n{SITE_PACKAGES}\n")
    for name, module in (("hvd-edl-cluster", "launcher.cluster.cli"),
                         ("hvd-edl-run", "launcher.cli")):
        script = prefix / "bin" / name
        script.write_text(f"#!{prefix / 'bin' / 'python'}\nimport sys\n"
                          f"from {module} import main\nsys.exit(main())\n")
        script.chmod(0o755)
    subprocess.run(["chmod", "-R", "a+rX", str(prefix)], check=True, timeout=60)
    p = prefix
    while p != p.parent:  # every folder above it must let users through
        if not os.stat(p).st_mode & 0o001:
            raise UsersUnavailable(f"{p} does not let other users through (mode "
                                   f"{os.stat(p).st_mode & 0o777:04o}): install elsewhere")
        p = p.parent
    return prefix / "bin"
