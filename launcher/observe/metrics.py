"""Prometheus metrics of a running job (``hvd-edl-run --metrics-port PORT``).

A custom collector (prometheus-client's ``Collector`` protocol: ``collect()`` yields metric
families) reads :class:`launcher.observe.telemetry.Telemetry` when ``/metrics`` is scraped: no thread or
state per metric, nothing on the training path.  prometheus-client's own WSGI app
(``make_wsgi_app``: the same exposition as its ``start_http_server``, the text format, OpenMetrics
when asked for, gzip when accepted, ``?name[]=`` filters, any path) answers each request, served on
the launcher's bind address by the bounded server of :mod:`launcher.serve.bounded_http` on one asyncio
thread: at most ``MAX_CONNECTIONS`` connections (503 past it), a request head of 16 KiB sent
within ``HEADER_TIMEOUT_S`` (408), one request per connection, a listen backlog of 1,024, and no
thread per connection (prometheus-client's server started one per connection, never timed a
head out and had a backlog of 5: 275 slow connections made 285 launcher threads).  Anyone who
can reach the port may scrape, as before (a Prometheus server usually runs as its own user).

=========================================  =========  ============================================
metric                                     type       what
=========================================  =========  ============================================
``hvd_edl_world_size``                     gauge      members of the current generation
``hvd_edl_target_world_size``              gauge      the world size the launcher aims at now
``hvd_edl_generation``                     gauge      number of the current generation
``hvd_edl_stall_seconds``                  histogram  stall of each generation change (s)
``hvd_edl_steps_per_second``               gauge      optimizer steps/s (mean over members)
``hvd_edl_samples_per_second``             gauge      samples/s of the job (sum over workers)
``hvd_edl_worker_step_seconds``            gauge      mean seconds per step, per worker
``hvd_edl_worker_compute_seconds``         gauge      ... of it computing
``hvd_edl_worker_wait_seconds``            gauge      ... of it blocked in collectives
``hvd_edl_worker_samples_per_second``      gauge      samples/s of the worker
``hvd_edl_worker_steps_total``             counter    timed steps the worker reported
``hvd_edl_failures_total`` ...             counter    failures, evictions, stragglers,
                                                      migrations, autoscale decisions
=========================================  =========  ============================================

Per-worker metrics carry the labels ``worker``, ``host`` and ``rank`` (-1: not a member); the
means are over ``Telemetry.window_s`` (5 s).
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Iterator, List, Tuple
from urllib.parse import unquote

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from launcher.serve.bounded_http import (ServingThread, BodyReader, BoundedHTTPServer, Limits, Request, Response,
                                   connection_cap, listen_socket)
from launcher.observe.telemetry import COUNTER_KINDS, Telemetry

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024  # a Prometheus server holds one; the rest is room for a flood of slow ones
HEADER_TIMEOUT_S = 5.0  # to send the request head on a new connection (a scrape sends it at once)

# stalls run from ~0.1 s (a stop-free scale-out) to tens of seconds (a timeout-bound failure)
STALL_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_COUNTER_NAMES = {"failure": "failures", "eviction": "evictions", "straggler": "stragglers",
                  "migration": "migrations", "autoscale": "autoscale_decisions"}
assert set(_COUNTER_NAMES) == set(COUNTER_KINDS)


class JobCollector:
    """Metric families of one job, read from ``telemetry`` at each scrape.

    Args:
        telemetry: the coordinator's telemetry.
        target_world_size: callable answering the world size the launcher aims at now.
    """

    def __init__(self, telemetry: Telemetry, target_world_size: Callable[[], int]):
        self.telemetry = telemetry
        self.target_world_size = target_world_size

    def describe(self):
        return []  # no collect() at registration (the families depend on the workers)

    def collect(self) -> Iterator:
        tel = self.telemetry
        job = tel.job()
        yield GaugeMetricFamily("hvd_edl_world_size", "Members of the current generation.",
                                value=job["world_size"])
        yield GaugeMetricFamily("hvd_edl_target_world_size",
                                "World size the launcher aims at now (usable slots up to the "
                                "target).", value=self.target_world_size())
        yield GaugeMetricFamily("hvd_edl_generation", "Number of the current generation.",
                                value=job["generation"])
        stalls = [s for _, _, s in tel.stalls()]
        buckets = [(_le(b), sum(1 for s in stalls if s <= b)) for b in STALL_BUCKETS_S]
        buckets.append(("+Inf", len(stalls)))
        yield HistogramMetricFamily("hvd_edl_stall_seconds",
                                    "Stall of each generation change: the longest pause of a "
                                    "worker that trained in both rings (seconds).",
                                    buckets=buckets, sum_value=sum(stalls))
        yield GaugeMetricFamily("hvd_edl_steps_per_second",
                                "Optimizer steps per second (mean over the members, last "
                                f"{tel.window_s:g} s).", value=job["steps_per_s"])
        yield GaugeMetricFamily("hvd_edl_samples_per_second",
                                f"Samples per second of the job (last {tel.window_s:g} s).",
                                value=job["samples_per_s"])
        noise = tel.gradient_noise()
        if noise is not None:  # McCandlish's estimates (hvd_edl.gradient_noise)
            for key, doc in (("sqr", "Squared norm of the true gradient |G|^2 (smoothed)."),
                             ("var", "Trace of one sample's gradient covariance (smoothed)."),
                             ("noise_scale_samples", "Gradient noise scale tr(Sigma)/|G|^2 "
                                                     "(samples)."),
                             ("batch", "Global batch of the last measured step (samples)."),
                             ("step", "The job's optimizer step of the last measured step."),
                             ("measured_steps", "Steps measured (every k-th is).")):
                if noise.get(key) is not None:
                    yield GaugeMetricFamily(f"hvd_edl_gradient_noise_{key}", doc,
                                            value=noise[key])
        plan = tel.adaptive_batch()
        if plan is not None:
            yield GaugeMetricFamily("hvd_edl_global_batch", "Global batch of the adaptive "
                                    "batch sampler (samples per optimizer step).",
                                    value=plan["batch"])
        labels = ["worker", "host", "rank"]
        fams = {key: GaugeMetricFamily(f"hvd_edl_worker_{key}", doc, labels=labels)
                for key, doc in (
                    ("step_seconds", "Mean seconds per optimizer step."),
                    ("compute_seconds", "Mean seconds per step computing (step - wait)."),
                    ("wait_seconds", "Mean seconds per step blocked in Horovod collectives."),
                    ("samples_per_second", "Samples per second of the worker."))}
        steps = CounterMetricFamily("hvd_edl_worker_steps", "Timed optimizer steps reported.",
                                    labels=labels)
        for w in tel.workers():
            lv = [w.worker_id, w.host, str(w.rank)]
            for key, value in (("step_seconds", w.step_s), ("compute_seconds", w.compute_s),
                               ("wait_seconds", w.wait_s)):
                if not math.isnan(value):
                    fams[key].add_metric(lv, value)
            fams["samples_per_second"].add_metric(lv, w.samples_per_s)
            steps.add_metric(lv, w.steps)
        yield from fams.values()
        yield steps
        counts = tel.counters()
        for kind, name in _COUNTER_NAMES.items():
            yield CounterMetricFamily(f"hvd_edl_{name}",
                                      f"{name.replace('_', ' ').capitalize()} so far.",
                                      value=counts.get(kind, 0))
        others = {k: v for k, v in counts.items() if k not in _COUNTER_NAMES}
        if others:
            fam = CounterMetricFamily("hvd_edl_events", "Other counted events, by kind.",
                                      labels=["kind"])
            for k, v in sorted(others.items()):
                fam.add_metric([k], v)
            yield fam


def _le(bound: float) -> str:
    return repr(float(bound))


class MetricsServer:
    """``/metrics`` of one :class:`JobCollector`: prometheus-client's WSGI app behind the bounded
    server (module docstring), on a daemon thread running one asyncio loop.

    Args:
        collector: what ``/metrics`` shows.
        bind_addr: address to listen on (the launcher's, default 127.0.0.1).
        port: TCP port, 0 for a free one (:attr:`port` says which).

    Raises:
        OSError: the address or port cannot be bound (in use, not local).
    """

    def __init__(self, collector: JobCollector, bind_addr: str, port: int):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self._app = make_wsgi_app(self.registry)
        self.limits = Limits(max_connections=connection_cap(MAX_CONNECTIONS),
                             header_timeout_s=HEADER_TIMEOUT_S)
        self._sock = listen_socket(bind_addr, port, self.limits.backlog)
        self.port = self._sock.getsockname()[1]
        self.http = BoundedHTTPServer(self._handle, self.limits, name="metrics",
                                      keep_alive=False, same_user_only=False)
        self.serving = ServingThread(self.http, self._sock, "metrics")
        try:
            self.serving.start()
        except BaseException:
            self.stop()
            raise

    def url(self, host: str) -> str:
        """``http://host:port/metrics`` (IPv6 hosts bracketed)."""
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop serving and close every connection (waits at most about 5 s)."""
        self.serving.stop()

    async def _handle(self, request: Request, body_reader: BodyReader) -> Response:
        """One request through prometheus-client's WSGI app (its methods, paths and formats)."""
        path, _, query = request.path.partition("?")
        environ = {"REQUEST_METHOD": request.method, "PATH_INFO": unquote(path, "latin-1"),
                   "QUERY_STRING": query, "SERVER_PROTOCOL": request.version}
        for name in ("accept", "accept-encoding"):
            if name in request.headers:
                environ["HTTP_" + name.upper().replace("-", "_")] = request.headers[name]
        answer: List[Tuple[str, List[Tuple[str, str]]]] = []
        body = b"".join(self._app(environ, lambda status, headers: answer.append(
            (status, headers))))
        status, headers = answer[0]
        content_type = next((v for k, v in headers if k.lower() == "content-type"),
                            "text/plain; charset=utf-8")
        return Response(int(status.split(" ", 1)[0]), body, content_type, close=True,
                        headers=tuple((k, v) for k, v in headers
                                      if k.lower() != "content-type"))
