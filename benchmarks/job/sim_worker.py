"""Simulated workers for the control-plane benchmark (``benchmarks/job/control_plane.py``):
asyncio tasks in one load-generator process that speak the worker side of the membership
protocol to a real launcher, with no torch and no Horovod.  Not a benchmark of its own:
control_plane.py starts it from the repository root as ``python -m benchmarks.job.sim_worker
--build-s S --step-s S`` and drives it over stdin (the protocol below).

Each simulated worker does what ``hvd_edl.runtime`` / ``hvd_edl.heartbeat`` do, with the same
messages (``hvd_edl.messages``), signed the same way (``hvd_edl.client``), on keep-alive
connections like the real client's ``requests.Session`` per thread:

* ``POST /register``, a build time (``--build-s``), ``POST /ready``, then ``POST /switch``
  ("join") until assigned; ``POST /started`` once in a ring;
* a heartbeat (``POST /beat`` every ``BeatReply.beat_s`` or ``messages.BEAT_S``) on its own
  connection, and a watcher's long poll (``POST /watch``) on another;
* at a change (the watch answers ``change_pending``) it "reaches the step boundary" and reports
  (``POST /switch``, "update"); told "exit", it waits for the next ring to train
  (``/watch until_started``, as a scaled-in member does) and ends with code 0;
* SIGTERM before ``/ready``: exit 0; after: ``POST /leave``; SIGKILL: gone at once (-9).

On demand (``mesh`` command) every member replays the key traffic of Horovod's Gloo rendezvous
against its generation's rendezvous server: for each of the scopes "global", "local<host>",
"cross<local rank>" (``horovod/common/gloo/gloo_context.cc``) Gloo's ``connectFullMesh``
(``third_party/gloo/gloo/rendezvous/context.cc``): PUT ``rank_<r>`` (host name), GET
``rank_0..rank_<r-1>``, PUT ``<r>`` ((size - 1) x 136-byte addresses), then for every other rank
``i`` the ``HTTPStore::wait`` poll (GET ``<i>``, again every 10 ms while 404) and the GET of
``<i>`` (``horovod/common/gloo/http_store.cc``), then DELETE ``<r>``; one connection per request
(the store's HTTP/1.0 client), 3 tries 0.5 s apart on errors.  ``sample`` ranks only, when given,
do their GETs (every rank PUTs), for sizes whose N^2 requests would take too long here.

Protocol (JSON lines): stdin ``{"op": "spawn", "id", "env"}``, ``{"op": "signal", "id",
"sig"}``, ``{"op": "gen", "generation"}`` (timing summary of a generation),
``{"op": "counters"}``, ``{"op": "mesh", "sample"}``, ``{"op": "flood", "seconds"}`` (every
live worker beats back to back: the launcher's capacity); stdout ``{"ev": "exit", "id",
"code"}`` and one answer line per query.  Times are ``time.monotonic()`` (one clock for every
process of a Linux machine).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections import defaultdict
from typing import Dict, Optional, Tuple

from hvd_edl import messages

GLOO_ADDRESS_BYTES = 136   # sizeof(gloo::transport::tcp::Address::Impl): sockaddr_storage + seq
STORE_POLL_S = 0.01        # HTTPStore::wait's sleep between polls
STORE_TRIES = 3            # HTTPStore::PerformHTTP's MAX_RETRY_TIMES
STORE_RETRY_S = 0.5        # ... and RETRY_WAITING_TIME_MILLSEC
GLOO_TIMEOUT_S = 30.0      # HOROVOD_GLOO_TIMEOUT_SECONDS' default: a key's longest wait


class HttpConnection:
    """One HTTP/1.1 client connection (keep-alive), reopened when the server closed it."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: Optional[asyncio.StreamReader] = None
        self.writer: Optional[asyncio.StreamWriter] = None

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: Optional[Dict[str, str]] = None,
                      keep_alive: bool = True) -> Tuple[int, bytes]:
        """Send one request; returns (status, body).  Raises OSError / asyncio errors when the
        connection fails."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if not keep_alive:
            head.append("Connection: close")
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        try:
            line = await self.reader.readuntil(b"\r\n\r\n")
            lines = line.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ")[1])
            length, close = 0, not keep_alive
            for h in lines[1:]:
                name, _, value = h.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "connection" and "close" in value.lower():
                    close = True
            data = await self.reader.readexactly(length) if length else b""
        except BaseException:
            self.close()
            raise
        if close or lines[0].startswith("HTTP/1.0"):
            self.close()
        return status, data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class Counters:
    """Requests answered per path, failures, and when."""

    def __init__(self):
        self.answered: Dict[str, int] = defaultdict(int)
        self.failed: Dict[str, int] = defaultdict(int)
        self.mesh_requests = 0
        self.mesh_bytes = 0
        self.mesh_errors = 0

    def snapshot(self) -> dict:
        return {"answered": dict(self.answered), "failed": dict(self.failed),
                "total": sum(self.answered.values()), "t": time.monotonic()}


class Coordinator:
    """Signed JSON requests to the launcher (``hvd_edl.client``'s scheme) on one connection."""

    def __init__(self, sim: "Simulator", env: Dict[str, str]):
        self.sim = sim
        self.secret = env[messages.ENV_SECRET]
        self.conn = HttpConnection(env[messages.ENV_COORD_ADDR], int(env[messages.ENV_COORD_PORT]))

    async def post(self, path: str, msg, reply_cls, retry_s: float = 30.0):
        body = messages.encode(msg)
        deadline = time.monotonic() + retry_s
        while True:
            headers = {messages.AUTH_HEADER: messages.sign(self.secret, "POST", path, body),
                       "Content-Type": "application/json"}
            try:
                status, data = await self.conn.request("POST", path, body, headers)
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                status, data = 0, b""
            if status == 200:
                self.sim.counters.answered[path] += 1
                return messages.decode(reply_cls, data)
            self.sim.counters.failed[path] += 1
            if status not in (0, 503) or time.monotonic() > deadline:
                raise RuntimeError(f"{path}: HTTP {status} {data[:200]!r}")
            self.conn.close()
            await asyncio.sleep(0.2)

    def close(self) -> None:
        self.conn.close()


class SimWorker:
    """One simulated training process (see the module docstring)."""

    def __init__(self, sim: "Simulator", worker_id: str, env: Dict[str, str]):
        self.sim, self.worker_id, self.env = sim, worker_id, env
        self.main = Coordinator(sim, env)
        self.beats = Coordinator(sim, env)
        self.watcher = Coordinator(sim, env)
        self.generation = 0
        self.assignment: Optional[messages.Assignment] = None
        self.steps = 0
        self.ready_reported = False
        self.leaving = False
        self.change = asyncio.Event()
        self.next_generation = asyncio.Event()
        self.tasks = []
        self.done = False
        self.watching = False
        self.beat_s = messages.BEAT_S

    def start(self) -> None:
        self.tasks.append(asyncio.ensure_future(self._life()))

    async def _life(self) -> None:
        code = 0
        try:
            await self.main.post("/register", messages.Register(self.worker_id),
                                 messages.Registered)
            self.tasks.append(asyncio.ensure_future(self._beat()))
            await asyncio.sleep(self.sim.build_s)
            self.ready_reported = True
            await self.main.post("/ready", messages.Ready(self.worker_id), messages.WatchReply)
            a = await self._switch("join")
            while a.action != "exit":
                self._enter(a)
                # reported before anything else goes on the main connection (the runtime reports
                # from a thread with its own session; 1,024 extra connections at each switch
                # would be the simulator's cost, not the protocol's)
                await self._started(a.generation)
                if not self.watching:
                    self.watching = True
                    self.tasks.append(asyncio.ensure_future(self._watch()))
                await self.change.wait()
                self.change.clear()
                await asyncio.sleep(self.sim.step_s)  # to the agreed step boundary
                self.steps += 1
                a = await self._switch("update")
            if self.generation > 0 and a.generation > self.generation:
                await self.main.post("/watch", messages.WatchRequest(
                    self.worker_id, a.generation, wait_s=10.0, until_started=True),
                    messages.WatchReply)
        except asyncio.CancelledError:
            return
        except Exception as e:  # noqa: BLE001 - a simulated worker that failed exits 1
            print(f"sim {self.worker_id}: {e!r}", file=sys.stderr, flush=True)
            code = 1
        self._exit(code)

    async def _switch(self, reason: str) -> messages.Assignment:
        first = time.monotonic()
        request = messages.SwitchRequest(self.worker_id, self.generation, reason, self.steps,
                                         self.steps)
        while True:
            a = await self.main.post("/switch", request, messages.Assignment)
            if a.action != "wait":
                now = time.monotonic()
                if a.action == "join":
                    g = self.sim.gens[a.generation]
                    g["members"] += 1
                    g["last_report"] = max(g["last_report"], first)
                    g["first_report"] = min(g["first_report"], first)
                    g["last_assigned"] = max(g["last_assigned"], now)
                    g["first_assigned"] = min(g["first_assigned"], now)
                    g["size"] = a.size
                return a

    def _enter(self, a: messages.Assignment) -> None:
        self.assignment = a
        self.generation = a.generation
        self.boundary_at = time.monotonic()
        self.next_generation.set()

    async def _started(self, generation: int) -> None:
        g = self.sim.gens[generation]
        stall = time.monotonic() - self.boundary_at
        await self.main.post("/started", messages.Started(
            self.worker_id, generation, stall, self.steps, {"wait_s": stall}),
            messages.WatchReply)
        g["started"] += 1
        g["last_started"] = max(g["last_started"], time.monotonic())

    async def _watch(self) -> None:
        while True:
            gen = self.generation
            r = await self.watcher.post("/watch", messages.WatchRequest(
                self.worker_id, gen, step=self.steps), messages.WatchReply)
            if gen != self.generation:
                continue
            if not r.change_pending and r.latest_generation <= gen:
                continue
            self.change.set()
            while gen == self.generation:
                self.next_generation.clear()
                await self.next_generation.wait()

    async def _beat(self) -> None:
        next_at = time.monotonic()
        while True:
            try:
                reply = await self.beats.post("/beat", messages.Beat(
                    self.worker_id, self.generation, self.steps), messages.BeatReply, retry_s=0)
                if reply.fenced:
                    self.kill(-signal.SIGKILL)
                    return
                self.beat_s = getattr(reply, "beat_s", 0.0) or messages.BEAT_S
            except RuntimeError:
                pass
            if self.sim.flooding:
                await asyncio.sleep(0)
                next_at = time.monotonic()
                continue
            next_at = max(next_at + self.beat_s, time.monotonic())
            await asyncio.sleep(next_at - time.monotonic())

    def signal(self, sig: int) -> None:
        if sig == signal.SIGKILL:
            self.kill(-signal.SIGKILL)
        elif not self.ready_reported or self.leaving:
            self.kill(0 if not self.leaving else -sig)
        else:
            self.leaving = True
            asyncio.ensure_future(self._leave(sig))

    async def _leave(self, sig: int) -> None:
        once = Coordinator(self.sim, self.env)  # the runtime's leave thread: its own session
        try:
            a = await once.post("/leave", messages.Leave(self.worker_id), messages.Assignment)
        except RuntimeError:
            a = messages.Assignment(action="exit")
        finally:
            once.close()
        if a.action == "exit":
            self.kill(-sig)

    def kill(self, code: int) -> None:
        for t in self.tasks:
            if t is not asyncio.current_task():
                t.cancel()
        self._exit(code)

    def _exit(self, code: int) -> None:
        if self.done:
            return
        self.done = True
        for c in (self.main, self.beats, self.watcher):
            c.close()
        self.sim.workers.pop(self.worker_id, None)
        self.sim.say({"ev": "exit", "id": self.worker_id, "code": code})


def _gen_record() -> dict:
    inf = float("inf")
    return {"members": 0, "size": 0, "first_report": inf, "last_report": -inf,
            "first_assigned": inf, "last_assigned": -inf, "started": 0, "last_started": -inf}


class Simulator:
    """The load generator: spawns :class:`SimWorker` tasks on the launcher's command."""

    def __init__(self, build_s: float, step_s: float):
        self.build_s, self.step_s = build_s, step_s
        self.workers: Dict[str, SimWorker] = {}
        self.gens: Dict[int, dict] = defaultdict(_gen_record)
        self.counters = Counters()
        self.flooding = False

    def say(self, obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    async def command(self, cmd: dict) -> None:
        op = cmd.get("op")
        if op == "spawn":
            w = SimWorker(self, cmd["id"], cmd["env"])
            self.workers[w.worker_id] = w
            w.start()
        elif op == "signal":
            w = self.workers.get(cmd["id"])
            if w is not None:
                w.signal(int(cmd["sig"]))
        elif op == "gen":
            rec = dict(self.gens.get(int(cmd["generation"]), _gen_record()))
            self.say({"ev": "gen", "generation": cmd["generation"],
                      **{k: (None if abs(v) == float("inf") else v) for k, v in rec.items()}})
        elif op == "counters":
            self.say({"ev": "counters", **self.counters.snapshot()})
        elif op == "flood":
            before = self.counters.snapshot()
            self.flooding = True
            await asyncio.sleep(float(cmd["seconds"]))
            self.flooding = False
            after = self.counters.snapshot()
            self.say({"ev": "flood", "requests": after["total"] - before["total"],
                      "seconds": after["t"] - before["t"]})
        elif op == "mesh":
            self.say({"ev": "mesh", **await self.mesh(cmd.get("sample"))})

    async def mesh(self, sample: Optional[int]) -> dict:
        members = [w for w in self.workers.values() if w.assignment is not None
                   and w.assignment.action == "join"]
        if not members:
            return {"error": "no members"}
        gen = max(w.generation for w in members)
        members = sorted((w for w in members if w.generation == gen),
                         key=lambda w: w.assignment.rank)
        size = members[0].assignment.size
        doers = set(range(size)) if not sample else \
            {round(i * (size - 1) / max(sample - 1, 1)) for i in range(min(sample, size))}
        c = self.counters
        c.mesh_requests = c.mesh_bytes = c.mesh_errors = 0
        t0 = time.monotonic()
        await asyncio.gather(*(self._mesh_rank(w, w.assignment.rank in doers) for w in members))
        return {"generation": gen, "size": size, "ranks_doing_gets": len(doers),
                "wall_s": time.monotonic() - t0, "requests": c.mesh_requests,
                "bytes": c.mesh_bytes, "errors": c.mesh_errors}

    async def _mesh_rank(self, w: SimWorker, gets: bool) -> None:
        a = w.assignment
        scopes = [("global", a.rank, a.size), (f"local{a.hostname}", a.local_rank, a.local_size),
                  (f"cross{a.local_rank}", a.cross_rank, a.cross_size)]
        for scope, rank, size in scopes:
            if size > 1:
                await self._full_mesh(a, scope, rank, size, gets)

    async def _store(self, a: messages.Assignment, method: str, path: str,
                     body: bytes = b"") -> Optional[bytes]:
        """One HTTPStore request (a fresh connection); the value, or None for a 404."""
        headers = {"X-Hvd-Edl-Rendezvous-Token": a.rendezvous_token}
        for _ in range(STORE_TRIES):
            conn = HttpConnection(a.rendezvous_addr, a.rendezvous_port)
            try:
                status, data = await conn.request(method, path, body, headers, keep_alive=False)
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                status, data = 0, b""
            finally:
                conn.close()
            self.counters.mesh_requests += 1
            self.counters.mesh_bytes += len(data) + len(body)
            if status == 200:
                return data
            if status == 404:
                return None
            self.counters.mesh_errors += 1
            await asyncio.sleep(STORE_RETRY_S)
        raise RuntimeError(f"rendezvous {method} {path}: failed {STORE_TRIES} times")

    async def _full_mesh(self, a, scope: str, rank: int, size: int, gets: bool) -> None:
        try:
            await self._store(a, "PUT", f"/{scope}/rank_{rank}", a.hostname.encode())
            if gets:
                for i in range(rank):
                    await self._store(a, "GET", f"/{scope}/rank_{i}")
            await self._store(a, "PUT", f"/{scope}/{rank}",
                              bytes(GLOO_ADDRESS_BYTES * (size - 1)))
            if gets:
                for i in range(size):
                    if i == rank:
                        continue
                    waited = time.monotonic() + GLOO_TIMEOUT_S
                    while await self._store(a, "GET", f"/{scope}/{i}") is None:
                        if time.monotonic() > waited:  # Gloo's "Wait timeout" (30 s)
                            raise RuntimeError(f"key {scope}/{i} not there after 30 s")
                        await asyncio.sleep(STORE_POLL_S)
                    await self._store(a, "GET", f"/{scope}/{i}")
        except RuntimeError as e:
            print(f"sim mesh rank {rank} {scope}: {e}", file=sys.stderr, flush=True)


async def _main(args) -> None:
    sim = Simulator(args.build_s, args.step_s)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = await reader.readline()
        if not line:
            break
        asyncio.ensure_future(sim.command(json.loads(line)))
    for w in list(sim.workers.values()):
        w.kill(-signal.SIGKILL)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-s", type=float, default=0.5,
                   help="seconds a joiner 'builds' between /register and /ready")
    p.add_argument("--step-s", type=float, default=0.01,
                   help="seconds from a change being announced to the step boundary")
    args = p.parse_args(argv)
    asyncio.run(_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
