"""The training loop of the tests' small elastic workers (test_state_stream.py and
test_stream_security.py, run as ``--worker``)."""
from __future__ import annotations

import os
import time


def train_until_stopped(hvd, state, model, optimizer, stop: str, features: int) -> None:
    """Steps on 8 random rows ``features`` wide, each counted in ``state.batch`` and committed
    (0.02 s apart); every 5 batches the ranks agree (a Max allreduce) whether the file ``stop``
    exists, and return once it does.  Call it inside ``hvd.elastic.run``."""
    import torch
    while True:
        optimizer.zero_grad()
        model(torch.randn(8, features)).pow(2).mean().backward()
        optimizer.step()
        state.batch += 1
        time.sleep(0.02)
        state.commit()
        flag = torch.tensor([1 if os.path.exists(stop) else 0], dtype=torch.int32)
        if state.batch % 5 == 0 and hvd.allreduce(flag, op=hvd.Max, name="stop")[0] > 0:
            return
