"""The core of one job: the driver's loop (``driver.py``), membership and generations
(``coordinator.py``, with ``formation.py``: when the next generation forms; ``polls.py``: the
workers' long polls; ``liveness.py``: where a silent peer is detected), worker records
(``registry.py``), a Gloo rendezvous per generation (``rendezvous.py``), the slot book
(``slot_book.py``) and the checkpoint directory (``checkpoint_dir.py``)."""
