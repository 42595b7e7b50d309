"""Worker records and their life cycle: one enum, one place where transitions are checked."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional


class WorkerState(enum.Enum):
    """Life of a worker process, as the coordinator sees it.

    Transitions (anything else is a bug):
      PENDING -> READY      the script entered ``hvd.elastic.run`` (or a static worker started)
      READY   -> MEMBER     a generation including it was formed
      MEMBER  -> LEAVING    its host left discovery / its slot shrank: leave at the next boundary
      any     -> EXITED     the process exited with code 0
      any     -> DEAD       the process crashed, was killed, or was dropped (start timeout)
    """
    PENDING = "pending"
    READY = "ready"
    MEMBER = "member"
    LEAVING = "leaving"
    EXITED = "exited"
    DEAD = "dead"

    @property
    def alive(self) -> bool:
        return self not in (WorkerState.EXITED, WorkerState.DEAD)


_ALLOWED = {
    WorkerState.PENDING: {WorkerState.READY, WorkerState.LEAVING},
    WorkerState.READY: {WorkerState.MEMBER, WorkerState.LEAVING},
    WorkerState.MEMBER: {WorkerState.LEAVING},
    WorkerState.LEAVING: set(),
    WorkerState.EXITED: set(),
    WorkerState.DEAD: set(),
}


@dataclass
class WorkerRecord:
    """One worker process.  ``slot`` is its local rank on ``host`` (stable for its life);
    ``order`` its spawn sequence number (older members get lower ranks)."""
    worker_id: str
    host: str
    slot: int
    order: int
    spawned_at: float
    initial: bool = False
    state: WorkerState = WorkerState.PENDING
    ready_at: Optional[float] = None
    rank: Optional[int] = None
    exit_code: Optional[int] = None
    fenced: bool = False  # declared dead by the coordinator (silent); never a member again
    # fenced, and the driver has not yet rested its slot: the slot counts as taken meanwhile
    fence_pending: bool = False
    elastic_run: bool = False  # its script entered hvd.elastic.run (messages.Ready)
    finished: bool = False  # its training function returned (messages.Finished): training over
    exiting: bool = False  # its interpreter is ending (messages.Exiting): silence is no fault
    stream_addr: str = ""  # where it listens for the state syncs it serves as rank 0
    stream_port: int = 0   # (messages.Register; 0: nowhere)
    gpu: Optional[str] = None  # the GPU its host line gave its slot at spawn (gpus=), if any
    handle: Any = field(default=None, repr=False)

    def move(self, new: WorkerState) -> None:
        """Apply a transition; EXITED and DEAD are reachable from any live state.

        Raises:
            ValueError: a transition the life cycle does not have.
        """
        if new in (WorkerState.EXITED, WorkerState.DEAD):
            if self.state.alive:
                self.state = new
            return
        if new not in _ALLOWED[self.state]:
            raise ValueError(f"{self.worker_id}: {self.state.value} -> {new.value} not allowed")
        self.state = new

    @property
    def label(self) -> str:
        return f"{self.worker_id}@{self.host}:{self.slot}"
