"""Layout rules: test modules never import each other, and bench's parts never import ``step``.

Importing a test module re-collects its tests under a second name; what tests share belongs in
a helper module (``graph_utils``, ``parity``). ``bench.step`` is the entry point; the modules
that define the numbers stay importable without it.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
BENCH = TESTS.parent / "bench"


def _is_test_module(dotted: str) -> bool:
    return dotted.rsplit(".", 1)[-1].startswith("test_")


def imported_test_modules(source: str) -> list[str]:
    """The ``test_*`` modules that ``source`` imports, at any depth of the module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if _is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.module and _is_test_module(node.module):
                found.append(node.module)
            else:  # ``from tests import test_x`` / ``from . import test_x``
                found += [a.name for a in node.names if _is_test_module(a.name)]
    return found


def test_no_module_imports_a_test_module():
    offenders = {
        path.name: names
        for path in sorted(TESTS.glob("*.py"))
        if (names := imported_test_modules(path.read_text()))
    }
    assert not offenders, f"move what these share into a helper module: {offenders}"


def test_the_check_sees_every_import_form():
    source = (
        "import test_a\nimport tests.test_b as b\nfrom test_c import X\n"
        "from tests.test_d import Y\nfrom tests import test_e\nfrom . import test_f\n"
        "def f():\n    from test_g import Z\n"
        "from graph_utils import Block\nimport tests.graph_utils\n"
    )
    assert imported_test_modules(source) == [
        "test_a", "tests.test_b", "test_c", "tests.test_d", "test_e", "test_f", "test_g",
    ]


def test_bench_modules_do_not_import_step():
    offenders = []
    for path in sorted(BENCH.glob("*.py")):
        if path.name == "step.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                prefix = f"{node.module}." if node.module else ""  # ``from . import step``
                names = [node.module or ""] + [prefix + a.name for a in node.names]
            else:
                continue
            offenders += [f"{path.name}: {n}" for n in names if n in ("bench.step", "step")]
    assert not offenders, offenders
