"""Exit 0 when the installed Horovod matches what the build would produce, 1 otherwise.

Usage: python horovod_matches.py VERSION [--write-stamp [PATCHES_SHA256] | --patches-sha256]

``--patches-sha256`` prints the patch set's hash; the build takes it *before* it applies the
patches and stamps that value after the build (``--write-stamp HASH``), so a patch added while
a build runs is not stamped as built.

A match is: ``horovod.__version__ == VERSION``, ``horovod.torch`` imports (its extension loads
against this torch), Gloo is built, and the stamp written after our last build names the torch
version installed now (an extension built against another torch must be rebuilt) and the hash of
the patch set in ``cmake/patches/`` (a patch added, changed or removed means a rebuild).
"""
import hashlib
import json
import os
import sys

PATCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "patches")


def patches_sha256() -> str:
    """SHA-256 over the names and contents of ``cmake/patches/*.patch``, in name order."""
    h = hashlib.sha256()
    names = sorted(n for n in os.listdir(PATCH_DIR) if n.endswith(".patch")) \
        if os.path.isdir(PATCH_DIR) else []
    for name in names:
        with open(os.path.join(PATCH_DIR, name), "rb") as f:
            data = f.read()
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


def main() -> int:
    version = sys.argv[1]
    if "--patches-sha256" in sys.argv:
        print(patches_sha256())
        return 0
    try:
        import torch
        import horovod
    except ImportError:
        return 1
    stamp = os.path.join(os.path.dirname(horovod.__file__), ".hvd_edl_built_against_torch")
    want = {"torch": torch.__version__, "patches_sha256": patches_sha256()}
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
        if not hvd.gloo_built():
            return 1
    except Exception:  # noqa: BLE001 - any failure to load means "rebuild"
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
