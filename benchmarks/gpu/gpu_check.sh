#!/usr/bin/env bash
# The GPU path, checked on the GPUs of this machine (issue 17, item 4), in at most ~5 minutes:
#
#   benchmarks/gpu/gpu_check.sh            # writes benchmarks/results/gpu.json
#
# 1. Exits 3 with one line naming what is missing where no usable GPU is: no nvidia-smi, no GPU,
#    torch without CUDA, Horovod without NCCL (cmake/detect_gpu.py says why it was not built).
# 2. Otherwise runs the elastic digits demo (examples/train_digits.py --device cuda) under
#    hvd-edl-run with a scale-out and a scale-in (host discovery follows a timetable): with G
#    GPUs, min(G, 4) - 1 -> min(G, 4) -> min(G, 4) - 1 workers, one GPU each; with 1 GPU, it says
#    so and runs 1 -> 2 -> 1 workers on it (NCCL refuses two ranks on one device unless each
#    process has its own NCCL_HOSTID: then they talk over loopback sockets, not NVLink/PCIe).
# 3. Checks the device pinning: every worker's device-check line (torch.cuda.current_device()
#    and its model's parameter device, at the first step of each generation it trains in) must
#    name GPU local_rank % G.
# 4. Prints the switch figures from the event log (stall, and its phases: boundary, shutdown,
#    wait, Gloo init, state sync) and each generation's first step (it creates the ring's NCCL
#    communicators, after the stall is counted), and writes them to benchmarks/results/gpu.json.
# 5. With 2 or more GPUs, two jobs on this one host at once, each given half of the GPUs by its
#    hostfile (`localhost gpus=0,1` / `localhost gpus=2,3`, docs/gpus.md): every worker's
#    torch.cuda.current_device() must be its local rank (its own GPU in its CUDA_VISIBLE_DEVICES),
#    and nvidia-smi's compute processes (sampled while they train) must show each job's workers
#    on its own GPUs only, no GPU used by both.
#
# Exit status: 0 all checks passed, 1 a check failed (named), 3 no usable GPU.
# Environment: PY (default .venv/bin/python), GPU_CHECK_OUT (default benchmarks/results/gpu.json),
# GPU_CHECK_PHASE_S (seconds each size is held, default 10).
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${GPU_CHECK_OUT:-benchmarks/results/gpu.json}

missing() { echo "gpu_check: $*" >&2; exit 3; }

command -v nvidia-smi >/dev/null 2>&1 \
  || missing "no nvidia-smi (no NVIDIA driver on this machine): run it where 2 or more NVIDIA GPUs are"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
[ "${ngpu:-0}" -ge 1 ] || missing "no GPU (nvidia-smi -L lists none)"
[ -x "$PY" ] || missing "no $PY (run make setup first)"
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)' 2>/dev/null \
  || missing "torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null) without CUDA (torch.cuda.is_available() is False; $ngpu GPU(s) listed by nvidia-smi)"
"$PY" -c 'import sys, horovod.torch as h; sys.exit(0 if h.nccl_built() else 1)' 2>/dev/null \
  || missing "Horovod without NCCL ($("$PY" cmake/detect_gpu.py --built 2>&1 | tail -n 1))"

exec "$PY" - "$OUT" <<'EOF'
import json
import os
import re
import subprocess
import sys
import time

import torch
import horovod

out_path = sys.argv[1]
gpus = torch.cuda.device_count()
shared = gpus == 1
hi = 2 if shared else min(gpus, 4)
lo = hi - 1
phase_s = float(os.environ.get("GPU_CHECK_PHASE_S", "10"))
work = os.path.abspath("build/gpu-check")
os.makedirs(work, exist_ok=True)
events, clock, stop, log_path, summary = (os.path.join(work, n) for n in (
    "events.jsonl", "clock", "stop", "output.log", "summary.json"))
for p in (events, clock, stop, summary):
    if os.path.exists(p):
        os.remove(p)
name = torch.cuda.get_device_name(0)
try:
    v = torch.cuda.nccl.version()
    nccl_torch = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
except Exception:  # noqa: BLE001 - only a figure for the report
    nccl_torch = "?"
print(f"gpu_check: {gpus} GPU(s) ({name}), torch {torch.__version__} CUDA {torch.version.cuda}, "
      f"NCCL {nccl_torch} (torch's), "
      f"horovod {horovod.__version__}", flush=True)
env = dict(os.environ, HVD_EDL_QUIET="1")
train = [sys.executable, "examples/train_digits.py", "--device", "cuda", "--epochs", "1000",
         "--step-delay", "0.005", "--stop-file", stop, "--summary", summary]
if shared:
    print("gpu_check: 1 GPU: running 2 workers on it, each with its own NCCL_HOSTID (NCCL then "
          "connects them over loopback sockets)", flush=True)
    env.update(NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
    train = ["bash", "-c", 'export NCCL_HOSTID="gpu-check-$HVD_EDL_WORKER_ID"; exec "$@"',
             "worker"] + train
schedule = f"0:{lo},{phase_s:g}:{hi},{2 * phase_s:g}:{lo}"
discovery = (f"{sys.executable} examples/discover_timetable.py --schedule {schedule} "
             f"--clock {clock} --event-log {events}")
cmd = [os.path.join(os.path.dirname(sys.executable), "hvd-edl-run"), "-np", str(lo),
       "--min-np", "1", "--max-np", str(hi), "--event-log", events,
       "--host-discovery-script", discovery] + train
print(f"gpu_check: {lo} -> {hi} -> {lo} workers, each size held {phase_s:g} s; output in "
      f"{log_path}", flush=True)


def generations():
    rows = []
    try:
        with open(events) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if "generation" in rec:
                    rows.append(rec)
    except OSError:
        pass
    return rows


failures = []
t0 = time.monotonic()
deadline = t0 + 240
with open(log_path, "w") as log:
    job = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    scaled_in_at = None
    while job.poll() is None:
        if time.monotonic() > deadline:
            failures.append("the job did not end within 240 s (stopped)")
            job.terminate()
            try:
                job.wait(30)
            except subprocess.TimeoutExpired:
                job.kill()
            break
        kinds = [g["kind"] for g in generations()]
        if scaled_in_at is None and "scale_out" in kinds and "scale_in" in kinds[
                kinds.index("scale_out"):]:
            scaled_in_at = time.monotonic()
        if scaled_in_at is not None and time.monotonic() - scaled_in_at > 3 \
                and not os.path.exists(stop):
            open(stop, "w").close()  # trains 3 s at the smaller size, then stops at an epoch end
        time.sleep(0.5)
rc = job.wait()
wall_s = time.monotonic() - t0
if rc != 0:
    failures.append(f"hvd-edl-run exited {rc}")

text = open(log_path, errors="replace").read()
checks = []
pat = re.compile(r"device-check rank=(\d+) size=(\d+) local_rank=(\d+) current_device=(\d+) "
                 r"param_device=(\S+) device_count=(\d+) first_step_s=([\d.]+)")
for m in pat.finditer(text):
    rank, size, local_rank, current, param, count, first = m.groups()
    c = {"rank": int(rank), "size": int(size), "local_rank": int(local_rank),
         "current_device": int(current), "param_device": param, "device_count": int(count),
         "first_step_s": float(first)}
    want = c["local_rank"] % c["device_count"]
    c["ok"] = c["current_device"] == want and c["param_device"] == f"cuda:{want}"
    if not c["ok"]:
        failures.append(f"local rank {local_rank}: current device {current}, parameters on "
                        f"{param}, expected cuda:{want}")
    checks.append(c)
if not checks:
    failures.append("no device-check line in the output")
gens = generations()
switches = [g for g in gens if g["kind"] in ("scale_out", "scale_in", "failure", "replace")]
for kind in ("scale_out", "scale_in"):
    if not any(g["kind"] == kind for g in switches):
        failures.append(f"no {kind} in the event log")
if any(g["kind"] == "failure" for g in switches):
    failures.append("a failure generation (a worker died): see " + log_path)
try:  # the job's end: accuracy, and the ranks' parameters equal (NCCL's allreduce agrees)
    with open(summary) as f:
        end = json.load(f)
except (OSError, ValueError):
    end = {}
    failures.append("no summary from rank 0 (the job did not finish)")
if end and end["param_spread"] > 1e-6:
    failures.append(f"the ranks' parameters differ by {end['param_spread']:g}")
if end and end["test_accuracy"] < 0.8:
    failures.append(f"test accuracy {end['test_accuracy']:.3f} < 0.8")
sizes_seen = sorted({c["size"] for c in checks})
if hi not in sizes_seen:
    failures.append(f"no worker trained at size {hi} (device checks at sizes {sizes_seen})")

print("gpu_check: device pinning: " + ", ".join(
    f"local rank {c['local_rank']} -> cuda:{c['current_device']} (params {c['param_device']}, "
    f"size {c['size']})" for c in checks), flush=True)
# device checks in output order, grouped into runs of one size: one run per generation
runs = []
for c in checks:
    if not runs or runs[-1][0] != c["size"]:
        runs.append((c["size"], []))
    runs[-1][1].append(c["first_step_s"])
first_by_generation = {g["generation"]: max(r[1]) for g, r in zip(gens, runs)
                       if g["world_size"] == r[0]}
rows = []
for g in switches:
    first = first_by_generation.get(g["generation"])
    row = {"generation": g["generation"], "kind": g["kind"],
           "from": g.get("previous_world_size"), "to": g["world_size"],
           "stall_s": g["stall_s"], "phases": g.get("phases", {}),
           "first_step_max_s": first}
    rows.append(row)
    ph = ", ".join(f"{k[:-2]} {v:.3f}" for k, v in row["phases"].items())
    print(f"gpu_check: {row['kind']} {row['from']} -> {row['to']}: stall {row['stall_s']:.3f} s "
          f"({ph}); first step at this size up to {row['first_step_max_s']} s (NCCL set-up)",
          flush=True)


def two_jobs_on_one_host():
    """Section 5: two jobs, each on its half of the GPUs (hostfile gpus=), sampled with
    nvidia-smi; returns the figures (and appends to failures)."""
    import psutil
    if gpus < 2:
        print("gpu_check: 1 GPU: the two-job case needs 2 or more (skipped)", flush=True)
        return {"skipped": "1 GPU"}
    uuid = dict(line.split(", ") for line in subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid,index", "--format=csv,noheader"], capture_output=True,
        text=True, timeout=30).stdout.strip().splitlines())
    half = min(gpus, 4) // 2
    lists = {"A": [str(i) for i in range(half)], "B": [str(i) for i in range(half, 2 * half)]}
    jobs = {}
    for name_, devices in lists.items():
        hostfile = os.path.join(work, f"hosts-{name_}")
        with open(hostfile, "w") as f:
            f.write(f"localhost gpus={','.join(devices)}\n")
        log_ = open(os.path.join(work, f"two-jobs-{name_}.log"), "w")
        argv = [os.path.join(os.path.dirname(sys.executable), "hvd-edl-run"), "-np",
                str(half), "--hostfile", hostfile, sys.executable, "examples/train_digits.py",
                "--device", "cuda", "--epochs", "30", "--step-delay", "0.005"]
        jobs[name_] = (subprocess.Popen(argv, env=env, stdout=log_, stderr=subprocess.STDOUT),
                       log_)
    seen = {"A": set(), "B": set()}
    end_at = time.monotonic() + 180
    while any(p.poll() is None for p, _ in jobs.values()) and time.monotonic() < end_at:
        pids = {}
        for name_, (proc, _) in jobs.items():
            try:
                pids.update({c.pid: name_ for c in psutil.Process(proc.pid).children(True)})
            except psutil.NoSuchProcess:
                pass
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30).stdout.strip().splitlines()
        for line in apps:
            pid, _, gpu_uuid = line.partition(", ")
            if pid.strip().isdigit() and int(pid) in pids:
                seen[pids[int(pid)]].add(uuid.get(gpu_uuid.strip(), gpu_uuid.strip()))
        time.sleep(0.5)
    for name_, (proc, log_) in jobs.items():
        if proc.poll() is None:
            proc.kill()
            failures.append(f"two jobs: job {name_} did not end within 180 s")
        log_.close()
        text_ = open(log_.name, errors="replace").read()
        for m in pat.finditer(text_):
            local_rank, current = int(m.group(3)), int(m.group(4))
            if current != local_rank:
                failures.append(f"two jobs: job {name_} local rank {local_rank} on device "
                                f"{current} of its visible list")
        if not pat.search(text_):
            failures.append(f"two jobs: no device-check line from job {name_}")
        if not seen[name_] <= set(lists[name_]):
            failures.append(f"two jobs: job {name_} ran on GPUs {sorted(seen[name_])}, "
                            f"given {lists[name_]}")
    if seen["A"] & seen["B"]:
        failures.append(f"two jobs: GPUs {sorted(seen['A'] & seen['B'])} used by both jobs")
    print(f"gpu_check: two jobs on one host: A given {lists['A']} ran on {sorted(seen['A'])}, "
          f"B given {lists['B']} ran on {sorted(seen['B'])} (nvidia-smi)", flush=True)
    return {"given": lists, "seen_by_nvidia_smi": {k: sorted(v) for k, v in seen.items()}}


two_jobs = two_jobs_on_one_host()
result = {"ok": not failures, "failures": failures, "two_jobs": two_jobs, "gpus": gpus, "gpu_name": name,
          "shared_device": shared, "torch": torch.__version__, "cuda": torch.version.cuda,
          "nccl_torch": nccl_torch,
          "horovod": horovod.__version__, "schedule": schedule, "wall_s": round(wall_s, 1),
          "switches": rows, "device_checks": checks, "end": end,
          "command": " ".join(cmd), "load": os.getloadavg()}
os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
with open(out_path, "w") as f:
    json.dump(result, f, indent=1)
for line in failures:
    print(f"gpu_check: FAILED: {line}", flush=True)
print(f"gpu_check: {'ok' if not failures else 'FAILED'} in {wall_s:.0f} s; wrote {out_path}",
      flush=True)
sys.exit(0 if not failures else 1)
EOF
