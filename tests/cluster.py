"""A multi-host test cluster on this one machine: network namespaces on a private bridge, an sshd
per host, the launcher in a namespace of its own.  Shared by the tests and the benchmarks.

    with Cluster(hosts=3) as c:            # as root; ClusterUnavailable says why not
        c.popen(c.launcher, [LAUNCHER, "-H", "h1:1,h2:1", "--network-interface", c.nic,
                             "-i", c.identity_file, ...])
        c.freeze("h2"); c.thaw("h2")        # SIGSTOP / SIGCONT every process of host h2
        c.cut("h2"); c.reconnect("h2")      # h2 off the bridge: silence, no FIN, no reset
        c.partition("h2"); c.heal("h2")     # launcher <-> h2 silent, the other pairs fine

Layout.  One Linux bridge ``hvdedl<id>`` (no address: the machine's own interfaces and routes are
never touched), a /24 of 10.250.0.0/16 on it, and per host a namespace ``hvdedl<id>-hN`` whose only
non-loopback interface is ``edl0`` (:data:`NIC`, a veth into the bridge) with the address .N+1; no
default route, so nothing but the bridge is reachable.  The launcher's namespace
``hvdedl<id>-launcher`` has .1.  Each host runs ``/usr/sbin/sshd`` (Debian's openssh-server,
installed with apt-get when missing, like iproute2 and openssh-client; port 22 and
:data:`ALT_SSH_PORT`) in its namespace and in a UTS namespace of its own (hostname ``hN``); name
resolution per namespace comes from ``/etc/netns/NS/hosts`` (``ip netns exec`` mounts it over
/etc/hosts).  ``loopback_hostname=True`` makes each host resolve its own hostname
to 127.0.1.1 (Debian's default line, many containers) instead of its address.  A key pair made
for the cluster is the only authorised key; the hosts' keys are pre-listed in a known-hosts file
that the launcher namespace's ``/etc/ssh/ssh_config`` (from ``/etc/netns/NS/ssh``) names, so ssh
never prompts and root's own ``~/.ssh`` is never written.  Each sshd sets ``SHLVL=1`` in its
sessions, so bash does not run the login user's ``~/.bashrc`` for the command (root's runs
``pyenv init``, whose rehash lock a session killed mid-command leaves behind: every later login
then waited 60 s); the product's ssh command is the same.  Hosts share this filesystem.

Teardown always happens: :meth:`Cluster.close` from the context manager, ``atexit`` and SIGTERM /
SIGHUP; and :func:`cleanup_leftovers` (run at each start) removes what a crashed run left, found
by the name prefix, unless the process that made it is still alive.
"""
from __future__ import annotations

import atexit
import ipaddress
import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

log = logging.getLogger(__name__)

PREFIX = "hvdedl"                     # every bridge, veth, namespace and /etc/netns dir name
NIC = "edl0"                          # the interface name inside every namespace
SUBNETS = ipaddress.ip_network("10.250.0.0/16")
SSHD = "/usr/sbin/sshd"
REGISTRY = Path("/run") / f"{PREFIX}-clusters"   # <id> -> pid of the process that owns it
GHOST = "ghost"                       # a name every namespace resolves to an unused address
BOGUS_MAC = "02:00:5e:00:53:01"       # neighbour entry that makes a peer silent (partition)
ALT_SSH_PORT = 2222                   # every sshd also listens here (tests of -p/--ssh-port)


class ClusterUnavailable(RuntimeError):
    """The cluster cannot be built here (not root, no ``ip``, no network namespaces, no sshd);
    the message is the reason, for ``pytest.skip``."""


def _run(argv: Sequence[str], check: bool = True, timeout_s: float = 30.0,
         **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, **kw)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {out.returncode}: {out.stderr.strip()}")
    return out


PACKAGES = {"ip": "iproute2", "ssh": "openssh-client", "ssh-keygen": "openssh-client",
            SSHD: "openssh-server"}   # what provides each tool on Debian


def _missing_tools() -> List[str]:
    return [t for t in PACKAGES if not (os.path.exists(t) if t.startswith("/") else
                                        shutil.which(t))]


def ensure_tools(timeout_s: float = 600.0) -> None:
    """Install what the cluster needs and lacks (Debian: ``apt-get update`` once, then
    ``apt-get install -y`` of iproute2 / openssh-client / openssh-server as needed).

    Raises:
        ClusterUnavailable: a tool is missing and there is no apt-get, or installing failed.
    """
    missing = _missing_tools()
    if not missing:
        return
    if not shutil.which("apt-get"):
        raise ClusterUnavailable(f"{', '.join(missing)} missing and no apt-get to install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    packages = sorted({PACKAGES[t] for t in missing})
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
        out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s)
        if out.returncode != 0:
            raise ClusterUnavailable(f"{' '.join(argv)} failed: {out.stderr.strip()[-300:]}")
    if _missing_tools():
        raise ClusterUnavailable(f"still missing after apt-get: {', '.join(_missing_tools())}")


def unavailable_reason() -> Optional[str]:
    """Why no cluster can be built here (None: it can), installing missing tools first."""
    if os.geteuid() != 0:
        return "the namespace cluster needs root (network namespaces, a bridge, sshd)"
    try:
        ensure_tools()
    except (ClusterUnavailable, OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if not shutil.which("unshare"):
        return "the namespace cluster needs 'unshare' (util-linux) on PATH"
    probe = f"{PREFIX}probe{os.getpid() % 100000}"
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "netns", "del", probe])
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return f"network namespaces unavailable: {e}"
    return None


def _netns_inode(netns: str) -> Optional[int]:
    try:
        return os.stat(f"/run/netns/{netns}").st_ino
    except OSError:
        return None


def pids_in_netns(netns: str) -> List[int]:
    """Every process whose network namespace is ``netns`` (all processes share one PID
    namespace here)."""
    ino = _netns_inode(netns)
    if ino is None:
        return []
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == ino:
                    out.append(int(entry))
            except OSError:
                continue
    return out


def _kill_netns_processes(netns: str) -> None:
    for pid in pids_in_netns(netns):
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _remove_cluster(cid: str) -> None:
    """Remove everything named for cluster ``cid`` (idempotent, best effort)."""
    base = f"{PREFIX}{cid}"
    names = [n.split()[0] for n in _run(["ip", "netns", "list"], check=False).stdout.splitlines()
             if n.startswith(base + "-")]
    for ns in names:
        _kill_netns_processes(ns)
    for ns in names:
        _run(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            link = parts[1].strip().split("@")[0]
            if link.startswith(base):
                _run(["ip", "link", "del", link], check=False)
    for d in Path("/etc/netns").glob(f"{base}-*") if Path("/etc/netns").is_dir() else []:
        shutil.rmtree(d, ignore_errors=True)
    for d in Path(tempfile.gettempdir()).glob(f"{base}-*"):  # its keys, configs, logs
        shutil.rmtree(d, ignore_errors=True)
    try:
        (REGISTRY / cid).unlink()
    except OSError:
        pass


def cleanup_leftovers() -> List[str]:
    """Remove the clusters of earlier runs whose owning process is gone (found by name prefix
    and the registry in /run); returns their ids.  A live owner's cluster is left alone."""
    ids = set()
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(PREFIX) and "-" in name:
            ids.add(name[len(PREFIX):].split("-")[0])
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        parts = line.split(":")
        link = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        if link.startswith(PREFIX) and len(link) >= len(PREFIX) + 4:
            ids.add(link[len(PREFIX):len(PREFIX) + 4])
    if Path("/etc/netns").is_dir():
        for d in Path("/etc/netns").glob(f"{PREFIX}*-*"):
            ids.add(d.name[len(PREFIX):].split("-")[0])
    for d in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        cid = d.name[len(PREFIX):].split("-")[0]
        if len(cid) == 4 and d.is_dir() and (d / "id_ed25519").exists():
            ids.add(cid)
    removed = []
    for cid in sorted(ids):
        try:
            owner = int((REGISTRY / cid).read_text())
        except (OSError, ValueError):
            owner = None
        if owner is not None and _pid_alive(owner):
            continue
        _remove_cluster(cid)
        removed.append(cid)
    return removed


@dataclass(frozen=True)
class Host:
    """One machine of the cluster: its name (what discovery prints), namespace and address."""
    name: str
    netns: str
    addr: str
    veth: str          # the bridge-side end of its veth pair (in the root namespace)


Where = Union[Host, str]


class Cluster:
    """K hosts and a launcher namespace on a private bridge; see the module docstring.

    Args:
        hosts: how many hosts (``h1`` .. ``hK``).
        loopback_hostname: each host resolves its own hostname to 127.0.1.1.
        spare: extra names in every hosts file with an address but no host behind it
            (``ghost`` always is one): discovery can name them to make ssh fail.

    Raises:
        ClusterUnavailable: see :func:`unavailable_reason`.
        RuntimeError: a set-up command failed (everything made so far is removed).
    """

    def __init__(self, hosts: int = 3, loopback_hostname: bool = False):
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        cleanup_leftovers()
        self.id = secrets.token_hex(2)
        self.loopback_hostname = loopback_hostname
        self.nic = NIC
        base = f"{PREFIX}{self.id}"
        self.bridge = base
        net = list(SUBNETS.subnets(new_prefix=24))[int(self.id, 16) % 256]
        self.prefixlen = net.prefixlen
        addrs = list(net.hosts())
        self.launcher = Host("launcher", f"{base}-launcher", str(addrs[0]), f"{base}l")
        self.hosts: Dict[str, Host] = {
            f"h{i}": Host(f"h{i}", f"{base}-h{i}", str(addrs[i]), f"{base}v{i}")
            for i in range(1, hosts + 1)}
        self.ghost_addr = str(addrs[200])
        self.dir = Path(tempfile.mkdtemp(prefix=f"{base}-"))
        os.chmod(self.dir, 0o755)
        self.identity_file = str(self.dir / "id_ed25519")
        self.known_hosts = self.dir / "known_hosts"
        self._sshd: Dict[str, subprocess.Popen] = {}
        self._closed = False
        self._lock = threading.Lock()
        REGISTRY.mkdir(parents=True, exist_ok=True)
        (REGISTRY / self.id).write_text(str(os.getpid()))
        atexit.register(self.close)
        self._old_handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ---- set-up --------------------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:
        self.close()
        old = self._old_handlers.get(signum)
        if callable(old):
            old(signum, frame)
        else:
            raise SystemExit(128 + signum)

    def _hosts_file(self, me: Optional[Host]) -> str:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        if me is not None and self.loopback_hostname:
            lines.append(f"127.0.1.1 {me.name}")
        for h in [self.launcher, *self.hosts.values()]:
            if h is me and self.loopback_hostname:
                continue
            lines.append(f"{h.addr} {h.name}")
        lines.append(f"{self.ghost_addr} {GHOST}")
        return "\n".join(lines) + "\n"

    def _add_namespace(self, h: Host, is_host: bool) -> None:
        _run(["ip", "netns", "add", h.netns])
        etc = Path("/etc/netns") / h.netns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(self._hosts_file(h if is_host else None))
        (etc / "hostname").write_text(h.name + "\n")
        _run(["ip", "link", "add", h.veth, "type", "veth", "peer", "name", NIC,
              "netns", h.netns])
        _run(["ip", "link", "set", h.veth, "master", self.bridge, "up"])
        _run(["ip", "-n", h.netns, "addr", "add", f"{h.addr}/{self.prefixlen}", "dev", NIC])
        _run(["ip", "-n", h.netns, "link", "set", NIC, "up"])
        _run(["ip", "-n", h.netns, "link", "set", "lo", "up"])

    def _build(self) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "link", "set", self.bridge, "up"])
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{PREFIX}{self.id}",
              "-f", self.identity_file])
        self._add_namespace(self.launcher, is_host=False)
        ssh_dir = Path("/etc/netns") / self.launcher.netns / "ssh"
        ssh_dir.mkdir()
        (ssh_dir / "ssh_config").write_text(
            "Host *\n"
            f"    GlobalKnownHostsFile {self.known_hosts}\n"
            "    UserKnownHostsFile /dev/null\n"
            "    StrictHostKeyChecking yes\n"
            "    CheckHostIP no\n")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        known = []
        for h in self.hosts.values():
            self._add_namespace(h, is_host=True)
            hk = self.dir / f"{h.name}.hostkey"
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hk)])
            known.append(f"{h.name},{h.addr} {Path(str(hk) + '.pub').read_text().strip()}")
            shutil.copy(self.identity_file + ".pub", self.dir / f"{h.name}.authorized_keys")
            (self.dir / f"{h.name}.sshd_config").write_text(
                f"ListenAddress {h.addr}:22\nListenAddress {h.addr}:{ALT_SSH_PORT}\n"
                f"HostKey {hk}\n"
                f"AuthorizedKeysFile {self.dir / (h.name + '.authorized_keys')} "
                f"{self.dir / (h.name + '.authorized_keys.%u')}\n"
                f"PidFile {self.dir / (h.name + '.sshd.pid')}\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nUseDNS no\n"
                "ClientAliveInterval 5\nClientAliveCountMax 3\nMaxStartups 100:30:200\n"
                "MaxSessions 100\nLogLevel ERROR\n"
                # bash runs ~/.bashrc for a command sshd starts only when it is a top-level
                # shell (SHLVL unset); with SHLVL=1 it is not, so root's rc files (pyenv init:
                # a `pyenv rehash` per login, whose lock a killed session leaves behind and
                # every later login waits 60 s on) stay out of the hosts' sessions.  The
                # product's ssh command is unchanged.
                "SetEnv SHLVL=1\n")
        self._built_known_hosts = "\n".join(known) + "\n"
        self.known_hosts.write_text(self._built_known_hosts)
        for h in self.hosts.values():
            self._start_sshd(h)
        for h in self.hosts.values():
            self._wait_ssh(h)

    def _start_sshd(self, h: Host) -> None:
        cfg = self.dir / f"{h.name}.sshd_config"
        log_path = self.dir / f"{h.name}.sshd.log"
        # -D: stays in the foreground (its pid is ours to stop); own UTS namespace: hostname hN
        self._sshd[h.name] = subprocess.Popen(
            ["ip", "netns", "exec", h.netns, "unshare", "--uts", "sh", "-c",
             f"hostname {h.name} && exec {SSHD} -D -f {cfg} -E {log_path}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)

    def _wait_ssh(self, h: Host, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            out = self.ssh(h, ["hostname"], check=False, timeout_s=10)
            if out.returncode == 0 and out.stdout.strip() == h.name:
                return
            last = out.stderr.strip()
            time.sleep(0.1)
        raise RuntimeError(f"sshd on {h.name} not answering within {timeout_s:g} s: {last}")

    # ---- use -----------------------------------------------------------------------------------

    def host(self, where: Where) -> Host:
        return where if isinstance(where, Host) else (
            self.launcher if where == "launcher" else self.hosts[where])

    def exec_argv(self, where: Where, argv: Sequence[str]) -> List[str]:
        """``argv`` run inside ``where``'s namespace (a host, its name, or ``"launcher"``)."""
        return [shutil.which("ip") or "ip", "netns", "exec", self.host(where).netns, *argv]

    def popen(self, where: Where, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``argv`` in ``where``'s namespace (``subprocess.Popen`` keywords pass through)."""
        return subprocess.Popen(self.exec_argv(where, argv), **kw)

    def ssh_options(self) -> List[str]:
        """Options for an ssh from the launcher namespace to the hosts (key, no prompts)."""
        return ["-i", self.identity_file, "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]

    def ssh(self, where: Where, argv: Sequence[str], check: bool = True,
            timeout_s: float = 30.0) -> subprocess.CompletedProcess:
        """Run ``argv`` on a host over ssh from the launcher namespace."""
        import shlex
        return _run(self.exec_argv("launcher", ["ssh", *self.ssh_options(),
                                                self.host(where).name, shlex.join(argv)]),
                    check=check, timeout_s=timeout_s)

    def pids(self, where: Where) -> List[int]:
        """Every process running on a host (its sshd, sessions, workers)."""
        return pids_in_netns(self.host(where).netns)

    def training_pid(self, where: Where, worker_id: str, script: str) -> Optional[int]:
        """The training process of ``worker_id`` on a host: the topmost of its processes whose
        environment names that worker and whose command line runs ``script`` (not its
        supervisor or ssh); None when there is none."""
        import psutil
        from hvd_edl.messages import ENV_WORKER_ID
        found = []
        for pid in self.pids(where):
            try:
                p = psutil.Process(pid)
                if p.environ().get(ENV_WORKER_ID) == worker_id and \
                        any(script in a for a in p.cmdline()):
                    found.append(p)
            except psutil.Error:
                continue
        pids = {p.pid for p in found}
        top = [p for p in found if p.ppid() not in pids]
        return top[0].pid if top else None

    def freeze(self, where: Where) -> int:
        """SIGSTOP every process of a host (a frozen VM); returns how many."""
        pids = self.pids(where)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
            except OSError:
                pass
        return len(pids)

    def thaw(self, where: Where) -> None:
        for pid in self.pids(where):
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass

    def cut(self, where: Where) -> None:
        """Take a host off the bridge: its peers hear nothing more (no FIN, no reset)."""
        _run(["ip", "link", "set", self.host(where).veth, "nomaster"])
        _run(["ip", "link", "set", self.host(where).veth, "down"])

    def reconnect(self, where: Where) -> None:
        h = self.host(where)
        _run(["ip", "link", "set", h.veth, "master", self.bridge, "up"])

    def _neigh(self, a: Host, b: Host, mac: Optional[str]) -> None:
        if mac:
            _run(["ip", "-n", a.netns, "neigh", "replace", b.addr, "lladdr", mac,
                  "nud", "permanent", "dev", NIC])
        else:
            _run(["ip", "-n", a.netns, "neigh", "del", b.addr, "dev", NIC], check=False)

    def partition(self, where: Where) -> None:
        """Silence the launcher <-> host path both ways (frames to a MAC nobody has); the host
        still reaches the other hosts."""
        h = self.host(where)
        self._neigh(self.launcher, h, BOGUS_MAC)
        self._neigh(h, self.launcher, BOGUS_MAC)

    def heal(self, where: Where) -> None:
        h = self.host(where)
        self._neigh(self.launcher, h, None)
        self._neigh(h, self.launcher, None)

    def refuse_key(self, where: Where, refuse: bool = True) -> None:
        """Make a host's sshd refuse the cluster's key (or accept it again)."""
        h = self.host(where)
        path = self.dir / f"{h.name}.authorized_keys"
        path.write_text("" if refuse else Path(self.identity_file + ".pub").read_text())

    def authorize(self, user: str, public_key: str) -> None:
        """Let local user ``user`` ssh to every host as ``user`` with ``public_key`` (its own
        key pair: what an operator sets up for each user of a team's cluster)."""
        for h in self.hosts.values():
            (self.dir / f"{h.name}.authorized_keys.{user}").write_text(public_key)

    def change_host_key(self, where: Where, changed: bool = True) -> None:
        """List a wrong key for a host in the launcher's known-hosts (what ssh sees when a host
        was reinstalled or is impersonated), or (``changed=False``) its own key again, as the
        cluster was built."""
        h = self.host(where)
        lines = [line for line in self.known_hosts.read_text().splitlines()
                 if not line.startswith(f"{h.name},")]
        if changed:
            other = self.dir / f"{h.name}.otherkey"
            if not other.exists():
                _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)])
            lines.append(f"{h.name},{h.addr} {Path(str(other) + '.pub').read_text().strip()}")
        else:
            lines += [line for line in self._built_known_hosts.splitlines()
                      if line.startswith(f"{h.name},")]
        self.known_hosts.write_text("\n".join(lines) + "\n")

    def close(self) -> None:
        """Stop every process of the cluster and remove it (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for p in self._sshd.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
        _remove_cluster(self.id)
        shutil.rmtree(self.dir, ignore_errors=True)
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):
                pass

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
