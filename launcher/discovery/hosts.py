"""Host lists in Horovod's syntax: ``host[:slots]``, comma separated (``-H``) or one a line
(``--hostfile``, host discovery output).  IPv6 addresses are written in brackets, ``[::1]:2``
(a bare ``::1`` is ambiguous with ``host:slots`` and rejected).

A line (hostfile, discovery output, the cluster service's allocation files) may go on with
attributes, ``key=value`` words after the host (:class:`HostLine`)::

    node1:4                      # Horovod's form: 4 slots
    node1 slots=4                # MPI hostfile form (Horovod's hostfile accepts it too)
    node1 gpus=2,3               # 2 slots, on GPUs 2 and 3 (slot i is the i-th GPU)
    node1:2 gpus=GPU-5c1b...,3   # nvidia-smi indices or UUIDs (GPU-..., MIG-...)

``gpus=`` names *which* GPUs the job's workers on that host use: the worker in slot ``i``
starts with ``CUDA_VISIBLE_DEVICES`` set to the whole list, so its own GPU sits at index ``i``
(its local rank) and ``torch.cuda.set_device(hvd.local_rank())`` selects it (docs/gpus.md).
``ends=T`` announces the host's end at unix time ``T`` (a spot / preemptible VM's notice: AWS
gives 120 s, GCE 30 s): no new worker goes there, the workers there leave stop-free at their
next commit (after a checkpoint where the job keeps them), and the pool stops placing work there.
``type=NAME`` names the host's GPU type (``t4``, ``a100``...: lower-cased, what the price and
revocation tables and a job's speeds per type are keyed by), ``price=D`` its price in dollars per
GPU-hour (per slot-hour on a host without GPUs), ``zone=Z`` where it runs, and the bare word
``spot`` marks it transient
(spot / preemptible: cheaper, revocable; its revocation risk comes from the operator's table,
:mod:`launcher.discovery.prices`).  A host line without ``price=`` takes its type's price from
the price table given once (``--prices FILE``), on-demand or spot as the line says::

    node3:4 type=t4 price=0.35 spot
    node4 gpus=0,1 type=a100

An unknown attribute is an error, so that a typo is never silently ignored.

Every host is checked and put in one canonical form where it enters (:func:`check_host`):

* a name follows RFC 1123: at most 253 characters, dot-separated labels of 1 to 63 letters,
  digits and hyphens, none starting or ending with a hyphen (underscores are tolerated, as
  resolvers do for container service names); it is lower-cased, as DNS compares names;
* an IPv4 address is four decimal numbers (``10.0.0.7``).  A name the C resolver would take for
  an address in another spelling (``0``, ``127.1``, ``0x7f000001``, ``017.0.0.1``) is refused
  instead of being ssh'd to under a name that hides where it points;
* an IPv6 address (in brackets) is written in its compressed form (``[0:0::1]`` -> ``::1``,
  ``[::FFFF:7F00:1]`` -> ``::ffff:127.0.0.1``);
* the unspecified addresses ``0.0.0.0`` and ``::`` are not hosts and are refused.

Which hosts are this machine (:func:`is_local`, spawned without ssh) is decided without any
network lookup, which can hang: loopback addresses (IPv4-mapped ones included), ``localhost``,
this machine's hostname, and the names ``/etc/hosts`` gives a loopback address or lists beside
this machine's hostname -- all compared without regard to case.  Anything else, e.g. another
namespace's ``10.x.x.x``, is remote.
"""
from __future__ import annotations

import ipaddress
import os
import re
import socket
from dataclasses import dataclass
from typing import Dict, FrozenSet, Optional, Tuple

from hvd_edl.peer_uid import parse_ip  # one parser for both sides (rendezvous imports it here)

MAX_SLOTS_PER_HOST = 1024   # more is a typo or garbage, and the driver walks every slot
MAX_NAME_CHARS = 253        # RFC 1035 / 1123: a name's text, without a final dot
MAX_LABEL_CHARS = 63
HOSTS_FILE = "/etc/hosts"
MAX_HOSTS_FILE_BYTES = 1 << 20

_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_\-]*[a-z0-9_])?")
_HOST_RE = re.compile(r"^(?:(?P<name>[^\[\]:\s]+)|\[(?P<v6>[^\[\]\s]+)\])(?::(?P<slots>.*))?$")
_ZONE = re.compile(r"[A-Za-z0-9_.\-]{1,15}")  # an interface name (IFNAMSIZ) or index


class HostSpecError(ValueError):
    """A host entry that does not follow ``host[:slots]`` with a valid host (see the module
    docstring) and slots a positive integer."""


def _show(text: str, limit: int = 80) -> str:
    """``repr`` of a user's text, cut to ``limit`` characters (a 1 MiB line stays one line)."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _inet_aton_accepts(name: str) -> bool:
    """Whether the C resolver reads ``name`` as an IPv4 address (``inet_aton``: ``0``,
    ``127.1``, ``0x7f000001``...); a pure parse, no lookup."""
    try:
        socket.inet_aton(name)
    except (OSError, ValueError):
        return False
    return True


def check_host(host: str) -> str:
    """The canonical form of one host (a name or an IP address, IPv6 without brackets), see the
    module docstring: ``"Node-1.Example.COM"`` -> ``"node-1.example.com"``, ``"0:0::1"`` ->
    ``"::1"``.

    Raises:
        HostSpecError: not an RFC 1123 name, a dotted-quad IPv4 or an IPv6 address; longer than
            253 characters; or an unspecified address.  The message shows at most 80 characters
            of ``host``.
    """
    if not isinstance(host, str) or not host:
        raise HostSpecError("empty host name")
    if ":" in host:
        try:
            ip = ipaddress.IPv6Address(host)
        except ValueError:
            raise HostSpecError(f"{_show(host)} is not an IPv6 address") from None
        if ip.is_unspecified:
            raise HostSpecError(f"{_show(host)} is the unspecified address, not a host")
        if ip.scope_id is not None and not _ZONE.fullmatch(ip.scope_id):
            raise HostSpecError(f"{_show(host)}: {_show(ip.scope_id)} is not an interface name")
        if ip.ipv4_mapped is not None:  # the same text on every Python version
            return f"::ffff:{ip.ipv4_mapped}" + (f"%{ip.scope_id}" if ip.scope_id else "")
        return str(ip)
    name = host.lower()
    if len(name) > MAX_NAME_CHARS:
        raise HostSpecError(f"host name {_show(host)} is {len(host)} characters long (at most "
                            f"{MAX_NAME_CHARS})")
    labels = name.split(".")
    # a name cannot end in a number (RFC 1123 2.1); what inet_aton takes is an address
    if re.fullmatch(r"[0-9]+", labels[-1]) or _inet_aton_accepts(name):
        try:
            ip4 = ipaddress.IPv4Address(name)
        except ValueError:
            raise HostSpecError(f"{_show(host)} is neither a host name nor an IPv4 address "
                                f"(write IPv4 addresses as four decimal numbers, e.g. "
                                f"127.0.0.1)") from None
        if ip4.is_unspecified:
            raise HostSpecError(f"{_show(host)} is the unspecified address, not a host")
        return str(ip4)
    for label in labels:
        if len(label) > MAX_LABEL_CHARS or not _LABEL.fullmatch(label):
            raise HostSpecError(f"{_show(host)} is not a valid host name (RFC 1123: labels of 1 "
                                f"to {MAX_LABEL_CHARS} letters, digits and hyphens, separated "
                                f"by dots)")
    return name


def parse_host_entry(entry: str, default_slots: Optional[int] = 1) -> Tuple[str, Optional[int]]:
    """``"node1:4"`` -> ``("node1", 4)``; ``"[::1]:2"`` -> ``("::1", 2)``; ``"node1"`` ->
    ``("node1", default_slots)`` (``None`` keeps "no slots given" visible to the caller).  The
    host comes back in :func:`check_host`'s canonical form.

    Raises:
        HostSpecError: unknown host syntax, a bare IPv6 address, an invalid host (see
            :func:`check_host`), or slots not an integer in [1, MAX_SLOTS_PER_HOST].
    """
    entry = entry.strip()
    m = _HOST_RE.match(entry)
    if not m:
        if entry.count(":") >= 2 and "[" not in entry:
            raise HostSpecError(f"IPv6 address {_show(entry)} must be written in brackets, "
                                f"e.g. [::1]:2")
        raise HostSpecError(f"unknown host syntax {_show(entry)} (expected host[:slots])")
    name, v6 = m.group("name"), m.group("v6")
    if v6 is not None and ":" not in v6:
        raise HostSpecError(f"{_show(entry)}: {_show(v6)} is not an IPv6 address")
    host = check_host(name if name is not None else v6)
    slots_text = m.group("slots")
    if slots_text is None:
        return host, default_slots
    if not re.fullmatch(r"[0-9]{1,9}", slots_text) or \
            not 1 <= int(slots_text) <= MAX_SLOTS_PER_HOST:
        raise HostSpecError(f"slots of host {_show(host)} must be a positive integer (at most "
                            f"{MAX_SLOTS_PER_HOST}), got {_show(slots_text)}")
    return host, int(slots_text)


def format_host_entry(host: str, slots: Optional[int] = None) -> str:
    """The inverse of :func:`parse_host_entry`: ``("::1", 2)`` -> ``"[::1]:2"``."""
    text = f"[{host}]" if ":" in host else host
    return text if slots is None else f"{text}:{slots}"


GPU_ID_RE = re.compile(r"[0-9]{1,4}|(?:GPU|MIG)-[0-9A-Za-z][0-9A-Za-z\-/]{0,95}")
HOST_ATTRIBUTES = ("slots", "gpus", "ends", "type", "price", "zone")  # key=value after the host
HOST_FLAGS = ("spot",)  # bare words after the host
GPU_TYPE_RE = re.compile(r"[a-z0-9][a-z0-9_.\-]{0,31}")
MAX_PRICE = 1e4  # dollars per GPU-hour: more is a typo (the dearest cloud GPU is ~ $15)


@dataclass(frozen=True)
class HostLine:
    """One host's entry: ``host`` (canonical, :func:`check_host`), ``slots`` (None: the line gave
    none and no default applies) and ``gpus``, the GPU of each slot in slot order (nvidia-smi
    indices or UUIDs; None: the line names no GPUs, the workers keep the launcher's view)."""
    host: str
    slots: Optional[int]
    gpus: Optional[Tuple[str, ...]] = None
    ends: Optional[float] = None  # unix seconds the host's notice gives for its end
    gpu_type: Optional[str] = None  # type=: the GPU type (lower-case), None: not given
    price: Optional[float] = None   # price=: dollars per GPU-hour, None: the price table's
    spot: bool = False              # spot: transient (revocable)
    zone: Optional[str] = None      # zone=: where it runs (its revocation risk may differ)

    def format(self) -> str:
        """The line again: ``node1:2 gpus=0,1 type=t4 price=0.35 spot`` (``node1`` alone
        without slots)."""
        text = format_host_entry(self.host, self.slots)
        text += f" gpus={','.join(self.gpus)}" if self.gpus else ""
        text += f" ends={self.ends:.3f}".rstrip("0").rstrip(".") if self.ends else ""
        text += f" type={self.gpu_type}" if self.gpu_type else ""
        text += f" price={self.price:g}" if self.price is not None else ""
        text += f" zone={self.zone}" if self.zone else ""
        return text + (" spot" if self.spot else "")


def parse_gpu_type(text: str, where: str = "") -> str:
    """``"A100"`` -> ``"a100"``: a GPU type name, 1 to 32 letters, digits, ``_ . -``, starting
    with a letter or digit; lower-cased.

    Raises:
        HostSpecError: another form."""
    name = text.strip().lower()
    if not GPU_TYPE_RE.fullmatch(name):
        raise HostSpecError(f"{where}type= needs a GPU type name (letters, digits, _ . -; at "
                            f"most 32), got {_show(text)}")
    return name


_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)


def parse_price(text: str, where: str = "price=") -> float:
    """``"0.35"`` -> 0.35: dollars per GPU-hour, a finite number in [0, MAX_PRICE], written as
    a plain decimal (ASCII digits, one point, an exponent: ``1e-3``; not ``1_000`` nor
    full-width digits, which Python's float() takes).

    Raises:
        HostSpecError: not a plain number, negative, infinite or above :data:`MAX_PRICE`."""
    try:
        value = float(text) if _DECIMAL.fullmatch(str(text).strip()) else float("nan")
    except (TypeError, ValueError):
        value = float("nan")
    if not 0 <= value <= MAX_PRICE:  # NaN fails too
        raise HostSpecError(f"{where} needs a price in dollars per GPU-hour, a number from 0 "
                            f"to {MAX_PRICE:g}, got {_show(str(text))}")
    return value


def parse_gpus(text: str, where: str = "") -> Tuple[str, ...]:
    """``"0,1,3"`` -> ``("0", "1", "3")``: GPU indices (0-9999) or UUIDs (``GPU-...``,
    ``MIG-...``), comma separated, none twice, at most :data:`MAX_SLOTS_PER_HOST`.

    Raises:
        HostSpecError: an empty list, an item of another form, or one listed twice."""
    items = tuple(g.strip() for g in text.split(","))
    if not text.strip() or len(items) > MAX_SLOTS_PER_HOST:
        raise HostSpecError(f"{where}gpus= needs 1 to {MAX_SLOTS_PER_HOST} GPU indices or "
                            f"UUIDs, comma separated, got {_show(text)}")
    for g in items:
        if not GPU_ID_RE.fullmatch(g):
            raise HostSpecError(f"{where}gpus=: {_show(g)} is neither a GPU index (0, 1, ...) "
                                f"nor a GPU UUID (GPU-..., MIG-...)")
    seen = set()
    for g in items:
        if g in seen:
            raise HostSpecError(f"{where}gpus=: GPU {g} is listed twice")
        seen.add(g)
    return items


def parse_host_line(line: str, default_slots: Optional[int] = 1) -> HostLine:
    """One line, ``host[:slots] [slots=N] [gpus=LIST] [ends=T] [type=NAME] [price=D] [spot]``
    (see the module docstring).  With ``gpus=`` and no slots, a slot per GPU; with both, as many
    slots as GPUs.

    Raises:
        HostSpecError: see :func:`parse_host_entry`, :func:`parse_gpus`,
            :func:`parse_gpu_type`, :func:`parse_price`; an unknown or repeated attribute,
            ``slots`` given twice or disagreeing with ``gpus``."""
    words = re.sub(r"\s*=\s*", "=", line.strip()).split()  # "slots = 4" as MPI writes it
    if not words:
        raise HostSpecError("empty host line")
    host, slots = parse_host_entry(words[0], None)
    attrs: Dict[str, str] = {}
    for word in words[1:]:
        key, eq, value = word.partition("=")
        key = key.strip().lower()
        known = ", ".join([k + "=" for k in HOST_ATTRIBUTES] + list(HOST_FLAGS))
        if not eq and key in HOST_FLAGS:
            if key in attrs:
                raise HostSpecError(f"host {host}: {key} given twice")
            attrs[key] = ""
            continue
        if not eq:
            raise HostSpecError(f"unknown host syntax {_show(line)} (expected host[:slots], "
                                f"then attributes key=value: {known})")
        if key not in HOST_ATTRIBUTES:
            raise HostSpecError(f"host {host}: unknown attribute {_show(word)} (known: "
                                f"{known})")
        if key in attrs:
            raise HostSpecError(f"host {host}: {key}= given twice")
        attrs[key] = value
    if "slots" in attrs:
        if slots is not None:
            raise HostSpecError(f"host {host}: slots given twice (host:N and slots=N)")
        _, slots = parse_host_entry(f"{words[0]}:{attrs['slots']}", None)
    gpus = parse_gpus(attrs["gpus"], f"host {host}: ") if "gpus" in attrs else None
    if gpus is not None:
        if slots is not None and slots != len(gpus):
            raise HostSpecError(f"host {host}: {slots} slots but {len(gpus)} GPUs in gpus= "
                                f"(each slot is one GPU)")
        slots = len(gpus)
    ends = None
    if "ends" in attrs:
        try:
            ends = float(attrs["ends"])
        except ValueError:
            ends = None
        if ends is None or not 0 < ends < 1e11:
            raise HostSpecError(f"host {host}: ends= needs the end's unix time in seconds, got "
                                f"{_show(attrs['ends'])}")
    where = f"host {host}: "
    gpu_type = parse_gpu_type(attrs["type"], where) if "type" in attrs else None
    price = parse_price(attrs["price"], f"{where}price=") if "price" in attrs else None
    zone = None
    if "zone" in attrs:
        zone = attrs["zone"].strip().lower()
        if not re.fullmatch(r"[a-z0-9][a-z0-9_.\-]{0,62}", zone):
            raise HostSpecError(f"{where}zone= needs a zone name (e.g. us-east1-c), got "
                                f"{_show(attrs['zone'])}")
    return HostLine(host, default_slots if slots is None else slots, gpus, ends, gpu_type,
                    price, "spot" in attrs, zone)


def parse_host_specs(text: str, default_slots: Optional[int] = 1) -> Dict[str, HostLine]:
    """Hostfile or discovery output, one :func:`parse_host_line` a line (blank lines and ``#``
    comments skipped), order kept: ``{host: HostLine}``.

    Raises:
        HostSpecError: a malformed line (the message gives its number) or a host listed twice,
            in any spelling (rejected rather than adding the slots up: a duplicate is far more
            often a broken script than a wish)."""
    out: Dict[str, HostLine] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            entry = parse_host_line(line, default_slots)
        except HostSpecError as e:
            raise HostSpecError(f"line {number}: {e}") from None
        if entry.host in out:
            raise HostSpecError(f"line {number}: host {entry.host!r} is listed twice")
        out[entry.host] = entry
    return out


def parse_hosts_arg(text: str) -> Dict[str, int]:
    """``-H a:2,b:1`` -> ``{"a": 2, "b": 1}`` (order kept; a repeated host is an error).

    Raises:
        HostSpecError: see :func:`parse_host_entry`; or a host listed twice.
    """
    return _collect((p, None) for p in text.split(",") if p.strip())


def parse_host_lines(text: str, default_slots: Optional[int] = 1) -> Dict[str, Optional[int]]:
    """Hostfile or discovery output as ``{host: slots}`` (:func:`parse_host_specs`, whose
    ``gpus=`` count as slots).

    Raises:
        HostSpecError: see :func:`parse_host_specs`.
    """
    return {h: e.slots for h, e in parse_host_specs(text, default_slots).items()}


def _collect(entries, default_slots: Optional[int] = 1) -> Dict[str, Optional[int]]:
    hosts: Dict[str, Optional[int]] = {}
    for entry, number in entries:
        where = f"line {number}: " if number is not None else ""
        try:
            host, slots = parse_host_entry(entry, default_slots)
        except HostSpecError as e:
            raise HostSpecError(f"{where}{e}") from None
        if host in hosts:
            raise HostSpecError(f"{where}host {host!r} is listed twice")
        hosts[host] = slots
    return hosts


_hosts_file_cache: Dict[str, tuple] = {}


def _names_of_this_machine(hostname: str, path: str) -> FrozenSet[str]:
    """Names ``path`` (``/etc/hosts``) gives a loopback address or lists on the line of
    ``hostname``, lower-cased; re-read only when the file changes, at most 1 MiB of it."""
    try:
        st = os.stat(path)
    except OSError:
        return frozenset()
    key = (st.st_ino, st.st_mtime_ns, st.st_size, hostname)
    cached = _hosts_file_cache.get(path)
    if cached is not None and cached[0] == key:
        return cached[1]
    names = set()
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_HOSTS_FILE_BYTES).decode("utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        fields = line.split("#", 1)[0].lower().split()
        if len(fields) < 2:
            continue
        ip = parse_ip(fields[0])
        if (ip is not None and ip.is_loopback) or hostname in fields[1:]:
            names.update(n.rstrip(".") for n in fields[1:])
    result = frozenset(names)
    _hosts_file_cache[path] = (key, result)
    return result


def is_local(host: str) -> bool:
    """True when ``host`` is provably this machine (spawned without ssh): a loopback or
    unspecified IP address (IPv4-mapped IPv6 included), ``localhost``, this machine's hostname,
    or a name ``/etc/hosts`` maps to loopback or lists beside that hostname; names are compared
    without regard to case or a final dot.  Never does a network lookup (a DNS query of a
    remote name can hang); everything else, e.g. ``10.0.0.7``, is remote."""
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    ip = parse_ip(text)
    if ip is not None:
        return ip.is_loopback or ip.is_unspecified
    name = text.lower().rstrip(".")
    if not name:
        return False
    me = socket.gethostname().lower().rstrip(".")
    return name in ("localhost", me) or name in _names_of_this_machine(me, HOSTS_FILE)
