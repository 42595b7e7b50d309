"""A Horovod script's ``hvd.broadcast_object`` (Horovod's docs: rank 0's object on every rank),
with ``import hvd_edl.torch as hvd``: a small object, pickles just under, at and just over the
first broadcast's room (``BROADCAST_HEAD_BYTES - 8``), and 3 MB.  Every rank starts from its own
objects and prints one line per object: ``<name> <sha256 of the result's pickle>``, then
``done <rank> <size>``."""
import hashlib
import pickle

import hvd_edl.torch as hvd
from hvd_edl.torch import BROADCAST_HEAD_BYTES

hvd.init()
me = hvd.rank()


def blob(n: int) -> bytes:
    """bytes whose pickle is exactly ``n`` bytes long (protocol 4, what cloudpickle uses)."""
    b = bytes([me % 251]) * n
    while len(pickle.dumps(b, protocol=4)) > n:
        b = b[:-1]
    return b


room = BROADCAST_HEAD_BYTES - 8
objects = {"small": {"rank": me, "lr": 0.1 * (me + 1), "name": f"r{me}"},
           "under": blob(room - 1), "exact": blob(room), "over": blob(room + 1),
           "large": [me] * 400_000}
for name, obj in objects.items():
    got = hvd.broadcast_object(obj, root_rank=0, name=f"bo.{name}")
    print(name, hashlib.sha256(pickle.dumps(got, protocol=4)).hexdigest(), flush=True)
print("done", me, hvd.size(), flush=True)
