"""Layout rules for tests/: test modules never import each other (shared code lives in helpers).

Importing a test module runs its collection-time setup and re-exports its tests under a second
name; what tests share belongs in a helper module such as ``graph_utils`` or ``parity``.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


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
