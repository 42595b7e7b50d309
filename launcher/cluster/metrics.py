"""Prometheus metrics of the cluster service (``hvd-edl-cluster serve --metrics-port PORT``),
served by :class:`launcher.observe.metrics.MetricsServer` (prometheus-client's WSGI app behind
the bounded server) from a collector that reads the service when ``/metrics`` is scraped.

==========================================  =========  ========================================
metric                                      type       what
==========================================  =========  ========================================
``hvd_edl_cluster_slots{state}``            gauge      slots ``used``, ``free``, ``lent`` (held
                                                       by running jobs beyond their ``np``),
                                                       ``total``
``hvd_edl_cluster_queue_length``            gauge      jobs queued or suspended
``hvd_edl_cluster_jobs{state}``             gauge      jobs per state
``hvd_edl_cluster_job_world_size{job}``     gauge      slots each running job holds
``hvd_edl_cluster_jct_seconds``             histogram  completion time of each job done
                                                       (submission to end)
``hvd_edl_cluster_decisions_total{kind}``   counter    decisions: start, grow, shrink, move,
                                                       preempt, resume, released, adopt
==========================================  =========  ========================================
"""
from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from launcher.cluster.store import STATES

JCT_BUCKETS_S = (10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 12 * 3600)


class ClusterCollector:
    """Metric families of one :class:`launcher.cluster.service.Service`."""

    def __init__(self, service):
        self.service = service

    def describe(self):
        return []

    def collect(self) -> Iterator:
        svc = self.service
        status = svc.status()
        slots = GaugeMetricFamily("hvd_edl_cluster_slots", "Slots of the pool by state.",
                                  labels=["state"])
        for k in ("used", "free", "lent", "total"):
            slots.add_metric([k], status["slots"][k])
        yield slots
        yield GaugeMetricFamily("hvd_edl_cluster_queue_length", "Jobs queued or suspended.",
                                value=len(status["queue"]))
        jobs = GaugeMetricFamily("hvd_edl_cluster_jobs", "Jobs by state.", labels=["state"])
        for state in STATES:
            jobs.add_metric([state], sum(1 for j in status["jobs"] if j["state"] == state))
        yield jobs
        ws = GaugeMetricFamily("hvd_edl_cluster_job_world_size", "Slots a running job holds.",
                               labels=["job"])
        for j in status["jobs"]:
            if j["state"] == "running":
                ws.add_metric([j["id"]], j["world_size"])
        yield ws
        jct = [j["finished_at"] - j["submitted_at"] for j in status["jobs"]
               if j["state"] == "done" and j["finished_at"]]
        buckets = [(repr(float(b)), sum(1 for x in jct if x <= b)) for b in JCT_BUCKETS_S]
        buckets.append(("+Inf", len(jct)))
        yield HistogramMetricFamily("hvd_edl_cluster_jct_seconds",
                                    "Job completion time, submission to end (seconds).",
                                    buckets=buckets, sum_value=sum(jct))
        dec = CounterMetricFamily("hvd_edl_cluster_decisions", "Decisions taken, by kind.",
                                  labels=["kind"])
        for kind, n in sorted(dict(svc.decisions).items()):
            dec.add_metric([kind], n)
        yield dec
