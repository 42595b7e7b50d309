"""Prometheus metrics of the cluster service (``hvd-edl-cluster serve --metrics-port PORT``),
served by :class:`launcher.observe.metrics.MetricsServer` (prometheus-client's WSGI app behind
the bounded server) from a collector that reads the service when ``/metrics`` is scraped.

=============================================  =========  =====================================
metric                                         type       what
=============================================  =========  =====================================
``hvd_edl_cluster_jobs_pending``               gauge      jobs waiting for slots (queued or
                                                          suspended)
``hvd_edl_cluster_jobs_running``               gauge      jobs running
``hvd_edl_cluster_jobs{state}``                gauge      jobs per state (every state)
``hvd_edl_cluster_queue_length``               gauge      jobs queued or suspended (the same
                                                          as ``jobs_pending``)
``hvd_edl_cluster_slots_allocated``            gauge      slots the jobs hold (until their
                                                          workers there are gone)
``hvd_edl_cluster_slots{state}``               gauge      slots ``used``, ``free``, ``lent``
                                                          (held by running jobs beyond their
                                                          ``np``), ``total``
``hvd_edl_cluster_job_world_size{job}``        gauge      workers in a running job's ring, from
                                                          its last telemetry answer (0 before
                                                          its first ring)
``hvd_edl_cluster_job_slots_allocated{job}``   gauge      slots a running job is allocated
``hvd_edl_cluster_user_jobs_pending{user}``   gauge      a user's jobs queued or suspended
``hvd_edl_cluster_user_jobs_running{user}``   gauge      a user's jobs running
``hvd_edl_cluster_user_slots_allocated{user}``  gauge    slots a user's running jobs are
                                                          allocated (what ``--user-quota`` caps)
``hvd_edl_cluster_preemptions_total``          counter    running jobs preempted (checkpoint,
                                                          then stopped; a shrink is not one)
``hvd_edl_cluster_job_restarts_total``         counter    runs started after a job's first (a
                                                          resume from its checkpoint)
``hvd_edl_cluster_job_failures_total``         counter    jobs ended ``failed``
``hvd_edl_cluster_jct_seconds``                histogram  completion time of each job done
                                                          (submission to end)
``hvd_edl_cluster_decisions_total{kind}``      counter    decisions: start, grow, shrink, move,
                                                          preempt, resume, released, adopt
=============================================  =========  =====================================

The counters count from the store (the cluster's whole history, so a restarted service goes on
from where it was); the gauges are read when ``/metrics`` is scraped.  Names follow Prometheus'
conventions (``_total`` counters, ``_seconds``, one gauge per quantity and a label for its
parts, as kube-state-metrics' ``kube_pod_status_phase`` and Slurm's exporter's
``slurm_queue_pending`` / ``slurm_queue_running``).
"""
from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from launcher.cluster.store import STATES

JCT_BUCKETS_S = (10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 12 * 3600)


def ring_size(telemetry) -> int:
    """The workers in a job's ring from the service's last ``(at, answer)`` of its
    ``/ctl/telemetry`` (0 when there is none yet)."""
    if not telemetry:
        return 0
    job = (telemetry[1] or {}).get("job") or {}
    size = job.get("world_size", 0)
    return size if isinstance(size, int) and not isinstance(size, bool) else 0


class ClusterCollector:
    """Metric families of one :class:`launcher.cluster.service.Service`."""

    def __init__(self, service):
        self.service = service

    def describe(self):
        return []

    @staticmethod
    def allocated(status: dict) -> Iterator:
        """The slots held: ``hvd_edl_cluster_slots_allocated`` (the total; the place for a
        per-GPU family beside it)."""
        yield GaugeMetricFamily("hvd_edl_cluster_slots_allocated",
                                "Slots the jobs hold (until their workers there are gone).",
                                value=status["slots"]["used"])

    @staticmethod
    def per_user(jobs) -> Iterator:
        """Per user (every user with a job not ended, and every user of a job at all): jobs
        pending, running, and the slots their running jobs are allocated."""
        pending, running, slots = {}, {}, {}
        for j in jobs:
            u = j.get("user") or ""
            for d in (pending, running, slots):
                d.setdefault(u, 0)
            if j["state"] in ("queued", "suspended"):
                pending[u] += 1
            elif j["state"] == "running":
                running[u] += 1
                slots[u] += j.get("allocated", j["world_size"])
        for name, doc, values in (
                ("hvd_edl_cluster_user_jobs_pending", "A user's jobs queued or suspended.",
                 pending),
                ("hvd_edl_cluster_user_jobs_running", "A user's jobs running.", running),
                ("hvd_edl_cluster_user_slots_allocated",
                 "Slots a user's running jobs are allocated.", slots)):
            family = GaugeMetricFamily(name, doc, labels=["user"])
            for u, n in sorted(values.items()):
                family.add_metric([u], n)
            yield family

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
        count = {state: sum(1 for j in status["jobs"] if j["state"] == state)
                 for state in STATES}
        yield GaugeMetricFamily("hvd_edl_cluster_jobs_pending",
                                "Jobs waiting for slots (queued or suspended).",
                                value=count["queued"] + count["suspended"])
        yield GaugeMetricFamily("hvd_edl_cluster_jobs_running", "Jobs running.",
                                value=count["running"])
        jobs = GaugeMetricFamily("hvd_edl_cluster_jobs", "Jobs by state.", labels=["state"])
        for state in STATES:
            jobs.add_metric([state], count[state])
        yield jobs
        yield from self.allocated(status)
        running = [j for j in status["jobs"] if j["state"] == "running"]
        ws = GaugeMetricFamily("hvd_edl_cluster_job_world_size",
                               "Workers in a running job's ring, from its telemetry.",
                               labels=["job"])
        held = GaugeMetricFamily("hvd_edl_cluster_job_slots_allocated",
                                 "Slots a running job is allocated.", labels=["job"])
        for j in running:
            ws.add_metric([j["id"]], ring_size(svc.telemetry.get(j["id"])))
            held.add_metric([j["id"]], j.get("allocated", j["world_size"]))
        yield ws
        yield held
        yield from self.per_user(status["jobs"])
        events = svc.store.event_counts()
        yield CounterMetricFamily("hvd_edl_cluster_preemptions",
                                  "Running jobs preempted (checkpoint, then stopped).",
                                  value=events.get("suspend", 0))
        yield CounterMetricFamily("hvd_edl_cluster_job_restarts",
                                  "Runs started after a job's first (resumes).",
                                  value=sum(max(0, j["runs"] - 1) for j in status["jobs"]))
        yield CounterMetricFamily("hvd_edl_cluster_job_failures", "Jobs ended failed.",
                                  value=count["failed"])
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
