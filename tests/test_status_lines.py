"""What ``status`` and ``top`` print under a job with an objective
(:func:`launcher.cluster.top.frame_lines`): the current choice and its prediction (after a
move, the move's, with the first beside it), what a job without a choice waits for (its speed,
measured on the type it started on), small costs with enough digits, and lines wrapped at the
terminal's width (``COLUMNS`` honoured), never cut.  Pure: frames of hand-made status answers
(the newcomer's report: ``spent $0.000``, ``no choice yet`` for whole short jobs)."""
from __future__ import annotations

from launcher.cluster import top


def _choice(t, spot, time_s, cost):
    return {"type": t, "spot": spot, "n": 1, "time_s": time_s, "cost_usd": cost, "fits": True}


def _status(goal, state="running", cost=0.000658):
    row = {"id": "j1", "name": "train.py", "user": "u", "state": state, "world_size": 1,
           "allocated": 1, "np": 1, "min_np": 1, "max_np": 1, "submitted_at": 0.0,
           "started_at": 0.0, "exit_code": None, "finished_at": None, "reason": "",
           "goal": dict({"objective": "cost", "samples": 1000, "deadline_at": None}, **goal),
           "cost_usd": cost}
    return {"policy": "typed", "slots": {"total": 1, "used": 1, "free": 0, "lent": 0},
            "queue": [], "pool": {"h": 1}, "holders": {"h": [["j1", 1]]}, "jobs": [row]}


def test_status_shows_the_current_choice_after_a_move_and_the_first_beside_it():
    first, now = _choice("t4", True, 162, 0.0049), _choice("t4", False, 80, 0.0093)
    text = "\n".join(top.frame_lines(_status({"first_choice": first, "choice": now}), 200))
    assert "cost: 1 x t4, pred 80 s $0.0093 (first 1 x t4 spot, pred 162 s)" in text, text
    assert "spent $0.00066" in text, text  # 0.000658: two significant digits, not $0.0007


def test_a_job_without_a_choice_says_what_it_waits_for():
    text = "\n".join(top.frame_lines(_status({"measuring": "1 x t4 on demand"}), 200))
    assert "no choice yet: measuring its speed on 1 x t4 on demand" in text, text
    text = "\n".join(top.frame_lines(_status({"measuring": "1 x t4 on demand"}, "done"), 200))
    assert "ended before a choice (its speed was measured on 1 x t4 on demand)" in text, text


def test_lines_follow_the_terminal_width_and_never_cut_a_figure(monkeypatch):
    why = "no choice fits the $0.01 budget; the cheapest: 1 x a100 spot, 1234 s, $0.123456"
    status = _status({"choice": dict(_choice("a100", True, 1234, 0.123456), fits=False)},
                     "queued")
    status["jobs"][0]["reason"] = why
    lines = top.frame_lines(status, 80)
    assert all(len(x) <= 80 for x in lines), lines
    assert "$0.123456" in " ".join(" ".join(lines).split()), lines  # wrapped whole
    monkeypatch.setenv("COLUMNS", "200")
    assert top.width() == 200
    assert any(why in x for x in top.frame_lines(status)), top.frame_lines(status)
    assert [top.usd(x) for x in (0, 0.0049, 0.000658, 1.5)] == ["$0.0000", "$0.0049",
                                                                 "$0.00066", "$1.5000"]


def test_an_ended_job_shows_its_run_and_cost_not_a_clock_or_a_leftover_prediction():
    """The newcomer's report: a done job's RUN kept growing (97 s, then 112 s, for a 20.6 s
    run), its line showed the last prediction (``pred 0 s``) and a deadline counting down."""
    import time
    now = time.time()
    st = _status({"choice": _choice("a100", False, 0, 0.0453),
                  "first_choice": _choice("a100", False, 25, 0.05),
                  "deadline_at": now + 96}, state="done", cost=0.0121)
    row = st["jobs"][0]
    row.update(submitted_at=now - 112, started_at=now - 100, finished_at=now - 79.4)
    text = "\n".join(top.frame_lines(st, 200))
    line = next(x for x in text.splitlines() if x.startswith("j1"))
    assert line.split()[-1] == "21s" and "100s" not in line, line  # RUN: its run, stopped
    assert "cost by its deadline (met, 175 s to spare): ran 20.6 s, spent $0.0121 (predicted " \
        "1 x a100, 25 s $0.0500)" in text, text
    assert "pred 0 s" not in text and "by 96s" not in text, text
