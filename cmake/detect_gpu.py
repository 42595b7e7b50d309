"""Whether the set-up can build Horovod with NCCL for GPU operations, and why not.

Usage (run it with the Python Horovod is built for: it asks that Python's torch)::

    python cmake/detect_gpu.py              # one line: what would be built, and why
    python cmake/detect_gpu.py --choice     # "NCCL" or "none" (the stamp's value); the line
                                            # on stderr
    python cmake/detect_gpu.py --cmake-env [--link-dir DIR]
                                            # the build's extra environment, KEY=VALUE;...
    python cmake/detect_gpu.py --built      # one line: what the installed Horovod was built with

NCCL for GPU operations (``HOROVOD_GPU_OPERATIONS=NCCL``) needs all of:

* ``nvcc``: ``$HOROVOD_CUDA_HOME/bin``, ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``, ``$PATH``,
  ``/usr/local/cuda/bin`` (in that order);
* NCCL, ``nccl.h`` and ``libnccl``: ``$HOROVOD_NCCL_INCLUDE`` / ``$HOROVOD_NCCL_LIB``,
  ``$HOROVOD_NCCL_HOME``, ``$NCCL_HOME``, the ``nvidia-nccl-cu*`` wheel in this Python
  (``site-packages/nvidia/nccl``: the NCCL a CUDA torch wheel loads, so Horovod shares it), the
  CUDA toolkit's directory, then ``/usr/include`` with ``/usr/lib/<multiarch>``, ``/usr/lib64``
  or ``/usr/lib``;
* a torch built with CUDA (``torch.version.cuda``), of the same CUDA major version as ``nvcc``:
  Horovod's ``horovod/torch/CMakeLists.txt`` stops with "GPU support was requested but this
  PyTorch installation does not support CUDA" otherwise.

``HVD_EDL_WITHOUT_NCCL=1`` builds without it anyway.  The variables handed to Horovod's build
are the ones its ``CMakeLists.txt``, ``cmake/Modules/FindNCCL.cmake`` and
``cmake/build_utils.py`` (0.28.1) read: ``HOROVOD_GPU_OPERATIONS``, ``HOROVOD_CUDA_HOME``,
``HOROVOD_NCCL_INCLUDE``, ``HOROVOD_NCCL_LIB``, ``HOROVOD_NCCL_LINK`` (``SHARED`` unless only
``libnccl_static.a`` is there), ``HOROVOD_BUILD_CUDA_CC_LIST`` (the GPUs present, if any), plus
``CUDA_HOME`` (torch's ``cpp_extension.CUDA_HOME``, which Horovod's ``FindPytorch.cmake`` asks)
and an rpath to NCCL's directory.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional

ENV_WITHOUT = "HVD_EDL_WITHOUT_NCCL"


@dataclass
class GpuChoice:
    """What the set-up builds.  ``nccl``: True when Horovod gets NCCL for GPU operations;
    ``reasons``: why not (empty when ``nccl``); the paths found (None when not found)."""
    nccl: bool
    reasons: List[str] = field(default_factory=list)
    nvcc: Optional[str] = None
    cuda_home: Optional[str] = None
    cuda_version: Optional[str] = None
    nccl_include: Optional[str] = None
    nccl_library: Optional[str] = None  # the library file (libnccl.so*, libnccl_static.a)
    nccl_version: Optional[str] = None
    torch_cuda: Optional[str] = None

    @property
    def choice(self) -> str:
        """"NCCL" or "none": the value the build stamp records (cmake/horovod_matches.py)."""
        return "NCCL" if self.nccl else "none"

    def summary(self) -> str:
        """The set-up's line, e.g. ``NCCL (GPU): no (nvcc not found)``."""
        if self.nccl:
            return (f"NCCL (GPU): yes (NCCL {self.nccl_version or '?'} {self.nccl_library}, "
                    f"nvcc {self.cuda_version}, torch CUDA {self.torch_cuda})")
        return f"NCCL (GPU): no ({'; '.join(self.reasons)})"


def find_nvcc(env: Mapping[str, str]) -> Optional[str]:
    """Path of ``nvcc`` (see the module's order), or None."""
    for var in ("HOROVOD_CUDA_HOME", "CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            path = os.path.join(env[var], "bin", "nvcc")
            if os.access(path, os.X_OK):
                return path
    found = shutil.which("nvcc", path=env.get("PATH", os.defpath))
    if found:
        return found
    path = "/usr/local/cuda/bin/nvcc"
    return path if os.access(path, os.X_OK) else None


def cuda_home_of(nvcc: str) -> str:
    """The toolkit directory of ``nvcc`` (``.../bin/nvcc`` -> ``...``), through a wrapper
    script or symlink to the real compiler."""
    real = os.path.realpath(nvcc)
    try:  # /usr/local/bin/nvcc can be a two-line "exec /usr/local/cuda-X/bin/nvcc" script
        with open(real, "rb") as f:
            head = f.read(512)
        m = re.search(rb"exec\s+(\S+/bin/nvcc)\b", head) if head.startswith(b"#!") else None
        if m and os.access(m.group(1).decode(), os.X_OK):
            real = os.path.realpath(m.group(1).decode())
    except OSError:
        pass
    return os.path.dirname(os.path.dirname(real))


def nvcc_version(nvcc: str) -> Optional[str]:
    """"13.0" from ``nvcc --version`` ("release 13.0, V13.0.88"), or None."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def _nccl_wheel_dirs() -> List[str]:
    """``site-packages/nvidia/nccl`` of this Python (the nvidia-nccl-cu* wheels)."""
    out = []
    for key in ("purelib", "platlib"):
        d = os.path.join(sysconfig.get_paths()[key], "nvidia", "nccl")
        if os.path.isdir(d) and d not in out:
            out.append(d)
    return out


def _libs_in(d: str) -> List[str]:
    """NCCL library files in ``d``, the shared ones first (libnccl.so, libnccl.so.N...)."""
    if not d or not os.path.isdir(d):
        return []
    shared = sorted(glob.glob(os.path.join(d, "libnccl.so*")), key=len)
    static = glob.glob(os.path.join(d, "libnccl_static.a"))
    return shared + static


def find_nccl(env: Mapping[str, str], cuda_home: Optional[str]):
    """(include dir, library file) of the first NCCL found (see the module's order), or
    (None, None); a header and a library are taken from the same place."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
    places = []  # (include dirs, library dirs)
    if env.get("HOROVOD_NCCL_INCLUDE") or env.get("HOROVOD_NCCL_LIB"):
        places.append(([env.get("HOROVOD_NCCL_INCLUDE", "")], [env.get("HOROVOD_NCCL_LIB", "")]))
    for var in ("HOROVOD_NCCL_HOME", "NCCL_HOME"):
        if env.get(var):
            home = env[var]
            places.append(([os.path.join(home, "include")],
                           [os.path.join(home, "lib"), os.path.join(home, "lib64")]))
    for d in _nccl_wheel_dirs():  # the NCCL a CUDA torch wheel loads itself: the same one
        places.append(([os.path.join(d, "include")], [os.path.join(d, "lib")]))
    if cuda_home:
        places.append(([os.path.join(cuda_home, "include")],
                       [os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "lib")]))
    places.append((["/usr/include", "/usr/local/include"],
                   [f"/usr/lib/{multiarch}", "/usr/lib64", "/usr/lib", "/usr/local/lib"]))
    for includes, libdirs in places:
        header = next((i for i in includes if i and os.path.isfile(os.path.join(i, "nccl.h"))),
                      None)
        lib = next((f for d in libdirs for f in _libs_in(d)), None)
        if header and lib:
            return header, lib
    return None, None


def nccl_header_version(include: str) -> Optional[str]:
    """"2.21.5" from ``nccl.h``'s NCCL_MAJOR / NCCL_MINOR / NCCL_PATCH, or None."""
    try:
        with open(os.path.join(include, "nccl.h")) as f:
            text = f.read()
    except OSError:
        return None
    parts = [re.search(rf"#define\s+NCCL_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None


def torch_cuda_version() -> Optional[str]:
    """``torch.version.cuda`` of this Python's torch ("12.4"), or None (CPU build, or no torch:
    Horovod's build would stop either way)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


def _torch_label() -> str:
    try:
        import torch
        return f"torch {torch.__version__}"
    except ImportError:
        return "no torch"


def detect(env: Mapping[str, str] = os.environ) -> GpuChoice:
    """Look for nvcc, NCCL and a CUDA torch; every missing piece is a reason (all are listed,
    in that order, so one run says everything to install)."""
    c = GpuChoice(nccl=False)
    if env.get(ENV_WITHOUT, "") not in ("", "0"):
        c.reasons.append(f"{ENV_WITHOUT}={env[ENV_WITHOUT]}")
        return c
    c.nvcc = find_nvcc(env)
    if c.nvcc is None:
        c.reasons.append("nvcc not found")
    else:
        c.cuda_home = cuda_home_of(c.nvcc)
        c.cuda_version = nvcc_version(c.nvcc)
        if c.cuda_version is None:
            c.reasons.append(f"{c.nvcc} --version gives no release")
    c.nccl_include, c.nccl_library = find_nccl(env, c.cuda_home)
    if c.nccl_include is None:
        c.reasons.append("NCCL not found (nccl.h and libnccl)")
    else:
        c.nccl_version = nccl_header_version(c.nccl_include)
    c.torch_cuda = torch_cuda_version()
    if c.torch_cuda is None:
        c.reasons.append(f"{_torch_label()} is built without CUDA")
    elif c.cuda_version and c.torch_cuda.split(".")[0] != c.cuda_version.split(".")[0]:
        c.reasons.append(f"nvcc is CUDA {c.cuda_version}, torch is built for CUDA "
                         f"{c.torch_cuda}")
    c.nccl = not c.reasons
    return c


def cmake_env(c: GpuChoice, link_dir: Optional[str] = None) -> Dict[str, str]:
    """The environment Horovod's build gets for ``c`` (empty for a CPU-only build).

    FindNCCL.cmake looks for ``libnccl_static.a`` or ``libnccl.so``; a wheel or a runtime-only
    package ships only ``libnccl.so.2``: then ``link_dir`` gets a ``libnccl.so`` symlink to it
    and becomes ``HOROVOD_NCCL_LIB``.

    Raises:
        ValueError: ``link_dir`` is needed (no ``libnccl.so`` or ``libnccl_static.a``) but None.
    """
    if not c.nccl:
        return {}
    lib_dir, name = os.path.split(c.nccl_library)
    if name not in ("libnccl.so", "libnccl_static.a"):
        if link_dir is None:
            raise ValueError(f"{c.nccl_library}: a link directory is needed (--link-dir)")
        os.makedirs(link_dir, exist_ok=True)
        link = os.path.join(link_dir, "libnccl.so")
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(c.nccl_library, link)
        lib_for_build = link_dir
    else:
        lib_for_build = lib_dir
    env = {
        "HOROVOD_GPU_OPERATIONS": "NCCL",
        "HOROVOD_CUDA_HOME": c.cuda_home,
        "CUDA_HOME": c.cuda_home,
        "HOROVOD_NCCL_INCLUDE": c.nccl_include,
        "HOROVOD_NCCL_LIB": lib_for_build,
        "HOROVOD_NCCL_LINK": "STATIC" if name == "libnccl_static.a" else "SHARED",
        # the extension finds libnccl.so.N where it was built against (torch, when it loads
        # NCCL itself first, satisfies it by soname anyway)
        "LDFLAGS": f"-Wl,-rpath,{lib_dir}",
    }
    ccs = gpu_capabilities()
    if ccs and "HOROVOD_BUILD_CUDA_CC_LIST" not in os.environ:
        # kernels for the GPUs here only (Horovod's default: every architecture nvcc knows)
        env["HOROVOD_BUILD_CUDA_CC_LIST"] = ",".join(ccs)
    return env


def gpu_capabilities() -> List[str]:
    """Compute capabilities of the GPUs torch sees here (["90"] on an H100/H200), sorted; empty
    without a GPU (building on a machine without one: Horovod's every-architecture default)."""
    try:
        import torch
        if not torch.cuda.is_available():
            return []
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    except Exception:  # noqa: BLE001 - no GPU figures: the default list
        return []
    return [f"{a}{b}" for a, b in sorted(caps)]


def built_line(c: GpuChoice) -> str:
    """What the installed Horovod was built with, e.g. ``Horovod built with: Gloo (CPU), NCCL
    (GPU): no (nvcc not found)``; ``c`` supplies the reason when NCCL is missing."""
    try:
        import horovod.torch as hvd
    except Exception as e:  # noqa: BLE001 - any failure to load is the answer
        return f"Horovod not usable: {e}"
    parts = []
    if hvd.gloo_built():
        parts.append("Gloo (CPU)")
    if hvd.mpi_built():
        parts.append("MPI (CPU)")
    if hvd.nccl_built():
        parts.append(c.summary() if c.nccl else "NCCL (GPU): yes")
    elif c.nccl:
        parts.append("NCCL (GPU): no (NCCL is found now, but this Horovod was built without "
                     "it: make setup rebuilds it)")
    else:
        parts.append(c.summary())
    return "Horovod built with: " + ", ".join(parts)


def main(argv: List[str]) -> int:
    c = detect()
    if "--choice" in argv:  # the choice on stdout, the line saying why on stderr
        print(c.choice)
        print(f"Horovod will be built with: Gloo (CPU), {c.summary()}", file=sys.stderr)
    elif "--cmake-env" in argv:
        link_dir = argv[argv.index("--link-dir") + 1] if "--link-dir" in argv else None
        print(";".join(f"{k}={v}" for k, v in cmake_env(c, link_dir).items()))
    elif "--built" in argv:
        print(built_line(c))
    elif not argv:
        print(f"Horovod will be built with: Gloo (CPU), {c.summary()}")
    else:
        print("\n\n".join(__doc__.split("\n\n")[1:3]), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
