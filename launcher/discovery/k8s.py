#!/usr/bin/env python3
"""Host discovery for Kubernetes: the pods selected by a label that are Running, Ready and not
being deleted, through ``kubectl get pods -l SELECTOR -o json``.

    python -m launcher.discovery.k8s -l app=train [-n NAMESPACE] [--slots 1] [--address ip]

Prints each pod's IP (``--address ip``, the default) or name (``--address name``, for pods
behind a headless service), oldest pod first.  A pod with a ``deletionTimestamp`` is going
(evicted, preempted, scaled down): it is left out at once, so its workers leave during the pod's
termination grace period.  Exits 1 with kubectl's message when kubectl fails, and when no pod
qualifies.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

if not __package__:  # run as a file: import from the repository, not from this folder
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from launcher.discovery.hosts import format_host_entry  # noqa: E402


def usable_pods(pod_list: dict) -> List[dict]:
    """The pods of a ``kubectl get pods -o json`` answer that are Running, Ready, not being
    deleted and have an IP, oldest first (then by name)."""
    def ready(pod):
        return any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in pod.get("status", {}).get("conditions") or [])

    pods = [p for p in pod_list.get("items", [])
            if p.get("status", {}).get("phase") == "Running" and ready(p)
            and not p.get("metadata", {}).get("deletionTimestamp")
            and p.get("status", {}).get("podIP")]
    return sorted(pods, key=lambda p: (p["metadata"].get("creationTimestamp", ""),
                                       p["metadata"].get("name", "")))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="k8s", description=__doc__.split("\n\n")[0])
    p.add_argument("-l", "--selector", required=True, help="label selector, e.g. app=train")
    p.add_argument("-n", "--namespace", help="namespace (default: kubectl's current one)")
    p.add_argument("--kubectl", default="kubectl", help="kubectl binary (default: on PATH)")
    p.add_argument("--slots", type=int, default=None,
                   help="slots per pod (default: none printed, so --slots-per-host applies)")
    p.add_argument("--address", choices=("ip", "name"), default="ip",
                   help="print the pod IP (default) or the pod name")
    p.add_argument("--timeout", type=float, default=3.0,
                   help="seconds kubectl may take (default 3)")
    a = p.parse_args(argv)
    if a.slots is not None and a.slots < 1:
        p.error(f"--slots must be a positive integer, got {a.slots}")
    cmd = [a.kubectl, "get", "pods", "-l", a.selector, "-o", "json",
           f"--request-timeout={a.timeout:g}s"] + (["-n", a.namespace] if a.namespace else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=a.timeout + 1, text=True)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"k8s: {a.kubectl} failed: {e}", file=sys.stderr)
        return 1
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        print(f"k8s: {a.kubectl} exited with code {proc.returncode}: {last}", file=sys.stderr)
        return 1
    try:
        pods = usable_pods(json.loads(proc.stdout))
    except (ValueError, AttributeError, TypeError) as e:
        print(f"k8s: cannot read {a.kubectl}'s JSON: {e}", file=sys.stderr)
        return 1
    seen, lines = set(), []
    for pod in pods:
        host = pod["status"]["podIP"] if a.address == "ip" else pod["metadata"]["name"]
        if host in seen:  # hostNetwork pods on one node share its IP
            print(f"k8s: {pod['metadata'].get('name')} shares address {host}: skipped",
                  file=sys.stderr)
            continue
        seen.add(host)
        lines.append(format_host_entry(host, a.slots))
    if not lines:
        print(f"k8s: no Running, Ready pod matches -l {a.selector}", file=sys.stderr)
        return 1
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
