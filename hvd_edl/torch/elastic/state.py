"""``TorchState``: the elastic state of a PyTorch job (Horovod's
``horovod/torch/elastic/state.py``), committed to host memory, restored after a failure and synced
from rank 0 after every generation change (streamed to the ranks that lack it:
:mod:`hvd_edl.state_stream`)."""
from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any, Dict

import torch

import horovod.torch as _hvd

from hvd_edl import audit, checkpoint, runtime, state_stream
from hvd_edl.elastic_state import ObjectState
from hvd_edl.torch import broadcasts as _broadcasts
from hvd_edl.torch.elastic.sampler import ElasticSampler

log = logging.getLogger(__name__)

STREAM = os.environ.get("HVD_EDL_SYNC_STREAM", "1") != "0"
"""``HVD_EDL_SYNC_STREAM=0``: ``TorchState.sync()`` broadcasts everything to every rank in one
``broadcast_object`` instead of streaming the tensors to the ranks that lack them."""


SYNC_PARTS = ("header_s", "skeleton_s", "transfer_s", "load_s")
"""Where a streamed sync's time goes on one rank (seconds): rank 0's header reaching it (on rank
0: nothing, or the broadcast), the skeleton (split on rank 0, the destinations built on a
receiver), the tensors' bytes (rank 0: until every receiver confirmed), ``load_state_dict``
with the samplers and the new commit."""


def _to_host(obj: Any, into: Any, pending: list, copies: list) -> Any:
    """Copy ``obj`` (nested dicts/lists of tensors and plain values) to host memory, reusing the
    buffers of the previous copy ``into`` where shapes and dtypes match (no allocation and no
    page faults at steady state).  CUDA tensors go to pinned buffers with asynchronous copies;
    ``pending`` collects their devices so the caller synchronises once.  Host-to-host copies
    into reused buffers are not made here but appended to ``copies`` as ``(buffer, source)``
    for the caller to make in one :func:`_copy_all`."""
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        if (isinstance(into, torch.Tensor) and into.device.type == "cpu"
                and into.shape == src.shape and into.dtype == src.dtype
                and (not src.is_cuda or into.is_pinned())):  # CUDA: into pinned memory only
            buf = into
        elif src.is_cuda:
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        else:
            return src.to("cpu", copy=True)
        if src.is_cuda:
            buf.copy_(src, non_blocking=True)
            pending.append(src.device)
        else:
            copies.append((buf, src))
        return buf
    if isinstance(obj, dict):
        prev = into if isinstance(into, dict) else {}
        return {k: _to_host(v, prev.get(k), pending, copies) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        prev = into if isinstance(into, (list, tuple)) and len(into) == len(obj) else [None] * len(obj)
        return type(obj)(_to_host(v, p, pending, copies) for v, p in zip(obj, prev))
    return copy.deepcopy(obj)


_foreach_copy = getattr(torch, "_foreach_copy_", None)


def _copy_all(copies: list) -> None:
    """Make the host-to-host ``(buffer, source)`` copies ``_to_host`` deferred, in one
    ``torch._foreach_copy_`` call where this torch has it (one dispatch instead of one per
    tensor; ``TorchState.save`` of the digits CNN with SGD momentum, 2,000 saves in one
    process: 0.103 ms with per-tensor copies, 0.091 ms with this)."""
    if not copies:
        return
    if _foreach_copy is not None:
        _foreach_copy([b for b, _ in copies], [s for _, s in copies])
    else:
        for b, s in copies:
            b.copy_(s)


def _note_progress(samplers: Dict[str, ElasticSampler]) -> None:
    """Tell the runtime the first sampler's epoch and samples since epoch 0 (what ``hvd-edl-ctl
    status`` shows; a few attribute reads per commit)."""
    from hvd_edl import runtime
    rt = runtime.get()
    if rt is not None and samplers:
        s = next(iter(samplers.values()))
        rt.progress = (s.epoch, s.epoch * s.num_samples_total + s.consumed)


def _clone(obj: Any) -> Any:
    """Deep copy of a host-memory commit, so that loading it never aliases the saved buffers
    (``Optimizer.load_state_dict`` keeps tensors that already have the right device and dtype)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return copy.deepcopy(obj)


def _held_by_nobody(obj: Any) -> bool:
    return False


def _any_device_tensor(obj: Any) -> bool:
    """Whether nested ``obj`` holds a tensor outside host memory (CUDA)."""
    if isinstance(obj, torch.Tensor):
        return obj.device.type != "cpu"
    if isinstance(obj, dict):
        return any(_any_device_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_any_device_tensor(v) for v in obj)
    return False


class TorchState(ObjectState):
    """Elastic state of a PyTorch job (Horovod's ``TorchState(model, optimizer, **kwargs)``).

    Args:
        model: ``torch.nn.Module`` or None.
        optimizer: ``torch.optim.Optimizer`` (e.g. the DistributedOptimizer) or None.
        **kwargs: ``ElasticSampler`` objects (tracked by their state_dict) and any picklable
            scalars (``epoch=0, batch=0``), exposed as attributes.

    ``commit()`` copies model and optimizer state to host memory (Horovod deep-copies CUDA
    tensors on the GPU), into the buffers of the previous commit (pinned for CUDA tensors);
    ``sync()`` hands rank 0's model, optimizer, scalars, samplers and step count to every rank
    (streaming the tensors only to the ranks that lack them), then resets every sampler to the
    new rank and world size.
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        scalars = {k: v for k, v in kwargs.items() if k not in samplers}
        self.model = model
        self.optimizer = optimizer
        self._samplers: Dict[str, ElasticSampler] = samplers
        for k, v in samplers.items():
            v.name = k
            object.__setattr__(self, k, v)
        super().__init__(bcast_object=_broadcasts.broadcast_object, get_rank=_hvd.rank, **scalars)
        self._saved_model = None
        self._saved_optimizer = None
        self._saved_samplers: Dict[str, Dict] = {}
        self._spare_model = self._spare_optimizer = None  # the second set (checkpoints only)
        self._synced_generation = None  # the generation of the last sync (None: never synced)
        self.last_sync: Dict[str, Any] = {}  # what the last sync() sent and received (bytes)
        # commits made by this lineage of the state (every rank saves at the same commits; a
        # sync hands rank 0's count on): equal counts and steps mean the same commit, also for
        # a script whose optimizer steps are not counted, or survivors of a failure that struck
        # between one rank's save and another's
        self._commit_seq = 0
        self.save()

    def committed_snapshot(self) -> Dict[str, Any]:
        """The last commit's host copies, as :meth:`save` took them, for a checkpoint writer
        (:mod:`hvd_edl.checkpoint`): ``model`` and ``optimizer`` (state dicts on the host, or
        None), ``samplers`` (name -> sampler state), ``scalars`` (name -> value), ``steps``
        (optimizer steps counted at the commit).  The tensors are not copied again: a reader
        must not change them, and the next commit may reuse them unless the writer holds them
        (``checkpoint.writer().holds``)."""
        return {"model": self._saved_model, "optimizer": self._saved_optimizer,
                "samplers": dict(self._saved_samplers), "scalars": dict(self._saved_state),
                "steps": self._saved_steps}

    def elastic_samplers(self) -> Dict[str, ElasticSampler]:
        """The :class:`ElasticSampler` objects this state carries (keyword name -> sampler)."""
        return dict(self._samplers)

    def load_committed_scalars(self, scalars: Dict[str, Any]) -> None:
        """Set the committed values of this state's scalars named in ``scalars`` (a checkpoint's;
        names this state does not carry are ignored, others keep their value) and the
        attributes that show them."""
        for k in self._saved_state:
            if k in scalars:
                self._saved_state[k] = scalars[k]
        self._set_attrs()

    def save(self) -> None:
        super().save()
        self._commit_seq += 1
        pending: list = []
        copies: list = []
        # --checkpoint-dir: while a background write reads the last commit's buffers, this
        # commit copies into a second set, kept for the next time (see hvd_edl.checkpoint);
        # without it, writer is None and nothing else changes
        writer = checkpoint.writer()
        held = writer.holds if writer is not None else _held_by_nobody
        if self.model is not None:
            into = self._saved_model
            if held(into):
                into, self._spare_model = self._spare_model, into
            self._saved_model = _to_host(self.model.state_dict(), into, pending, copies)
        if self.optimizer is not None:
            into = self._saved_optimizer
            if held(into):
                into, self._spare_optimizer = self._spare_optimizer, into
            self._saved_optimizer = _to_host(self.optimizer.state_dict(), into, pending, copies)
        _copy_all(copies)
        for device in set(pending):  # the asynchronous device-to-host copies are done here
            torch.cuda.synchronize(device)
        self._saved_samplers = {k: s.state_dict() for k, s in self._samplers.items()}
        _note_progress(self._samplers)
        if writer is not None:
            writer.offer(self)  # rank 0, when a checkpoint is due: hands this commit over

    def restore(self) -> None:
        super().restore()
        if self.model is not None and self._saved_model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None and self._saved_optimizer is not None:
            self.optimizer.load_state_dict(_clone(self._saved_optimizer))
        for k, s in self._samplers.items():
            if k in self._saved_samplers:
                s.load_state_dict(self._saved_samplers[k])

    def sync(self) -> None:
        """Horovod's ``sync()``: every rank ends with rank 0's model, optimizer, scalars,
        samplers and step count, then resets its samplers to the new rank and world size.

        Under ``hvd-edl-run`` the tensors are streamed (:mod:`hvd_edl.state_stream`) only to
        the ranks that lack them: a member of the previous generation whose committed step
        equals rank 0's holds the same commit and receives only the small header (scalars,
        samplers, steps) and the model's buffers.  The header comes over the same connection
        from rank 0's listener, which the assignment names (:meth:`_sync_direct`: no Horovod
        collective at all), or, when rank 0 listens nowhere, in one ``broadcast_object``
        (:meth:`_sync_stream`).  Elsewhere, or with ``HVD_EDL_SYNC_STREAM=0``, one
        ``broadcast_object`` of everything, as before.  ``last_sync`` says what this rank sent
        and received and where the time went (:data:`SYNC_PARTS`, seconds).

        Raises:
            HorovodInternalError: a member failed (``state_stream.StreamError`` is one).
            hvd_edl.checkpoint.CheckpointError: no checkpoint the launcher named can be used.
        """
        from hvd_edl import runtime
        rt = runtime.get()
        from hvd_edl import step_timer
        t0 = time.monotonic()
        with step_timer.waiting():  # inside the training function: waiting, not compute
            if rt is None or not STREAM:
                stats = self._sync_broadcast(rt)
            elif rt.assignment is not None and rt.assignment.state_port > 0:
                stats = self._sync_direct(rt, self._held_step(rt))
            else:
                stats = self._sync_stream(rt, self._held_step(rt))
        stats["seconds"] = round(time.monotonic() - t0, 4)
        self.last_sync = stats
        if rt is not None:
            rt.sync_parts = {k: stats[k] for k in SYNC_PARTS if k in stats}
        self._synced_generation = rt.generation if rt is not None else 0
        log.info("state sync (%s): sent %d bytes to %d receivers, received %d bytes, %.3f s",
                 stats["mode"], stats["sent_bytes"], stats["receivers"],
                 stats["received_bytes"], stats["seconds"])

    def _held_step(self, rt) -> int:
        """The committed step this rank holds for the generation being synced, or -1: only a
        member of an earlier generation (a joiner never holds the state) at its first sync in
        this one (a second ``sync()`` call in one generation gets rank 0's state, as in
        Horovod), and none in a generation resumed from a checkpoint."""
        if self._synced_generation is None or self._synced_generation >= rt.generation:
            return -1
        if rt.assignment is not None and rt.assignment.restore_paths:
            return -1
        return int(rt.steps)

    def _header(self, rt) -> Dict[str, Any]:
        return {"scalars": {k: getattr(self, k) for k in self._saved_state},
                "samplers": {k: s.state_dict() for k, s in self._samplers.items()},
                "steps": rt.steps if rt is not None else 0,
                "commit_seq": self._commit_seq}

    def _sync_stream(self, rt, held: int) -> Dict[str, Any]:
        """Rank 0 streams the model and optimizer state to the ranks whose ``held`` step and
        commit count differ from its own (or either step is -1), and the model's buffers alone
        (batch-norm statistics: no collective keeps them equal across ranks, Horovod's sync
        hands rank 0's to everyone) to the others; every rank gets the header (scalars,
        samplers, steps, rank 0's held step, the skeleton) in one small ``broadcast_object``.
        Each rank decides itself what it lacks and asks rank 0's stream for that (nothing, the
        buffers or everything): no collective gathers who holds what (at 16 ranks on 2 cores
        one Horovod collective costs 22-50 ms of the switch: benchmarks/job/collectives.py)."""
        rank, size = _hvd.rank(), _hvd.size()
        t_start = time.monotonic()
        error = checkpoint.restore_into(self) if rank == 0 else None
        mine = [int(held), int(self._commit_seq)]
        header: Any = None
        server = None
        if rank == 0:
            if error is not None:  # every rank ends with the same clear error
                header = {"checkpoint_error": error}
            else:
                header = self._header(rt)
                header["held"] = mine
                if size > 1:
                    buffers, params, optimizer = self._state_to_send()
                    skeletons, tensors, ends = state_stream.split(buffers, params, optimizer)
                    server = state_stream.StreamServer(tensors, state_stream.transfer_address(),
                                                       prefix=ends[0])
                    header["endpoint"] = server.endpoint()
                    header["state"] = skeletons
        t_header = time.monotonic()
        try:
            header = _broadcasts.broadcast_object(header, root_rank=0, name="hvd_edl.sync")
        except BaseException:
            if server is not None:
                server.close()
            raise
        header_s = time.monotonic() - t_header
        skeleton_s = t_header - t_start
        if header.get("checkpoint_error"):
            raise checkpoint.CheckpointError(header["checkpoint_error"])
        root = header["held"]
        lacks = rank != 0 and state_stream.lacks(root, mine)
        sent = received = receivers = 0
        t0 = time.monotonic()
        load = None
        if server is not None:
            sent = server.serve(size - 1)  # every other rank connects, asking for what it lacks
            receivers = server.receivers
        elif rank != 0 and "endpoint" in header:
            if lacks:
                dests, load = self._destinations(header["state"])
            elif header["endpoint"]["prefix_nbytes"] > 0:
                dests, load = self._buffer_destinations(header["state"][0])
            t1 = time.monotonic()
            skeleton_s += t1 - t0
            t0 = t1
            if load is None:
                state_stream.decline(header["endpoint"])
            else:
                received = state_stream.receive(header["endpoint"], dests,
                                                prefix=not lacks)
        transfer_s = time.monotonic() - t0
        load_s = self._take(rt, rank, header, load)
        return {"mode": "stream", "header": "broadcast", "sent_bytes": sent,
                "received_bytes": received, "receivers": receivers, "held": not lacks,
                "header_s": round(header_s, 4),
                "skeleton_s": round(skeleton_s, 4), "transfer_s": round(transfer_s, 4),
                "load_s": round(load_s, 4)}

    def _sync_direct(self, rt, held: int) -> Dict[str, Any]:
        """The sync without any collective: rank 0 serves the header and the tensors on this
        process's listener (:class:`state_stream.HeaderStreamServer`), which the assignment
        names to every member with a per-generation token; each other rank connects at once
        after ``hvd.init()``, says which (step, commit count) it holds, and gets the header
        with what it lacks (everything, the model's buffers, or nothing), chosen by rank 0 as
        :meth:`_sync_stream` chooses it.  Every wait is one socket operation bounded by
        ``HVD_EDL_STREAM_TIMEOUT_S`` and ended at once by ``state_stream.release()``; rank 0
        dying mid-sync fails the receivers' connections (``StreamError``), and the next
        generation syncs from its own rank 0 (every member still holds its commit)."""
        a = rt.assignment
        rank, size = _hvd.rank(), _hvd.size()
        rt.syncs += 1
        keys = state_stream.sync_keys(rt.secret, a.state_token, rt.syncs)
        mine = (int(held), int(self._commit_seq))
        sent = received = receivers = 0
        t0 = time.monotonic()
        header_s = transfer_s = 0.0
        load = None
        lacks = False
        if rank == 0:
            error = checkpoint.restore_into(self)
            tensors, ends = [], [0]
            if error is not None:  # every rank ends with the same clear error
                header = {"checkpoint_error": error}
            else:
                header = self._header(rt)
                header["held"] = list(mine)
                if size > 1:
                    buffers, params, optimizer = self._state_to_send()
                    header["state"], tensors, ends = state_stream.split(buffers, params,
                                                                        optimizer)
            skeleton_s = time.monotonic() - t0
            t1 = time.monotonic()
            if size > 1:
                listener = state_stream.listener()
                if listener is None or listener.port != a.state_port:
                    raise state_stream.StreamError(
                        "state stream: the assignment names a listener this rank 0 lacks")
                server = state_stream.HeaderStreamServer(
                    tensors, listener, keys,
                    state_stream.sync_keys(rt.secret, a.state_token, rt.syncs + 1)[0],
                    header, mine, prefix=ends[0])
                sent = server.serve(size - 1)
                receivers = server.receivers
            transfer_s = time.monotonic() - t1
            if error is not None:
                raise checkpoint.CheckpointError(error)
        else:
            def destinations(header, part):
                nonlocal load
                if part == b"A":
                    dests, load = self._destinations(header["state"])
                elif part == b"P":
                    dests, load = self._buffer_destinations(header["state"][0])
                else:
                    dests = []
                return dests

            got = state_stream.fetch(a.state_addr, a.state_port, keys, mine, destinations)
            header = got["header"]
            if header.get("checkpoint_error"):
                raise checkpoint.CheckpointError(header["checkpoint_error"])
            received = got["received_bytes"]
            lacks = got["part"] == b"A"
            header_s, skeleton_s, transfer_s = (got["header_s"], got["skeleton_s"],
                                                got["transfer_s"])
        load_s = self._take(rt, rank, header, load)
        return {"mode": "stream", "header": "stream", "sent_bytes": sent, "received_bytes": received,
                "receivers": receivers, "held": not lacks, "header_s": round(header_s, 4),
                "skeleton_s": round(skeleton_s, 4), "transfer_s": round(transfer_s, 4),
                "load_s": round(load_s, 4)}

    def _take(self, rt, rank: int, header: Dict[str, Any], load) -> float:
        """The end of a streamed sync on every rank: load the received tensors (``load``, or
        None when nothing came), the header's scalars (not on rank 0, whose they are) and the
        samplers, then commit.  Returns the seconds it took (the sync's ``load_s``)."""
        t0 = time.monotonic()
        if load is not None:
            load()
        if rank != 0:
            self._load_header(rt, header)
        for k, s in self._samplers.items():
            s.load_state_dict(header["samplers"][k])  # also resets to the new rank/size
        self.save()
        return time.monotonic() - t0

    def _state_to_send(self):
        """Rank 0's (buffers, parameters, optimizer state) as host tensors: buffers and
        parameters are the two halves of the model's ``state_dict()`` (both keep its
        ``_metadata``); the live state when it is all in host memory (nothing copied), else the
        commit's pinned host buffers after a fresh ``save()`` (CUDA tensors)."""
        model = self.model.state_dict() if self.model is not None else None
        optimizer = self.optimizer.state_dict() if self.optimizer is not None else None
        if _any_device_tensor((model, optimizer)):
            self.save()
            model = self._saved_model if self.model is not None else None
            optimizer = self._saved_optimizer if self.optimizer is not None else None
        buffers, params = self._halves(model)
        return buffers, params, optimizer

    def _halves(self, model_state):
        """``model_state`` (a ``state_dict()``) as (buffers and other entries, parameters)."""
        if model_state is None:
            return None, None
        names = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        buffers, params = copy.copy(model_state), copy.copy(model_state)
        for k in model_state:
            del (params if k not in names else buffers)[k]
        return buffers, params

    def _destinations(self, skeletons):
        """Where rank 0's tensors go: this rank's own (parameters, buffers, optimizer state
        where they fit; for a joiner also its commit buffers, pinned for CUDA models), fresh
        tensors otherwise.  Returns (the tensors in stream order, a function that loads them
        once received)."""
        live = self._own(self.model.state_dict() if self.model is not None else None,
                         self.optimizer.state_dict() if self.optimizer is not None else None)
        candidates = [live]
        if self._synced_generation is None:  # a joiner: its commit holds nothing to keep
            candidates.append(self._own(self._saved_model, self._saved_optimizer))
        (buffers, params, optimizer), dests = state_stream.fill(
            tuple(skeletons), *candidates, pin=_any_device_tensor(live))

        def load():
            if self.model is not None:
                model_state = copy.copy(buffers)
                model_state.update(params)
                self.model.load_state_dict(model_state)  # its own tensors: nothing copied
            if self.optimizer is not None:
                self.optimizer.load_state_dict(optimizer)
        return dests, load

    def _buffer_destinations(self, skeleton):
        """A member holding the commit: rank 0's model buffers (the stream's prefix) go into
        its own.  Returns (the tensors, a function that loads them once received)."""
        live = self._halves(self.model.state_dict())[0] if self.model is not None else None
        buffers, dests = state_stream.fill(skeleton, live)
        return dests, lambda: self.model.load_state_dict(buffers, strict=False)

    def _own(self, model_state, optimizer_state):
        buffers, params = self._halves(model_state)
        return (buffers, params, optimizer_state)

    def _load_header(self, rt, header: Dict[str, Any]) -> None:
        self._saved_state = header["scalars"]
        self._set_attrs()
        self._commit_seq = header.get("commit_seq", self._commit_seq)
        if rt is not None:
            rt.steps = header["steps"]

    def _sync_broadcast(self, rt) -> Dict[str, Any]:
        """The fallback (outside ``hvd-edl-run``, where no address for a transfer is known, or
        ``HVD_EDL_SYNC_STREAM=0``): everything from rank 0 in one ``broadcast_object`` (two
        collectives: size and payload) to every rank."""
        payload = None
        rank = _hvd.rank()
        if rank == 0:
            # a generation without any holder of the state: rank 0 loads the newest good
            # checkpoint the launcher named, then broadcasts it like any state
            error = checkpoint.restore_into(self)
            payload = dict(self._header(rt), **{
                "model": self.model.state_dict() if self.model is not None else None,
                "optimizer": (self.optimizer.state_dict()
                              if self.optimizer is not None else None)})
            if error is not None:  # every rank ends with the same clear error
                payload = {"checkpoint_error": error}
        payload = _broadcasts.broadcast_object(payload, root_rank=0, name="hvd_edl.sync")
        if payload.get("checkpoint_error"):
            raise checkpoint.CheckpointError(payload["checkpoint_error"])
        if rank != 0:
            if self.model is not None:
                self.model.load_state_dict(payload["model"])
            if self.optimizer is not None:
                self.optimizer.load_state_dict(payload["optimizer"])
            self._load_header(rt, payload)
        for k, s in self._samplers.items():
            s.load_state_dict(payload["samplers"][k])  # also resets to the new rank/size
        self.save()
        return {"mode": "broadcast", "sent_bytes": 0, "received_bytes": 0,
                "receivers": _hvd.size() - 1 if rank == 0 else 0, "held": rank == 0}

    def audit_resume(self) -> None:
        ledger = audit.ledger()
        if ledger is None:
            return
        if not self._samplers:
            super().audit_resume()
        for k, s in self._samplers.items():
            ledger.write("sync", sampler=k, epoch=s.epoch, consumed=s.consumed,
                         **runtime.position())

    def reset(self) -> None:
        for s in self._samplers.values():
            s.reset()

    def __setattr__(self, name, value):
        samplers = self.__dict__.get("_samplers")
        if samplers is not None and isinstance(value, ElasticSampler):
            value.name = name
            samplers[name] = value
        super().__setattr__(name, value)
