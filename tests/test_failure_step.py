"""The step a failure generation reports (``GenerationEvent.step``, the event log's "at step N")
is the commit its survivors restored, also when a joiner that never finished its state sync is
among the reporters (its count is 0: it holds no commit of the ring).  Unit level: a real
``Coordinator`` fed the workers' messages; no processes, no rendezvous servers."""
from hvd_edl import messages
from launcher.job.registry import WorkerRecord

from test_migration import _ring_of_two


def test_a_failure_reports_the_survivors_restored_step_not_a_joiners_zero():
    coord = _ring_of_two()
    assert coord.current.members == ["w1", "w2"]
    coord.add_worker(WorkerRecord("w3", "localhost", 2, 3, 0.0))
    coord.ready(messages.Ready("w3"))
    for w in ("w1", "w2"):  # the ring agrees at the commit of step 50: w3 joins
        coord.switch(messages.SwitchRequest(w, 1, "update", 50, 50, wait_s=0))
    g = coord.current
    assert (g.number, g.kind, g.members, g.step) == (2, "scale_out", ["w1", "w2", "w3"], 50)
    for w in ("w1", "w2", "w3"):
        coord.started(messages.Started(w, 2, 0.1, 50 if w != "w3" else 0, {}))
    # rank 0 (w1) is killed in generation 2's sync: w2 restored its commit of step 60 (from
    # 64); w3's sync never finished, its count is still 0
    coord.on_exit("w1", -9)
    coord.switch(messages.SwitchRequest("w3", 2, "failure", 0, 0, wait_s=0))
    coord.switch(messages.SwitchRequest("w2", 2, "failure", 60, 64, wait_s=0))
    g = coord.current
    assert (g.number, g.kind, g.members, g.step, g.rolled_back_steps) == \
        (3, "failure", ["w2", "w3"], 60, 4)
