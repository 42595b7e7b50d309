"""The GPU path where no GPU is (issue 17, item 4): the set-up's NCCL detection says why it builds
without NCCL, its build environment and stamp follow the choice, the NCCL-only Horovod patch
applies on top of the others, and benchmarks/gpu/gpu_check.sh fails clearly (exit 3, one line).

What only a GPU machine can check (NCCL communicators across a switch, device pinning, stall with
NCCL) is benchmarks/gpu/gpu_check.sh itself."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "cmake"))

import detect_gpu  # noqa: E402
import horovod_matches  # noqa: E402

GPU_CHECK = str(ROOT / "benchmarks" / "gpu" / "gpu_check.sh")


def _fake_nccl(home: Path, version=(2, 21, 5)) -> None:
    """An NCCL installation as the wheel ships it: include/nccl.h, lib/libnccl.so.2 only."""
    (home / "include").mkdir(parents=True)
    (home / "lib").mkdir()
    (home / "include" / "nccl.h").write_text(
        "".join(f"#define NCCL_{k} {v}\n" for k, v in zip(("MAJOR", "MINOR", "PATCH"), version)))
    (home / "lib" / "libnccl.so.2").write_bytes(b"")


def test_detection_says_why_no_nccl_and_builds_for_what_it_finds(tmp_path):
    import torch
    here = detect_gpu.detect()
    assert here.nccl == (not here.reasons)
    if torch.version.cuda is None:  # this machine: CPU torch, so Gloo only, and it says so
        assert here.choice == "none"
        assert any("built without CUDA" in r for r in here.reasons), here.reasons
        assert here.summary().startswith("NCCL (GPU): no (")
        assert detect_gpu.cmake_env(here) == {}
    assert detect_gpu.detect({detect_gpu.ENV_WITHOUT: "1"}).reasons == [
        f"{detect_gpu.ENV_WITHOUT}=1"]
    no_tools = detect_gpu.detect({"PATH": str(tmp_path)})
    if not os.access("/usr/local/cuda/bin/nvcc", os.X_OK):
        assert "nvcc not found" in no_tools.reasons

    # NCCL from $NCCL_HOME, as a wheel ships it (libnccl.so.2 only: the build gets a link dir)
    _fake_nccl(tmp_path / "nccl")
    include, lib = detect_gpu.find_nccl({"NCCL_HOME": str(tmp_path / "nccl")}, None)
    assert (include, lib) == (str(tmp_path / "nccl" / "include"),
                              str(tmp_path / "nccl" / "lib" / "libnccl.so.2"))
    assert detect_gpu.nccl_header_version(include) == "2.21.5"
    found = detect_gpu.GpuChoice(nccl=True, cuda_home="/opt/cuda", nccl_include=include,
                                 nccl_library=lib)
    with pytest.raises(ValueError):
        detect_gpu.cmake_env(found)  # libnccl.so.2 only, and nowhere to put the link
    env = detect_gpu.cmake_env(found, link_dir=str(tmp_path / "link"))
    assert os.readlink(tmp_path / "link" / "libnccl.so") == lib
    assert env["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert env["HOROVOD_NCCL_LIB"] == str(tmp_path / "link")
    assert env["HOROVOD_NCCL_INCLUDE"] == include
    assert env["HOROVOD_NCCL_LINK"] == "SHARED"
    assert env["HOROVOD_CUDA_HOME"] == env["CUDA_HOME"] == "/opt/cuda"


def test_stamp_follows_the_gpu_choice_and_cpu_builds_keep_theirs():
    cpu, nccl = horovod_matches.patches_sha256("none"), horovod_matches.patches_sha256("NCCL")
    assert glob.glob(os.path.join(horovod_matches.NCCL_PATCH_DIR, "*.patch"))
    assert cpu != nccl  # the NCCL patches are part of a NCCL build's hash only
    # a CPU build's stamp has the keys it had before GPU builds: those builds stay valid
    assert horovod_matches.wanted_stamp("2.13.0+cpu", "none") == {
        "torch": "2.13.0+cpu", "patches_sha256": cpu}
    assert horovod_matches.wanted_stamp("2.13.0+cu124", "NCCL") == {
        "torch": "2.13.0+cu124", "patches_sha256": nccl, "gpu_operations": "NCCL"}
    r = subprocess.run([sys.executable, str(ROOT / "cmake" / "horovod_matches.py"), "0.28.1",
                        "--gpu", "none", "--patches-sha256"], capture_output=True, text=True,
                       timeout=60)
    assert r.stdout.strip() == cpu


def test_nccl_patch_applies_after_the_others(tmp_path):
    sdists = glob.glob(str(ROOT / "build" / "horovod" / "horovod-*.tar.gz"))
    if not sdists or shutil.which("patch") is None:
        pytest.skip("no Horovod sdist in build/horovod (make setup downloads it)")
    with tarfile.open(sdists[0]) as t:
        # Horovod's own sources and Gloo's (patch 0006), not the other third-party trees
        t.extractall(tmp_path, members=[m for m in t.getmembers()
                                        if "/third_party/" not in m.name
                                        or "/third_party/gloo/gloo/" in m.name])
    src = next(tmp_path.iterdir())
    patches = sorted(glob.glob(str(ROOT / "cmake" / "patches" / "*.patch")))
    patches += sorted(glob.glob(str(ROOT / "cmake" / "patches" / "nccl" / "*.patch")))
    for p in patches:
        r = subprocess.run(["patch", "-p1", "--forward", "--batch", "-i", p], cwd=src,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, f"{p}: {r.stdout}{r.stderr}"
    assert '"HVD_EDL_NCCL_ELASTIC", state.elastic_enabled' in \
        (src / "horovod" / "common" / "operations.cc").read_text()


def test_gpu_check_exits_3_naming_what_is_missing(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")  # a driver that lists no GPU
    (fake / "nvidia-smi").chmod(0o755)
    r = subprocess.run([GPU_CHECK], env=dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}"),
                       capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stdout, r.stderr) == (3, "", "gpu_check: no GPU (nvidia-smi -L "
                                                          "lists none)\n")
    if shutil.which("nvidia-smi") is None:  # this machine
        r = subprocess.run([GPU_CHECK], capture_output=True, text=True, timeout=30)
        assert r.returncode == 3
        assert r.stderr.startswith("gpu_check: no nvidia-smi") and r.stderr.count("\n") == 1
