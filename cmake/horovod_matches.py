"""Exit 0 when the installed Horovod matches what the build would produce, 1 otherwise.

Usage: python horovod_matches.py VERSION [--write-stamp]

A match is: ``horovod.__version__ == VERSION``, ``horovod.torch`` imports (its extension loads
against this torch), Gloo is built, and the stamp written after our last build names the torch
version installed now (an extension built against another torch must be rebuilt).
"""
import os
import sys


def main() -> int:
    version = sys.argv[1]
    try:
        import torch
        import horovod
    except ImportError:
        return 1
    stamp = os.path.join(os.path.dirname(horovod.__file__), ".hvd_edl_built_against_torch")
    if "--write-stamp" in sys.argv:
        with open(stamp, "w") as f:
            f.write(torch.__version__)
        return 0
    if horovod.__version__ != version:
        return 1
    try:
        with open(stamp) as f:
            if f.read().strip() != torch.__version__:
                return 1
        import horovod.torch as hvd
        if not hvd.gloo_built():
            return 1
    except Exception:  # noqa: BLE001 - any failure to load means "rebuild"
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
