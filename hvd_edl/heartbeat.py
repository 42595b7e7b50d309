"""The worker's heartbeat: what lets the coordinator tell a silent peer from a busy one.

A daemon thread posts ``POST /beat`` (:class:`hvd_edl.messages.Beat`) every
:data:`hvd_edl.messages.BEAT_S` seconds on its own connection, off the training thread: a worker
computing a long step, syncing its state or blocked in a collective still beats; a frozen
process, a vanished host or a host cut off from the launcher does not (the coordinator's side
is ``launcher/job/liveness.py``).  The answer carries the coordinator's decisions:

* ``release``: a member of this worker's generation was declared dead, or died: the worker
  shuts down the sockets of that ring (or of the ring it is setting up), so a collective or a
  ``hvd.init()`` blocked on the lost member fails now with the error Horovod recovers from,
  instead of after Gloo's timeout (30 s);
* ``fenced``: this worker was declared dead (it may have been frozen, or cut off): it exits at
  once, before it could touch any later ring.

A beat that gets no answer is not retried: the next one follows ``BEAT_S`` later.  When the
launcher is gone, the watcher thread (``hvd_edl.runtime``) ends the process.
"""
from __future__ import annotations

import logging
import threading
import time

from hvd_edl import adaptive_batch, gradient_noise, messages
from hvd_edl.client import CoordinatorClient, CoordinatorUnreachable

log = logging.getLogger(__name__)


class Heartbeat:
    """Beats for ``rt`` (a :class:`hvd_edl.runtime.WorkerRuntime`) until the process ends.

    Args:
        rt: the runtime: its ``worker_id``, ``beat_generation()``, ``steps``, ``timer``,
            ``release_ring(generation)`` and ``fenced()`` are used.
        client: a client of the coordinator (one attempt per request: ``retry_s`` 0).
        period_s: seconds between beats.
    """

    def __init__(self, rt, client: CoordinatorClient, period_s: float = messages.BEAT_S):
        self.rt = rt
        self.client = client
        self.period_s = period_s
        self._released = set()
        self._thread = threading.Thread(target=self._run, name="hvd_edl-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        next_at = time.monotonic()
        while True:
            generation = self.rt.beat_generation()
            mark, (steps, compute_s, wait_s, samples) = self.rt.timer.take()
            try:
                reply = self.client.post(
                    "/beat", messages.Beat(self.rt.worker_id, generation, self.rt.steps,
                                           steps, compute_s, wait_s, samples,
                                           noise=_noise(), batch=adaptive_batch.published()),
                    messages.BeatReply, timeout_s=max(1.0, 4 * self.period_s))
            except (CoordinatorUnreachable, RuntimeError) as e:
                log.debug("heartbeat of %s not answered: %s", self.rt.worker_id, e)
            else:
                self.rt.timer.sent(mark)
                if reply.beat_s > 0:  # the launcher's period for the job's size (at most 60 s)
                    self.period_s = min(float(reply.beat_s), 60.0)
                if reply.fenced:
                    self.rt.fenced()
                    return
                if reply.release and generation and generation not in self._released:
                    if self.rt.release_ring(generation):  # else: asked again at the next beat
                        self._released.add(generation)
            next_at = max(next_at + self.period_s, time.monotonic())
            time.sleep(max(0.0, next_at - time.monotonic()))


def _noise() -> dict:
    """The process's latest gradient noise estimate as the beat carries it ({} before any)."""
    est = gradient_noise.published()
    return {} if est is None else est.as_dict()
