"""The multi-tenant cluster layer (EDL's subject: one scheduler sharing a pool of hosts among many
elastic jobs).

* :mod:`launcher.cluster.policy`: what a scheduling policy sees (a :class:`Snapshot`) and decides
  (host -> slots per job), and the checks every decision passes;
* :mod:`launcher.cluster.policies`: ``fifo``, ``tiresias``, ``edl``, one module each, the same
  objects used live (the service) and in the simulator;
* the service (``hvd-edl-cluster``), its SQLite store and the simulator live beside them.

The service is a *client* of its jobs: each job is an ordinary ``hvd-edl-run`` whose host
discovery is the service's allocation for it, steered only through the public control API.
"""
