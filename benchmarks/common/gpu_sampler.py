"""Which GPU every live worker process uses, sampled from outside (a library, not a benchmark):
each worker's own environment (``/proc/PID/environ``: ``CUDA_VISIBLE_DEVICES`` and
``HOROVOD_LOCAL_RANK``) gives the GPU ``torch.cuda.set_device(hvd.local_rank())`` selects in
it.  Used by tests/test_cluster_gpus.py and benchmarks/cluster/gpu_placement.py."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import psutil


def environ(pid: int) -> Optional[Dict[str, str]]:
    """The environment process ``pid`` started with (None: gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _launcher_of(parent: int) -> int:
    """The launcher of a worker whose parent is ``parent``: the parent itself, or for a worker
    forked by a launcher's zygote (docs/zygote.md) the zygote's parent."""
    try:
        cmd = psutil.Process(parent).cmdline()
        if len(cmd) > 2 and cmd[1] == "-c" and "hvd_edl.zygote" in cmd[2]:
            return psutil.Process(parent).ppid()
    except psutil.Error:
        pass
    return parent


def _job_worker(env: Dict[str, str]) -> Tuple[str, str]:
    """A worker's identity across processes: its job's secret (one per launcher) and its id."""
    return env.get("HVD_EDL_SECRET", ""), env.get("HVD_EDL_WORKER_ID", "")


def _stub_launchers(envs: Dict[int, Optional[Dict[str, str]]]) -> Dict[Tuple[str, str], int]:
    """(job secret, worker id) -> the launcher, for every worker's stub among ``envs`` (pid ->
    environment): a worker forked by a kept zygote (docs/zygote.md) is no launcher's
    descendant, its stub is the launcher's child."""
    out = {}
    for pid, env in envs.items():
        if not env or "HVD_EDL_WORKER_ID" not in env:
            continue
        try:
            proc = psutil.Process(pid)
            if any(a.endswith("zygote_client.py") for a in proc.cmdline()[:4]):
                out[_job_worker(env)] = proc.ppid()
        except psutil.Error:
            continue
    return out


class GpuSampler:
    """Samples, every ``period_s``, every worker process whose environment carries
    ``HVD_EDL_TEST_MARKER=marker`` (and a ``CUDA_VISIBLE_DEVICES``).

    ``samples``: one ``{pid: (launcher pid, worker id, GPU)}`` a sample; ``seen``: per
    (launcher pid, worker id) ``[GPU, first seen, last seen]`` (monotonic seconds); ``hosts``:
    pid -> its ``HOROVOD_HOSTNAME`` (GPU 0 of two hosts are two GPUs); ``runs``: per (cluster
    run, worker id) ``[host, GPU, first seen, last seen, pids]``, the run being the worker's
    ``HVD_EDL_CLUSTER_RUN`` (``STATE_DIR/jobs/<job>/run<N>``; its launcher's pid outside the
    cluster service).  A remote worker is seen twice, its local ``ssh`` client carrying the same
    environment: one worker of one run, counted once."""

    def __init__(self, marker: str, period_s: float = 0.1):
        self.marker = marker
        self.period_s = period_s
        self.samples: List[Dict[int, Tuple[int, str, str]]] = []
        self.seen: Dict[Tuple[int, str], list] = {}
        self.hosts: Dict[int, str] = {}
        self.runs: Dict[Tuple[str, str], list] = {}
        self._identity: Dict[int, Tuple[str, str]] = {}  # pid -> (run, worker id)
        # (pid, devices, local rank, worker id, cluster run, parent pid, command line[:4])
        self.unreadable: List[tuple] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def workers(self) -> Dict[Tuple[int, str], str]:
        """(launcher pid, worker id) -> the GPU it selected."""
        return {k: v[0] for k, v in self.seen.items()}

    def _run(self) -> None:
        while not self._stop.is_set():
            sample = {}
            now = time.monotonic()
            envs = {pid: environ(pid) for pid in psutil.pids()}
            stubs = _stub_launchers(envs)
            for pid, env in envs.items():
                if not env or "HVD_EDL_WORKER_ID" not in env \
                        or env.get("HVD_EDL_TEST_MARKER") != self.marker:
                    continue
                devices = env.get("CUDA_VISIBLE_DEVICES", "")
                if not devices:
                    continue
                try:
                    gpu = devices.split(",")[int(env["HOROVOD_LOCAL_RANK"])]
                except (KeyError, ValueError, IndexError):
                    # no GPU this process could select (seen once under load in make test, not
                    # reproduced: a process whose environment names more local ranks than
                    # devices); kept for the test to show, never a crash of the sampler
                    try:
                        proc = psutil.Process(pid)
                        who = (proc.ppid(), proc.cmdline()[:4])
                    except psutil.Error:
                        who = (None, [])
                    self.unreadable.append((pid, devices, env.get("HOROVOD_LOCAL_RANK"),
                                            env.get("HVD_EDL_WORKER_ID"),
                                            env.get("HVD_EDL_CLUSTER_RUN"), *who))
                    continue
                try:
                    proc = psutil.Process(pid)
                    launcher, cmd = proc.ppid(), proc.cmdline()
                except psutil.Error:
                    continue
                if cmd and os.path.basename(cmd[0]) == "ssh":
                    continue  # the launcher's ssh client of a remote worker: its environment,
                    # no GPU (the worker on the remote host is sampled itself)
                if any(a.endswith("zygote_client.py") for a in cmd[:4]):
                    continue  # a worker's stub (docs/zygote.md): the worker is sampled itself
                launcher = stubs.get(_job_worker(env)) or _launcher_of(launcher)
                key = (launcher, env["HVD_EDL_WORKER_ID"])
                sample[pid] = (launcher, key[1], gpu)
                self.hosts[pid] = env.get("HOROVOD_HOSTNAME", "")
                ident = (env.get("HVD_EDL_CLUSTER_RUN") or str(launcher), key[1])
                self._identity[pid] = ident
                row = self.runs.setdefault(ident, [self.hosts[pid], gpu, now, now, set()])
                row[3] = now
                row[4].add(pid)
                self.seen.setdefault(key, [gpu, now, now])[2] = now
            self.samples.append(sample)
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def shared_gpus(self) -> List[Tuple[str, list]]:
        """Every (GPU, processes) selected by two live workers on one host in one sample (the
        GPU as ``host/GPU`` where the workers' host is not this one's only)."""
        bad = []
        for sample in self.samples:
            by_gpu: Dict[str, list] = {}
            hosts = {self.hosts.get(pid, "") for pid in sample}
            for pid, (launcher, worker, gpu) in sample.items():
                where = f"{self.hosts.get(pid, '')}/{gpu}" if len(hosts) > 1 else gpu
                by_gpu.setdefault(where, []).append((pid, launcher, worker))
            bad += [(g, users) for g, users in by_gpu.items()
                    if len({self._identity.get(pid, (str(launcher), worker))
                            for pid, launcher, worker in users}) > 1]
        return bad
