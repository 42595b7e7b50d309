"""Messages between training processes (``hvd_edl``) and the driver (``launcher``).

Both sides import this module; the worker side never imports the launcher.  Every message is a
dataclass sent as JSON over HTTP on the coordinator's port; nothing received from the network is
unpickled.  Every request carries an HMAC-SHA256 under the per-job secret (the scheme of Horovod's
``horovod.runner.common.util.secret``) over the method, path, a wall-clock timestamp, a random
nonce and the body, checked before the body is parsed.  The timestamp bounds how long a captured
request stays valid (``AUTH_WINDOW_S``); the server remembers nonces for that long, so a request
is accepted once.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import re
import secrets
import time
import typing
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Type, TypeVar

# Environment the launcher sets for every worker it spawns.
ENV_COORD_ADDR = "HVD_EDL_COORDINATOR_ADDR"
ENV_COORD_PORT = "HVD_EDL_COORDINATOR_PORT"
ENV_SECRET = "HVD_EDL_SECRET"
ENV_WORKER_ID = "HVD_EDL_WORKER_ID"
ENV_HOST = "HVD_EDL_HOST"
ENV_SLOT = "HVD_EDL_SLOT"
ENV_ELASTIC = "HVD_EDL_ELASTIC"
ENV_LAUNCHED_AT = "HVD_EDL_LAUNCHED_AT"  # the launcher's start, unix seconds: orders a job's runs

BEAT_S = 0.3  # seconds between a worker's heartbeats (``Beat``; see launcher/job/liveness.py)

AUTH_HEADER = "X-Hvd-Edl-Auth"
AUTH_SCHEME = "v1"
AUTH_WINDOW_S = 120.0     # a signature older or newer than this (wall clock) is refused
MAX_BODY_BYTES = 1 << 20  # requests larger than this are refused unread

T = TypeVar("T")
_STAMP = re.compile(r"[0-9]{1,15}")          # unix milliseconds
_NONCE = re.compile(r"[0-9a-f]{16,64}")
_MAC = re.compile(r"[0-9a-f]{64}")           # HMAC-SHA256, hex


def new_secret() -> str:
    """A fresh per-job secret: 32 random bytes, hex encoded (64 characters)."""
    return secrets.token_hex(32)


def _mac(secret: str, method: str, path: str, stamp: str, nonce: str, body: bytes) -> str:
    mac = hmac.new(secret.encode(), digestmod=hashlib.sha256)
    mac.update(f"{method} {path}\n{stamp}\n{nonce}\n".encode())
    mac.update(body)
    return mac.hexdigest()


def sign(secret: str, method: str, path: str, body: bytes) -> str:
    """The :data:`AUTH_HEADER` value for one request: ``v1:<unix ms>:<nonce>:<hmac hex>``.

    The HMAC-SHA256 covers ``METHOD path``, the timestamp, a fresh 128-bit nonce and the body.
    Sign each attempt anew (a resent header is a replay)."""
    stamp = str(int(time.time() * 1000))
    nonce = secrets.token_hex(16)
    return f"{AUTH_SCHEME}:{stamp}:{nonce}:{_mac(secret, method, path, stamp, nonce, body)}"


def verify(secret: str, method: str, path: str, body: bytes, signature: Optional[str],
           now: Optional[float] = None, window_s: float = AUTH_WINDOW_S) -> Optional[str]:
    """Check a :func:`sign` header: well formed, timestamp within ``window_s`` seconds of ``now``
    (unix seconds; default the clock), HMAC right (constant-time comparison).

    Returns the request's nonce when valid (the caller refuses a nonce seen before), else None.
    """
    parts = (signature or "").split(":")
    if len(parts) != 4 or parts[0] != AUTH_SCHEME or not _STAMP.fullmatch(parts[1]) \
            or not _NONCE.fullmatch(parts[2]) or not _MAC.fullmatch(parts[3]):
        return None  # ASCII digits and hex only: int() and compare_digest() cannot raise
    _, stamp, nonce, mac = parts
    now = time.time() if now is None else now
    if abs(now - int(stamp) / 1000.0) > window_s:
        return None
    if not hmac.compare_digest(_mac(secret, method, path, stamp, nonce, body), mac):
        return None
    return nonce


@functools.lru_cache(maxsize=None)
def _fields(cls) -> tuple:
    """(name, type hint) of each field of a message class: ``typing.get_type_hints`` resolves
    the string annotations anew at every call, a tenth of the launcher's CPU per request
    (benchmarks/job/control_plane.py), so once per class."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def encode(msg) -> bytes:
    """A message dataclass as UTF-8 JSON bytes (fields hold JSON values: str, numbers, bools,
    lists and str-keyed dicts of them, so no deep copy as ``dataclasses.asdict`` makes)."""
    return json.dumps({name: getattr(msg, name) for name, _ in _fields(type(msg))}).encode()


def loads(body: bytes):
    """JSON ``body`` (UTF-8) as Python objects.

    Raises:
        ValueError: not UTF-8, not JSON, or nested too deep for the parser.
    """
    try:
        return json.loads(body.decode() or "{}")
    except RecursionError:
        raise ValueError("JSON nested too deep") from None


def _type_ok(value, hint) -> bool:
    """Whether a JSON value fits a field's type: str, int, float (an int too), bool, List[X],
    Dict[str, X]; bools are not numbers."""
    origin = typing.get_origin(hint)
    if origin in (list, List):
        (item,) = typing.get_args(hint) or (object,)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin in (dict, Dict):
        _, item = typing.get_args(hint) or (str, object)
        return isinstance(value, dict) and all(isinstance(k, str) and _type_ok(v, item)
                                               for k, v in value.items())
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


def decode(cls: Type[T], body: bytes) -> T:
    """Parse JSON ``body`` into dataclass ``cls``; unknown keys are ignored, known ones must have
    their field's type.

    Raises:
        ValueError: the body is not a JSON object, lacks a required field, or a field has the
            wrong type.
    """
    data = loads(body)
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected a JSON object")
    kwargs = {}
    for name, hint in _fields(cls):
        if name in data:
            if not _type_ok(data[name], hint):
                raise ValueError(f"{cls.__name__}.{name}: expected {hint}, "
                                 f"got {type(data[name]).__name__}")
            kwargs[name] = data[name]
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"{cls.__name__}: {e}") from None


# ---- worker -> coordinator -------------------------------------------------------------------

@dataclass
class Register:
    """``POST /register``: a process announces itself after ``init()`` (state pending).
    ``stream_addr``/``stream_port``: where it listens for the state syncs in which it will be
    rank 0 (``hvd_edl.state_stream.Listener``; "" / 0: nowhere, the sync's header then goes in
    a Horovod broadcast)."""
    worker_id: str
    stream_addr: str = ""
    stream_port: int = 0


@dataclass
class Ready:
    """``POST /ready``: the script entered ``hvd.elastic.run`` (``elastic_run`` True) or needs
    the ring now (a collective outside it, or a static job: False).  A member whose script
    entered ``hvd.elastic.run`` and exits 0 before its training function returned
    (:class:`Finished`) is taken for a leave, not for the end of the job."""
    worker_id: str
    elastic_run: bool = False


@dataclass
class Finished:
    """``POST /finished``: the worker's training function (under ``hvd.elastic.run``) returned in
    ``generation`` at optimizer step ``step``: training is over.  The coordinator forms no more
    generations and never takes this worker's silence (its interpreter's teardown) for a
    failure; the job ends once the members have exited.  ``done`` False: the worker entered an
    elastic function again (a script with a second one, e.g. an evaluation phase): training
    goes on after all."""
    worker_id: str
    generation: int
    step: int = 0
    done: bool = True


@dataclass
class SwitchRequest:
    """``POST /switch``: a worker is at a step boundary and asks for its next generation.

    ``reason`` is "join" (not yet a member), "update" (the ring agreed to switch at a commit) or
    "failure" (a collective failed: HorovodInternalError).  ``step`` is the worker's optimizer step
    count after restore; ``steps_before_restore`` its count before (equal unless rolled back).
    The call long-polls: it answers ``Assignment(action="wait")`` after ``wait_s`` seconds.
    """
    worker_id: str
    generation: int
    reason: str
    step: int = 0
    steps_before_restore: int = 0
    wait_s: float = 10.0


@dataclass
class Started:
    """``POST /started``: the worker began its first step in ``generation`` after ``stall_s`` s
    (end of its last step in the previous ring to the start of its first in this one).

    ``phases`` splits ``stall_s`` (seconds each): ``boundary_s`` (last step's end to leaving the
    ring: commit, the agreement allreduce), ``shutdown_s`` (``hvd.shutdown()``), ``wait_s`` (the
    coordinator forming the generation: every member at the boundary), ``init_s``
    (``hvd.init()``: Gloo rendezvous and connections), ``sync_s`` (``state.sync()``) and
    ``rest_s`` (what is left).  ``sync_parts`` splits ``sync_s`` (seconds): ``header_s`` (rank
    0's header reaching this rank), ``skeleton_s`` (the skeleton split on rank 0, the
    destinations built on a receiver), ``transfer_s`` (the tensors' bytes), ``load_s``
    (``load_state_dict``, the samplers, the new commit); empty when the switch had no sync."""
    worker_id: str
    generation: int
    stall_s: float
    step: int
    phases: Dict[str, float] = field(default_factory=dict)
    sync_parts: Dict[str, float] = field(default_factory=dict)


@dataclass
class WatchRequest:
    """``POST /watch``: long-poll; answered when a change is pending after ``generation`` or after
    ``wait_s`` seconds, whichever is first.  With ``until_started`` (a worker scaled in, before
    it exits): answered once ``generation`` trains (every continuing member reported its first
    step) or is over, or after ``wait_s``.  Also answered at once when ``hvd-edl-ctl status``
    wants fresh progress: ``step`` (optimizer steps), ``epoch`` and ``samples`` (the first
    ElasticSampler's epoch and samples of every rank since epoch 0, as of the last commit;
    -1 unknown) are what the status shows (``launcher.observe.progress``)."""
    worker_id: str
    generation: int
    wait_s: float = 20.0
    until_started: bool = False
    step: int = -1
    epoch: int = -1
    samples: int = -1


@dataclass
class Beat:
    """``POST /beat``: a member's heartbeat, sent every ``BEAT_S`` by its heartbeat thread (off
    the training thread: a worker blocked in a collective or computing a long step still
    beats; a frozen process, a vanished host or a partition from the launcher does not).
    ``generation``: the ring the worker is in or is joining (0: none yet); ``step`` its
    optimizer steps.  Telemetry (``hvd_edl.step_timer``), sums since the previous answered
    beat: ``steps_done`` timed optimizer steps, ``compute_s`` and ``wait_s`` their seconds
    computing and blocked in collectives, ``samples`` this rank's samples (0 from old
    senders).  ``noise``: the latest gradient noise estimate
    (:meth:`hvd_edl.gradient_noise.NoiseEstimate.as_dict`; empty before the first measured
    step); ``batch``: the script's adaptive batch, when it opted in
    (:meth:`hvd_edl.adaptive_batch.BatchPlan.as_dict`; empty when it did not)."""
    worker_id: str
    generation: int
    step: int = -1
    steps_done: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    samples: int = 0
    noise: Dict[str, float] = field(default_factory=dict)
    batch: Dict[str, float] = field(default_factory=dict)


@dataclass
class Exiting:
    """``POST /exiting``: the worker's interpreter is ending (``atexit``: the script returned or
    called ``sys.exit``); its teardown (Horovod's shutdown, torch's) may keep its heartbeat
    silent for a while, which is not a fault.  A member whose training function had not
    returned is leaving: its peers are released at once."""
    worker_id: str
    generation: int


@dataclass
class Leave:
    """``POST /leave``: this worker received SIGTERM and leaves gracefully: at the next step
    boundary if it is a member (nothing rolled back), at once otherwise."""
    worker_id: str


# ---- coordinator -> worker -------------------------------------------------------------------

@dataclass
class Registered:
    """Answer to :class:`Register`: the slot the worker holds on its host and provisional figures
    (rank and size it would have if the next generation formed now) for scripts that read
    ``hvd.rank()`` / ``hvd.size()`` before joining."""
    worker_id: str
    host: str
    local_rank: int
    provisional_rank: int
    provisional_size: int
    generation: int


@dataclass
class Assignment:
    """Answer to :class:`SwitchRequest`.

    ``action``: "join" (set the Horovod environment below and ``hvd.init()``), "exit" (leave with
    code 0: scaled in, or the job is over), or "wait" (ask again).  Ranks follow Horovod: ``rank``
    in [0, size), ``local_rank`` in [0, local_size) within ``hostname``, ``cross_rank`` in
    [0, cross_size) over hosts.  ``rendezvous_port`` is this generation's Gloo rendezvous.
    ``sync``: whether the members broadcast the state when the generation starts; the same for
    every member (False only after an agreed switch that removed members and added none, when
    every member holds the state committed at that step boundary).  ``rendezvous_token``: the
    generation's rendezvous token (``HOROVOD_GLOO_RENDEZVOUS_TOKEN``, which our patched Horovod
    sends with every rendezvous request; "" from a coordinator that has none).
    ``restore_paths``: set when the generation starts without any holder of the state (the
    job's first, or a ring re-formed after every member died) and ``--checkpoint-dir`` holds
    checkpoints: rank 0 loads the first that is good and fits (newest first; see
    ``hvd_edl.checkpoint``) before the state is broadcast.
    ``state_addr``/``state_port``: where rank 0 listens for the state sync (its
    :class:`Register`), ``state_token``: this generation's random token, from which the sync's
    keys are derived under the job's secret (``hvd_edl.state_stream.sync_keys``); port 0: the
    sync's header goes in a Horovod broadcast.
    ``batch``: the global batch (samples) asked for this generation through the control API
    (``/ctl/batch``; 0: none asked): a script that opted in to an adaptive batch applies it when
    it enters the generation (``hvd_edl.adaptive_batch``), the same on every member; others
    ignore it.
    """
    action: str
    generation: int = 0
    rank: int = 0
    size: int = 0
    local_rank: int = 0
    local_size: int = 0
    cross_rank: int = 0
    cross_size: int = 0
    hostname: str = ""
    rendezvous_addr: str = ""
    rendezvous_port: int = 0
    members: List[str] = field(default_factory=list)
    reason: str = ""
    sync: bool = True
    rendezvous_token: str = ""
    restore_paths: List[str] = field(default_factory=list)
    state_addr: str = ""
    state_port: int = 0
    state_token: str = ""
    batch: int = 0


@dataclass
class BeatReply:
    """Answer to :class:`Beat`.  ``release``: a member of the worker's generation was declared
    dead (silent, or exited): shut that ring's sockets down so that a collective or a ring
    set-up blocked on it fails now, not after Gloo's timeout.  ``fenced``: this worker was
    declared dead (it may have been frozen or cut off): it must exit without touching any
    ring again.  ``beat_s``: seconds until this worker's next beat (the period grows with the
    job's size, ``launcher.job.liveness.beat_period_s``; 0 from an older launcher: ``BEAT_S``)."""
    release: bool = False
    fenced: bool = False
    beat_s: float = 0.0


@dataclass
class WatchReply:
    """Answer to :class:`WatchRequest`: ``change_pending`` when the coordinator wants a switch.
    ``checkpoint_request``: how many checkpoints ``hvd-edl-ctl checkpoint`` asked for so far
    (rank 0 writes one at its next commit when this grows).  ``finishing``: a member's training
    function returned (:class:`Finished`): training is over, no generation forms any more."""
    change_pending: bool
    latest_generation: int
    checkpoint_request: int = 0
    finishing: bool = False
