"""New files that shadow a module a long-lived interpreter already loaded (the kept zygote's
staleness, ``docs/zygote.md``).

A module is found by the first ``sys.path`` entry that holds it (``importlib``'s
``PathFinder``: ``NAME.py``, ``NAME/__init__.py``, a sourceless ``NAME.pyc`` or an extension
``NAME.*.so`` in one entry beats every later entry; a plain directory ``NAME/`` only adds a
portion to a namespace package).  An interpreter that loaded ``NAME`` from entry *i* and is
asked to run code later runs the old ``NAME`` even once an entry before *i* holds a new one,
which a fresh interpreter (an exec'd worker) would import instead.

Cost per check: one ``stat`` per ``sys.path`` entry; an entry whose modification and change
times moved since it was last listed (a file created, removed or renamed in it) is listed
again, and only then are its names compared with the loaded top-level modules (a set lookup
per module, suffix and earlier entry).  An unrelated new file in an entry changes nothing.
"""
from __future__ import annotations

import os
import stat
import sys
from importlib.machinery import all_suffixes
from typing import Dict, FrozenSet, List, Optional, Set, Tuple

_LISTINGS: Dict[str, Tuple[Tuple[int, int], FrozenSet[str]]] = {}


def _listing(entry: str) -> FrozenSet[str]:
    """The names in ``sys.path`` entry ``entry`` (empty: not a readable directory), listed
    again only when its mtime or ctime moved."""
    try:
        st = os.stat(entry or ".")
    except OSError:
        return frozenset()
    if not stat.S_ISDIR(st.st_mode):
        return frozenset()   # a zip archive: not watched
    stamp = (st.st_mtime_ns, st.st_ctime_ns)
    known = _LISTINGS.get(entry)
    if known is not None and known[0] == stamp:
        return known[1]
    try:
        names = frozenset(os.listdir(entry or "."))
    except OSError:
        names = frozenset()
    _LISTINGS[entry] = (stamp, names)
    return names


def _origins(path: List[str]) -> Dict[str, Tuple[int, Optional[List[str]]]]:
    """Loaded top-level module name -> (index of the ``path`` entry it was loaded from, its
    namespace ``__path__`` if it is a namespace package, else None).  Built-in and frozen
    modules, and those loaded by another finder (an editable install's), are left out: no
    file in a ``sys.path`` entry can shadow them."""
    index = {os.path.abspath(e or "."): i for i, e in reversed(list(enumerate(path)))}
    out: Dict[str, Tuple[int, Optional[List[str]]]] = {}
    for name, module in list(sys.modules.items()):
        if "." in name:
            continue
        spec = getattr(module, "__spec__", None)
        if spec is None:
            continue
        if spec.origin is None and spec.submodule_search_locations is not None:
            portions = list(spec.submodule_search_locations)   # a namespace package
            found = [index[os.path.dirname(p)] for p in portions
                     if os.path.dirname(p) in index]
            if found:
                out[name] = (min(found), portions)
            continue
        if not spec.has_location or not isinstance(spec.origin, str):
            continue
        folder = os.path.dirname(spec.origin)
        if spec.submodule_search_locations is not None:   # a package: NAME/__init__.py
            folder = os.path.dirname(folder)
        if folder in index:
            out[name] = (index[folder], None)
    return out


def shadows(path: Optional[List[str]] = None) -> Set[str]:
    """Every file or directory in a ``path`` entry (default ``sys.path``) that a fresh
    interpreter would import instead of a top-level module this one has loaded (or, for a
    namespace package, a portion it lacks), as full paths."""
    path = list(sys.path if path is None else path)
    suffixes = all_suffixes()
    listings = [_listing(e) for e in path]
    found: Set[str] = set()
    for name, (origin, portions) in _origins(path).items():
        for j in range(origin):
            names = listings[j]
            if not names:
                continue
            for suffix in suffixes:
                if name + suffix in names:
                    found.add(os.path.join(path[j] or ".", name + suffix))
            if name in names:
                folder = os.path.join(path[j] or ".", name)
                if portions is not None:
                    if os.path.abspath(folder) not in portions and os.path.isdir(folder):
                        found.add(folder)
                elif any(os.path.exists(os.path.join(folder, "__init__" + s)) for s in suffixes):
                    found.add(folder)
    return found
