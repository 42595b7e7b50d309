"""Measured speeds per GPU type, read as :class:`launcher.cluster.speed_types.Row` lists: CM-DARE's
(Li, Walls and Guo, arXiv 2004.03072; GCE K80 / P100) and Sia's per-type throughput profiles
(Jayaram Subramanya et al., SOSP 2023; t4 / rtx / a100).

The data are read at run time from ``$HVD_EDL_TRANSIENT_TRACES`` (default
``../shared/traces/transient-cloud``) and ``$HVD_EDL_SIA_TRACES`` (default
``../shared/traces/sia-sosp23``) beside the repository; each folder's README.md gives the columns.
FileNotFoundError (one line) when a folder is absent.
"""
from __future__ import annotations

import csv
import os
import re
from pathlib import Path
from statistics import mean
from typing import Dict, List, Optional, Tuple

from launcher.cluster.speed_types import Row

SIA_TYPES: Dict[str, str] = {"t4": "aws", "rtx": "rtx", "a100": "dgx-ext"}
"""Our GPU type name -> the profile suffix in Sia's ``traces/<app>/placements-<suffix>.csv``."""

SIA_MODELS: Dict[str, Tuple[float, float]] = {
    "cifar10": (0.56e9, 11.2e6),       # ResNet-18 (CIFAR), 32x32
    "imagenet": (4.1e9, 25.6e6),       # ResNet-50, 224x224
    "bert": (4.2e10, 110e6),           # BERT-base, SQuAD, 384 tokens (MACs ~ params x tokens)
    "deepspeech2": (2.0e10, 38e6),     # DeepSpeech2 (LibriSpeech), an estimate
    "yolov3": (3.3e10, 61.9e6),        # YOLOv3, 416x416
    "ncf": (2.0e6, 1.0e6),             # NCF (MovieLens), an estimate
}
"""(forward multiply-adds per sample, parameters) of each Sia application's model (published
architecture figures; the two marked are estimates).  Only their logs enter the features."""


def _folder(env: str, name: str, path: Optional[str]) -> Path:
    p = Path(path or os.environ.get(env) or
             Path(__file__).resolve().parents[2].parent / "shared" / "traces" / name)
    if not p.is_dir():
        raise FileNotFoundError(f"no {name} data at {p} (set {env})")
    return p


def transient_dir(path: Optional[str] = None) -> Path:
    """The transient-cloud data folder (FileNotFoundError if absent)."""
    return _folder("HVD_EDL_TRANSIENT_TRACES", "transient-cloud", path)


def sia_dir(path: Optional[str] = None) -> Path:
    """Sia's data folder (FileNotFoundError if absent)."""
    return _folder("HVD_EDL_SIA_TRACES", "sia-sosp23", path)


def _rows(path: Path) -> List[Dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def cmdare_single(path: Optional[str] = None) -> List[Row]:
    """CM-DARE's one-GPU speed table (``speed_data/0latency_norm_computation.csv``: 20 models x
    K80 / P100, 13 runs each): one row per run, ``step_s`` = its mean step time (job = model)."""
    out = []
    for r in _rows(transient_dir(path) / "cm-dare" / "speed_data" /
                   "0latency_norm_computation.csv"):
        out.append(Row(r["Model (temp)"], r["GPU (temp)"].lower(), float(r["Step Time (s)"]),
                       float(r["Model FLOPs"]), float(r["Number of Parameters"])))
    return out


_CLUSTER_MODEL = {"res15": "Res15", "res32": "Res32", "shakesmall": "shakesmall",
                  "shakebig": "shakebig"}


def cmdare_cluster(path: Optional[str] = None) -> List[Row]:
    """CM-DARE's speed against cluster size (``speed_and_cluster_size/{k80,p100}``, one parameter
    server, N = 1..8 workers, 4 models): one row per (model, GPU, N), ``step_s`` = N / (mean
    cluster steps/s), i.e. seconds per step of one worker; FLOPs and parameters from the one-GPU
    table."""
    root = transient_dir(path) / "cm-dare"
    cost = {r.job: (r.flops, r.params) for r in cmdare_single(path)}
    out = []
    for gpu in ("k80", "p100"):
        for d in sorted((root / "speed_and_cluster_size" / gpu).iterdir()):
            m = re.fullmatch(r"(res15|res32|shakesmall|shakebig)(?:k80|p100|100|80)worker(\d+)",
                             d.name)
            if not m:
                continue
            vals = [float(r["Value"]) for f in d.glob("*.csv") for r in _rows(f)]
            vals = vals[1:] or vals               # the first log point holds start-up
            n = int(m.group(2))
            fl, pa = cost[_CLUSTER_MODEL[m.group(1)]]
            out.append(Row(m.group(1), gpu, n / mean(vals), fl, pa, n))
    return out


def sia_profile(app: str, gpu_type: str, path: Optional[str] = None) -> List[Row]:
    """Sia's measured step times of ``app`` on ``gpu_type`` (t4 / rtx / a100): every row of its
    placements and scalability files, ``n`` = GPUs, ``local_bsz`` the local batch, ``step_s`` the
    step time (job = app).  ValueError for an unknown app or type."""
    if gpu_type not in SIA_TYPES or app not in SIA_MODELS:
        raise ValueError(f"unknown Sia app/type {app!r}/{gpu_type!r}")
    folder = sia_dir(path) / "traces" / app
    fl, pa = SIA_MODELS[app]
    out = []
    for r in _rows(folder / f"placements-{SIA_TYPES[gpu_type]}.csv"):
        n = sum(int(c) for c in r["placement"])
        out.append(Row(app, gpu_type, float(r["step_time"]), fl, pa, n, float(r["local_bsz"])))
    for r in _rows(folder / f"scalability-{SIA_TYPES[gpu_type]}.csv"):
        out.append(Row(app, gpu_type, float(r["step_time"]), fl, pa, int(r["num_replicas"]),
                       float(r["local_bsz"])))
    return out


def sia_profiles(path: Optional[str] = None) -> List[Row]:
    """:func:`sia_profile` of Sia's five workload applications on its three types, concatenated."""
    return [r for app in ("cifar10", "imagenet", "bert", "deepspeech2", "yolov3")
            for t in SIA_TYPES for r in sia_profile(app, t, path)]
