"""A job's host discovery under the cluster service: prints the allocation file the service
keeps for that job (Horovod's format, one ``host:slots`` a line), after checking that the file
is this user's own and private (a plain file, mode 0600 or stricter).

    python -I -S launcher/cluster/allocation.py STATE_DIR/jobs/<id>/hosts

The service rewrites the file atomically (a temporary file renamed over it, in the job's 0700
folder), so a read never sees half an allocation; a job sees only its own hosts.  Run by path
with ``-I -S`` it imports nothing but ``os`` and ``sys``: the job's launcher calls it every
``--discovery-interval`` (0.2 s), so it must start in a few milliseconds.  Exit status 1, one
line on stderr, for a missing, unsafe or empty file (the launcher then keeps its last host set).
"""
import os
import sys


def read(path: str) -> str:
    """The allocation file's text.

    Raises:
        OSError: missing, unreadable, a symbolic link, not a regular file, not this user's, or
            readable or writable by others (the message says which).
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if (st.st_mode & 0o170000) != 0o100000:
            raise OSError(f"{path} is not a regular file")
        if st.st_uid != os.getuid():
            raise OSError(f"{path} is owned by uid {st.st_uid}, not by you")
        if st.st_mode & 0o077:
            raise OSError(f"{path} is readable or writable by others (mode "
                          f"{st.st_mode & 0o777:04o})")
        return f.read()


def write(path: str, hosts: dict) -> None:
    """Replace the allocation file at ``path`` with ``hosts`` ({host: slots}) atomically, mode
    0600 (the service's side).

    Raises:
        OSError: it cannot be written.
    """
    import tempfile
    from launcher.discovery.hosts import format_host_entry
    text = "".join(f"{format_host_entry(h, k)}\n" for h, k in hosts.items() if k > 0)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".hosts-")  # 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def parse(text: str) -> dict:
    """{host: slots} of an allocation file's text (as :func:`write` wrote it)."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line:
            host, _, slots = line.rpartition(":")
            out[host.removeprefix("[").removesuffix("]")] = int(slots)
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
