"""The product's structure, checked at every ``make test`` so that it cannot decay unnoticed:

* no import circle among the product modules (``hvd_edl``, ``launcher``), function-level imports
  counted (a lazy import hides a circle from Python, not from a reader);
* the worker side (``hvd_edl``) never imports the driver side (``launcher``);
* no room reaches into another room's private state: no ``from x import _name`` across rooms,
  no ``obj._attr`` on another object when ``_attr`` is defined (assigned, or a def / class, at
  any level) in another room, and no lock or condition of another object taken or waited on
  (``with obj.lock``, ``obj._cond.wait()``...): ask its owner with a method instead.

Python imports a module's parent packages first, so ``import a.b.c`` counts as importing ``a.b``
and ``a`` too (a re-export in a package ``__init__`` can close a circle that way).  The
standard library's and namedtuples' private-looking API (``os._exit``, ``sys._getframe``,
``_replace``, ``_asdict``, ``_fields``, ``_make``) is not state.

A room is a sub-package (``launcher.job``, ``launcher.cluster``, ``hvd_edl.torch``...); the
top-level modules of ``launcher`` and of ``hvd_edl`` form a room each.  The check reads the
source with :mod:`ast` (nothing is imported).  ``python tests/test_structure.py`` prints the
import graph between rooms and every finding.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hvd_edl", "launcher")
LOCK_RE = re.compile(r"(?i)(^|_)(lock|cond|cv|mutex)$")
LOCK_CALLS = {"acquire", "release", "wait", "wait_for", "notify", "notify_all", "locked"}
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


PACKAGE_MARK = "# package\n"  # prepended to a package's __init__ source (tells packages apart)


def product_sources(root: Path = ROOT) -> Dict[str, str]:
    """Module name -> source text for every ``.py`` file of the product packages (a package's
    ``__init__`` under the package's name, its text prefixed with :data:`PACKAGE_MARK`)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            text = path.read_text()
            if parts[-1] == "__init__":
                parts = parts[:-1]
                text = PACKAGE_MARK + text
            out[".".join(parts)] = text
    return out


_TREES: Dict[tuple, ast.AST] = {}


def _parse(mod: str, source: str) -> ast.AST:
    """``source`` parsed once per run; a syntax error names the module's file."""
    key = (mod, source)
    if key not in _TREES:
        path = mod.replace(".", "/") + ("/__init__.py" if source.startswith(PACKAGE_MARK)
                                        else ".py")
        _TREES[key] = ast.parse(source, filename=path)
    return _TREES[key]


def room(module: str) -> str:
    """``launcher.job.driver`` -> ``launcher.job``; ``launcher.cli`` -> ``launcher``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0]


def _is_package(module: str, modules: Dict[str, str]) -> bool:
    return modules.get(module, "").startswith(PACKAGE_MARK) or \
        any(m.startswith(module + ".") for m in modules)


def _resolve(name: str, modules: Dict[str, str]):
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports(modules: Dict[str, str]) -> Dict[str, Set[str]]:
    """Module -> the product modules it imports anywhere in its body (``from pkg import mod``
    counts as an import of ``pkg.mod``; a package's ``__init__`` is not counted as imported by
    its own sub-modules' names)."""
    edges: Dict[str, Set[str]] = {m: set() for m in modules}
    for mod, source in modules.items():
        package = mod if _is_package(mod, modules) else mod.rpartition(".")[0]
        for node in ast.walk(_parse(mod, source)):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[:len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                resolved = _resolve(target, modules)
                while resolved and resolved != mod:
                    edges[mod].add(resolved)
                    # Python runs the parent packages' __init__ first: edges to them too, but
                    # not to a package holding ``mod`` (it is being imported already)
                    resolved = resolved.rpartition(".")[0]
                    if mod.startswith(resolved + ".") or not resolved:
                        break
    return edges


def circles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan),
    each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges) + 100))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def layer_violations(edges: Dict[str, Set[str]]) -> List[str]:
    """``hvd_edl`` modules importing ``launcher`` (the worker side must run without it)."""
    return [f"{m} imports {t}" for m, targets in sorted(edges.items()) if m.startswith("hvd_edl")
            for t in sorted(targets) if t.startswith("launcher")]


def private_reaches(modules: Dict[str, str]) -> List[str]:
    """Every place a module reaches into another room's private state (see the module)."""
    trees = {m: _parse(m, s) for m, s in modules.items()}
    defined_in: Dict[str, Set[str]] = {}   # private name -> rooms that define it
    for mod, tree in trees.items():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.append(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names += [t.id for t in targets if isinstance(t, ast.Name)]
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    defined_in.setdefault(name, set()).add(room(mod))
    found = []
    for mod, tree in trees.items():
        package = mod if _is_package(mod, modules) else mod.rpartition(".")[0]
        outside = set()   # names bound to modules outside the product (os, sys, ...)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                outside |= {(a.asname or a.name).split(".")[0] for a in node.names
                            if not _resolve(a.name, modules)}
        seen = set()

        def note(line: int, text: str) -> None:
            if (line, text) not in seen:
                seen.add((line, text))
                found.append(f"{mod}:{line} {text}")

        def foreign(owner: ast.AST, attr: str) -> bool:
            """``owner.attr`` is another room's private state (``owner`` not self/cls/super())."""
            if isinstance(owner, ast.Name) and (owner.id in ("self", "cls") or owner.id in outside):
                return False
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) \
                    and owner.func.id == "super":
                return False
            if not attr.startswith("_") or attr.startswith("__") or attr in NAMEDTUPLE_API:
                return False
            return bool(defined_in.get(attr, set()) - {room(mod)})

        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - (node.level - 1)] + ([base] if base else []))
                source = _resolve(base, modules)
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__") \
                            and source and room(source) != room(mod):
                        note(node.lineno, f"imports {alias.name} from {source}")
            elif isinstance(node, ast.Attribute) and foreign(node.value, node.attr):
                note(node.lineno, f"reads {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str) \
                    and foreign(node.args[0], node.args[1].value):
                note(node.lineno, f"reads {ast.unparse(node)}")
            lock = None
            if isinstance(node, (ast.With, ast.AsyncWith)):
                lock = next((i.context_expr for i in node.items
                             if isinstance(i.context_expr, ast.Attribute)
                             and LOCK_RE.search(i.context_expr.attr)), None)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in LOCK_CALLS \
                    and isinstance(node.func.value, ast.Attribute) \
                    and LOCK_RE.search(node.func.value.attr):
                lock = node.func.value
            if lock is not None and not (isinstance(lock.value, ast.Name)
                                         and lock.value.id in ("self", "cls")):
                note(node.lineno, f"takes {ast.unparse(lock)}")
    return found


# ---- the checks on the product ------------------------------------------------------------------

def test_no_import_circle_among_product_modules():
    assert circles(imports(product_sources())) == []


def test_worker_side_never_imports_the_launcher():
    assert layer_violations(imports(product_sources())) == []


def test_no_room_reaches_into_another_rooms_private_state():
    assert private_reaches(product_sources()) == []


# ---- the checker finds what it is for (it can fail) --------------------------------------------

def test_checker_finds_a_lazy_circle_and_a_layer_break():
    modules = {"hvd_edl": "", "hvd_edl.a": "from hvd_edl import b\n",
               "hvd_edl.b": "def f():\n    from hvd_edl.a import x\n",
               "hvd_edl.c": "import launcher.job.driver\n", "launcher": "",
               "launcher.job": "", "launcher.job.driver": ""}
    edges = imports(modules)
    assert circles(edges) == [["hvd_edl.a", "hvd_edl.b"]]
    assert layer_violations(edges) == ["hvd_edl.c imports launcher", "hvd_edl.c imports launcher.job",
                                       "hvd_edl.c imports launcher.job.driver"]


def test_checker_finds_private_reaches_across_rooms():
    modules = {
        "launcher": "", "launcher.job": "", "launcher.serve": "",
        "launcher.job.coordinator": ("class C:\n    def __init__(self):\n"
                                     "        self.lock = None\n        self._members = {}\n"
                                     "def _helper():\n    pass\n"),
        "launcher.job.driver": "from launcher.job.coordinator import _helper\n",
        "launcher.serve.server": ("from launcher.job.coordinator import _helper\n"
                                  "def f(coord):\n    with coord.lock:\n"
                                  "        return coord._members\n"),
    }
    found = private_reaches(modules)
    assert found == ["launcher.serve.server:1 imports _helper from launcher.job.coordinator",
                     "launcher.serve.server:3 takes coord.lock",
                     "launcher.serve.server:4 reads coord._members"]


def test_checker_counts_parent_packages_and_locks_outside_with():
    """A re-export in a package ``__init__`` closes a circle through Python's implicit import of
    parent packages; a lock acquired or a condition waited on outside ``with`` is taken too;
    the standard library's and namedtuples' private-looking API and a room's own private
    state are not flagged."""
    modules = {
        "launcher": "# package\n", "launcher.job": "# package\nfrom launcher.job.driver import D\n",
        "launcher.job.driver": "from launcher.serve import server\nclass D:\n    pass\n",
        "launcher.job.book": "class B:\n    def __init__(self):\n        self._cooldown = 1\n",
        "launcher.job.formation": "def f(book):\n    return book._cooldown\n",
        "launcher.serve": "# package\n",
        "launcher.serve.server": ("import os\nfrom launcher.job import book\n"
                                  "def g(driver, point):\n    driver._lock.acquire()\n"
                                  "    driver.cond.wait(1)\n    os._exit(0)\n"
                                  "    return point._replace(x=1)\n"),
        "launcher.serve.other": "class C:\n    def _exit(self):\n        self._lock = 1\n",
    }
    assert circles(imports(modules)) == [["launcher.job", "launcher.job.driver",
                                          "launcher.serve.server"]]
    # another object's lock is taken (with or without ``with``); a room's own private state,
    # os._exit beside a product _exit, a namedtuple's _replace: not flagged
    assert sorted(private_reaches(modules)) == ["launcher.serve.server:4 takes driver._lock",
                                                "launcher.serve.server:5 takes driver.cond"]
    modules["launcher.job.book"] += "    def take(self):\n        self._lock = 0\n"
    assert "launcher.serve.server:4 reads driver._lock" in private_reaches(modules)


def main() -> int:
    modules = product_sources()
    edges = imports(modules)
    between: Dict[str, Set[str]] = {}
    for mod, targets in edges.items():
        for t in targets:
            if room(t) != room(mod):
                between.setdefault(room(mod), set()).add(room(t))
    print("imports between rooms:")
    for r in sorted(between):
        print(f"  {r} -> {', '.join(sorted(between[r]))}")
    problems = [f"import circle: {' <-> '.join(c)}" for c in circles(edges)]
    problems += layer_violations(edges) + private_reaches(modules)
    print("\n".join(problems) if problems else "no circle, no layer break, no private reach")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
