"""The driver side of hvd_edl, one room per concern:

* ``cli.py`` (``hvd-edl-run``) and ``ctl.py`` (``hvd-edl-ctl``): the two commands;
* ``job/``: the core of one job: the driver's loop, membership and generations (where a worker
  joins: ``formation.py``; where a silent peer is detected: ``liveness.py``), the rendezvous,
  the slot book, the checkpoint directory;
* ``spawn/``: where a worker process starts, locally or over ssh;
* ``serve/``: the servers and their security (bounded HTTP, authentication, socket owners);
* ``discovery/``: host discovery, host names, the ready discovery scripts;
* ``apps/``: EDL's applications (migration, stragglers, profiling, speed model, autoscaling),
  clients of the driver's public interface;
* ``observe/``: the event log, telemetry, metrics, ``top``, progress.
"""
