"""GCE preemptible lifetimes as a pool of hosts that only ever go away: the measured lifetimes
of 1-GPU preemptible VMs per GPU type and zone (transient-deep-learning, Li et al., ICAC 2019;
``transient-cloud/transient-deep-learning/lifetime/lifetime_2019_tidy.csv``), each revoked VM
replaced by a new one that starts after CM-DARE's measured preemptible start-up
(``transient-cloud/cm-dare/startup_time/pre_*/``; Li, Walls, Guo, arXiv 2004.03072).

Unlike Bamboo's AWS traces (:func:`launcher.cluster.transient_sim.availability`), where spot
capacity also arrives on its own, a GCE preemptible pool only shrinks: a VM lives until GCE
revokes it or it reaches GCE's 24 h limit, and the operator asks for a replacement, which runs
after its start-up.  :func:`availability` turns that into the same ``[(t_s, hosts)]`` steps
that :func:`launcher.cluster.transient_sim.run` replays.

The pool: as many slots as the zone had VMs in the measurement (10-19); at time 0 each slot
holds one VM, whose lifetime is that of the measured VM at its position (the measurement's own
mix of early revocations and 24 h terminations, in its order); every later VM of a slot lives a
lifetime drawn (seeded, with replacement) from the zone's measured lifetimes.  A zero lifetime
(one K80 VM) is a VM revoked as it started.
"""
from __future__ import annotations

import csv
import random
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

GCE_LIMIT_H = 24.0


def lifetimes_h(path: Path, gpu: str, zone: str) -> List[float]:
    """The measured lifetimes (hours, at most about 24.7: GCE's limit plus the minute
    resolution) of the ``gpu`` VMs in ``zone`` from ``lifetime_2019_tidy.csv``, in file order.

    Raises:
        ValueError: no VM of that type in that zone."""
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["gpu"].lower() == gpu.lower() and row["zone"] == zone:
                out.append(float(row["lifetime_h"]))
    if not out:
        raise ValueError(f"{path}: no {gpu} VM in {zone}")
    return out


def preemptible_startup_s(folder: Path) -> Dict[str, float]:
    """GPU type (lower case) -> mean seconds from a preemptible VM's request to its boot's end
    (Provisioning + Staging + Booting), over every ``pre_*/vm_time_measure_<gpu>*.csv`` in
    CM-DARE's ``startup_time`` folder (K80: 22 starts, P100: 23)."""
    sums: Dict[str, List[float]] = {}
    for path in sorted(folder.glob("pre_*/vm_time_measure_*.csv")):
        gpu = path.stem.split("_")[3]
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                sums.setdefault(gpu, []).append(
                    sum(float(row[k]) for k in ("Provisioning", "Staging", "Booting")))
    return {g: sum(v) / len(v) for g, v in sums.items()}


def availability(first_h: Sequence[float], startup_s: float, horizon_s: float,
                 seed: int = 0) -> List[Tuple[float, int]]:
    """Hosts alive over ``[0, horizon_s]`` (module docstring): ``[(t_s, hosts), ...]``, one
    entry per instant the count changes, the last at ``horizon_s``; ``first_h``: the measured
    lifetimes in hours (one slot each); ``startup_s``: a replacement's start-up, seconds.

    Raises:
        ValueError: no lifetimes, or a negative one or start-up."""
    if not first_h or min(first_h) < 0 or startup_s < 0:
        raise ValueError("lifetimes and the start-up must be given and not negative")
    rng = random.Random(seed)
    delta: Dict[float, int] = {}
    for life_h in first_h:
        t, life = 0.0, life_h * 3600.0
        delta[t] = delta.get(t, 0) + 1
        while True:
            end = t + life
            if end >= horizon_s:
                break
            delta[end] = delta.get(end, 0) - 1
            t = end + startup_s
            if t >= horizon_s:
                break
            delta[t] = delta.get(t, 0) + 1
            life = rng.choice(first_h) * 3600.0
    out: List[Tuple[float, int]] = []
    n = 0
    for t in sorted(delta):
        n += delta[t]
        if delta[t] and (not out or out[-1][1] != n):
            out.append((t, n))
    out.append((horizon_s, n))
    return out
