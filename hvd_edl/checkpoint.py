"""Durable commits: rank 0 persists a commit to ``--checkpoint-dir`` off the training thread, and
a ring that starts without any holder of the state resumes from the newest good checkpoint.

Format (``DIR`` is ``hvd-edl-run --checkpoint-dir``, passed to every worker as
``HVD_EDL_CHECKPOINT_DIR``):

* ``DIR/ckpt-<step, 12 digits>-<unix ms>.pt``: a plain :func:`torch.save` file of a dict
  ``{"format", "model", "optimizer", "samplers", "scalars", "steps", "generation", "world_size",
  "time"}``: the model's and optimizer's ``state_dict`` (CPU tensors), every ElasticSampler's
  ``state_dict`` by name, the script's scalars (``TorchState(..., epoch=0)``), the optimizer
  step count, the generation and world size it was written at, unix seconds;
* ``DIR/<same name>.json``: its sidecar ``{"file", "bytes", "sha256", "steps", "generation",
  "world_size", "time", "request"}``, written after the ``.pt`` file is durable.  A checkpoint
  is complete only once its sidecar exists, and good only when the file's size and SHA-256
  match it.

Writing (:class:`CheckpointWriter`): at a commit (``TorchState.save``) on rank 0, once
``HVD_EDL_CHECKPOINT_EVERY_S`` seconds (default :data:`DEFAULT_EVERY_S`) have passed since the
last write began, or when ``hvd-edl-ctl checkpoint`` asked for one, the host-memory copy the
commit just made is handed to a background thread, which writes it to a temporary file,
``fsync``\\ s it, renames it, writes the sidecar the same way and ``fsync``\\ s the directory, then
deletes all but the newest ``HVD_EDL_CHECKPOINT_KEEP`` (default :data:`DEFAULT_KEEP`).  The
training thread never waits for the disk: while a write is in flight, further commits are not
written (the next one due after it is).

No copy is made for the writer.  ``TorchState.save`` copies into the previous commit's buffers
(no allocation at steady state); while the writer reads those (:meth:`CheckpointWriter.holds`),
commits copy into a second set of buffers instead, kept for the next write, so the writer never
reads a buffer the training thread is overwriting and nothing is allocated after the first
write.  The price is host memory: with checkpoints on, two copies of the state (one without).
Measured for 100 MB of state (one process, 2 cores): a commit into reused buffers 39 ms, into
fresh ones 106 ms (median; what an earlier version did for every commit inside a write), a clone
52 ms (the other way: one clone at hand-over, on the training thread, at every checkpoint).

Reading: :func:`load` verifies the checksum and returns the dict above (``torch.load`` of the
``.pt`` file gives the same, unverified).  Without ``HVD_EDL_CHECKPOINT_DIR`` nothing here runs:
:func:`writer` returns None after one dictionary lookup.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

log = logging.getLogger(__name__)

ENV_DIR = "HVD_EDL_CHECKPOINT_DIR"
ENV_EVERY_S = "HVD_EDL_CHECKPOINT_EVERY_S"
ENV_KEEP = "HVD_EDL_CHECKPOINT_KEEP"
DEFAULT_EVERY_S = 60.0  # seconds between checkpoints: at most a minute of work lost to a loss of
                        # every worker; a 100 MB write takes about a second here (see the README)
DEFAULT_KEEP = 3        # checkpoints kept: the newest, and two to fall back on if it is bad
FORMAT = "hvd_edl.checkpoint/1"
LOCK_NAME = ".hvd-edl.lock"
EXIT_WAIT_S = 60.0      # longest a finishing process waits for a write in flight (seconds)

_NAME = re.compile(r"ckpt-(\d{12})-(\d{13,})\.pt")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file and the problem."""


# ---- the files ---------------------------------------------------------------------------------

def file_name(steps: int, unix_ms: int) -> str:
    """``ckpt-<steps>-<unix ms>.pt``: names sort by step, then by time."""
    return f"ckpt-{steps:012d}-{unix_ms:013d}.pt"


def sidecar_of(path: Path) -> Path:
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
        if m and os.path.exists(os.path.join(directory, name[:-3] + ".json")):
            found.append(((int(m.group(1)), int(m.group(2))), Path(directory) / name))
    return [p for _, p in sorted(found, reverse=True)]


def read_sidecar(path: Path) -> dict:
    """The sidecar of checkpoint ``path``.

    Raises:
        CheckpointError: missing, unreadable or malformed.
    """
    side = sidecar_of(path)
    try:
        meta = json.loads(side.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read its sidecar {side.name}: {e}") \
            from None
    if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), str) \
            or not isinstance(meta.get("bytes"), int):
        raise CheckpointError(f"checkpoint {path}: malformed sidecar {side.name}")
    return meta


def verify(path: Path) -> dict:
    """Check checkpoint ``path`` against its sidecar (size, then SHA-256; about 1 s per GB) and
    return the sidecar.

    Raises:
        CheckpointError: no sidecar, a truncated or missing file, or a checksum mismatch.
    """
    meta = read_sidecar(path)
    try:
        size = os.path.getsize(path)
        if size != meta["bytes"]:
            raise CheckpointError(f"checkpoint {path}: truncated or changed: {size} bytes, its "
                                  f"sidecar says {meta['bytes']}")
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while True:
                chunk = f.read(1 << 22)
                if not chunk:
                    break
                digest.update(chunk)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: cannot read it: {e}") from None
    got = digest.hexdigest()
    if got != meta["sha256"]:
        raise CheckpointError(f"checkpoint {path}: wrong checksum (SHA-256 {got[:16]}..., its "
                              f"sidecar says {meta['sha256'][:16]}...): corrupted")
    return meta


def load(path) -> Dict[str, Any]:
    """Load a checkpoint for evaluation, export or resume, after verifying it.

    Returns the dict :func:`torch.save` wrote (``torch.load(path)`` gives the same without the
    check): ``model`` and ``optimizer`` (``state_dict``\\ s with CPU tensors, for
    ``load_state_dict``), ``samplers`` (name -> ``ElasticSampler.state_dict()``), ``scalars``
    (the ``TorchState`` keyword values), ``steps`` (optimizer steps), ``generation``,
    ``world_size``, ``time`` (unix seconds), ``format``.  Only load files you trust: like
    ``torch.load(weights_only=False)`` this unpickles.

    Raises:
        CheckpointError: the file is missing, truncated, fails its checksum or is not a
            checkpoint (the message names it).
    """
    import torch
    path = Path(path)
    verify(path)
    try:
        data = torch.load(str(path), map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling problem is this file's
        raise CheckpointError(f"checkpoint {path}: cannot be loaded: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: not an hvd_edl checkpoint")
    return data


def _fsync_dir(directory: Path) -> None:
    fd = os.open(str(directory), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def write(directory: Path, snapshot: Dict[str, Any], request: int = 0) -> Path:
    """Write ``snapshot`` (the dict :func:`load` returns) durably as a new checkpoint in
    ``directory`` and return its path: temporary file, ``fsync``, rename, sidecar likewise,
    ``fsync`` of the directory.  On failure (a full disk, no permission) nothing is left behind
    and no earlier checkpoint is touched.

    Raises:
        OSError: the directory cannot be written.
    """
    import torch
    directory = Path(directory)
    name = file_name(int(snapshot["steps"]), int(time.time() * 1000))
    final = directory / name
    tmp = directory / f".{name}.{os.getpid()}.tmp"
    side_tmp = directory / f".{name[:-3]}.json.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
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
        _fsync_dir(directory)
        meta = {"file": name, "bytes": h.bytes, "sha256": h.digest.hexdigest(),
                "steps": int(snapshot["steps"]), "generation": snapshot.get("generation", 0),
                "world_size": snapshot.get("world_size", 0), "time": snapshot.get("time"),
                "request": request}
        with open(side_tmp, "w") as f:
            json.dump(meta, f)
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
        if final.exists() and not sidecar_of(final).exists():
            try:
                os.unlink(final)
            except OSError:
                pass
        raise
    return final


def prune(directory: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (sidecar first, so a checkpoint is
    never complete without its file), and data files left without a sidecar that are older than
    the newest complete one."""
    done = complete(directory)
    for old in done[keep:]:
        for p in (sidecar_of(old), old):
            try:
                os.unlink(p)
            except OSError:
                pass
    if done:
        newest = done[0].name
        for name in os.listdir(directory):
            if _NAME.fullmatch(name) and name < newest \
                    and not os.path.exists(os.path.join(directory, name[:-3] + ".json")):
                try:
                    os.unlink(os.path.join(directory, name))
                except OSError:
                    pass


# ---- the writer (rank 0, in the training process) ----------------------------------------------

class CheckpointWriter:
    """Background writer of one training process.

    Args:
        directory: where checkpoints go (``--checkpoint-dir``).
        every_s: seconds from the start of one write to the next commit that is written.
        keep: complete checkpoints kept.

    Attributes:
        written: path of the last checkpoint written, None before the first.
        last_write_s: how long it took (seconds, serialise + fsync + rename).
    """

    def __init__(self, directory: str, every_s: float = DEFAULT_EVERY_S,
                 keep: int = DEFAULT_KEEP):
        self.directory = Path(directory)
        self.every_s = every_s
        self.keep = keep
        self.written: Optional[Path] = None
        self.last_write_s: Optional[float] = None
        self._last_start = time.monotonic()
        self._done_request = 0
        self._held: Tuple[int, ...] = ()
        self._busy = threading.Event()
        self._lock = threading.Lock()
        self._job: Optional[Tuple[Dict[str, Any], int]] = None
        self._wake = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="hvd_edl-checkpoint",
                                        daemon=True)
        self._thread.start()

    def holds(self, obj: Any) -> bool:
        """True while a write in flight reads ``obj`` (a commit's model or optimizer copy): the
        next commit must not copy into it."""
        return obj is not None and self._busy.is_set() and id(obj) in self._held

    def busy(self) -> bool:
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
        snapshot = {"format": FORMAT, "model": state._saved_model,
                    "optimizer": state._saved_optimizer,
                    "samplers": dict(state._saved_samplers),
                    "scalars": dict(state._saved_state), "steps": state._saved_steps,
                    "generation": rt.generation, "world_size": rt.assignment.size,
                    "time": time.time()}
        with self._lock:
            self._held = (id(state._saved_model), id(state._saved_optimizer))
            self._busy.set()
            self._last_start = now
            self._done_request = max(self._done_request, request)
            self._job = (snapshot, request)
            self._wake.notify()
        return True

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the write in flight; True when none is."""
        deadline = time.monotonic() + timeout_s
        while self._busy.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._busy.is_set()

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._job is None:
                    self._wake.wait()
                snapshot, request = self._job
                self._job = None
            t0 = time.monotonic()
            try:
                path = write(self.directory, snapshot, request)
            except OSError as e:
                log.error("checkpoint at step %s not written to %s: %s (the earlier "
                          "checkpoints are kept; the next one is tried in %g s)",
                          snapshot["steps"], self.directory, e, self.every_s)
            except Exception:  # noqa: BLE001 - the training goes on without this checkpoint
                log.exception("checkpoint at step %s not written", snapshot["steps"])
            else:
                self.written = path
                self.last_write_s = time.monotonic() - t0
                log.info("checkpoint %s written in %.3f s", path, self.last_write_s)
                try:
                    prune(self.directory, self.keep)
                except OSError as e:
                    log.warning("could not delete old checkpoints in %s: %s", self.directory, e)
            finally:
                del snapshot
                with self._lock:
                    self._held = ()
                    self._busy.clear()


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
        for k, s in state._samplers.items():
            if k in data.get("samplers", {}):
                s.load_state_dict(data["samplers"][k])
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        why = " ".join(str(e).split()).rstrip(".")  # torch's message, on one line
        raise CheckpointError(f"checkpoint {path} does not fit this job's model or optimizer "
                              f"(another model?): {why[:400]}") from None
    scalars = data.get("scalars", {})
    for k in state._saved_state:
        if k in scalars:
            state._saved_state[k] = scalars[k]
    state._set_attrs()
