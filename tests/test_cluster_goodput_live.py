"""The ``goodput`` policy live (issue 41 s2): the cluster service learns a real job's goodput from
its telemetry (its script opted in to an adaptive batch, examples/train_digits.py
--adaptive-batch) and passes it the batch chosen with its allocation through the job's
``/ctl/batch``; the job applies it at a switch.  Long (a real job runs until its model is
learned): ``make test-long``."""
import pytest

from conftest import STOP_FILE, long_digits
from test_cluster_service import service, wait_for  # noqa: F401 - the fixture


@pytest.mark.long
def test_service_passes_the_goodput_policys_batch_to_a_job_that_opted_in(service, tmp_path):  # noqa: F811
    from launcher.cluster.runs import JobFiles
    from launcher.serve.control import ControlClient, ControlError
    svc = service("--policy", "goodput", "-H", "localhost:2", "--round", "1")
    job = svc.submit("--np", "2", "--min-np", "1", "--max-np", "2", "--",
                     *long_digits(tmp_path, "--adaptive-batch", "--global-batch-size", "16",
                                  "--max-batch", "512", "--max-local-batch", "64",
                                  "--commit-every", "4"))
    ev = wait_for("the service passing a batch", lambda: svc.events(job, "batch"), 240,
                  lambda: svc.output() + svc.job_logs())
    batch = ev[-1]["batch"]
    assert batch != 16 and 16 <= batch <= 512, ev
    client = ControlClient(JobFiles(svc.state, job).job_file, timeout_s=5.0)

    def in_force():
        try:
            return (client.call("telemetry").get("adaptive_batch") or {}).get("batch")
        except ControlError:
            return None
    wait_for(f"batch {batch} in force", lambda: in_force() == svc.events(job, "batch")[-1][
        "batch"], 120, lambda: svc.job_logs())
    (tmp_path / STOP_FILE).touch()
    svc.wait_jobs(lambda j: j[job]["state"] == "done", "the job's end", 180)
