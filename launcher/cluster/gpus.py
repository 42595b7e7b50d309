"""Where a job's GPUs are chosen, in the cluster service: every slot of a GPU host is one GPU, and
each job holds *which* GPUs, not only how many (Slurm's gres, Kubernetes' device plugin and Ray
hand out devices the same way; horovod issues 2034, 1586, 2831, 497 and ray 40803 are what
happens otherwise: two jobs' workers on one GPU).

* The pool's GPUs per host (:func:`pool_gpus`): a ``gpus=`` the pool's own host line gives,
  else ``serve --assume-gpus`` (GPU indices ``0..slots-1``, nothing asked), else what
  ``nvidia-smi`` on the host answers (over ssh for a remote host, :func:`probe`), the slots
  capped to the GPUs found; a host without GPUs keeps CPU slots (no GPU lists for its jobs).
* A job's GPUs on a host are an ordered list, written into its allocation file
  (``host:2 gpus=4,1``): its launcher starts the worker of slot ``i`` with
  ``CUDA_VISIBLE_DEVICES`` = that list, so ``set_device(local_rank)`` is the ``i``-th GPU.
  A shrink drops GPUs from the end of the list (the launcher's highest slots leave), a growth
  appends free GPUs (:func:`choose`): a running worker's slot keeps its GPU.
* ``held`` GPUs (job -> host -> set) are those a job's live processes may still use: its list,
  plus the GPUs it was asked to give back until its telemetry shows no worker on them
  (:func:`released`).  A GPU is free only when no job holds it, so no GPU is ever given to two
  jobs' live processes, also while a shrinking job's leavers finish their last step.  The held
  sets are kept in the service's folder (``held/<job>.json``), so a restarted service counts a leaver's
  GPU as held until it is gone (:func:`load_held`).

Each function takes the service explicitly (:class:`launcher.cluster.service.Service`), on its
loop's thread; it reads ``pool``, ``host_gpus``, ``job_gpus``, ``held_gpus``.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from launcher.cluster.runs import takes_part

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 10.0  # one nvidia-smi call, local or over ssh
PROBE_AGAIN_S = 300.0  # a host that answered "no GPUs" (or did not answer) is asked again after this
NVIDIA_SMI = ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"]


def parse_nvidia_smi(text: str) -> Tuple[str, ...]:
    """GPU indices from ``nvidia-smi --query-gpu=index,uuid --format=csv,noheader`` output
    (``"0, GPU-5c1b..."`` a line), in the order given; lines that are not ``index, uuid`` are
    skipped."""
    out = []
    for line in text.splitlines():
        index = line.split(",")[0].strip()
        if index.isdigit():
            out.append(index)
    return tuple(out)


def probe(host: str, local: bool, ssh_args: Sequence[str] = (),
          timeout_s: float = PROBE_TIMEOUT_S) -> Optional[Tuple[str, ...]]:
    """The GPU indices ``nvidia-smi`` reports on ``host`` (run here when ``local``, else over
    ``ssh`` with ``ssh_args``: ``-p PORT``, ``-i KEY``), or None when it has none, has no
    ``nvidia-smi``, or does not answer within ``timeout_s`` (a CPU host: CPU slots)."""
    if local:
        if shutil.which("nvidia-smi") is None:
            return None
        argv = list(NVIDIA_SMI)
    else:
        argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", *ssh_args, host,
                " ".join(NVIDIA_SMI)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("GPUs of %s: nvidia-smi did not answer (%s): CPU slots", host, e)
        return None
    if done.returncode != 0:
        return None
    return parse_nvidia_smi(done.stdout) or None


def pool_gpus(hosts: Dict[str, int], named: Dict[str, Tuple[str, ...]], assume: bool,
              known: Dict[str, Tuple[str, ...]], prober=None,
              cpu_hosts: Optional[Dict[str, float]] = None,
              now: Optional[float] = None) -> Dict[str, Tuple[str, ...]]:
    """The GPUs of each pool host (host -> GPU ids, one per slot, hosts without GPUs left out):
    a host line's ``gpus=`` (``named``), else ``0..slots-1`` with ``assume``
    (``serve --assume-gpus``), else what ``known`` already says (found when the host joined),
    else ``prober(host)`` (:func:`probe`), capped to the host's slots.

    ``cpu_hosts`` (host -> monotonic time, s, of the answer; updated in place) remembers the
    hosts the prober found without GPUs, so that a CPU host is not asked over ssh at every
    change of the pool (each ask can hold the caller up to :data:`PROBE_TIMEOUT_S`): it is
    asked again after :data:`PROBE_AGAIN_S` (an unreachable GPU host is found later), and at
    once when it left the pool and came back."""
    now = time.monotonic() if now is None else now
    if cpu_hosts is not None:
        for gone in [h for h in cpu_hosts if h not in hosts]:
            del cpu_hosts[gone]
    out: Dict[str, Tuple[str, ...]] = {}
    for host, slots in hosts.items():
        if host in named:
            gpus = tuple(named[host])
        elif assume:
            gpus = tuple(str(i) for i in range(slots))
        elif host in known:
            gpus = known[host]
        elif cpu_hosts is not None and now - cpu_hosts.get(host, -PROBE_AGAIN_S) < PROBE_AGAIN_S:
            gpus = None  # asked recently: CPU slots
        else:
            gpus = prober(host) if prober is not None else None
            if cpu_hosts is not None:
                if gpus:
                    cpu_hosts.pop(host, None)
                else:
                    cpu_hosts[host] = now
        if gpus:
            out[host] = tuple(gpus[:slots])
    return out


def live_pairs(telemetry: Optional[dict]) -> List[Tuple[str, Optional[str]]]:
    """(host, gpu) of each worker that still takes part in the job in a ``/ctl/telemetry``
    answer (:func:`launcher.cluster.runs.takes_part`)."""
    return [(w["host"], w.get("gpu")) for w in (telemetry or {}).get("workers", [])
            if takes_part(w)]


def held_anywhere(svc, host: str, but: Optional[str] = None) -> Set[str]:
    """The GPUs of ``host`` any job (but ``but``) holds."""
    out: Set[str] = set()
    for job_id, hosts in svc.held_gpus.items():
        if job_id != but:
            out |= hosts.get(host, set())
    return out


def free_count(svc, host: str) -> Optional[int]:
    """GPUs of ``host`` no job holds (None: a CPU host, counted in slots)."""
    gpus = svc.host_gpus.get(host)
    if gpus is None:
        return None
    return len([g for g in gpus if g not in held_anywhere(svc, host)])


def choose(svc, job_id: str, hosts: Dict[str, int]) -> Dict[str, Tuple[str, ...]]:
    """The job's GPU list per GPU host for the allocation ``hosts`` (host -> slots): its
    current list cut to the new count, then GPUs no job holds appended (this job's own
    leavers' GPUs included among the held ones).  Hosts without GPUs are left out.

    Raises:
        ValueError: a GPU host has fewer free GPUs than the growth needs (the caller checked
            the free counts first: a bug, never silent)."""
    current = svc.job_gpus.get(job_id, {})
    out: Dict[str, Tuple[str, ...]] = {}
    for host, k in hosts.items():
        gpus = svc.host_gpus.get(host)
        if gpus is None or k <= 0:
            continue
        mine = [g for g in current.get(host, ()) if g in gpus][:k]
        busy = held_anywhere(svc, host) | set(mine)
        spare = [g for g in gpus if g not in busy]
        if len(mine) + len(spare) < k:
            raise ValueError(f"{host}: {k} GPUs wanted for {job_id}, {len(mine)} held and "
                             f"{len(spare)} free")
        out[host] = tuple(mine + spare[:k - len(mine)])
    return out


def hold(svc, job_id: str, lists: Dict[str, Tuple[str, ...]]) -> None:
    """The job's allocation file now names ``lists``: they are its lists, and held on top of
    what it held (the GPUs it gives back stay held until :func:`released`)."""
    svc.job_gpus[job_id] = {h: tuple(g) for h, g in lists.items()}
    held = svc.held_gpus.setdefault(job_id, {})
    for host, gpus in lists.items():
        held.setdefault(host, set()).update(gpus)
    save_held(svc, job_id)


def released(svc, job_id: str, live: Iterable[Tuple[str, Optional[str]]]) -> Dict[str, List[str]]:
    """The job's telemetry shows its live workers on ``live`` ((host, gpu) pairs): it holds its
    lists and those GPUs only; returns what it gave back (host -> GPUs)."""
    keep: Dict[str, Set[str]] = {h: set(g) for h, g in svc.job_gpus.get(job_id, {}).items()}
    for host, gpu in live:
        if gpu is not None:
            keep.setdefault(host, set()).add(gpu)
    before = svc.held_gpus.get(job_id, {})
    gone = {h: sorted(g - keep.get(h, set())) for h, g in before.items()
            if g - keep.get(h, set())}
    svc.held_gpus[job_id] = {h: g for h, g in keep.items() if g}
    save_held(svc, job_id)
    return gone


def drop(svc, job_id: str) -> None:
    """The job's processes are all gone (its run ended): it holds no GPU."""
    svc.job_gpus.pop(job_id, None)
    svc.held_gpus.pop(job_id, None)
    save_held(svc, job_id)


def occupied_counts(svc, job_id: str, counts: Dict[str, int]) -> Dict[str, int]:
    """``counts`` (host -> slots a job occupies) with each GPU host's count raised to the GPUs
    the job holds there (a leaver's GPU is occupied until released)."""
    out = dict(counts)
    for host, gpus in svc.held_gpus.get(job_id, {}).items():
        if host in svc.host_gpus:
            out[host] = max(out.get(host, 0), len(gpus))
    return out


def _held_path(svc, job_id: str) -> str:
    """``STATE_DIR/held/<job>.json``: the service's own folder, never the job's (a job's folder
    is its user's under a root service: a file the service writes or trusts there could be a
    link the user planted, or a list of GPUs the user wrote)."""
    return os.path.join(str(svc.state_dir), "held", f"{job_id}.json")


def save_held(svc, job_id: str) -> None:
    """Keep the job's lists and held GPUs in the service's folder (:func:`_held_path`, written
    atomically), for a restarted service (:func:`load_held`)."""
    path = _held_path(svc, job_id)
    if not os.path.isdir(os.path.join(str(svc.state_dir), "jobs", job_id)):
        return
    data = {"lists": {h: list(g) for h, g in svc.job_gpus.get(job_id, {}).items()},
            "held": {h: sorted(g) for h, g in svc.held_gpus.get(job_id, {}).items()}}
    tmp = path + ".tmp"
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("job %s: cannot keep its GPUs in %s: %s", job_id, path, e)


def load_held(svc, job_id: str, lists: Dict[str, Tuple[str, ...]]) -> None:
    """A re-adopted job (a restarted service): its lists are what its allocation file names
    (``lists``), and it holds those plus what :func:`save_held` kept it still held (its leavers'
    GPUs until its telemetry shows them gone)."""
    svc.job_gpus[job_id] = {h: tuple(g) for h, g in lists.items()}
    held: Dict[str, Set[str]] = {h: set(g) for h, g in lists.items()}
    try:
        with open(_held_path(svc, job_id)) as f:
            saved = json.load(f).get("held", {})
        for host, gpus in saved.items():
            if host in svc.host_gpus and isinstance(gpus, list):
                held.setdefault(host, set()).update(str(g) for g in gpus)
    except (OSError, ValueError, AttributeError):
        pass
    svc.held_gpus[job_id] = held
