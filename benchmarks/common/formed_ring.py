"""A real ``Coordinator`` whose generation 1 (w1, w2 on localhost) is formed without Gloo: what
the coordinator's unit tests and the heartbeat benchmark (``benchmarks/job/beat_cost.py``) drive,
in one process, with no worker and no rendezvous server."""
from __future__ import annotations

from hvd_edl import messages
from launcher.job.coordinator import Coordinator
from launcher.job.registry import WorkerRecord
from launcher.observe.events import EventLog


class NoRingRendezvous:
    """The coordinator's view of a rendezvous, with nothing behind it: a generation is opened
    and aborted, and no ring is ever initialised."""

    def open(self, generation, hosts=(), **kwargs):
        return 1

    def token(self, generation):
        return "token"

    def abort(self, generation):
        pass

    def close(self):
        pass


def ring_of_two(max_np: int = 4, elastic_run: bool = False, events=None,
                rendezvous=None) -> Coordinator:
    """A coordinator (``--min-np 1 --max-np max_np``, elastic) whose generation 1 is w1 (rank 0)
    and w2 (rank 1) on localhost, both ready (``elastic_run``: they run under
    ``hvd.elastic.run``); events to ``events`` (default: none kept), rendezvous
    :class:`NoRingRendezvous` unless given."""
    coord = Coordinator(min_np=1, max_np=max_np, elastic=True, events=events or EventLog(None),
                        rendezvous=rendezvous or NoRingRendezvous(),
                        rendezvous_addr="127.0.0.1")
    for i in (1, 2):
        coord.add_worker(WorkerRecord(f"w{i}", "localhost", i - 1, i, 0.0, initial=True))
    for i in (1, 2):
        coord.ready(messages.Ready(f"w{i}", elastic_run=elastic_run))
    return coord
