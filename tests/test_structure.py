"""The product's structure, checked at every ``make test`` so that it cannot decay unnoticed:

* no import circle among the product modules (``hvd_edl``, ``launcher``), function-level imports
  counted (a lazy import hides a circle from Python, not from a reader);
* the worker side (``hvd_edl``) never imports the driver side (``launcher``);
* no room reaches into another room's private state: no ``from x import _name`` across rooms,
  no ``obj._attr`` on another object when ``_attr`` is defined only in other modules, and no
  ``with obj.lock`` on another object's lock (ask its owner with a method instead).

A room is a sub-package (``launcher.job``, ``launcher.cluster``, ``hvd_edl.torch``...); the
top-level modules of ``launcher`` and of ``hvd_edl`` form a room each.  The check reads the
source with :mod:`ast` (nothing is imported).  ``python tests/test_structure.py`` prints the
import graph between rooms and every finding.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hvd_edl", "launcher")
LOCK_NAMES = {"lock", "_lock", "cond", "_cond"}


def product_sources(root: Path = ROOT) -> Dict[str, str]:
    """Module name -> source text for every ``.py`` file of the product packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path.read_text()
    return out


def room(module: str) -> str:
    """``launcher.job.driver`` -> ``launcher.job``; ``launcher.cli`` -> ``launcher``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0]


def _is_package(module: str, modules: Dict[str, str]) -> bool:
    return any(m.startswith(module + ".") for m in modules)


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
        for node in ast.walk(ast.parse(source)):
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
                if resolved and resolved != mod:
                    edges[mod].add(resolved)
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
    trees = {m: ast.parse(s) for m, s in modules.items()}
    defined: Dict[str, Set[str]] = {}
    for mod, tree in trees.items():
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
        defined[mod] = {n for n in names if n.startswith("_") and not n.startswith("__")}
    anywhere = set().union(*defined.values()) if defined else set()
    found = []
    for mod, tree in trees.items():
        package = mod if _is_package(mod, modules) else mod.rpartition(".")[0]
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
                        found.append(f"{mod}:{node.lineno} imports {alias.name} from {source}")
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                if node.attr in anywhere and node.attr not in defined[mod]:
                    found.append(f"{mod}:{node.lineno} reads {ast.unparse(node)}")
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    e = item.context_expr
                    if isinstance(e, ast.Attribute) and e.attr in LOCK_NAMES \
                            and not (isinstance(e.value, ast.Name) and e.value.id == "self"):
                        found.append(f"{mod}:{node.lineno} takes {ast.unparse(e)}")
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
    assert layer_violations(edges) == ["hvd_edl.c imports launcher.job.driver"]


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
