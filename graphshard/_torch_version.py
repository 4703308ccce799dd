"""The oldest torch graphshard runs on, checked when ``graphshard`` is imported.

graphshard relies on torch internals (Inductor, AOTAutograd, DTensor, functional
collectives) that change between releases; it is tested on torch 2.11 through 2.14. On an
older torch, importing it raises an ImportError naming both versions, instead of failing later
on some missing function. ``MIN_TORCH`` must equal the floor of ``torch>=`` in pyproject.toml
(tests/test_packaging.py checks it).
"""

from __future__ import annotations

import re

import torch

__all__ = ["MIN_TORCH", "installed_torch_version", "check_torch_version"]

MIN_TORCH: tuple[int, int] = (2, 11)


def _major_minor(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``"2.11.0+cu130"``,
    ``"2.12.0.dev20260101"``, ``"2.11.0a0+gitabc"``: a pre-release counts as its release)."""
    match = re.match(r"\s*(\d+)\.(\d+)", str(version))
    if match is None:
        raise ImportError(f"graphshard cannot read the installed torch version {version!r}")
    return int(match.group(1)), int(match.group(2))


def installed_torch_version() -> tuple[int, int]:
    """``(major, minor)`` of the torch this process imported."""
    return _major_minor(torch.__version__)


def check_torch_version() -> None:
    """Raise ImportError naming the versions when the installed torch is older than
    :data:`MIN_TORCH`."""
    found = installed_torch_version()
    if found < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ImportError(
            f"graphshard needs torch>={need}, but torch {torch.__version__} "
            f"({found[0]}.{found[1]}) is installed: upgrade it (pip install 'torch>={need}')."
        )
