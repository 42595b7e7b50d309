"""What an operator sees of a job: the event log (``events.py``), the heartbeats' telemetry
windows (``telemetry.py``), Prometheus metrics (``metrics.py``), ``hvd-edl-ctl top``
(``top.py``) and the members' progress reports (``progress.py``)."""
