"""The main job: a small CNN on scikit-learn's handwritten digits, elastic with Horovod's API.

Real data shipped with scikit-learn (1,797 8x8 images, no download; read without importing
scikit-learn); a fixed-seed, stratified 75/25 train/test split.  It is a plain Horovod elastic
script: only the import differs.

    hvd-edl-run -np 2 python examples/train_digits.py --summary s.json
    hvd-edl-run -np 2 --min-np 1 --max-np 4 --host-discovery-script ./d.sh \\
        python examples/train_digits.py --build-delay 8

``--summary PATH`` writes {"test_accuracy", "world_size", "steps", "epochs", "wall_s",
"param_spread"} (param_spread: the largest difference of a parameter across ranks, 0 when the
ranks agree, as data parallelism requires).
"""
import argparse
import gzip
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import hvd_edl.torch as hvd


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--global-batch-size", type=int,
                   help="fixed samples per step, split over the ranks (ElasticBatchSampler): "
                   "the run then does not depend on the world size; replaces --batch-size")
    p.add_argument("--adaptive-batch", action="store_true",
                   help="opt in to an adaptive global batch (hvd.elastic.AdaptiveBatchSampler "
                   "and hvd.AdaptiveOptimizer; docs/adaptive_batch.md): starts at "
                   "--global-batch-size (default 32), may change at a switch "
                   "between it and --max-batch")
    p.add_argument("--max-batch", type=int, help="adaptive batch: largest global batch "
                   "(default 32 x the initial)")
    p.add_argument("--max-local-batch", type=int, help="adaptive batch: most samples a rank "
                   "computes at once (larger shares are accumulated)")
    p.add_argument("--lr-rule", default="adascale", choices=("adascale", "sqrt", "linear", "none"),
                   help="adaptive batch: how the learning rate follows it (default adascale)")
    p.add_argument("--model", choices=("small", "large"), default="small",
                   help="small: the digits CNN (16/32 channels, 64 hidden); large: 64/128 "
                   "channels, 256 hidden (about 14x the parameters, 10x the compute)")
    p.add_argument("--target-accuracy", type=float,
                   help="end training at the first epoch whose test accuracy (rank 0's, on "
                   "the whole test split) reaches this (all ranks agree through one allreduce)")
    p.add_argument("--accuracy-log", help="rank 0 appends one JSON line per epoch: time, "
                   "epoch, step, test accuracy, world size, global batch, gradient noise, lr "
                   "factor (benchmarks/job/adaptive_batch_tta.py)")
    p.add_argument("--save-epochs", metavar="DIR", help="rank 0 saves the parameters and the "
                   "online gradient noise estimate at every epoch's end to DIR/epoch-K.pt "
                   "(benchmarks/job/noise_scale_check.py)")
    p.add_argument("--init-params", metavar="PATH", help="start from the parameters saved "
                   "by --save-epochs (with --lr 0: measure the gradient noise at fixed "
                   "parameters)")
    p.add_argument("--train-size", type=int, help="use only the first N training samples")
    p.add_argument("--repeat-data", type=int, default=1,
                   help="an epoch passes over K copies of the training set (longer epochs)")
    p.add_argument("--lr", type=float, default=0.02,
                   help="SGD learning rate, momentum 0.9 (0.05 is unstable at 1 worker of 16)")
    p.add_argument("--commit-every", type=int, default=10, help="steps between state.commit()")
    p.add_argument("--build-delay", type=float, default=0.0,
                   help="seconds to sleep between init() and entering run (a slow model build)")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="extra seconds per step (stands for a heavier model)")
    p.add_argument("--slow-worker", metavar="HOST:SLOT:FACTOR[:AFTER_S]", type=_slow_worker,
                   help="the worker on HOST (HOROVOD_HOSTNAME) in SLOT (its local rank) computes "
                   "FACTOR times slower, from AFTER_S seconds after its first step (default 0): "
                   "it sleeps (FACTOR-1) x its measured compute each step.  The slowness "
                   "belongs to the slot, not the rank: a replacement elsewhere is fast "
                   "(a straggler for --straggler-policy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: train on GPU (local rank %% GPUs on the host, the one hvd_edl "
                   "pinned at init); each worker then prints a 'device-check' line at the first "
                   "step of every generation it trains in")
    p.add_argument("--stop-file", help="end training at the next epoch boundary once this file "
                   "exists (all ranks agree through one allreduce)")
    p.add_argument("--summary", help="write a JSON summary here (rank 0)")
    p.add_argument("--save-params", help="save the final parameters here (rank 0, torch.save)")
    return p.parse_args()


def _slow_worker(text: str):
    """``HOST:SLOT:FACTOR[:AFTER_S]`` -> (host, slot, factor, after_s)."""
    parts = text.rsplit(":", 3) if text.count(":") >= 3 else text.rsplit(":", 2)
    try:
        host, slot, factor = parts[0], int(parts[1]), float(parts[2])
        after = float(parts[3]) if len(parts) > 3 else 0.0
    except (IndexError, ValueError):
        raise argparse.ArgumentTypeError(f"expected HOST:SLOT:FACTOR[:AFTER_S], got {text!r}")
    if not host or slot < 0 or factor < 1 or after < 0:
        raise argparse.ArgumentTypeError(f"need a host, SLOT >= 0, FACTOR >= 1 and AFTER_S >= 0, "
                                         f"got {text!r}")
    return host, slot, factor, after


def _is_slow_slot(spec) -> bool:
    """True when this process runs on the slot ``--slow-worker`` names (launcher's variables,
    set before the script starts and stable for the worker's life)."""
    import os
    return spec is not None and os.environ.get("HOROVOD_HOSTNAME") == spec[0] \
        and os.environ.get("HOROVOD_LOCAL_RANK") == str(spec[1])


class _Slowdown:
    """``--slow-worker``: after each step, sleep (FACTOR-1) x this step's compute as the launcher
    measures it (``hvd_edl.step_timer``: the step's time outside collectives, less the previous
    sleep), so that the launcher sees FACTOR x the compute of an unslowed worker; outside
    hvd-edl-run, (FACTOR-1) x ``fallback_s`` (forward, backward, data loading)."""

    def __init__(self, factor: float):
        self.factor = factor
        self.last_sleep_s = 0.0
        self.seen = None  # (steps, compute_s) totals at the previous sleep

    def sleep(self, fallback_s: float) -> None:
        from hvd_edl import step_timer
        t = step_timer.timer()
        base = fallback_s
        if t is not None:
            steps, compute, _ = t.totals
            if self.seen is not None and steps > self.seen[0]:
                base = (compute - self.seen[1]) / (steps - self.seen[0]) - self.last_sleep_s
            self.seen = (steps, compute)
        self.last_sleep_s = (self.factor - 1.0) * max(base, 0.0)
        time.sleep(self.last_sleep_s)


class DigitsCNN(nn.Module):
    """(N, 1, 8, 8) images -> (N, 10) logits; ``width`` multiplies the channels (16, 32) and
    ``hidden`` is the dense layer's width."""

    def __init__(self, width: int = 1, hidden: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16 * width, 3, padding=1)
        self.conv2 = nn.Conv2d(16 * width, 32 * width, 3, padding=1)
        self.fc1 = nn.Linear(32 * width * 4 * 4, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def _device(kind: str) -> torch.device:
    """``--device``: the CPU, or this worker's GPU (local rank modulo the host's GPUs, as
    ``hvd_edl.torch.init`` pinned it).  Exits with status 2 when CUDA is asked for and absent."""
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print(f"train_digits.py: --device cuda, but torch {torch.__version__} sees no CUDA GPU",
              file=sys.stderr)
        sys.exit(2)
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _device_check(model, first_step_s: float) -> None:
    """One line (``--device cuda``) at a generation's first step: slot, current CUDA device,
    the model's device, and that first step's seconds (it creates the ring's NCCL
    communicators), for benchmarks/gpu/gpu_check.sh."""
    print(f"device-check rank={hvd.rank()} size={hvd.size()} local_rank={hvd.local_rank()} "
          f"current_device={torch.cuda.current_device()} "
          f"param_device={next(model.parameters()).device} "
          f"device_count={torch.cuda.device_count()} first_step_s={first_step_s:.4f}",
          flush=True)


def load_digits():
    """scikit-learn's copy of the UCI handwritten digits: ``(pixels, labels)``, arrays of shape
    (1797, 64) (values 0-16) and (1797,) (0-9).  Read from the file scikit-learn ships, without
    importing scikit-learn (1.3 s of CPU in every worker of a job: ``sklearn.datasets`` pulls
    in SciPy); ``sklearn.datasets.load_digits`` where that file is not found."""
    spec = importlib.util.find_spec("sklearn")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt") as f:
                table = np.loadtxt(f, delimiter=",")
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sklearn_digits
    digits = sklearn_digits()
    return digits.data, digits.target


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int):
    """A seeded split of ``range(len(labels))`` into (train, test) index lists keeping each
    label's share in both (as ``train_test_split(..., stratify=labels)``)."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        n_test = int(round(test_fraction * len(members)))
        test.extend(members[:n_test].tolist())
        train.extend(members[n_test:].tolist())
    return rng.permutation(train).tolist(), sorted(test)


def load_data(seed: int, train_size=None, repeat: int = 1):
    pixels, labels = load_digits()
    x = torch.tensor(pixels, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    idx_train, idx_test = stratified_split(labels, 0.25, seed)
    idx_train = idx_train[:train_size] if train_size else idx_train
    train = torch.utils.data.TensorDataset(x[idx_train].repeat(repeat, 1, 1, 1),
                                           y[idx_train].repeat(repeat))
    test = torch.utils.data.TensorDataset(x[idx_test], y[idx_test])
    return train, test


def _epoch_end(args, model, optimizer, sampler, state, test_ds, device, t0) -> bool:
    """Rank 0 scores the whole test split, logs it (``--accuracy-log``), saves the parameters
    with the online noise estimate (``--save-epochs``); every rank learns through one allreduce
    whether ``--target-accuracy`` was reached (True: stop)."""
    import os
    reached = 0
    if hvd.rank() == 0:
        model.eval()
        with torch.no_grad():
            xs, ys = test_ds.tensors
            acc = float((model(xs.to(device)).argmax(1).cpu() == ys).float().mean())
        model.train()
        est = optimizer.gradient_noise.noise.latest
        noise = est.as_dict() if est is not None else None
        batch = getattr(sampler, "global_batch_size", None) or sampler.batch_size * hvd.size()
        line = {"t": time.time(), "wall_s": round(time.time() - t0, 3), "epoch": state.epoch,
                "step": state.step, "accuracy": acc, "world_size": hvd.size(),
                "batch": batch, "noise": noise,
                "lr_factor": getattr(getattr(optimizer, "adaptive", None), "last_factor", 1.0),
                "progress": getattr(getattr(optimizer, "adaptive", None), "progress", None),
                **_costs(optimizer)}
        if args.accuracy_log:
            with open(args.accuracy_log, "a") as f:
                f.write(json.dumps(line) + "\n")
        if args.save_epochs:
            os.makedirs(args.save_epochs, exist_ok=True)
            torch.save({"params": {k: v.detach().cpu().clone()
                                   for k, v in model.state_dict().items()},
                        "line": line, "noise_state": optimizer.gradient_noise.noise.state_dict()},
                       os.path.join(args.save_epochs, f"epoch-{state.epoch}.pt"))
        reached = int(args.target_accuracy is not None and acc >= args.target_accuracy)
    flag = torch.tensor([reached], dtype=torch.int32)
    return bool(hvd.allreduce(flag, op=hvd.Max, name="target_reached")[0] > 0)


def _costs(optimizer) -> dict:
    """The noise meter's seconds per step on the training thread and the mean step seconds
    (this worker's, from hvd_edl's step timer; None outside hvd-edl-run)."""
    from hvd_edl import step_timer
    meter = optimizer.gradient_noise
    t = step_timer.timer()
    steps, compute, wait = t.totals if t is not None else (0, 0.0, 0.0)
    return {"noise_cost_s": meter.cost_s / meter.cost_steps if meter.cost_steps else None,
            "step_s": (compute + wait) / steps if steps else None}


def _agreed_stop(path: str) -> bool:
    import os
    flag = torch.tensor([1 if os.path.exists(path) else 0], dtype=torch.int32)
    return bool(hvd.allreduce(flag, op=hvd.Max, name="stop_file")[0] > 0)


def main():
    args = parse_args()
    t0 = time.time()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train_ds, test_ds = load_data(args.seed, args.train_size, args.repeat_data)

    device = _device(args.device)
    model = (DigitsCNN() if args.model == "small" else DigitsCNN(4, 256)).to(device)
    if args.init_params:
        model.load_state_dict(torch.load(args.init_params, weights_only=True)["params"])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    if args.adaptive_batch:  # the two lines that opt in to an adaptive batch
        sampler = hvd.elastic.AdaptiveBatchSampler(
            train_ds, batch_size=args.global_batch_size or 32, max_batch=args.max_batch,
            max_local_batch=args.max_local_batch, shuffle=True, seed=args.seed)
        optimizer = hvd.AdaptiveOptimizer(optimizer, sampler, lr_rule=args.lr_rule)
        loader = torch.utils.data.DataLoader(train_ds, batch_sampler=sampler)
        weight = sampler.loss_weight
    elif args.global_batch_size:
        sampler = hvd.elastic.ElasticBatchSampler(train_ds, args.global_batch_size,
                                                  shuffle=True, seed=args.seed)
        loader = torch.utils.data.DataLoader(train_ds, batch_sampler=sampler)
        weight = sampler.loss_weight
    else:
        sampler = hvd.elastic.ElasticSampler(train_ds, shuffle=True, seed=args.seed,
                                             batch_size=args.batch_size)
        loader = torch.utils.data.DataLoader(train_ds, batch_size=args.batch_size,
                                             sampler=sampler)
        weight = None
    if args.build_delay:
        time.sleep(args.build_delay)
    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0, step=0)
    slow = args.slow_worker if _is_slow_slot(args.slow_worker) else None
    slowed = _Slowdown(slow[2]) if slow else None
    slow_from = []  # monotonic time the slowness starts (set at the first step)

    @hvd.elastic.run
    def train(state):
        entered = time.monotonic() if device.type == "cuda" else None
        bar = tqdm(total=args.epochs * len(train_ds), initial=state.epoch * len(train_ds)
                   + sampler.consumed, disable=hvd.rank() != 0, unit="sample",
                   mininterval=3.0, file=sys.stderr, ascii=True, desc=f"size {hvd.size()}")
        while state.epoch < args.epochs:
            model.train()
            last_end = None  # end of the previous step's own work (its data loading counts)
            for batch_idx, (x, y) in enumerate(loader):
                before = sampler.consumed
                t_compute = time.perf_counter() if last_end is None else last_end
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x.to(device)), y.to(device))
                if weight is not None:  # fixed global batch: the rank's share of the mean
                    loss = loss * weight(batch_idx)
                loss.backward()
                # this step's compute outside collectives: the commit and data loading since the
                # previous step's end, forward and backward
                compute_s = time.perf_counter() - t_compute
                optimizer.step()
                if entered is not None:  # this generation's first step: where it ran
                    _device_check(model, time.monotonic() - entered)
                    entered = None
                sampler.record_batch(batch_idx, len(x))
                state.step += 1
                bar.update(sampler.consumed - before)
                if args.step_delay:
                    time.sleep(args.step_delay)
                if slow is not None:
                    if not slow_from:
                        slow_from.append(time.monotonic() + slow[3])
                    if len(slow_from) == 1 and time.monotonic() >= slow_from[0]:
                        slow_from.append(True)
                        print(f"slow-worker: {slow[0]}:{slow[1]} computes {slow[2]:g}x slower "
                              f"from now ({time.time():.3f})", flush=True)
                    if time.monotonic() >= slow_from[0]:
                        slowed.sleep(compute_s + args.step_delay)
                last_end = time.perf_counter()
                if state.step % args.commit_every == 0:
                    state.commit()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
            if args.stop_file and _agreed_stop(args.stop_file):
                break
            if (args.target_accuracy or args.accuracy_log or args.save_epochs) \
                    and _epoch_end(args, model, optimizer, sampler, state, test_ds, device, t0):
                break
        bar.close()

    train(state)

    # Final test accuracy: each rank scores its share of the test set, sums are allreduced.
    model.eval()
    with torch.no_grad():
        xs, ys = test_ds.tensors
        shard = slice(hvd.rank(), None, hvd.size())
        correct = (model(xs[shard].to(device)).argmax(1).cpu() == ys[shard]).sum().float()
    totals = hvd.allreduce(torch.stack([correct, torch.tensor(float(len(ys[shard])))]),
                           op=hvd.Sum, name="test_accuracy")
    accuracy = float(totals[0] / totals[1])
    # every rank must hold the same parameters (data parallelism): the spread across ranks
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    spread = float((hvd.allreduce(flat, op=hvd.Max, name="param_max")
                    - hvd.allreduce(flat, op=hvd.Min, name="param_min")).abs().max())
    if hvd.rank() == 0:
        summary = {"test_accuracy": accuracy, "world_size": hvd.size(), "steps": state.step,
                   "epochs": state.epoch, "wall_s": round(time.time() - t0, 3),
                   "param_spread": spread}
        print(f"test accuracy {accuracy:.4f} at world size {hvd.size()} "
              f"({state.step} steps, {state.epoch} epochs, {summary['wall_s']:.1f} s)")
        if args.summary:
            with open(args.summary, "w") as f:
                json.dump(summary, f)
        if args.save_params:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                       args.save_params)


if __name__ == "__main__":
    main()
