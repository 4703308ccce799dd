"""The package's import graph: imports point one way (graphshard -> graphshard.passes, never
back) and
no module imports one that imports it back, counting imports inside function bodies (a cycle
hidden there still couples the two modules)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# import name -> folder (the passes install as graphshard.passes from the root folder passes/)
PACKAGES = {"graphshard": ROOT / "graphshard", "graphshard.passes": ROOT / "passes"}
PASSES = "graphshard.passes"


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package, *parts))] = path
    return found


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree``, function bodies included, except what sits under ``if
    TYPE_CHECKING:`` (annotations only: it never runs)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if _is_type_checking(node):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source (function bodies
    included). ``from pkg import sub`` counts as importing ``pkg.sub`` (not all of ``pkg``)."""
    modules = _modules()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{alias.name}" for alias in node.names]
                targets = [t for t in subs if t in modules]
                if len(targets) < len(subs):  # names defined in node.module itself
                    targets.append(node.module)
            else:
                continue
            edges[name].update(t for t in targets if t in modules and t != name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_even_in_function_bodies():
    assert cycles(import_graph()) == []


def _in_passes(module: str) -> bool:
    return module == PASSES or module.startswith(PASSES + ".")


def test_passes_never_import_graphshard():
    backwards = {m: sorted(t for t in targets if not _in_passes(t))
                 for m, targets in import_graph().items() if _in_passes(m)}
    assert {m: t for m, t in backwards.items() if t} == {}


def test_the_cycle_finder_finds_a_hidden_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]


def test_no_module_imports_a_top_level_passes():
    """The passes are imported as ``graphshard.passes`` everywhere: a top-level ``passes``
    would pick up a user's own ``passes.py`` (library, tests, bench and examples alike)."""
    offenders = []
    for folder in ("graphshard", "passes", "tests", "bench", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                              if n.split(".")[0] == "passes"]
    assert offenders == []


# The rooms of graphshard/ from the bottom up: a module imports only from its own room or a
# lower one, so the folders read as the data path (records -> the user API -> the compiler
# -> state on disk -> tools). The package root's __init__ (the public API) may import any.
LAYERS = [
    {"graphshard.errors", "graphshard.records", "graphshard._source_tree",
     "graphshard._torch_version"},
    {"graphshard.models"},
    {"graphshard.safety"},
    {"graphshard.analysis"},
    {"graphshard.api"},
    {"graphshard.compiler"},
    {"graphshard.state"},
    {"graphshard.tools"},
]


def _layer(module: str) -> int | None:
    for depth, rooms in enumerate(LAYERS):
        if any(module == r or module.startswith(r + ".") for r in rooms):
            return depth
    return None


def test_every_module_sits_in_a_room():
    homeless = [m for m in import_graph()
                if not _in_passes(m) and m != "graphshard" and _layer(m) is None]
    assert homeless == []


def test_rooms_import_only_downward():
    upward = []
    for module, targets in import_graph().items():
        if _in_passes(module) or module == "graphshard":
            continue
        for target in targets:
            if not _in_passes(target) and _layer(target) > _layer(module):
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_records_is_a_leaf():
    """The shared record types import nothing of graphshard at run time."""
    assert import_graph()["graphshard.records"] == set()


def test_type_checking_imports_are_not_edges():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n"
                     "else:\n    import b\ndef f():\n    import c\n")
    imported = {alias.name for node in _runtime_nodes(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    assert imported == {"b", "c"}
