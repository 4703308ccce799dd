"""Inductor's C++ wrapper for graphshard's graphs, where torch can build one.

``torch._inductor.config.cpp_wrapper = True`` asks Inductor to call a compiled graph's
kernels from generated C++ instead of generated Python. ``torch.compile`` with Inductor
reads the setting in ``compile_fx`` and hands it to ``compile_fx_inner`` as an argument;
``compile_fx_inner`` does not read it from the config. graphshard calls ``compile_fx_inner``
itself, and until this module it never passed the setting on: its graphs kept the Python
wrapper whatever the user set, and nothing said so.

Now the setting reaches every graph whose operations torch's C++ wrapper can call. On torch
2.13 two of graphshard's operations it cannot:

- a compile region (``invoke_subgraph``: "codegen invoke_subgraph is not implemented for cpp
  wrapper"), which every block of the main list is under ``shard()``'s default
  ``compile_blocks_once=True``;
- ``_c10d_functional.all_to_all_single``, gloo's gradient reduction under
  ``reduce_scatter_via="auto"`` ("arg type Any is not yet supported by custom_op_wrapper":
  its group argument).

A graph that holds one keeps the Python wrapper, with a warning that names it and what to
change. An operation the C++ wrapper refuses that is not listed here (another torch, another
collective) is caught the same way: the graph is compiled again with the Python wrapper and
the warning quotes torch's refusal.
"""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import fx

__all__ = ["PythonWrapperWarning", "cpp_wrapper_blockers", "compile_with_wrapper_choice"]

_T = TypeVar("_T")


class PythonWrapperWarning(UserWarning):
    """``torch._inductor.config.cpp_wrapper`` is set, but a graph keeps Inductor's Python
    wrapper: torch's C++ wrapper cannot call one of its operations. The message names it
    and what to change."""


_WHY = "torch._inductor.config.cpp_wrapper is set, but torch's C++ wrapper"
_KEEPS = "this graph keeps Inductor's Python wrapper"


def _known_blockers() -> dict[Any, tuple[str, str]]:
    """The operations torch's C++ wrapper cannot call: what it cannot do, and what to change
    so that the graph holds none."""
    c10d = torch.ops._c10d_functional
    return {
        torch.ops.higher_order.invoke_subgraph: (
            "cannot call a compile region, which every block is under graphshard.shard()'s "
            "default compile_blocks_once=True",
            "graphshard.shard(..., compile_blocks_once=False) compiles the blocks inline, "
            "where it can call them"),
        c10d.all_to_all_single.default: (
            "cannot pass all_to_all_single its group, which gloo's gradient reductions use "
            "under reduce_scatter_via='auto'",
            "graphshard.backend(reduce_scatter_via='reduce_scatter') uses gloo's "
            "reduce-scatter instead, which sends twice the bytes"),
    }


def cpp_wrapper_blockers(gm: fx.GraphModule) -> list[str]:
    """Why torch's C++ wrapper cannot call ``gm``'s operations, and what to change (empty: it
    can), one line per kind of operation, in the order they first occur."""
    known = _known_blockers()
    reasons: list[str] = []
    for node in gm.graph.nodes:
        blocker = known.get(node.target) if node.op == "call_function" else None
        if blocker is None:
            continue
        reason = f"{_WHY} {blocker[0]}; {_KEEPS} ({blocker[1]})."
        if reason not in reasons:
            reasons.append(reason)
    return reasons


def _refused_by_cpp_wrapper(error: BaseException | None) -> bool:
    """Whether ``error`` (Inductor's, which wraps the cause) is the C++ wrapper's refusal:
    a ``NotImplementedError`` raised in Inductor's C++ wrapper code generation."""
    while error is not None:
        if isinstance(error, NotImplementedError) and _raised_in(error, _CPP_WRAPPER_CODEGEN):
            return True
        error = error.__cause__ or getattr(error, "inner_exception", None)
    return False


_CPP_WRAPPER_CODEGEN = os.path.join("_inductor", "codegen", "cpp_wrapper")


def _raised_in(error: BaseException, path_part: str) -> bool:
    """Whether ``error`` was raised in a file whose path holds ``path_part``."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and path_part in frames[-1].filename


@contextlib.contextmanager
def _cpp_wrapper_config() -> Iterator[None]:
    """The config Inductor's ``compile_fx`` sets around a C++-wrapped compile (some torch
    versions' ``compile_fx_inner`` sets it again itself)."""
    from torch._inductor import compile_fx, config

    settings = getattr(compile_fx, "get_cpp_wrapper_config", None)
    if settings is None:
        yield
        return
    with config.patch(settings()):
        yield


def compile_with_wrapper_choice(gm: fx.GraphModule, kwargs: dict[str, Any],
                                compile_fn: Callable[[dict[str, Any]], _T]) -> _T:
    """``compile_fn(kwargs)`` with ``cpp_wrapper=True`` among ``kwargs`` where the user set
    ``torch._inductor.config.cpp_wrapper`` and torch can wrap ``gm`` in C++, else with the
    Python wrapper (warning when the user asked for C++)."""
    from torch._inductor import config

    if not config.cpp_wrapper or "cpp_wrapper" in kwargs:
        return compile_fn(kwargs)
    blockers = cpp_wrapper_blockers(gm)
    if blockers:
        for reason in blockers:
            warnings.warn(reason, PythonWrapperWarning, stacklevel=2)
        return compile_fn({**kwargs, "cpp_wrapper": False})
    try:
        with _cpp_wrapper_config():
            return compile_fn({**kwargs, "cpp_wrapper": True})
    except Exception as error:  # Inductor wraps the refusal in its own error type
        if not _refused_by_cpp_wrapper(error):
            raise
        warnings.warn(f"{_WHY} refused this graph ({error}); {_KEEPS}.", PythonWrapperWarning,
                      stacklevel=2)
        return compile_fn({**kwargs, "cpp_wrapper": False})
