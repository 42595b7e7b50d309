"""The launcher's Ray driver: a child process of ``hvd-edl-run --ray ADDRESS``, the only place
of the launcher that imports ``ray``.

Why a process of its own: a Ray driver blocks in every call while Ray's head is unreachable and
terminates itself once the head has been gone for 60 s (Ray's
``gcs_rpc_server_reconnect_timeout_s``: "Failed to connect to GCS within 60 seconds ... The
program will terminate").  The launcher must go on with the workers it has, so Ray's calls run
here and the launcher waits for each answer a bounded time (:mod:`launcher.ray.engine`).

    python -m launcher.ray.agent ADDRESS

Protocol: JSON lines.  First line out: ``{"ready": true, "node_id", "node_ip", "ray"}`` (this
node, Ray's version) or ``{"error": "..."}`` and exit 2.  Then one request a line in, each
``{"id": N, "op": ...}``, one answer a line out with the same id:

* ``nodes``: ``{"nodes": [{"id", "ip", "alive", "head", "total", "available", "draining"}]}``:
  every node Ray knows, its total and available resources (``{"CPU": 2.0, ...}``) and, for a
  node being drained, the drain's deadline (unix ms, 0: none), else null;
* ``start``: ``{"worker", "node", "cpus", "gpus", "argv", "env", "cwd", "node_ip",
  "auto_iface", "place_timeout_s", "slot", "node_gpus"}``: a :class:`launcher.ray.actor.WorkerPlace` actor reserving
  ``cpus`` / ``gpus`` on node ``node`` (node affinity, not soft: it never runs elsewhere) starts
  the worker's link bootstrap; answered ``{"ok": true, "pid", "iface"}`` once it ran, or
  ``{"ok": false, "error": "..."}`` (the actor refused, not placed within
  ``place_timeout_s``);
* ``stop``: ``{"worker"}``: the worker's actor is killed (its reservation released).

Each request is served in a thread of its own: answers may come out of order.

The agent ends when its stdin closes (the launcher stopped or died: ``PR_SET_PDEATHSIG`` too);
Ray then ends its actors, which hold nothing but the reservation by then.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
from typing import Dict


def _say(obj: dict, lock=threading.Lock()) -> None:
    with lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def unreachable(address: str, timeout_s: float = 5.0) -> str:
    """Why nothing answers at ``HOST:PORT`` (a TCP connect within ``timeout_s``), "" when
    something does or ``address`` is not of that form (``auto``, ``ray://...``): ``ray.init``
    itself retries an unreachable head for half a minute before it says so."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in address:
        return ""
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        return f"nothing answers at {address} ({e.strerror or type(e).__name__})"
    return ""


def main(argv=None) -> int:
    address = (argv or sys.argv[1:] or ["auto"])[0]
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    refused = unreachable(address)
    if refused:  # before the second or two of importing ray
        _say({"error": f"cannot connect to the Ray cluster at {address}: {refused}"})
        return 2
    try:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    except ImportError as e:
        _say({"error": f"ray is not installed in {sys.executable} ({e}): pip install 'ray>=2.51'"})
        return 2
    try:
        ctx = ray.init(address=address, logging_level="ERROR", log_to_driver=False,
                       configure_logging=True, namespace="hvd_edl")
    except Exception as e:  # noqa: BLE001 - ConnectionError, ValueError, RuntimeError ...
        _say({"error": f"cannot connect to the Ray cluster at {address}: {_first_line(e)}"})
        return 2
    import ray.cloudpickle
    from ray._private import state as ray_state

    from launcher.ray import actor as actor_module
    ray.cloudpickle.register_pickle_by_value(actor_module)  # nodes need nothing of ours
    place_class = ray.remote(actor_module.WorkerPlace)
    actors: Dict[str, object] = {}
    lock = threading.Lock()
    rt = ray.get_runtime_context()
    _say({"ready": True, "node_id": rt.get_node_id(), "node_ip": ctx.address_info["node_ip_address"],
          "ray": ray.__version__})

    def nodes(req):
        draining = ray_state.state.get_draining_nodes()
        available = ray_state.available_resources_per_node()
        out = []
        for n in ray.nodes():
            nid = n["NodeID"]
            out.append({"id": nid, "ip": n["NodeManagerAddress"], "alive": bool(n["Alive"]),
                        "head": "node:__internal_head__" in n.get("Resources", {}),
                        "total": n.get("Resources", {}), "available": available.get(nid, {}),
                        "draining": draining.get(nid)})
        return {"nodes": out}

    def start(req):
        handle = place_class.options(
            num_cpus=req["cpus"], num_gpus=req["gpus"], max_restarts=0,
            name=None, scheduling_strategy=NodeAffinitySchedulingStrategy(req["node"], soft=False)
        ).remote()
        with lock:
            actors[req["worker"]] = handle
        try:
            got = ray.get(handle.start.remote(req["argv"], req["env"], req["cwd"],
                                              req["node_ip"], req["auto_iface"],
                                              req.get("slot", 0), req.get("node_gpus", 0)),
                          timeout=req["place_timeout_s"])
        except ray.exceptions.GetTimeoutError:
            ray.kill(handle, no_restart=True)
            return {"ok": False, "error": f"the worker's actor ({req['cpus']:g} CPU, "
                                          f"{req['gpus']:g} GPU) was not placed on the node "
                                          f"within {req['place_timeout_s']:g} s"}
        except Exception as e:  # noqa: BLE001 - the actor died, was refused, raised
            ray.kill(handle, no_restart=True)
            return {"ok": False, "error": _first_line(e)}
        return {"ok": True, **got}

    def stop(req):
        with lock:
            handle = actors.pop(req["worker"], None)
        if handle is not None:
            ray.kill(handle, no_restart=True)
        return {"ok": True}

    ops = {"nodes": nodes, "start": start, "stop": stop}

    def serve(req):
        try:
            answer = ops[req["op"]](req)
        except Exception as e:  # noqa: BLE001 - every request gets an answer
            answer = {"ok": False, "error": _first_line(e)}
        _say({"id": req.get("id"), **answer})

    for line in sys.stdin:
        try:
            req = json.loads(line)
        except ValueError:
            continue
        # each in a thread: a start waits for a placement, and every call blocks while the
        # head is unreachable; none may hold up the others
        threading.Thread(target=serve, args=(req,), daemon=True).start()
    return 0


if __name__ == "__main__":
    if not __package__:  # run as a file: import from the repository
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))))
    sys.exit(main())
