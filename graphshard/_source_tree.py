"""``graphshard.passes`` in a source checkout that was never installed.

The graph passes live in the repository's root folder ``passes/``; an install maps that folder
to ``graphshard.passes`` (``package-dir`` in pyproject.toml, also under ``pip install -e``).
Run straight from a checkout (``PYTHONPATH=<repo>``, as on a machine where nothing is
installed) there is no ``graphshard/passes`` to find, so this mounts the sibling folder under
the same name. So it does where an editable install of another checkout provides
``graphshard.passes``: the package and its passes then always come from one tree (a second
clone on ``PYTHONPATH`` ran the first clone's passes before). It never adds a top-level
``passes`` to ``sys.modules``: a user's own ``graphshard.passes.py`` stays theirs.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

_NAME = "graphshard.passes"


def _from_another_checkout(spec: importlib.machinery.ModuleSpec, root: Path) -> bool:
    """Whether ``spec`` (the ``graphshard.passes`` an install provides) lies outside ``root``,
    the source checkout this ``graphshard`` was imported from: an editable install of another
    checkout, whose passes would otherwise run with this checkout's package."""
    if not (root / "pyproject.toml").is_file() or spec.origin is None:
        return False  # not a checkout (an installed package), or nothing to compare
    return not Path(spec.origin).resolve().is_relative_to(root)


def mount_passes() -> None:
    """Import ``<repo>/passes`` as ``graphshard.passes`` unless an install already provides
    it from this same tree."""
    if _NAME in sys.modules:
        return
    root = Path(__file__).resolve().parent.parent
    installed = importlib.util.find_spec(_NAME)
    if installed is not None and not _from_another_checkout(installed, root):
        return
    folder = root / "passes"
    init = folder / "__init__.py"
    if not init.is_file():
        return  # neither installed nor a checkout: the first import names what is missing
    spec = importlib.util.spec_from_file_location(
        _NAME, init, submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_NAME]
        raise
    sys.modules["graphshard"].passes = module


mount_passes()
