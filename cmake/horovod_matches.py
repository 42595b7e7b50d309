"""Exit 0 when the installed Horovod matches what the build would produce, 1 otherwise.

Usage: python horovod_matches.py VERSION [--gpu NCCL|none]
                                          [--write-stamp [PATCHES_SHA256] | --patches-sha256]

``--patches-sha256`` prints the patch set's hash; the build takes it *before* it applies the
patches and stamps that value after the build (``--write-stamp HASH``), so a patch added while
a build runs is not stamped as built.  ``--gpu`` is the build's GPU choice (default: what
``cmake/detect_gpu.py`` finds now).

A match is: ``horovod.__version__ == VERSION``, ``horovod.torch`` imports (its extension loads
against this torch), Gloo is built, NCCL is built exactly when the GPU choice is "NCCL", and the
stamp written after our last build names the torch version installed now (an extension built
against another torch must be rebuilt), the GPU choice (nvcc and NCCL found or lost since: a
rebuild) and the hash of the patch set in ``cmake/patches/`` (a patch added, changed or removed
means a rebuild), with ``cmake/patches/nccl/`` in it for NCCL builds only.  A CPU-only stamp
carries no GPU key, as before GPU builds existed, so those builds stay valid.
"""
import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PATCH_DIR = os.path.join(HERE, "patches")
NCCL_PATCH_DIR = os.path.join(PATCH_DIR, "nccl")  # applied to NCCL builds only


def _patch_names(d: str):
    return sorted(n for n in os.listdir(d) if n.endswith(".patch")) if os.path.isdir(d) else []


def patches_sha256(gpu: str = "none") -> str:
    """SHA-256 over the names and contents of ``cmake/patches/*.patch``, in name order, then
    (``gpu == "NCCL"``) of ``cmake/patches/nccl/*.patch`` named ``nccl/NAME``; a CPU build's
    hash is the one it had before NCCL patches existed."""
    h = hashlib.sha256()
    files = [(n, os.path.join(PATCH_DIR, n)) for n in _patch_names(PATCH_DIR)]
    if gpu == "NCCL":
        files += [("nccl/" + n, os.path.join(NCCL_PATCH_DIR, n))
                  for n in _patch_names(NCCL_PATCH_DIR)]
    for name, path in files:
        with open(path, "rb") as f:
            data = f.read()
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


def gpu_choice(argv) -> str:
    """``--gpu X`` if given, else ``cmake/detect_gpu.py``'s choice now ("NCCL" or "none")."""
    if "--gpu" in argv:
        return argv[argv.index("--gpu") + 1]
    sys.path.insert(0, HERE)
    import detect_gpu
    return detect_gpu.detect().choice


def wanted_stamp(torch_version: str, gpu: str) -> dict:
    """The stamp a build for this torch and GPU choice writes; a CPU build's has no GPU key
    (the stamps written before GPU builds existed stay valid)."""
    want = {"torch": torch_version, "patches_sha256": patches_sha256(gpu)}
    if gpu != "none":
        want["gpu_operations"] = gpu
    return want


def main() -> int:
    version = sys.argv[1]
    gpu = gpu_choice(sys.argv)
    if "--patches-sha256" in sys.argv:
        print(patches_sha256(gpu))
        return 0
    try:
        import torch
        import horovod
    except ImportError:
        return 1
    stamp = os.path.join(os.path.dirname(horovod.__file__), ".hvd_edl_built_against_torch")
    want = wanted_stamp(torch.__version__, gpu)
    if "--write-stamp" in sys.argv:
        i = sys.argv.index("--write-stamp")
        if len(sys.argv) > i + 1:  # the hash of the patches this build applied
            want["patches_sha256"] = sys.argv[i + 1]
        with open(stamp, "w") as f:
            json.dump(want, f)
        return 0
    if horovod.__version__ != version:
        return 1
    try:
        with open(stamp) as f:
            if json.load(f) != want:  # an older plain-text stamp fails to parse: rebuild
                return 1
        import horovod.torch as hvd
        if not hvd.gloo_built() or bool(hvd.nccl_built()) != (gpu == "NCCL"):
            return 1
    except Exception:  # noqa: BLE001 - any failure to load means "rebuild"
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
