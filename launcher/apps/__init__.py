"""EDL's applications of elasticity (arXiv 1909.11985; CM-DARE, arXiv 2004.03072), each a
client of the driver's public interface (``launcher.job.driver.Driver``: set_target,
start_worker, ask_to_leave, swap, note, ring ...): job migration (``migration.py``), where a
straggler is found and replaced (``straggler.py``), profiling through elasticity
(``profiler.py``), the speed model (``speed_model.py``), autoscaling on efficiency and cost
(``autoscale.py``)."""
