"""A submit's goal as the service's API takes it (:func:`launcher.cluster.handlers.check_goal`):
``types`` as a list or as ``--types``' comma string (never split into letters), a deadline that
is not a finite number refused in its own words.  Pure: the check on a pool's known types."""
from __future__ import annotations

import time

import pytest

from launcher.cluster.handlers import RequestError, check_goal


class _Pool:
    """What check_goal asks of the service: the GPU types the pool and price table name."""

    def known_types(self):
        return {"t4", "a100"}


def _goal(**kw):
    return dict({"objective": "cost", "samples": 1000, "deadline_at": time.time() + 600}, **kw)


def test_types_are_a_list_or_a_comma_string_never_letters():
    for types in ("t4,A100", ["t4", "A100"], " t4 , a100 "):
        out, _ = check_goal(_Pool(), _goal(types=types), None)
        assert out["types"] == ["t4", "a100"], types
    with pytest.raises(RequestError, match="types must be a list"):
        check_goal(_Pool(), _goal(types=7), None)
    for bad in ("t4,,a100", ["t4", " "], "t4,"):  # a stray comma is no shorter list
        with pytest.raises(RequestError, match="an empty GPU type name"):
            check_goal(_Pool(), _goal(types=bad), None)
    with pytest.raises(RequestError, match="unknown GPU type 'k80'"):
        check_goal(_Pool(), _goal(types="k80"), None)


def test_a_deadline_that_is_not_finite_is_refused_in_its_own_words():
    for bad in (float("inf"), float("nan")):
        with pytest.raises(RequestError, match="finite number of unix seconds"):
            check_goal(_Pool(), _goal(deadline_at=bad), None)
    with pytest.raises(RequestError, match="already past"):
        check_goal(_Pool(), _goal(deadline_at=time.time() - 1), None)


def _submit_goal(*args):
    from launcher.cluster.cli import build_parser, goal_request
    return goal_request(build_parser().parse_args(["submit", *args, "--", "python", "x.py"]))


def test_submit_names_every_flag_without_objective_and_refuses_the_other_limit():
    with pytest.raises(ValueError, match=r"^--samples, --budget go with --objective time\|cost"):
        _submit_goal("--budget", "2", "--samples", "1000")
    with pytest.raises(ValueError, match="^--deadline goes with --objective cost, not time"):
        _submit_goal("--objective", "time", "--budget", "2", "--deadline", "600",
                     "--samples", "1000")
    with pytest.raises(ValueError, match="^--budget goes with --objective time, not cost"):
        _submit_goal("--objective", "cost", "--budget", "2", "--samples", "1000")
    # each objective without its limit: accepted, no limit (docs/transient.md says so)
    assert _submit_goal("--objective", "cost", "--samples", "1000")["goal"]["deadline_at"] \
        is None


def test_hvd_edl_run_autoscale_refuses_the_other_limit_and_a_deadline_not_finite():
    from launcher.apps.server_choice import choose_hosts
    for args, says in [(("time", 100, 600, 2), "--deadline goes with --autoscale cost"),
                       (("cost", 100, None, 2), "--budget goes with --autoscale time"),
                       (("cost", 100, float("inf"), None), "not a finite number of seconds"),
                       (("cost", 100, float("nan"), None), "not a finite number of seconds")]:
        with pytest.raises(ValueError, match=says):
            choose_hosts({}, *args, 1, 1)
    with pytest.raises(ValueError, match="^--deadline inf: not a finite number of seconds"):
        _submit_goal("--objective", "cost", "--deadline", "inf", "--samples", "1000")


def test_submit_refuses_an_empty_name_in_types():
    """The newcomer's report: ``--types a100,,t4`` was taken as ``a100,t4``."""
    for bad in ("a100,,t4", "a100,", ",t4", ""):
        with pytest.raises(ValueError, match="an empty GPU type name"):
            _submit_goal("--objective", "time", "--samples", "100", "--types", bad)
    assert _submit_goal("--objective", "time", "--samples", "100", "--types", "A100, t4")[
        "goal"]["types"] == ["a100", "t4"]


def test_submit_with_an_empty_type_name_is_one_line_and_exit_2(capsys, tmp_path,
                                                               monkeypatch):
    from launcher.cluster import cluster_file
    from launcher.cluster.cli import main
    monkeypatch.setenv("HVD_EDL_CLUSTER", str(cluster_file.write(
        str(tmp_path / "cluster.json"), "http://127.0.0.1:9", str(tmp_path))))  # not called
    code = main(["submit", "--objective", "time", "--samples", "100", "--types", "a100,,t4",
                 "--", "python", "x.py"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "empty GPU type name" in err, (code, err)
