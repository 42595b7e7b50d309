"""``serve`` tells the operator once, one line each, about pool lines taken that do not do
what they seem to (:mod:`launcher.cluster.pool_notes`): a GPU type with no price at all, a
host whose ``ends=`` is already past; prices are plain decimals only.  Pure: parsed lines."""
from __future__ import annotations

import pytest

from launcher.cluster.pool_notes import pool_notes
from launcher.discovery.hosts import HostSpecError, parse_host_specs, parse_price
from launcher.discovery.prices import TableError, TypePrice, host_terms


def test_a_type_without_price_and_an_end_already_past_are_told():
    lines = parse_host_specs("localhost:2 type=k80\n127.0.0.1:2 type=t4 ends=1000\n")
    terms = host_terms(lines, {"t4": TypePrice(0.35, 0.11, None)})
    notes = pool_notes(lines, terms, now=2000.0)
    assert sorted(notes) == ["ends:127.0.0.1", "price:k80"], notes
    assert "GPU type k80 has no price for its on-demand hosts" in notes["price:k80"]
    assert "already past (ends=1000, 1000 s ago)" in notes["ends:127.0.0.1"]
    assert pool_notes(lines, terms, now=500.0).keys() == {"price:k80"}  # a notice to come
    assert all("\n" not in x for x in notes.values())


def test_a_host_whose_class_has_a_blank_price_is_told_not_priced_as_the_other(tmp_path):
    """The newcomer's report: ``t4,,0.1`` (no on-demand price) and an on-demand t4 host: taken
    silently at the spot price.  A blank cell prices nothing; the host is told as unpriced."""
    from launcher.discovery.prices import read_prices
    table = tmp_path / "prices.csv"
    table.write_text("type,on_demand,spot\nt4,,0.1\n")
    prices = read_prices(str(table))
    lines = parse_host_specs("localhost:1 type=t4\n127.0.0.1:1 type=t4 spot\n")
    terms = host_terms(lines, prices)
    assert terms["localhost"].price is None and terms["127.0.0.1"].price == 0.1, terms
    notes = pool_notes(lines, terms, now=0.0)
    assert list(notes) == ["price:t4"], notes
    assert "no price for its on-demand hosts" in notes["price:t4"]
    assert "on_demand cell is blank" in notes["price:t4"]
    table.write_text("type,on_demand,spot\nt4,,\n")  # no price at all in a row: refused
    with pytest.raises(TableError, match="neither an on_demand nor a spot price"):
        read_prices(str(table))


def test_a_price_is_a_plain_decimal_only():
    assert [parse_price(x) for x in ("0.35", "1e-3", "2", ".5")] == [0.35, 0.001, 2.0, 0.5]
    for bad in ("1_000", "\uff11", "nan", "inf", "0x10", " "):
        with pytest.raises(HostSpecError, match="needs a price"):
            parse_price(bad)


def test_serve_help_lists_every_host_line_attribute(capsys):
    from launcher.cluster.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for attr in ("slots=", "gpus=", "type=", "price=", "zone=", "[spot]", "ends="):
        assert attr in text, (attr, text)


def _served(state_dir, text: str):
    from launcher.cluster import drains
    from launcher.cluster.policies import make_policy
    from launcher.cluster.service import Service
    from launcher.discovery import FixedHosts
    svc = Service(state_dir, FixedHosts.from_lines(text), make_policy("fifo"), fixed_pool=True)
    svc.open()
    drains.check(svc)  # the loop's first pass
    return svc, drains.kept_out(svc)


def test_an_end_from_a_line_follows_the_line_and_an_operators_drain_persists(tmp_path):
    """The newcomer's report: ``ends=1000`` then the line edited to no ``ends=`` and a restart
    on the same state kept the host out for good, said nowhere, with an event of an end "in
    -1796578160.0 s".  A line's end follows the line; an operator's drain stays until undone;
    whatever keeps a host out is one line with its undo."""
    from launcher.cluster import drains
    svc, out = _served(tmp_path, "localhost:1 type=t4 spot ends=1000\n")
    try:
        assert svc.pool == {} and list(out) == ["localhost"], (svc.pool, out)
        assert "ends=1000 (already past, " in out["localhost"], out
        assert "remove ends= from its line" in out["localhost"], out
    finally:
        svc.close()
    svc, out = _served(tmp_path, "localhost:1 type=t4\n")
    try:
        assert svc.pool == {"localhost": 1} and out == {}, (svc.pool, out, svc.drains)
        drains.drain(svc, "localhost")  # the operator's own drain
    finally:
        svc.close()
    svc, out = _served(tmp_path, "localhost:1 type=t4\n")
    try:
        assert svc.pool == {} and "hvd-edl-cluster drain localhost --undo" in out["localhost"]
    finally:
        svc.close()
    events = (tmp_path / "events.jsonl").read_text()
    assert "in -" not in events and "already past" in events, events[-2000:]
    import re
    assert "after its deadline" in events, events[-2000:]  # drained past the line's end
    assert not re.search(r"-\d+(\.\d+)? s\b", events), events[-2000:]  # no negative seconds


def test_hvd_edl_run_autoscale_tells_a_chosen_host_without_a_price(tmp_path):
    """``hvd-edl-run --autoscale`` on an on-demand t4 host with ``t4,,0.1``: the host is not
    charged the spot price; the run says it counts as free (one real launcher, ``true`` as
    the training command)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "pool").write_text("localhost:1 type=t4\n")
    (tmp_path / "prices.csv").write_text("type,on_demand,spot,tflops\nt4,,0.1,8.1\n")
    (tmp_path / "profile.json").write_text('{"t4": {"1": 100}}')
    out = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "--hostfile", str(tmp_path / "pool"),
         "--autoscale", "time", "--samples", "1000", "--prices", str(tmp_path / "prices.csv"),
         "--speed-profile", str(tmp_path / "profile.json"), "-np", "1", "true"],
        cwd=root, env=dict(os.environ, PYTHONPATH=root, HOME=str(tmp_path)),
        capture_output=True, text=True, timeout=120)
    assert "soonest: 1 x t4, 20 s, $0.0000" in out.stdout, (out.stdout, out.stderr)
    assert "GPU type t4 has no price for its on-demand hosts" in out.stdout, out.stdout
