"""What a host costs and how likely it is to be revoked, per GPU type: the operator's price table
(``--prices FILE``) and revocation-risk table (``--revocation-risk FILE``), and what a pool's
host lines (:class:`launcher.discovery.hosts.HostLine`: ``type=``, ``price=``, ``zone=``,
``spot``) make of them (:func:`host_terms`).  CM-DARE (Li, Walls, Guo, arXiv 2004.03072) chooses
cloud GPU servers by these three figures and a job's speed per type.

Price table, CSV with a header, dollars per GPU-hour (a blank cell: not offered that way), and
optionally each type's peak ``tflops`` (a job's speed on a type it has not run on is its speed
on another scaled by the two types' TFLOPS, CM-DARE's first feature)::

    type,on_demand,spot,tflops
    t4,0.35,0.11,8.1
    a100,2.93,0.88,19.5

Revocation-risk table, CSV with a header, revocations per GPU-hour of a transient host (a
blank zone: the type's rate anywhere not listed), and optionally ``replacement_start_s``, the
seconds a replacement host takes to start there (blank or absent: :data:`STARTUP_S`)::

    type,zone,revocations_per_hour,replacement_start_s
    k80,,0.0161,
    k80,us-central1-c,0.0716,81

The default (:data:`GCE_RATES`) is GCE's preemptible VMs as measured in February 2019 by
transient-deep-learning (Li et al., ICAC 2019; ``../shared/traces/transient-cloud/``,
``lifetime_2019_tidy.csv``): the maximum-likelihood rate of an exponential lifetime,
revocations over the VM-hours observed (a VM that reached GCE's 24 h limit counts its hours,
not a revocation).  A zone with none observed takes its type's rate (16 VMs for a day cannot
show a zone never revokes); a type the table lacks takes :data:`DEFAULT_RATE_PER_H`, every VM
measured.  On-demand hosts are never revoked.

A revocation costs the work since the job's last commit (none when a notice came first: the
workers leave at a commit, :mod:`launcher.cluster.drains`) plus a stop-free switch, and its
replacement's start-up (:data:`STARTUP_S`: CM-DARE's VM start-up means, on-demand 69-76 s,
preemptible 81-92 s) during which the job trains one host short.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

from launcher.discovery.hosts import HostLine, HostSpecError, parse_gpu_type, parse_price

# revocations per VM-hour of a GCE preemptible 1-GPU VM (transient-deep-learning, 2019):
# revocations / VM-hours observed; (type, zone) with zone "" for the whole type
GCE_RATES: Dict[Tuple[str, str], float] = {
    ("k80", ""): 20 / 1245.3, ("k80", "europe-west1-b"): 6 / 275.9,
    ("k80", "us-central1-c"): 14 / 195.5,
    ("p100", ""): 8 / 840.5, ("p100", "europe-west1-b"): 3 / 206.2,
    ("p100", "us-east1-c"): 1 / 223.2, ("p100", "us-west1-b"): 4 / 164.4,
    ("v100", ""): 5 / 1095.3, ("v100", "asia-east1-c"): 3 / 391.6,
    ("v100", "europe-west4-a"): 2 / 456.5,
}
DEFAULT_RATE_PER_H = 33 / 3181.1   # all 152 VMs: 0.0104 revocations per VM-hour
STARTUP_S = {"on_demand": 72.0, "spot": 87.0}  # CM-DARE's GCE VM start-up means, seconds


class TableError(ValueError):
    """A price or risk table that cannot be used (one line: the file, the row, the problem)."""


@dataclass(frozen=True)
class TypePrice:
    """One type's prices, dollars per GPU-hour; None: not offered that way; ``tflops``: its
    peak TFLOPS (None: not given)."""
    on_demand: Optional[float] = None
    spot: Optional[float] = None
    tflops: Optional[float] = None


def _rows(path: str, columns: Tuple[str, ...]):
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in columns if c not in (reader.fieldnames or [])]
            if missing:
                raise TableError(f"{path}: needs the columns {', '.join(columns)} (missing "
                                 f"{', '.join(missing)})")
            yield from enumerate(reader, 2)
    except OSError as e:
        raise TableError(f"cannot read {path}: {e.strerror or e}") from None


def read_prices(path: str) -> Dict[str, TypePrice]:
    """The price table at ``path`` (module docstring): type -> :class:`TypePrice`.

    Raises:
        TableError: unreadable, a missing column, a bad type name, a price not a number in
            [0, 10000] (a negative one included), a type listed twice, or no price in a row."""
    out: Dict[str, TypePrice] = {}
    for number, row in _rows(path, ("type", "on_demand", "spot")):
        where = f"{path} line {number}: "
        try:
            t = parse_gpu_type(row["type"] or "", where)
            cells = {k: (row[k] or "").strip() for k in ("on_demand", "spot")}
            vals = {k: parse_price(v, f"{where}{k}") if v else None for k, v in cells.items()}
        except HostSpecError as e:
            raise TableError(str(e)) from None
        if t in out:
            raise TableError(f"{where}type {t} is listed twice")
        if vals["on_demand"] is None and vals["spot"] is None:
            raise TableError(f"{where}type {t} has neither an on_demand nor a spot price")
        tflops = None
        if (row.get("tflops") or "").strip():
            try:
                tflops = float(row["tflops"])
            except ValueError:
                tflops = float("nan")
            if not 0 < tflops < 1e5:
                raise TableError(f"{where}tflops needs a positive number, got "
                                 f"{row['tflops']!r}")
        out[t] = TypePrice(vals["on_demand"], vals["spot"], tflops)
    return out


class RiskTable:
    """Revocations per GPU-hour of a transient host, by type and zone (module docstring).

    Args:
        rates: (type, zone) -> revocations per hour, zone "" for the whole type; default
            :data:`GCE_RATES`.
        default_per_h: the rate of a type the table lacks."""

    def __init__(self, rates: Optional[Mapping[Tuple[str, str], float]] = None,
                 default_per_h: float = DEFAULT_RATE_PER_H,
                 startup_s: Optional[Mapping[Tuple[str, str], float]] = None):
        self.rates = dict(GCE_RATES if rates is None else rates)
        self.default_per_h = default_per_h
        self.startup = dict(startup_s or {})  # (type, zone) -> seconds; ("*", "") any type

    def startup_s(self, gpu_type: Optional[str], zone: Optional[str] = None) -> Optional[float]:
        """Seconds a replacement transient host of ``gpu_type`` in ``zone`` takes to start (the
        table's ``replacement_start_s``: the zone's, else the type's, else the ``*`` row's);
        None: not given (the caller's default, CM-DARE's VM start-up)."""
        t, z = (gpu_type or ""), (zone or "")
        for k in ((t, z), (t, ""), ("*", "")):
            if k in self.startup:
                return self.startup[k]
        return None

    def rate_per_h(self, gpu_type: Optional[str], zone: Optional[str] = None) -> float:
        """Revocations per hour of one transient GPU host of ``gpu_type`` in ``zone``: the
        zone's rate when listed and positive, else the type's, else the default."""
        t, z = (gpu_type or ""), (zone or "")
        zoned = self.rates.get((t, z)) if z else None
        if zoned:
            return zoned
        return self.rates.get((t, ""), self.default_per_h)

    @classmethod
    def read(cls, path: str) -> "RiskTable":
        """The table at ``path`` (CSV ``type,zone,revocations_per_hour``); its rows replace
        the GCE defaults wholly (a type it lacks gets its ``*`` row's rate, else the default).

        Raises:
            TableError: unreadable, a missing column, a bad type, a rate not a finite number
                >= 0, or a (type, zone) listed twice."""
        rates: Dict[Tuple[str, str], float] = {}
        startup: Dict[Tuple[str, str], float] = {}
        default = DEFAULT_RATE_PER_H
        for number, row in _rows(path, ("type", "zone", "revocations_per_hour")):
            where = f"{path} line {number}: "
            try:
                value = float(row["revocations_per_hour"])
            except (TypeError, ValueError):
                value = float("nan")
            if not (math.isfinite(value) and value >= 0):
                raise TableError(f"{where}revocations_per_hour needs a number >= 0, got "
                                 f"{row['revocations_per_hour']!r}")
            start = (row.get("replacement_start_s") or "").strip()
            if start:
                try:
                    start_s = float(start)
                except ValueError:
                    start_s = float("nan")
                if not 0 <= start_s < 1e5:
                    raise TableError(f"{where}replacement_start_s needs seconds >= 0, got "
                                     f"{start!r}")
            if (row["type"] or "").strip() == "*":
                default = value
                if start:
                    startup[("*", "")] = start_s
                continue
            try:
                key = (parse_gpu_type(row["type"] or "", where),
                       (row["zone"] or "").strip().lower())
            except HostSpecError as e:
                raise TableError(str(e)) from None
            if key in rates:
                raise TableError(f"{where}{key[0]} {key[1] or '(any zone)'} is listed twice")
            rates[key] = value
            if start:
                startup[key] = start_s
        return cls(rates, default, startup)


@dataclass(frozen=True)
class HostTerms:
    """What one pool host offers: its GPU ``gpu_type`` (None: untyped), ``price`` in dollars
    per GPU-hour (None: unknown, counted as 0), ``spot`` (transient), ``revocations_per_h``
    (per GPU, 0 on demand) and ``startup_s`` (a replacement host's start-up, seconds)."""
    gpu_type: Optional[str]
    price: Optional[float]
    spot: bool
    revocations_per_h: float
    startup_s: float


def host_terms(lines: Mapping[str, HostLine], prices: Optional[Mapping[str, TypePrice]] = None,
               risk: Optional[RiskTable] = None,
               startup_s: Optional[Mapping[str, float]] = None) -> Dict[str, HostTerms]:
    """host -> :class:`HostTerms` from the pool's host lines: a line's ``price=`` wins, else
    its type's spot (a ``spot`` line) or on-demand price from ``prices``, never the other
    class's (a blank cell leaves that class unpriced: ``price`` None, which ``serve`` tells,
    :mod:`launcher.cluster.pool_notes`); the risk of a ``spot`` line from
    ``risk`` (default the GCE rates) by type and zone; a spot host's replacement start-up from
    ``risk``'s ``replacement_start_s`` where given, else from ``startup_s`` (keys ``spot``,
    ``on_demand``; default :data:`STARTUP_S`)."""
    risk = risk or RiskTable()
    startup = dict(STARTUP_S, **(startup_s or {}))
    out: Dict[str, HostTerms] = {}
    for host, line in lines.items():
        tp = (prices or {}).get(line.gpu_type or "")
        price = line.price
        if price is None and tp is not None:  # its own class's price only: a blank cell is
            price = tp.spot if line.spot else tp.on_demand  # "not offered that way", no price
        given = risk.startup_s(line.gpu_type, line.zone) if line.spot else None
        out[host] = HostTerms(line.gpu_type, price, line.spot,
                              risk.rate_per_h(line.gpu_type, line.zone) if line.spot else 0.0,
                              startup["spot" if line.spot else "on_demand"] if given is None
                              else given)
    return out
