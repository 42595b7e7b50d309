"""Ray as the engine of a job (``hvd-edl-run --ray ADDRESS``): the cluster's nodes are the hosts,
actors hold the workers' places, and the launcher's own links and heartbeats keep the job going
whatever Ray's head does.  One idea per file:

* ``engine.py``: the launcher's handle on Ray: hosts and slots from the nodes (discovery), and
  starting a worker on a node (spawning); the only two questions the driver asks;
* ``agent.py``: the Ray driver, a child process (the only importer of ``ray``), so that a lost
  head never blocks or ends the launcher;
* ``actor.py``: the actor on a node that reserves a worker's resources and starts its
  supervisor, detached;
* ``link.py``: the connections the node dials back to the launcher (the worker's stdin, output
  and exit code, as an ssh session carries them);
* ``worker.py``: a worker on a Ray node as the driver sees it (the ``WorkerProcess`` interface).

See docs/ray.md.
"""
