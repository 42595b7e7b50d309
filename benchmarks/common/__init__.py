"""The benchmarks' library, not a benchmark: what the scripts in ``benchmarks/<room>/`` share.
Nothing in this package measures anything or writes results, and no benchmark script is
imported by another: what two of them need lives here.

* ``jobs``: the job harness (``WorkloadJob``, ``Job``, ``stop_launcher``) and what is measured
  from the workers' timelines (``change_stall``, ``kill_outcome``), ``machine_info``;
* ``workload.py``: the training script the harness starts (the digits CNN writing per-step
  timelines); run by launchers, never imported;
* ``chaos_harness``: what the two chaos runners share (the digits job in audit mode, the run,
  the bad-discovery fault, the checks, the report);
* ``cluster_service``: the cluster service driven from a benchmark (``Serve``), the reclaim's
  parts, ``in_cluster`` (a benchmark run inside the namespace test cluster);
* ``namespace_cluster``: the namespace test cluster (tests/cluster.py, loaded by path) and
  ``reset_hosts``, for the benchmarks that run on it;
* ``gpu_sampler``: which GPU every live worker process selects, sampled from its environment
  (tests/test_cluster_gpus.py and cluster/gpu_placement.py);
* ``ring_env``: Horovod ranks started by hand, without a launcher (each rank's environment, a
  rendezvous server that counts requests); also imported by the tests of our Horovod patches.

A script puts the repository root first on ``sys.path`` and imports from here::

    ROOT = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(ROOT))
    from benchmarks.common.ring_env import rank_env  # noqa: E402

(tests append the root instead: ``sys.path.append(str(ROOT))``).
"""
