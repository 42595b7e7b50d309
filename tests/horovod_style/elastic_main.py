"""A Horovod elastic training script written against Horovod's documented API, with one import
changed (``import hvd_edl.torch as hvd``).  It follows the pattern of Horovod's own integration
script (test/integration/data/elastic_torch_main.py: a tiny model, ``state.batch`` and
``state.epoch`` counters, commits every ``--batches-per-commit`` batches, an exit schedule that
makes chosen ranks raise or kill themselves, one JSON line per epoch written by rank 0), and adds
what Horovod users also do:

* ``--dataset-size N``: train over an ``ElasticSampler`` of N samples (tracked by ``TorchState``),
  calling ``record_batch`` with ``--record-index`` ``enumerate`` (the loader's index), ``zero``
  (a constant) or ``global`` (a step counter kept across resets); Horovod ignores the index;
* ``--env-file F``: append the ``HOROVOD_*`` variables as the script sees them right after
  start, right after ``hvd.init()`` and after each (re-)entry into the elastic function.

With ``--discovery-wait`` > 0 Horovod's script makes rank 0 wait at an epoch's end, when the
schedule changes the hosts, until the driver has notified it, by polling
``state._host_messages``, Horovod's *private* queue of driver notifications.  hvd_edl has no
such queue; this script polls the equivalent, ``hvd_edl.runtime.get().change_pending()`` (the
runtime's "the coordinator wants a switch" flag), which is not part of Horovod's API either.
"""
import argparse
import json
import os
import time

import psutil
import torch
import torch.nn.functional as F

ENV_NAMES = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
             "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME",
             "CUDA_VISIBLE_DEVICES")

parser = argparse.ArgumentParser(description="Horovod-style elastic test script")
parser.add_argument("--batches-per-epoch", type=int, default=10)
parser.add_argument("--batches-per-commit", type=int, default=1)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--epoch-wait", type=float, default=0)
parser.add_argument("--step-delay", type=float, default=0)
parser.add_argument("--logfile", required=True)
parser.add_argument("--exit-schedule", default="{}")
parser.add_argument("--exit-mode", default="exception", choices=["exception", "kill"])
parser.add_argument("--discovery-wait", type=int, default=0,
                    help="seconds rank 0 waits at an epoch's end for the driver to notice a "
                         "scheduled host change (0: do not wait)")
parser.add_argument("--discovery-schedule", default="[]")
parser.add_argument("--dataset-size", type=int, default=0)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--record-index", default="enumerate", choices=["enumerate", "zero", "global"])
parser.add_argument("--env-file", default=None)
parser.add_argument("--broadcast-at-start", action="store_true",
                    help="hvd.broadcast_parameters / broadcast_optimizer_state at the top level, "
                         "as static Horovod scripts do")
parser.add_argument("--commit-log", default=None,
                    help="rank 0 appends the wall-clock time of each commit here")
parser.add_argument("--stop-file", default=None,
                    help="with --epochs 0: train until this file exists (then to the epoch end, "
                         "without --step-delay: the delay paces training for a test's changes, "
                         "and none come once the file exists)")
args = parser.parse_args()


def dump_env(when):
    if args.env_file:
        record = {"when": when, "pid": os.getpid(), **{k: os.environ.get(k) for k in ENV_NAMES}}
        with open(args.env_file, "a") as f:
            f.write(json.dumps(record) + "\n")


dump_env("spawn")
import hvd_edl.torch as hvd  # noqa: E402 - the one line changed from `import horovod.torch as hvd`
from hvd_edl import runtime as _runtime  # noqa: E402 - only for --discovery-wait

hvd.init()
dump_env("init")

torch.manual_seed(0)
batch_size = 32
data = torch.randn(batch_size, 2)
target = torch.LongTensor(batch_size).random_() % 2

lr = 0.001
model = torch.nn.Sequential(torch.nn.Linear(2, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size())
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

if args.broadcast_at_start:
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

hostname = os.environ.get("HOROVOD_HOSTNAME")
start_rank = int(os.environ.get("HOROVOD_RANK", 0))
exit_schedule = json.loads(args.exit_schedule) if args.exit_schedule else {}
discovery_schedule = json.loads(args.discovery_schedule)
epoch_to_hosts = {epoch: hosts for epoch, hosts in discovery_schedule if epoch is not None}
default_hosts = discovery_schedule[-1][1] if discovery_schedule else []

sampler = loader = None
if args.dataset_size:
    dataset = torch.utils.data.TensorDataset(torch.arange(args.dataset_size))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)


def check_exit(epoch, batch):
    ranks_to_exit = exit_schedule.get(str((epoch, batch)), [])
    if start_rank in ranks_to_exit:
        if args.exit_mode == "exception":
            raise RuntimeError(f"check_rank and exit epoch={epoch} batch={batch} "
                               f"start_rank={start_rank} rank={hvd.rank()}")
        psutil.Process(os.getpid()).kill()


def log_state(state):
    record = {"epoch": state.epoch, "batch": state.batch, "commits": state.commits,
              "hostname": hostname, "start_rank": start_rank, "rank": hvd.rank(),
              "size": hvd.size(), "rendezvous": state.rendezvous}
    with open(args.logfile, "a") as f:
        f.write(json.dumps(record) + os.linesep)


def one_step(state, batch_idx):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()
    if sampler is not None:  # after the step, before its commit (Horovod's documented order)
        index = {"enumerate": batch_idx, "zero": 0,
                 "global": state.global_step}[args.record_index]
        state.sampler.record_batch(index, args.batch_size)
        state.global_step += 1
    if args.step_delay and not stop_asked():
        time.sleep(args.step_delay)
    state.batch += 1
    if state.batch % args.batches_per_commit == 0:
        state.commits += 1
        commit(state)


def commit(state):
    if args.commit_log and hvd.rank() == 0:
        with open(args.commit_log, "a") as f:
            f.write(f"{time.time()}\n")
    state.commit()


def batches(state):
    """The epoch's batches: a fixed count (Horovod's script), or the sampler's loader."""
    if loader is None:
        while state.batch < args.batches_per_epoch:
            yield state.batch
        return
    for batch_idx, _ in enumerate(loader):
        yield batch_idx


_stop_seen = []


def stop_asked():
    """``--stop-file`` exists (remembered once seen)."""
    if not _stop_seen and args.stop_file and os.path.exists(args.stop_file):
        _stop_seen.append(True)
    return bool(_stop_seen)


def more_epochs(state):
    if args.epochs:
        return state.epoch < args.epochs
    return not stop_asked()


@hvd.elastic.run
def train(state):
    state.rendezvous += 1
    dump_env("joined")
    while more_epochs(state):
        for batch_idx in batches(state):
            check_exit(state.epoch, state.batch)
            one_step(state, batch_idx)
        if hvd.rank() == 0:
            log_state(state)
            current_hosts = epoch_to_hosts.get(state.epoch, default_hosts)
            next_hosts = epoch_to_hosts.get(state.epoch + 1, default_hosts)
            if args.discovery_wait > 0 and current_hosts != next_hosts:
                # Horovod's script polls its private ``state._host_messages`` here; the
                # hvd_edl equivalent is the runtime's "a switch is wanted" flag
                print(f"host changes: {current_hosts} -> {next_hosts}")
                deadline = time.monotonic() + args.discovery_wait
                while not _runtime.get().change_pending():
                    if time.monotonic() > deadline:
                        raise TimeoutError("Timed out waiting for notifications from driver.")
                    time.sleep(0.05)
        if args.epoch_wait > 0:
            time.sleep(args.epoch_wait)
        state.epoch += 1
        state.batch = 0
        if sampler is not None:
            state.sampler.set_epoch(state.epoch)
        state.commits += 1
        commit(state)


def on_state_reset():
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr * hvd.size()


extra = {"sampler": sampler} if sampler is not None else {}
state = hvd.elastic.TorchState(model, optimizer, batch=0, epoch=0, commits=0, rendezvous=0,
                               global_step=0, **extra)
state.register_reset_callbacks([on_state_reset])
train(state)
