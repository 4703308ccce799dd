"""``graphshard.passes`` in a source checkout that was never installed.

The graph passes live in the repository's root folder ``passes/``; an install maps that folder
to ``graphshard.passes`` (``package-dir`` in pyproject.toml, also under ``pip install -e``).
Run straight from a checkout (``PYTHONPATH=<repo>``, as on a machine where nothing is
installed) there is no ``graphshard/passes`` to find, so this mounts the sibling folder under
the same name. It never adds a top-level ``passes`` to ``sys.modules``: a user's own
``graphshard.passes.py`` stays theirs.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_NAME = "graphshard.passes"


def mount_passes() -> None:
    """Import ``<repo>/passes`` as ``graphshard.passes`` unless an install already provides it."""
    if _NAME in sys.modules or importlib.util.find_spec(_NAME) is not None:
        return
    folder = Path(__file__).resolve().parent.parent / "passes"
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
