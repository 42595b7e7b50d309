"""What ``serve`` tells the operator once about the pool's lines, one line each, where a line
is taken but does not do what it seems to: a GPU type whose hosts of a class (on-demand,
spot) have no price (no ``price=`` on their lines, no row in ``--prices`` or a blank cell for
that class: those hosts count as free, $0 per GPU-hour, in every cost and
choice), and a host not scheduled because its line's end (``ends=``, a spot notice:
:mod:`launcher.cluster.drains`) is already past (a pool of such hosts serves 0 slots, where
an empty ``-H`` is refused; a notice still to come is a drain, which the events report).
:meth:`launcher.cluster.service.Service.set_pool` logs each note the first time it holds
(the keys say which were told).
"""
from __future__ import annotations

from typing import Dict, Mapping


def pool_notes(lines: Mapping[str, object], terms: Mapping[str, object],
               now: float) -> Dict[str, str]:
    """key -> one line for the operator, from the pool's host ``lines`` (host ->
    :class:`launcher.discovery.hosts.HostLine`), their ``terms`` (host ->
    :class:`launcher.discovery.prices.HostTerms`: the price each line ends up with) and
    ``now`` (unix seconds).  Keys: ``price:TYPE`` / ``price:TYPE:spot`` (a type whose on-demand /
    spot hosts have no price: neither ``price=`` nor that class's cell in ``--prices``), ``ends:HOST``
    (a host whose announced end is past)."""
    out: Dict[str, str] = {}
    unpriced = sorted({(t.gpu_type, bool(getattr(t, "spot", False))) for t in terms.values()
                       if getattr(t, "gpu_type", None) and t.price is None})
    for t, spot in unpriced:
        cls, col = ("spot", "spot") if spot else ("on-demand", "on_demand")
        out[f"price:{t}" + (":spot" if spot else "")] = (
            f"GPU type {t} has no price for its {cls} hosts (no price= on their lines; "
            f"--prices has no {t} row, or its {col} cell is blank): they count as free ($0 "
            f"per GPU-hour) in every cost and choice")
    for host, line in sorted(lines.items()):
        end = getattr(line, "ends", None)
        if end and end <= now:  # a notice to come is a drain, and its events say so
            out[f"ends:{host}"] = (f"host {host} is not scheduled: its line's end is already "
                                   f"past (ends={end:g}, {now - end:.0f} s ago); to serve "
                                   f"it again, remove ends= from its line")
    return out
