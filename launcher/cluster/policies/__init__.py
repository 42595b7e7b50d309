"""The scheduling policies, one module each: ``fifo``, ``tiresias``, ``edl``
(:class:`launcher.cluster.policy.Policy` subclasses)."""
