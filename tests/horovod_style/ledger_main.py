"""A Horovod elastic script written from Horovod's documented API (``hvd.elastic.run``,
``TorchState``, ``ElasticSampler``, ``record_batch`` after every batch, ``commit`` every few),
one import changed, that ends the way real scripts end: each rank runs code after the training
function (a line in ``--done-log``, then ``--post-s`` seconds of work), and the faults of issue
26 can be injected by worker id (the launcher's ``HVD_EDL_WORKER_ID``: stable for a process's
life, unlike its rank):

* ``--freeze-after W:S``: worker W stops itself (SIGSTOP) for S seconds once its training
  function returned (its interpreter's teardown on a loaded machine: no heartbeat);
* ``--exit0-at W:N``: worker W calls ``sys.exit(0)`` after its N-th batch (a script's own exit
  in the middle of training);
* ``--step-log F``: one line per batch and process, its unix time (when did the job train);
* ``--stop-file F``: train up to ``--epochs`` epochs, but end at the first epoch's end after F
  exists (the ranks agree with one allreduce).

Run under ``HVD_EDL_AUDIT_DIR`` the elastic sampler keeps the audit ledger (exactly-once)."""
import argparse
import hashlib
import json
import os
import queue
import socket
import signal
import subprocess
import sys
import threading
import time

import torch

import hvd_edl.torch as hvd   # instead of: import horovod.torch as hvd

p = argparse.ArgumentParser()
p.add_argument("--dataset-size", type=int, default=512)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--commit-every", type=int, default=4)
p.add_argument("--step-delay", type=float, default=0.0)
p.add_argument("--busy-s", type=float, default=0.0,
               help="CPU seconds of work per step (a busy loop: under a CPU quota its wall time "
                    "stretches, as a slower GPU type's step does)")
p.add_argument("--device-dir", default="",
               help="run --busy-s in one thread of its own, the emulated GPU: it announces itself "
                    "as DIR/<hostname>.<thread id> and waits (60 s) until its CPU cgroup changed "
                    "(benchmarks/cluster/transient_real.py moves it under its type's CPU quota), so "
                    "a type's quota slows the device's work, not the imports or the ring")
p.add_argument("--done-log", required=True)
p.add_argument("--post-s", default="", help="RANK:SECONDS,...: work after training, by rank")
p.add_argument("--freeze-after", default="")
p.add_argument("--exit0-at", default="")
p.add_argument("--stop-file", default="", help="end at the next epoch's end once this exists")
p.add_argument("--step-log", default="", help="append each batch's unix time here (progress)")
p.add_argument("--linger-s", type=float, default=0.0,
               help="the process stays this long in its teardown (a GPU's memory released late)")
p.add_argument("--child-linger-s", type=float, default=0.0,
               help="start a helper process (as a data loader's worker) that outlives this one "
                    "by this long, even when this one is SIGKILLed (PR_SET_PDEATHSIG spares it)")
args = p.parse_args()
me = os.environ.get("HVD_EDL_WORKER_ID", "")


def busy(seconds):
    """``seconds`` of this thread's CPU time (hashing releases the GIL, so that a device thread
    throttled by its quota does not hold the heartbeats back)."""
    block = bytes(1 << 14)
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        hashlib.sha256(block).digest()


class Device:
    """The emulated GPU (``--device-dir``): one thread that does each step's busy work while the
    step waits for it, as a step waits for its kernels."""

    def __init__(self, folder):
        self.work, self.done = queue.Queue(), queue.Queue()
        self.folder, self.host = folder, socket.gethostname()
        threading.Thread(target=self._serve, daemon=True, name="emulated-gpu").start()
        ready = self.done.get(timeout=90)
        if ready is not True:
            raise RuntimeError(f"--device-dir: {ready}")

    def _serve(self):
        tid = threading.get_native_id()
        where = f"/proc/self/task/{tid}/cgroup"
        with open(where) as f:
            before = f.read()
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, f"{self.host}.{tid}"), "w") as f:
            f.write(str(os.getpid()))
        deadline = time.monotonic() + 60
        while True:
            with open(where) as f:
                if f.read() != before:
                    break
            if time.monotonic() > deadline:
                self.done.put(f"thread {tid} on {self.host} was not moved to a cgroup in 60 s")
                return
            time.sleep(0.05)
        self.done.put(True)
        while True:
            busy(self.work.get())
            self.done.put(None)

    def run(self, seconds):
        self.work.put(seconds)
        self.done.get(timeout=600)

hvd.init()
device = Device(args.device_dir) if args.device_dir and args.busy_s else None
if args.child_linger_s > 0:  # inherits this process's environment (its GPU, its run's marker)
    subprocess.Popen([sys.executable, "-c", "import os, sys, time\nparent = int(sys.argv[1])\n"
                      "while os.getppid() == parent: time.sleep(0.05)\n"
                      "time.sleep(float(sys.argv[2]))", str(os.getpid()),
                      str(args.child_linger_s)], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
if args.linger_s > 0:
    import atexit
    atexit.register(time.sleep, args.linger_s)
torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(args.dataset_size, 4),
                                      torch.randn(args.dataset_size, 1))
sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=1)
loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, sampler=sampler)
model = torch.nn.Linear(4, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
batches = 0  # this process's batches, never rolled back
step_log = os.open(args.step_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT) if args.step_log \
    else None


@hvd.elastic.run
def train(state):
    global batches
    while state.epoch < args.epochs:
        for batch_idx, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            state.sampler.record_batch(batch_idx, args.batch_size)
            batches += 1
            if step_log is not None:
                os.write(step_log, f"{time.time():.3f}\n".encode())
            who, _, n = args.exit0_at.partition(":")
            if who == me and batches == int(n):
                sys.exit(0)
            if args.step_delay:
                time.sleep(args.step_delay)
            if device is not None:
                device.run(args.busy_s)
            elif args.busy_s:
                busy(args.busy_s)
            if batch_idx % args.commit_every == 0:
                state.commit()
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()
        if args.stop_file:  # every rank stops at the same epoch's end
            flag = torch.tensor([1.0 if os.path.exists(args.stop_file) else 0.0])
            if hvd.allreduce(flag, op=hvd.Max, name="stop").item() > 0:
                break


train(state)
with open(args.done_log, "a") as f:  # the script's code after training: once per rank
    f.write(json.dumps({"worker": me, "rank": hvd.rank(), "size": hvd.size(),
                        "epoch": state.epoch}) + "\n")
who, _, s = args.freeze_after.partition(":")
if who == me:
    subprocess.Popen(["sh", "-c", f"sleep {float(s)}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)
post = dict(item.split(":") for item in args.post_s.split(",") if item)
time.sleep(float(post.get(str(hvd.rank()), 0)))
