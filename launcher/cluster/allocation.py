"""A job's host discovery under the cluster service: prints the allocation file the service
keeps for that job (Horovod's format, one ``host:slots`` a line), after checking that the file
is this user's own and private (a plain file, mode 0600 or stricter).

    python -I -S launcher/cluster/allocation.py STATE_DIR/jobs/<id>/hosts

The service rewrites the file atomically (a temporary file renamed over it, in the job's 0700
folder), so a read never sees half an allocation; a job sees only its own hosts.  Run by path
with ``-I -S`` it imports only the standard library and ``hvd_edl.private_file`` (the check every
file holding something private passes; ``hvd_edl/__init__`` imports nothing at import time): the
job's launcher calls it every ``--discovery-interval`` (0.2 s), so it must start in a few
milliseconds.  Exit status 1, one
line on stderr, for a missing, unsafe or empty file (the launcher then keeps its last host set).
"""
import os
import sys

if __name__ == "__main__":  # run by path with -I -S: the repository holds hvd_edl
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from hvd_edl.private_file import PrivateFileError, read_private, write_private  # noqa: E402

_WHY = {"missing": "does not exist", "symlink": "is a symbolic link",
        "not_regular": "is not a regular file", "too_large": "is too large"}


def read(path: str, owners=None) -> str:
    """The allocation file's text.  ``owners``: the uids whose file is accepted (default: this
    user only, the job's side; the root service also accepts the job's user,
    :meth:`launcher.cluster.runs.JobFiles.uids`).

    Raises:
        OSError: missing, unreadable, a symbolic link, not a regular file, not this user's, or
            readable or writable by others (the message says which).
    """
    try:
        return read_private(path, max_bytes=1 << 20, owners=owners).decode()
    except PrivateFileError as e:
        if e.reason == "other_owner":
            raise OSError(f"{path} is owned by uid {e.uid}, not by you") from None
        if e.reason == "open":
            raise OSError(f"{path} is readable or writable by others (mode {e.mode:04o})") \
                from None
        raise OSError(f"{path} {_WHY.get(e.reason, 'cannot be read: ' + (e.detail or e.reason))}") \
            from None


def write(path: str, hosts: dict, gpus: dict = None, owner: tuple = None) -> None:
    """Replace the allocation file at ``path`` with ``hosts`` ({host: slots}) atomically, mode
    0600 (the service's side), owned by ``owner`` ``(uid, gid)`` when given (the job's user,
    who reads it, under a root service); ``gpus`` ({host: GPU ids in slot order}) names the job's GPUs on
    those hosts (``host:2 gpus=4,1``, :mod:`launcher.discovery.hosts`).

    Raises:
        OSError: it cannot be written.
    """
    from launcher.discovery.hosts import format_host_entry
    gpus = gpus or {}
    text = "".join(f"{format_host_entry(h, k)}"
                   + (f" gpus={','.join(gpus[h])}" if gpus.get(h) else "") + "\n"
                   for h, k in hosts.items() if k > 0)
    write_private(path, text.encode(), owner=owner)


def parse(text: str) -> dict:
    """{host: slots} of an allocation file's text (as :func:`write` wrote it)."""
    out = {}
    for line in text.splitlines():
        words = line.split()
        if words:
            host, _, slots = words[0].rpartition(":")
            out[host.removeprefix("[").removesuffix("]")] = int(slots)
    return out


def parse_gpus(text: str) -> dict:
    """{host: (GPU ids in slot order)} of an allocation file's text, hosts without ``gpus=``
    left out."""
    out = {}
    for line in text.splitlines():
        words = line.split()
        for word in words[1:]:
            if word.startswith("gpus="):
                host = words[0].rpartition(":")[0]
                out[host.removeprefix("[").removesuffix("]")] = tuple(word[5:].split(","))
    return out


def main(argv) -> int:
    if len(argv) != 2:
        print("usage: allocation.py FILE", file=sys.stderr)
        return 2
    try:
        text = read(argv[1])
    except OSError as e:
        print(f"allocation: {e}", file=sys.stderr)
        return 1
    if not text.strip():
        print(f"allocation: {argv[1]} holds no host", file=sys.stderr)
        return 1
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
