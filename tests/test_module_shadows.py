"""hvd_edl/module_shadows.py: which new files would make a fresh interpreter import another
module than the one already loaded (the kept zygote's staleness, docs/zygote.md)."""
from __future__ import annotations

import importlib
import sys

from hvd_edl import module_shadows


def test_a_new_module_package_or_extension_before_the_loaded_ones_entry_shadows_it(
        tmp_path, monkeypatch):
    early, late = tmp_path / "early", tmp_path / "late"
    early.mkdir()
    late.mkdir()
    (late / "shadowme_i8.py").write_text("X = 1\n")
    (late / "nsmod_i8").mkdir()   # a namespace package's portion
    monkeypatch.setattr(sys, "path", [str(early), str(late)] + sys.path)
    for name in ("shadowme_i8", "nsmod_i8"):
        monkeypatch.delitem(sys.modules, name, raising=False)
        importlib.import_module(name)
    path = sys.path[:2]
    assert module_shadows.shadows(path) == set()
    (early / "unrelated.py").write_text("")
    (early / "shadowme_i8").mkdir()   # a plain directory: a regular module later still wins
    assert module_shadows.shadows(path) == set()
    (early / "shadowme_i8" / "__init__.py").write_text("")
    assert module_shadows.shadows(path) == {str(early / "shadowme_i8")}
    (early / "shadowme_i8" / "__init__.py").unlink()
    (early / "shadowme_i8.abi3.so").write_bytes(b"")   # an extension
    assert module_shadows.shadows(path) == {str(early / "shadowme_i8.abi3.so")}
    (early / "nsmod_i8").mkdir()   # a new portion of the namespace package
    assert module_shadows.shadows(path) == {str(early / "shadowme_i8.abi3.so"),
                                            str(early / "nsmod_i8")}
