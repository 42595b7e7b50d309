"""State sync cost, before and after the stream (issue 17, item 3), in one run.

Part 1, ``TorchState``'s sync among 3 workers (``hvd-edl-run -np 3``) for a model + SGD-momentum
state of about 1, 10 and 100 MB (eight bias-free ``Linear(d, d)`` layers and their momentum):

* ``horovod``: the old sync with Horovod 0.28.1's ``broadcast_object`` (everything pickled,
  two broadcasts to every rank);
* ``broadcast``: the old sync with hvd_edl's ``broadcast_object`` (``HVD_EDL_SYNC_STREAM=0``);
* ``stream``: the stream to 2 joiners (one sending thread each), ``stream_sequential`` (one
  joiner after the other), and ``stream_1_joiner`` (ranks 0 and 1 hold the commit, rank 2
  joins: the holder receives nothing), the header in a broadcast (one collective);
* ``direct``, ``direct_1_joiner``: the same with the header over the stream (rank 0's listener
  named by the assignment, no collective); each prints its parts (header, skeleton, transfer,
  load: each rank's median, rank 0 first).

Each figure is the slowest rank's time (the switch waits for it), median over ``--reps``; a
joiner's optimizer state is dropped before each repetition (it starts without it).  Peak extra
memory per rank: the process's resident high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` before each sync) minus its resident size before the sync, the
largest over repetitions; it counts what the sync allocates, including a joiner's new
optimizer state.

Part 2 (``--switch``, default on): the switch in real scale-outs 2 -> 3 (``--switch-changes``,
default 3,2,3,2,3: three of them) of ``benchmarks/common/workload.py`` with ``--model-mb``
(default 100) MB of frozen parameters, in three modes in the same run: the old broadcast
(``HVD_EDL_SYNC_STREAM=0``), the stream with its header in a broadcast
(``HVD_EDL_SYNC_HEADER_BROADCAST=1``) and the stream with its header over the stream; one table
of the medians of the pause measured from outside (``pause_s``: the survivors' longest gap from
the end of their last step at 2 to the start of their first at 3, from the steps' wall times, as
``make bench`` measures a stall), the event log's stall, phases (boundary, shutdown, wait, init: the ring's
re-init, sync, rest) and the sync's parts (header, skeleton, transfer, load), as the slowest
continuing member reported them.

    .venv/bin/python benchmarks/job/sync.py            # writes benchmarks/results/sync.json
    .venv/bin/python benchmarks/job/sync.py --no-switch --sizes 100 --reps 1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RESULTS = ROOT / "benchmarks" / "results"
LAYERS = 8
SYNC_PARTS = ("header_s", "skeleton_s", "transfer_s", "load_s")  # TorchState.last_sync
SWITCH_PHASES = ("boundary_s", "shutdown_s", "wait_s", "init_s", "sync_s", "rest_s")
# (name, HVD_EDL_SYNC_STREAM, HVD_EDL_SYNC_HEADER_BROADCAST) of the real switch's modes
SWITCH_MODES = (("broadcast", "0", "0"), ("stream, header bcast", "1", "1"),
                ("stream", "1", "0"))


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))


def _hwm_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmHWM:"))


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: resets VmHWM to the current RSS


def worker(sizes, reps: int, horovod_reps: int) -> None:
    import torch
    import horovod.torch as horovod
    import hvd_edl.torch as hvd
    import hvd_edl.torch.elastic as elastic
    from hvd_edl.torch import broadcasts
    from hvd_edl import runtime, state_stream
    hvd.init()
    torch.set_num_threads(1)
    rt = runtime.get()
    rank = hvd.rank()
    rows = []
    for mb in sizes:
        d = max(8, int((mb * 2 ** 20 / (2 * LAYERS * 4)) ** 0.5))
        torch.manual_seed(rank)
        model = torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(LAYERS)])
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        model(torch.randn(2, d)).sum().backward()
        opt.step()  # momentum buffers exist
        state = elastic.TorchState(model, opt, epoch=0)
        state_mb = 2 * LAYERS * d * d * 4 / 2 ** 20
        variants = [("horovod", None), ("broadcast", None), ("stream", (0, -1, -1)),
                    ("stream_sequential", (0, -1, -1)), ("stream_1_joiner", (0, 0, -1)),
                    ("direct", (0, -1, -1)), ("direct_1_joiner", (0, 0, -1))]
        for impl, held in variants:
            times, extra_kb, received, transfer, parts = [], [], [], [], []
            n = min(reps, horovod_reps) if impl == "horovod" else reps
            for i in range(n):
                joiner = rank > 0 and (held is None or held[rank] < 0)
                if joiner:
                    opt.state.clear()  # a joiner starts without optimizer state
                hvd.allreduce(torch.zeros(1), name=f"barrier.{impl}.{mb}.{i}")
                rss = _rss_kb()
                _reset_hwm()
                t = time.perf_counter()
                if impl == "horovod":
                    saved = broadcasts.broadcast_object
                    broadcasts.broadcast_object = horovod.broadcast_object
                    try:
                        stats = state._sync_broadcast(rt)
                    finally:
                        broadcasts.broadcast_object = saved
                elif impl == "broadcast":
                    stats = state._sync_broadcast(rt)
                elif impl.startswith("direct"):  # the header over the stream: no collective
                    state_stream.PARALLEL = True
                    stats = state._sync_direct(rt, held[rank])
                else:
                    state_stream.PARALLEL = impl != "stream_sequential"
                    stats = state._sync_stream(rt, held[rank])
                times.append(time.perf_counter() - t)
                extra_kb.append(_hwm_kb() - rss)
                received.append(stats["received_bytes"])
                transfer.append(stats.get("transfer_s", 0.0))
                parts.append({k: stats.get(k, 0.0) for k in SYNC_PARTS})
            per_rank = hvd.allgather_object({"rank": rank, "times": times,
                                             "extra_mb": max(extra_kb) / 1024,
                                             "received_mb": max(received) / 2 ** 20,
                                             "transfer_s": statistics.median(transfer),
                                             "parts": {k: statistics.median(p[k] for p in parts)
                                                       for k in SYNC_PARTS}},
                                            name=f"gather.{impl}.{mb}")
            slowest = [max(r["times"][i] for r in per_rank) for i in range(n)]
            rows.append({"impl": impl, "state_mb": round(state_mb, 2),
                         "median_s": statistics.median(slowest), "min_s": min(slowest),
                         "max_s": max(slowest), "runs": n,
                         "gb_per_s": round(state_mb / 1024 / statistics.median(slowest), 3),
                         "peak_extra_mb": [round(r["extra_mb"], 1) for r in per_rank],
                         "received_mb": [round(r["received_mb"], 2) for r in per_rank],
                         "transfer_s": [round(r["transfer_s"], 4) for r in per_rank],
                         # each part's median on each rank: [rank 0, rank 1, rank 2]
                         "parts": {k: [round(r["parts"][k], 4) for r in per_rank]
                                   for k in SYNC_PARTS}})
            sums = hvd.allgather_object(sum(float(t.double().sum()) for t in
                                            list(model.state_dict().values()) + [
                                                opt.state[q]["momentum_buffer"]
                                                for q in model.parameters()]),
                                        name=f"check.{impl}.{mb}")
            assert len(set(sums)) == 1, f"{impl}: the ranks' states differ: {sums}"
        del state, model, opt
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def switch_phases(model_mb: float, changes, settle_steps: int, timeout_s: float) -> dict:
    """A real elastic job (benchmarks/common/jobs.py's Job: the workload with ``model_mb`` MB of
    frozen parameters) started at 2 workers and taken through ``changes`` (world sizes, e.g. 3 or
    3, 2, 3), with the old broadcast and with the stream: the scale-outs' ``phases.sync_s``,
    ``init_s`` and ``stall_s`` from the event log (what was measured before an error is kept,
    with the error)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.common.jobs import Job, change_stall
    out = {}
    # a script's folder is not put first on sys.path: a benchmarks/ module named like one of
    # the standard library's could not shadow it in the workers
    os.environ["PYTHONSAFEPATH"] = "1"
    for mode, env, header in SWITCH_MODES:
        os.environ["HVD_EDL_SYNC_STREAM"] = env
        os.environ["HVD_EDL_SYNC_HEADER_BROADCAST"] = header
        with tempfile.TemporaryDirectory() as tmp:
            job = Job("hvd_edl", Path(tmp), 2, step_delay=0.05, model_mb=model_mb, max_np=3)
            error = None
            outside = []  # (old, new, unix time) of each scale-out
            try:
                if not job.wait_settled(2, settle_steps, 0, timeout_s):
                    raise RuntimeError(f"no ring of 2: {job.output_tail()}")
                old = 2
                for new in changes:
                    t = job.change(new)
                    if not job.wait_settled(new, settle_steps, t, timeout_s):
                        raise RuntimeError(f"no ring of {new}: {job.output_tail(3)}")
                    if new > old:
                        outside.append((old, new, t))
                    old = new
                time.sleep(0.5)
            except RuntimeError as e:
                error = str(e)
            finally:
                outs = [e for e in job.events() if e["kind"] == "scale_out"]
                tl = job.timelines()
                pauses = [change_stall(tl, o, n, t) for o, n, t in outside]
                out[mode] = [dict({k: e["phases"].get(k) for k in SWITCH_PHASES},
                                  stall_s=e["stall_s"],
                                  pause_s=(pauses[i] or {}).get("stall_s")
                                  if i < len(pauses) else None,
                                  **{"sync." + k: e.get("sync_parts", {}).get(k)
                                     for k in SYNC_PARTS}) for i, e in enumerate(outs)]
                if error:
                    out[mode + "_error"] = error
                job.finish()
    os.environ.pop("HVD_EDL_SYNC_STREAM", None)
    os.environ.pop("HVD_EDL_SYNC_HEADER_BROADCAST", None)
    return out


def print_breakdown(switch: dict) -> None:
    """The scale-outs' stall, its phases and the sync's parts (the slowest continuing
    member's; seconds), each the median over the scale-outs, one column per mode."""
    modes = [m for m, _, _ in SWITCH_MODES if switch.get(m)]
    rows = ["pause_s", "stall_s"] + list(SWITCH_PHASES) + ["sync." + k for k in SYNC_PARTS]
    print(f"{'median of scale-outs (s)':26s}" + "".join(f"{m:>24s}" for m in modes))
    for row in rows:
        cells = []
        for m in modes:
            vals = [e[row] for e in switch[m] if e.get(row) is not None]
            cells.append(f"{statistics.median(vals):8.3f} ({min(vals):.3f}-{max(vals):.3f})"
                         if vals else "-")
        print(f"{row:26s}" + "".join(f"{c:>24s}" for c in cells))
    print(f"{'scale-outs':26s}" + "".join(f"{len(switch[m]):>24d}" for m in modes))


def transfer_alone(mb: float, reps: int) -> dict:
    """The stream alone, one process to another on loopback (no Horovod): ``mb`` MB in 8
    tensors received into existing tensors, against a 100 MB ``copy_`` in the same process, the
    medians of ``reps``: how close to memory speed the transfer is on this machine now."""
    import multiprocessing as mp
    import torch
    from hvd_edl import state_stream as ss
    torch.set_num_threads(1)
    n = int(mb * 2 ** 20 / 4 / 8)
    src = [torch.randn(n) for _ in range(8)]
    flat_src, flat_dst = torch.randn(8 * n), torch.zeros(8 * n)
    ctx = mp.get_context("fork")
    times, copies = [], []
    for _ in range(reps):
        server = ss.StreamServer(src, "127.0.0.1")
        q = ctx.Queue()

        def child(endpoint, q=q):
            dst = [torch.zeros(n) for _ in range(8)]  # touched, as a model's parameters are
            t = time.perf_counter()
            ss.receive(endpoint, dst)
            q.put(time.perf_counter() - t)

        proc = ctx.Process(target=child, args=(server.endpoint(),))
        proc.start()
        server.serve(1)
        times.append(q.get(timeout=60))
        proc.join(60)
        t = time.perf_counter()
        flat_dst.copy_(flat_src)
        copies.append(time.perf_counter() - t)
    stream_s, copy_s = statistics.median(times), statistics.median(copies)
    out = {"state_mb": mb, "stream_s": round(stream_s, 4),
           "stream_gb_per_s": round(mb / 1024 / stream_s, 2), "copy_s": round(copy_s, 4),
           "copy_gb_per_s": round(mb / 1024 / copy_s, 2), "runs": reps}
    print(f"transfer alone {mb:.0f} MB: stream {stream_s:.3f} s ({out['stream_gb_per_s']} GB/s), "
          f"memory copy {copy_s:.3f} s ({out['copy_gb_per_s']} GB/s), median of {reps}")
    return out


def run_sync(a):
    out = subprocess.run([str(BIN / "hvd-edl-run"), "-np", "3", sys.executable, __file__,
                          "--worker", "--sizes", a.sizes, "--reps", str(a.reps),
                          "--horovod-reps", str(a.horovod_reps)],
                         capture_output=True, text=True, cwd=str(ROOT), timeout=1800,
                         env=dict(os.environ, PYTHONSAFEPATH="1"))  # see switch_phases
    line = next((x for x in out.stdout.splitlines() if "RESULT " in x), None)
    if out.returncode != 0 or line is None:
        print(out.stdout[-3000:], out.stderr[-3000:])
        return None
    rows = json.loads(line.split("RESULT ", 1)[1])
    for r in rows:
        print(f"{r['impl']:18s} {r['state_mb']:7.1f} MB: {r['median_s']:7.3f} s median "
              f"(min {r['min_s']:.3f}, max {r['max_s']:.3f}, {r['runs']} runs) "
              f"{r['gb_per_s']:6.2f} GB/s; peak extra MB per rank {r['peak_extra_mb']}; "
              f"received MB {r['received_mb']}"
              + (f"; transfer s {r['transfer_s']}" if r["impl"].startswith(("stream", "direct"))
                 else "")
              + ("".join(f"; {k} {r['parts'][k]}" for k in SYNC_PARTS)
                 if r["impl"].startswith(("stream", "direct")) else ""))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,10,100", help="state MB (default %(default)s)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--horovod-reps", type=int, default=1,
                   help="repetitions of Horovod's broadcast_object (at most --reps; default "
                        "%(default)s: 100 MB take 15-80 s here)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--switch", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure the switch's sync phase in a real scale-out")
    p.add_argument("--only", choices=("sync", "switch", "transfer"),
                   help="run one part (writes --out all the same)")
    p.add_argument("--model-mb", type=float, default=100.0,
                   help="frozen parameters of the scale-out job (MB, default %(default)s)")
    p.add_argument("--switch-changes", default="3,2,3,2,3",
                   help="world sizes the scale-out job goes through from 2 (default %(default)s;"
                        " e.g. 3,2,3 for two scale-outs)")
    p.add_argument("--out", default=str(RESULTS / "sync.json"))
    a = p.parse_args()
    try:
        sizes = [float(x) for x in a.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes: expected comma-separated numbers, got {a.sizes!r}")
    try:
        changes = [int(x) for x in a.switch_changes.split(",")]
    except ValueError:
        p.error(f"--switch-changes: expected comma-separated sizes, got {a.switch_changes!r}")
    if not all(1 <= c <= 3 for c in changes):
        p.error("--switch-changes: sizes from 1 to 3")
    if a.reps < 1 or a.horovod_reps < 1:
        p.error("--reps and --horovod-reps must be at least 1")
    if a.worker:
        worker(sizes, a.reps, a.horovod_reps)
        return 0
    load = os.getloadavg()
    result = {"benchmark": "TorchState sync among 3 workers: before (broadcast_object) and "
                           "after (stream)", "load_before": [round(x, 2) for x in load]}
    if a.only in (None, "transfer"):
        result["transfer_alone"] = transfer_alone(max(sizes), a.reps)
    if a.only in (None, "sync"):
        rows = run_sync(a)
        if rows is None:
            return 1
        result["results"] = rows
    if a.only in ("sync", "transfer"):
        a.switch = False
    if a.switch:
        result["switch"] = switch_phases(a.model_mb, changes, 5, 180.0)
        result["switch"]["model_mb"] = a.model_mb
        for mode, _, _ in SWITCH_MODES:
            print(f"switch 2->3, {a.model_mb:.0f} MB frozen, {mode:20s}: " + ", ".join(
                f"sync {s['sync_s']:.3f} s / stall {s['stall_s']:.3f} s"
                for s in result["switch"][mode])
                + (f" (error: {result['switch'][mode + '_error']})"
                   if mode + "_error" in result["switch"] else ""))
        print_breakdown(result["switch"])
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = Path(a.out)
    if a.only is not None and out.exists():  # a partial run keeps the other parts' figures
        try:
            kept = json.loads(out.read_text())
        except ValueError:
            kept = {}
        for key in ("transfer_alone", "results", "switch"):
            if key not in result and key in kept:
                result[key] = kept[key]
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"load average before {result['load_before']}, after {result['load_after']}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
