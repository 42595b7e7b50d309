"""Durable commits: rank 0 persists a commit to ``--checkpoint-dir`` off the training thread, and
a ring that starts without any holder of the state resumes from the newest good checkpoint.

Format (``DIR`` is ``hvd-edl-run --checkpoint-dir``, passed to every worker as
``HVD_EDL_CHECKPOINT_DIR``):

* ``DIR/ckpt-<step, 12 digits>-<unix ms>.pt``: a :func:`torch.save` file of a dict
  ``{"format", "model", "optimizer", "samplers", "scalars", "steps", "generation", "world_size",
  "time"}``: the model's and optimizer's ``state_dict`` (CPU tensors), every ElasticSampler's
  ``state_dict`` by name, the script's scalars (``TorchState(..., epoch=0)``), the optimizer
  step count, the generation and world size it was written at, unix seconds.  Only tensors and
  plain values (numbers, strings, ``None``, lists, tuples, dicts, sets; :func:`check_plain`):
  it is read with ``torch.load(weights_only=True)``, so nothing in it can run code;
* ``DIR/<same name>.json``: its sidecar ``{"file", "bytes", "sha256", "steps", "generation",
  "world_size", "time", "request", "hmac"}``, written after the ``.pt`` file is durable.
  ``hmac`` is an HMAC-SHA256 under the user's checkpoint key over every other field (the file's
  name and SHA-256 among them, so over the file).  A checkpoint is complete only once its
  sidecar exists, and good only when the sidecar's HMAC is right and the file's size and SHA-256
  match it.

Authentication.  Whoever can write ``DIR`` can write a ``.pt`` file and a matching SHA-256, so
the checksum alone proves nothing about who wrote a checkpoint.  The key is a secret only the
job's user can read: the file :func:`key_file` names (``HVD_EDL_CHECKPOINT_KEY_FILE``, default
``~/.hvd_edl/checkpoint.key``, created once with mode 0600; refused when another user owns it
or others can read it).  The launcher reads it and hands it to every worker in its environment
(``HVD_EDL_CHECKPOINT_KEY``), the way the job's secret (``HVD_EDL_SECRET``) travels: for remote
workers over the ssh session's stdin, never on a command line; so only the launcher's host needs
the file.  A checkpoint whose sidecar has no HMAC (written before this check existed) or a
wrong one is refused, naming the file, before any byte of it is unpickled; ``python -m
hvd_edl.checkpoint trust PATH`` signs one of your own (see :func:`trust`).  Checkpoints and
sidecars are opened with ``O_NOFOLLOW``: a symbolic link is refused, and so is anything but a
regular file (a FIFO would block the reader).

Writing (:class:`CheckpointWriter`): at a commit (``TorchState.save``) on rank 0, once
``HVD_EDL_CHECKPOINT_EVERY_S`` seconds (default :data:`DEFAULT_EVERY_S`) have passed since the
last write began, or when ``hvd-edl-ctl checkpoint`` asked for one, the host-memory copy the
commit just made is handed to a background thread.  It first makes room: it deletes all but the
newest ``HVD_EDL_CHECKPOINT_KEEP - 1`` (default :data:`DEFAULT_KEEP`) of this user's checkpoints
(never the newest good one: the last this process wrote or resumed from), so a directory with
room for K checkpoints keeps writing at ``--checkpoint-keep K``.  Then it writes to a temporary
file (a fresh name, ``O_EXCL | O_NOFOLLOW``), ``fsync``\\ s it, renames it, writes the sidecar the
same way and ``fsync``\\ s the directory.  A write that runs out of space (``ENOSPC``, ``EDQUOT``)
deletes every older checkpoint but the newest good one and is tried once more.  When writes
fail, one line says that checkpoints stopped (and which one is kept), at most one a minute
that they still fail, and one that they resumed.  The training thread never waits for the disk:
while a write is in flight, further commits are not written (the next one due after it is).

No copy is made for the writer.  ``TorchState.save`` copies into the previous commit's buffers
(no allocation at steady state); while the writer reads those (:meth:`CheckpointWriter.holds`),
commits copy into a second set of buffers instead, kept for the next write, so the writer never
reads a buffer the training thread is overwriting and nothing is allocated after the first
write.  The price is host memory: with checkpoints on, two copies of the state (one without).
Measured for 100 MB of state (one process, 2 cores): a commit into reused buffers 39 ms, into
fresh ones 106 ms (median; what an earlier version did for every commit inside a write), a clone
52 ms (the other way: one clone at hand-over, on the training thread, at every checkpoint).

Reading: :func:`load` authenticates and verifies the file and returns the dict above, read from
the same open file it checked.  Without ``HVD_EDL_CHECKPOINT_DIR`` nothing here runs:
:func:`writer` returns None after one dictionary lookup.
"""
from __future__ import annotations

import atexit
import errno
import hashlib
import hmac
import io
import json
import logging
import os
import re
import secrets
import stat
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from hvd_edl import private_file

log = logging.getLogger(__name__)

ENV_DIR = "HVD_EDL_CHECKPOINT_DIR"
ENV_EVERY_S = "HVD_EDL_CHECKPOINT_EVERY_S"
ENV_KEEP = "HVD_EDL_CHECKPOINT_KEEP"
ENV_KEY = "HVD_EDL_CHECKPOINT_KEY"            # the key itself: launcher -> workers (environment)
ENV_KEY_FILE = "HVD_EDL_CHECKPOINT_KEY_FILE"  # where the key is kept (default DEFAULT_KEY_FILE)
DEFAULT_KEY_FILE = "~/.hvd_edl/checkpoint.key"
DEFAULT_EVERY_S = 60.0  # seconds between checkpoints: at most a minute of work lost to a loss of
                        # every worker; a 100 MB write takes about a second here (docs/checkpoints.md)
DEFAULT_KEEP = 3        # checkpoints kept: the newest, and two to fall back on if it is bad
FORMAT = "hvd_edl.checkpoint/1"
MAC_DOMAIN = b"hvd_edl.checkpoint-sidecar/2\n"  # what the sidecar's HMAC is computed over, first
LOCK_NAME = ".hvd-edl.lock"
EXIT_WAIT_S = 60.0      # longest a finishing process waits for a write in flight (seconds)
MAX_SIDECAR_BYTES = 64 * 1024   # a sidecar is about 300 bytes; larger ones are refused unread
MAX_KEY_BYTES = 4096
MIN_KEY_CHARS = 32
STILL_FAILING_LOG_S = 60.0  # while writes keep failing, one line at most this often (seconds)
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
# what torch.load(weights_only=True) must allow beyond its defaults for our state: nothing (a
# model's and an optimizer's state_dict are tensors in dicts and lists with numbers, strings,
# booleans and None; sampler states and scalars are plain values: check_plain); a global added
# here is one more callable a checkpoint may make the loader call
SAFE_GLOBALS: Tuple[Any, ...] = ()

_NAME = re.compile(r"ckpt-(\d{12})-(\d{13,})\.pt")


class CheckpointError(RuntimeError):
    """A checkpoint (or the checkpoint key) cannot be used; the message names the file and the
    problem."""


# ---- the key -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Key:
    """The user's checkpoint key: ``secret`` (bytes, never in a repr) and where it came from
    (for messages)."""
    secret: bytes = field(repr=False)
    source: str = ""

    def mac(self, meta: Dict[str, Any]) -> str:
        """HMAC-SHA256 (hex) over the sidecar ``meta`` without its ``hmac`` field."""
        body = json.dumps({k: v for k, v in meta.items() if k != "hmac"}, sort_keys=True,
                          separators=(",", ":"))
        return hmac.new(self.secret, MAC_DOMAIN + body.encode(), hashlib.sha256).hexdigest()


def key_file() -> Path:
    """The key file: ``HVD_EDL_CHECKPOINT_KEY_FILE``, else ``~/.hvd_edl/checkpoint.key``."""
    return Path(os.path.expanduser(os.environ.get(ENV_KEY_FILE) or DEFAULT_KEY_FILE))


def read_key_file(path: Optional[Path] = None, create: bool = True) -> Key:
    """Read the key file (:func:`key_file` by default), creating it first when it is missing and
    ``create`` (32 random bytes as 64 hex digits, mode 0600, its folder 0700; two processes
    creating it at once end with the same key).

    Raises:
        CheckpointError: it cannot be created or read, is a symbolic link or not a regular
            file, is owned by another user, can be read by group or others, or holds fewer
            than 32 characters (or more than 4 KiB).
    """
    path = Path(path) if path is not None else key_file()
    for attempt in (0, 1):
        try:
            data = private_file.read_private(path, max_bytes=MAX_KEY_BYTES)
            break
        except private_file.PrivateFileError as e:
            if e.reason == private_file.MISSING and create and not attempt:
                _create_key_file(path)
                continue
            raise CheckpointError(_key_refusal(path, e)) from None
    secret = data.strip()
    if len(data) > MAX_KEY_BYTES or len(secret) < MIN_KEY_CHARS \
            or not all(33 <= c < 127 for c in secret):
        raise CheckpointError(f"checkpoint key {path}: expected {MIN_KEY_CHARS} to "
                              f"{MAX_KEY_BYTES} printable ASCII characters without spaces (e.g. "
                              f"'openssl rand -hex 32'), got {len(secret)} bytes")
    return Key(secret, str(path))


def _key_refusal(path: Path, e: "private_file.PrivateFileError") -> str:
    """One line for a key file that cannot be used."""
    if e.reason == private_file.MISSING:
        return f"checkpoint key {path} does not exist"
    if e.reason == private_file.SYMLINK:
        return f"checkpoint key {path} cannot be read: it is a symbolic link"
    if e.reason == private_file.NOT_REGULAR:
        return f"checkpoint key {path} is not a regular file"
    if e.reason == private_file.OTHER_OWNER:
        return (f"checkpoint key {path} is owned by uid {e.uid}, not by this user "
                f"(uid {os.geteuid()}): refused")
    if e.reason == private_file.OPEN_TO_OTHERS:
        return f"checkpoint key {path} has mode {e.mode:04o}: others may read it; chmod 600 {path}"
    if e.reason == private_file.TOO_LARGE:
        return (f"checkpoint key {path}: expected {MIN_KEY_CHARS} to {MAX_KEY_BYTES} printable "
                f"ASCII characters without spaces (e.g. 'openssl rand -hex 32'), got more")
    return f"checkpoint key {path} cannot be read: {e.detail or e.reason}"


def _create_key_file(path: Path) -> None:
    try:
        # never replaces: two processes creating it at once end with the first one's key
        private_file.write_private(path, (secrets.token_hex(32) + "\n").encode(),
                                   replace=False, fsync=True)
    except FileExistsError:
        return
    except OSError as e:
        raise CheckpointError(f"checkpoint key {path} cannot be created: "
                              f"{e.strerror or e}") from None
    log.warning("created checkpoint key %s (mode 0600): checkpoints are authenticated with it",
                path)


def job_key() -> Key:
    """The key of this process: ``HVD_EDL_CHECKPOINT_KEY`` (what ``hvd-edl-run`` gives its
    workers), else :func:`read_key_file`.

    Raises:
        CheckpointError: no key in the environment and the key file cannot be used.
    """
    secret = os.environ.get(ENV_KEY)
    if secret:
        return Key(secret.strip().encode(), f"{ENV_KEY}, from the launcher's {key_file()}")
    return read_key_file()


# ---- the files ---------------------------------------------------------------------------------

def file_name(steps: int, unix_ms: int) -> str:
    """``ckpt-<steps>-<unix ms>.pt``: names sort by step, then by time."""
    return f"ckpt-{steps:012d}-{unix_ms:013d}.pt"


def sidecar_of(path: Path) -> Path:
    """The sidecar's path of checkpoint ``path`` (``.pt`` -> ``.json``)."""
    return Path(path).with_suffix(".json")


def complete(directory: Path) -> List[Path]:
    """The checkpoints in ``directory`` whose sidecar exists, newest (highest step, then latest
    write) first.  A missing directory has none."""
    found: List[Tuple[Tuple[int, int], Path]] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        m = _NAME.fullmatch(name)
        if m and os.path.lexists(os.path.join(directory, name[:-3] + ".json")):
            found.append(((int(m.group(1)), int(m.group(2))), Path(directory) / name))
    return [p for _, p in sorted(found, reverse=True)]


def _open_regular(path: Path, what: str):
    """``path`` opened for reading, never through a symbolic link, never blocking on a FIFO.

    Raises:
        CheckpointError: a symbolic link, not a regular file, or not readable.
    """
    try:
        fd = os.open(str(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{what}: refused: it is a symbolic link (checkpoints are "
                                  f"plain files written in place)") from None
        raise CheckpointError(f"{what}: cannot read it: {e.strerror}") from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise CheckpointError(f"{what}: refused: not a regular file")
    return f


def read_sidecar(path: Path, key: Optional[Key] = None) -> dict:
    """The sidecar of checkpoint ``path``; with ``key``, only when its HMAC is right and it
    names ``path``.

    Raises:
        CheckpointError: missing, a symbolic link, unreadable, over 64 KiB or malformed; with
            ``key``: without an HMAC (written before checkpoints were authenticated), with a
            wrong one (not written by this user), or for another file.
    """
    side = sidecar_of(path)
    with _open_regular(side, f"checkpoint {path}: its sidecar {side.name}") as f:
        raw = f.read(MAX_SIDECAR_BYTES + 1)
    if len(raw) > MAX_SIDECAR_BYTES:
        raise CheckpointError(f"checkpoint {path}: its sidecar {side.name} is over "
                              f"{MAX_SIDECAR_BYTES} bytes: not a sidecar")
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: cannot read its sidecar {side.name}: {e}") \
            from None
    if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), str) \
            or not isinstance(meta.get("bytes"), int) or not isinstance(meta.get("steps"), int):
        raise CheckpointError(f"checkpoint {path}: malformed sidecar {side.name}")
    if key is None:
        return meta
    tag = meta.get("hmac")
    if not isinstance(tag, str):
        raise CheckpointError(
            f"checkpoint {path}: refused: its sidecar carries no HMAC (written before hvd_edl "
            f"authenticated checkpoints, or not by hvd_edl); nothing in it was loaded"
            f"{_owner_note(path)}. If you wrote it and trust it: python -m hvd_edl.checkpoint "
            f"trust {path}; else remove it")
    if not hmac.compare_digest(key.mac(meta), tag):
        raise CheckpointError(
            f"checkpoint {path}: refused: its HMAC does not match this user's checkpoint key "
            f"({key.source}): not written by this job's user (or under another key); nothing "
            f"in it was loaded{_owner_note(path)}")
    if meta.get("file") != Path(path).name:
        raise CheckpointError(f"checkpoint {path}: refused: its sidecar is the one of "
                              f"{meta.get('file')!r} (a renamed checkpoint)")
    return meta


def _owner_note(path: Path) -> str:
    """`` (it is owned by uid N, not by this user)`` when it is, else ``""``."""
    try:
        uid = os.lstat(path).st_uid
    except OSError:
        return ""
    return f" (it is owned by uid {uid}, not by this user)" if uid != os.geteuid() else ""


def _digest(f, path: Path, meta: dict, keep: bool) -> Optional[bytes]:
    """Check the open file ``f`` against ``meta`` (size, SHA-256); return its bytes if ``keep``.

    Raises:
        CheckpointError: a size or checksum mismatch, or a read error.
    """
    digest = hashlib.sha256()
    size = 0
    chunks: List[bytes] = []
    try:
        while True:
            chunk = f.read(1 << 22)
            if not chunk:
                break
            size += len(chunk)
            if size > meta["bytes"]:
                break
            digest.update(chunk)
            if keep:
                chunks.append(chunk)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: cannot read it: {e.strerror}") from None
    if size != meta["bytes"]:
        size = os.fstat(f.fileno()).st_size
        raise CheckpointError(f"checkpoint {path}: truncated or changed: {size} bytes, its "
                              f"sidecar says {meta['bytes']}")
    got = digest.hexdigest()
    if got != meta["sha256"]:
        raise CheckpointError(f"checkpoint {path}: wrong checksum (SHA-256 {got[:16]}..., its "
                              f"sidecar says {meta['sha256'][:16]}...): corrupted")
    return b"".join(chunks) if keep else None


def verify(path: Path, key: Optional[Key] = None) -> dict:
    """Authenticate checkpoint ``path`` (its sidecar's HMAC under ``key``, default
    :func:`job_key`) and check the file against it (size, then SHA-256; about 1 s per GB);
    return the sidecar.

    Raises:
        CheckpointError: no sidecar, no or a wrong HMAC, a symbolic link, a truncated or
            missing file, or a checksum mismatch.
    """
    path = Path(path)
    meta = read_sidecar(path, key if key is not None else job_key())
    with _open_regular(path, f"checkpoint {path}") as f:
        _digest(f, path, meta, keep=False)
    return meta


def load(path, key: Optional[Key] = None) -> Dict[str, Any]:
    """Load a checkpoint for evaluation, export or resume, after authenticating and verifying
    it (:func:`verify`; ``key`` defaults to :func:`job_key`).

    Returns the dict :func:`write` wrote: ``model`` and ``optimizer`` (``state_dict``\\ s with
    CPU tensors, for ``load_state_dict``), ``samplers`` (name -> ``ElasticSampler.state_dict()``),
    ``scalars`` (the ``TorchState`` keyword values), ``steps`` (optimizer steps),
    ``generation``, ``world_size``, ``time`` (unix seconds), ``format``.  Read with
    ``torch.load(weights_only=True)`` from the very file that was checked (no second open): only
    tensors and plain containers are unpickled.

    Raises:
        CheckpointError: the file is missing, a symbolic link, unauthenticated, truncated,
            fails its checksum, holds anything but tensors and plain values, or is not a
            checkpoint (the message names it).
    """
    path = Path(path)
    meta = read_sidecar(path, key if key is not None else job_key())
    with _open_regular(path, f"checkpoint {path}") as f:
        st = os.fstat(f.fileno())
        # a file only this user can write cannot change under the open file once checked;
        # another's (a trusted shared directory) is read once, checked and loaded from memory
        private = st.st_uid == os.geteuid() and not st.st_mode & 0o022
        data = _digest(f, path, meta, keep=not private)
        if private:
            f.seek(0)
        obj = _torch_load(f if private else io.BytesIO(data), path)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: not an hvd_edl checkpoint")
    return obj


def _torch_load(source, path: Path) -> Any:
    """``torch.load(weights_only=True)`` of an open file, torch's refusal as one line.

    Raises:
        CheckpointError: anything but tensors and plain values, or not a torch file.
    """
    import torch
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling problem is this file's
        lines = str(e).splitlines() or [type(e).__name__]
        why = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line),
                   lines[0])
        raise CheckpointError(f"checkpoint {path}: cannot be loaded with "
                              f"torch.load(weights_only=True) (only tensors and plain values "
                              f"are unpickled): {' '.join(why.split())[:300]}") from None


_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def check_plain(obj: Any, where: str = "the state") -> None:
    """Check that ``obj`` holds only what ``torch.load(weights_only=True)`` unpickles without
    any extra allow-list: tensors, ``torch.Size``/``dtype``/``device``, numbers, strings,
    bytes, ``None``, and dicts, ordered dicts, lists, tuples and sets of them.

    Raises:
        CheckpointError: the first value that is not (its place and type in the message).
    """
    import torch
    stack = [(obj, where)]
    while stack:
        value, at = stack.pop()
        t = type(value)
        if t in _PLAIN or t in (torch.Tensor, torch.nn.Parameter, torch.Size, torch.dtype,
                                torch.device):
            continue
        if t in (dict, OrderedDict):
            stack.extend((v, f"{at}[{k!r}]") for k, v in value.items())
            stack.extend((k, f"a key of {at}") for k in value)
        elif t in (list, tuple, set):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(value))
        else:
            raise CheckpointError(
                f"{at} is a {t.__module__}.{t.__qualname__}, which a resume would refuse to "
                f"unpickle (checkpoints hold only tensors and plain values: numbers, strings, "
                f"None, lists, tuples, dicts); convert it (e.g. int(x), float(x))")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(str(directory), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create(path: Path):
    """A new file at ``path`` for writing: never an existing one, never through a link."""
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    return os.fdopen(fd, "wb")


class _HashingFile:
    """A write-only file object that also feeds a SHA-256 (what ``torch.save`` writes to)."""

    def __init__(self, f):
        self.f = f
        self.digest = hashlib.sha256()
        self.bytes = 0
        self.error: Optional[OSError] = None  # torch's writer turns it into a RuntimeError

    def write(self, data) -> int:
        self.digest.update(data)
        self.bytes += len(data)
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def write(directory: Path, snapshot: Dict[str, Any], request: int = 0,
          key: Optional[Key] = None) -> Path:
    """Write ``snapshot`` (the dict :func:`load` returns) durably as a new checkpoint in
    ``directory``, its sidecar signed with ``key`` (default :func:`job_key`), and return its
    path: temporary file, ``fsync``, rename, sidecar likewise, ``fsync`` of the directory.  On
    failure (a full disk, no permission) nothing is left behind and no earlier checkpoint is
    touched.

    Raises:
        OSError: the directory cannot be written (``ENOSPC``: no room).
        CheckpointError: ``snapshot`` holds a value that is not plain (:func:`check_plain`),
            or there is no usable key.
    """
    import torch
    key = key if key is not None else job_key()
    check_plain(snapshot, "the checkpoint")
    directory = Path(directory)
    name = file_name(int(snapshot["steps"]), int(time.time() * 1000))
    final = directory / name
    token = f"{os.getpid()}.{secrets.token_hex(4)}"
    tmp = directory / f".{name}.{token}.tmp"
    side_tmp = directory / f".{name[:-3]}.json.{token}.tmp"
    renamed = False
    try:
        with _create(tmp) as f:
            h = _HashingFile(f)
            try:
                torch.save(snapshot, h)
            except RuntimeError:
                if h.error is not None:  # a full disk, a quota: say so, as an OSError
                    raise h.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        renamed = True
        _fsync_dir(directory)
        meta = {"file": name, "bytes": h.bytes, "sha256": h.digest.hexdigest(),
                "steps": int(snapshot["steps"]), "generation": snapshot.get("generation", 0),
                "world_size": snapshot.get("world_size", 0), "time": snapshot.get("time"),
                "request": request}
        meta["hmac"] = key.mac(meta)
        with _create(side_tmp) as f:
            f.write(json.dumps(meta).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(side_tmp, sidecar_of(final))
        _fsync_dir(directory)
    except BaseException:
        for p in (tmp, side_tmp):
            try:
                os.unlink(p)
            except OSError:
                pass
        if renamed and not os.path.lexists(sidecar_of(final)):
            try:
                os.unlink(final)
            except OSError:
                pass
        raise
    return final


def ours(directory: Path, key: Key) -> List[Path]:
    """The complete checkpoints in ``directory`` whose sidecar authenticates under ``key``,
    newest first (sidecars read, the data files not)."""
    found = []
    for path in complete(directory):
        try:
            read_sidecar(path, key)
        except CheckpointError:
            continue
        found.append(path)
    return found


def prune(directory: Path, keep: int, key: Optional[Key] = None,
          protect: Iterable[Path] = ()) -> List[Path]:
    """Delete all but the newest ``keep`` of this user's complete checkpoints (those whose
    sidecar authenticates under ``key``, default :func:`job_key`; others' files are left
    alone), sidecar first so a checkpoint is never complete without its file, except those in
    ``protect``; and data files of ours left without a sidecar that are older than the newest
    complete one.  At least one is always kept: with ``keep`` 0, the newest protected one, or
    else the newest.  Returns the checkpoints deleted.

    Raises:
        CheckpointError: no usable key.
    """
    key = key if key is not None else job_key()
    done = ours(directory, key)
    protected = {Path(p).name for p in protect if p is not None}
    if keep < 1 and not protected & {p.name for p in done}:
        keep = 1
    deleted = []
    for old in done[keep:]:
        if old.name in protected:
            continue
        for p in (sidecar_of(old), old):
            try:
                os.unlink(p)
            except OSError:
                pass
        deleted.append(old)
    newest = complete(directory)
    if newest:
        for name in os.listdir(directory):
            if _NAME.fullmatch(name) and name < newest[0].name \
                    and not os.path.lexists(os.path.join(directory, name[:-3] + ".json")):
                try:
                    if os.lstat(os.path.join(directory, name)).st_uid == os.geteuid():
                        os.unlink(os.path.join(directory, name))
                except OSError:
                    pass
    return deleted


def trust(path, key: Optional[Key] = None) -> dict:
    """Sign checkpoint ``path`` (one written before checkpoints were authenticated, or copied
    from another user) with ``key`` (default :func:`job_key`), after checking it against its
    sidecar's SHA-256 and that it loads with ``torch.load(weights_only=True)`` (so nothing in
    it ran or will run code).  Only for a checkpoint you trust the contents of: a signed
    checkpoint is resumed from.  Returns the new sidecar.

    Raises:
        CheckpointError: it is not a good checkpoint, or holds more than tensors and plain
            values.
        OSError: the sidecar cannot be rewritten.
    """
    path = Path(path)
    key = key if key is not None else job_key()
    meta = read_sidecar(path)
    meta.pop("hmac", None)
    meta["file"] = path.name
    with _open_regular(path, f"checkpoint {path}") as f:
        data = _digest(f, path, meta, keep=True)
    obj = _torch_load(io.BytesIO(data), path)  # what was checked, before vouching for it
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: not an hvd_edl checkpoint")
    signed = dict(meta, hmac=key.mac(meta))
    tmp = path.parent / f".{path.stem}.json.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with _create(tmp) as f:
            f.write(json.dumps(signed).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, sidecar_of(path))
        _fsync_dir(path.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return signed


# ---- the writer (rank 0, in the training process) ----------------------------------------------

class CheckpointWriter:
    """Background writer of one training process.

    Args:
        directory: where checkpoints go (``--checkpoint-dir``).
        every_s: seconds from the start of one write to the next commit that is written.
        keep: complete checkpoints kept (at least 1).
        key: what sidecars are signed with (default :func:`job_key`).

    Attributes:
        written: path of the last checkpoint written, None before the first.
        last_write_s: how long it took (seconds, serialise + fsync + rename).
        failures: writes failed in a row since the last one that succeeded (0: none).

    Raises:
        CheckpointError: no ``key`` given and no usable key (:func:`job_key`).
    """

    def __init__(self, directory: str, every_s: float = DEFAULT_EVERY_S,
                 keep: int = DEFAULT_KEEP, key: Optional[Key] = None):
        self.directory = Path(directory)
        self.every_s = every_s
        self.keep = max(1, keep)
        self.key = key if key is not None else job_key()
        self.written: Optional[Path] = None
        self.last_write_s: Optional[float] = None
        self.failures = 0
        self._failing_since: Optional[Tuple[float, int]] = None  # (monotonic s, step)
        self._last_fail_log = float("-inf")
        self._last_start = time.monotonic()
        self._done_request = 0
        self._held: Tuple[int, ...] = ()
        self._busy = threading.Event()
        self._lock = threading.Lock()
        self._job: Optional[Tuple[Dict[str, Any], int]] = None
        self._wake = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)  # notified when a write ends
        self._thread = threading.Thread(target=self._run, name="hvd_edl-checkpoint",
                                        daemon=True)
        self._thread.start()

    def holds(self, obj: Any) -> bool:
        """True while a write in flight reads ``obj`` (a commit's model or optimizer copy): the
        next commit must not copy into it."""
        return obj is not None and self._busy.is_set() and id(obj) in self._held

    def busy(self) -> bool:
        """True while a write is in flight."""
        return self._busy.is_set()

    def offer(self, state) -> bool:
        """At the end of ``TorchState.save``: on rank 0, hand this commit to the writer when one
        is due (the interval passed, or ``hvd-edl-ctl checkpoint`` asked) and none is in
        flight.  Returns True when handed over.  Never blocks."""
        from hvd_edl import runtime
        rt = runtime.get()
        if rt is None or rt.assignment is None or rt.assignment.rank != 0 \
                or rt.generation == 0 or self._busy.is_set():
            return False
        request = getattr(rt, "checkpoint_request", 0)
        now = time.monotonic()
        if request <= self._done_request and now - self._last_start < self.every_s:
            return False
        committed = state.committed_snapshot()
        snapshot = dict(committed, format=FORMAT, generation=rt.generation,
                        world_size=rt.assignment.size, time=time.time())
        with self._lock:
            self._held = (id(committed["model"]), id(committed["optimizer"]))
            self._busy.set()
            self._last_start = now
            self._done_request = max(self._done_request, request)
            self._job = (snapshot, request)
            self._wake.notify()
        return True

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the write in flight; True when none is."""
        with self._lock:   # blocked until the writer says it is done: no polling
            return self._idle.wait_for(lambda: not self._busy.is_set(), timeout_s)

    def _protected(self) -> List[Path]:
        """The newest checkpoints known good: the last this process wrote, the one it resumed
        from."""
        return [p for p in (self.written, _restored_path[0]) if p is not None]

    def _write(self, snapshot: Dict[str, Any], request: int) -> Path:
        """Make room (keep the newest ``keep - 1`` and the good ones), write; out of space, keep
        only the newest good one and try once more.

        Raises:
            OSError: the write failed (also the second time).
            CheckpointError: the state is not plain, or the key is unusable.
        """
        prune(self.directory, self.keep - 1, self.key, self._protected())
        try:
            return write(self.directory, snapshot, request, self.key)
        except OSError as e:
            if e.errno not in NO_ROOM:
                raise
            deleted = prune(self.directory, 0, self.key, self._protected())
            if not deleted:
                raise
            log.warning("no room for the checkpoint at step %s in %s (%s): deleted %d older "
                        "checkpoint(s), kept %s; writing it again", snapshot["steps"],
                        self.directory, e.strerror, len(deleted), self._newest_kept())
            return write(self.directory, snapshot, request, self.key)

    def _newest_kept(self) -> str:
        done = ours(self.directory, self.key)
        return f"{done[0]} (step {int(_NAME.fullmatch(done[0].name).group(1))})" if done \
            else "no checkpoint"

    def _failed(self, steps: int, why: str) -> None:
        """One line when checkpoints stop, at most one a minute while they still fail."""
        now = time.monotonic()
        self.failures += 1
        if self._failing_since is None:
            self._failing_since = (now, steps)
            self._last_fail_log = now
            log.error("checkpoints stopped: the checkpoint at step %s was not written to %s: "
                      "%s; kept: %s; trying again at the next commit after %g s", steps,
                      self.directory, why, self._newest_kept(), self.every_s)
        elif now - self._last_fail_log >= STILL_FAILING_LOG_S:
            self._last_fail_log = now
            log.error("checkpoints still stopped: %d writes failed in %.0f s (the last at step "
                      "%s: %s); kept: %s", self.failures, now - self._failing_since[0], steps,
                      why, self._newest_kept())

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._job is None:
                    self._wake.wait()
                snapshot, request = self._job
                self._job = None
            t0 = time.monotonic()
            try:
                path = self._write(snapshot, request)
            except OSError as e:
                self._failed(snapshot["steps"], str(e))
            except CheckpointError as e:
                self._failed(snapshot["steps"], str(e))
            except Exception as e:  # noqa: BLE001 - the training goes on without this checkpoint
                log.exception("checkpoint at step %s not written", snapshot["steps"])
                self._failed(snapshot["steps"], f"{type(e).__name__}: {e}")
            else:
                self.written = path
                self.last_write_s = time.monotonic() - t0
                log.info("checkpoint %s written in %.3f s", path, self.last_write_s)
                if self._failing_since is not None:
                    since_s, step = self._failing_since
                    log.warning("checkpoints resumed: %s (step %s) written after %d failed "
                                "writes over %.0f s (the first at step %s)", path,
                                snapshot["steps"], self.failures, time.monotonic() - since_s,
                                step)
                    self._failing_since = None
                    self.failures = 0
                try:
                    prune(self.directory, self.keep, self.key, [path])
                except (OSError, CheckpointError) as e:
                    log.warning("could not delete old checkpoints in %s: %s", self.directory, e)
            finally:
                del snapshot
                with self._lock:
                    self._held = ()
                    self._busy.clear()
                    self._idle.notify_all()


_writer: Optional[CheckpointWriter] = None
_writer_lock = threading.Lock()


def writer() -> Optional[CheckpointWriter]:
    """This process's writer when ``HVD_EDL_CHECKPOINT_DIR`` is set (created at the first call),
    else None."""
    global _writer
    if _writer is not None:
        return _writer
    directory = os.environ.get(ENV_DIR)
    if not directory:
        return None
    with _writer_lock:
        if _writer is None:
            _writer = CheckpointWriter(directory,
                                       float(os.environ.get(ENV_EVERY_S, DEFAULT_EVERY_S)),
                                       int(os.environ.get(ENV_KEEP, DEFAULT_KEEP)))
            atexit.register(_writer.wait, EXIT_WAIT_S)  # a finishing job keeps its last write
        return _writer


# ---- resume (rank 0, in TorchState.sync) -------------------------------------------------------

_restored_generation = [0]
_restored_path: List[Optional[Path]] = [None]  # the checkpoint this process resumed from


def restore_into(state) -> Optional[str]:
    """On rank 0 of a generation the launcher told to resume (``Assignment.restore_paths``,
    newest first): load the first checkpoint that is good and fits into ``state`` (model,
    optimizer, samplers, scalars) and the runtime's step count, logging one line per
    checkpoint that does not.  Once per generation; nothing to do otherwise.

    Returns None when done (or nothing to do), else the error every rank raises: no listed
    checkpoint could be used (the message names each file and its problem).
    """
    from hvd_edl import runtime
    rt = runtime.get()
    paths = list(rt.assignment.restore_paths) if rt is not None and rt.assignment else []
    if not paths or _restored_generation[0] == rt.generation:
        return None
    _restored_generation[0] = rt.generation
    problems = []
    for path in paths:
        try:
            data = load(path)
            _apply(state, data, path)
        except CheckpointError as e:
            problems.append(str(e))
            log.error("%s%s", e, "; trying the previous one" if path != paths[-1] else "")
            continue
        rt.steps = int(data["steps"])
        _restored_path[0] = Path(path)
        log.warning("resumed from checkpoint %s (step %d, written at world size %s)", path,
                    rt.steps, data.get("world_size"))
        return None
    return ("no checkpoint in the checkpoint directory can be used: "
            + "; ".join(p.rstrip(".") for p in problems)
            + ". Remove them (or use another --checkpoint-dir) to start from scratch")


def _apply(state, data: Dict[str, Any], path) -> None:
    """Load checkpoint ``data`` into a ``TorchState``.

    Raises:
        CheckpointError: the model's or optimizer's tensors do not fit (another model).
    """
    try:
        if state.model is not None:
            if data.get("model") is None:
                raise ValueError("it holds no model")
            state.model.load_state_dict(data["model"])
        if state.optimizer is not None and data.get("optimizer") is not None:
            state.optimizer.load_state_dict(data["optimizer"])
        for k, s in state.elastic_samplers().items():
            if k in data.get("samplers", {}):
                s.load_state_dict(data["samplers"][k])
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        why = " ".join(str(e).split()).rstrip(".")  # torch's message, on one line
        raise CheckpointError(f"checkpoint {path} does not fit this job's model or optimizer "
                              f"(another model?): {why[:400]}") from None
    state.load_committed_scalars(data.get("scalars", {}))


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m hvd_edl.checkpoint trust PATH...``: sign checkpoints you trust with your key
    (:func:`trust`; for ones written before checkpoints were authenticated).  Exit 0 when every
    one was signed, 1 otherwise (one line per file), 2 for a usage error."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] != "trust":
        print("usage: python -m hvd_edl.checkpoint trust CHECKPOINT.pt [...]\n"
              "  signs checkpoints you wrote and trust with your checkpoint key "
              f"({key_file()}), so a job resumes from them", file=sys.stderr)
        return 2
    code = 0
    for path in args[1:]:
        try:
            meta = trust(path)
        except (CheckpointError, OSError) as e:
            print(f"not signed: {e}", file=sys.stderr)
            code = 1
            continue
        print(f"signed {path} (step {meta['steps']})")
    return code


if __name__ == "__main__":
    sys.exit(main())
