"""Methods other than ``forward`` that run as a forward: :func:`register_forward_method`.

A sharded model gathers its parameters inside a forward: between the forward pre-hook and
forward hook graphshard installs on the root, or inside the ``forward`` of a submodule
holding parameters (:mod:`graphshard.api.forward_depth`). A method called directly
(``model.encode(x)``, ``generate``) is neither, so it reads the sharded DTensor parameters
and DTensor refuses the plain input ("got mixed torch.Tensor and DTensor").
:func:`register_forward_method` wraps such a method so that it runs as a forward does
(FSDP2's ``register_fsdp_forward_method``): between the root's graphshard hooks, or counted
as a submodule's forward is. The parameters gather, the root's mixed-precision casts and
``no_sync``'s folding apply, eagerly and under ``torch.compile``.

DTensor's own error for an unregistered method is not rewritten: torch raises it from
DTensor's C++ dispatch fast path, which graphshard could only intercept by wrapping every
DTensor operation (the hot path of a tensor-parallel forward).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from graphshard.api.forward_depth import counted_call, counts_in_class, is_graphshard_hook
from graphshard.errors import GraphshardValueError
from graphshard.records import STATE_ATTR

__all__ = ["register_forward_method"]

_METHOD_ATTR = "_graphshard_forward_method"


def register_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` run as a forward of the sharded model.

    Like FSDP2's ``register_fsdp_forward_method``: after ``graphshard.shard(model)``, a method
    other than ``forward`` that computes with the parameters (``model.encode(x)``,
    ``model.generate(...)``) must be registered, or it reads the sharded DTensor parameters
    and DTensor refuses the plain input. A registered method runs between the module's
    graphshard hooks, as ``model(x)`` runs ``forward``: parameters read inside it are gathered
    (an all-gather eagerly; marker nodes the compiler lowers under ``torch.compile``), the
    root's ``MixedPrecision`` casts its inputs and outputs, and ``no_sync`` folds held-back
    gradients. Called from inside a running forward, it is a plain call. Registering twice,
    or registering ``forward``, does nothing.

    Compile the bound method itself (``model.encode = torch.compile(model.encode,
    backend="graphshard")``, after registering); ``torch.compile(model)`` compiles only
    ``forward``, and ``compiled.encode`` runs eagerly.

    Args:
        module: the sharded root (or its ``torch.compile`` wrapper), or a submodule of a
            sharded model that holds parameters.
        method_name: the name of the method, e.g. ``"encode"``.

    Raises:
        GraphshardValueError: ``module`` is not (part of) a sharded model, or has no method
            ``method_name``.
    """
    module = getattr(module, "_orig_mod", module)
    if not isinstance(module, nn.Module):
        raise GraphshardValueError(
            f"register_forward_method takes an nn.Module, got {type(module).__name__}"
        )
    state = module.__dict__.get(STATE_ATTR) or module.__dict__.get("_graphshard_root_state")
    if state is None:
        raise GraphshardValueError(
            f"register_forward_method: {type(module).__name__} is not sharded: call "
            f"graphshard.shard(model) first, then register a method of the model (or of one "
            f"of its submodules that holds parameters)."
        )
    method = getattr(module, method_name, None)
    if not callable(method):
        raise GraphshardValueError(
            f"register_forward_method: {type(module).__name__} has no method {method_name!r}"
        )
    if method_name == "forward" or getattr(method, _METHOD_ATTR, False):
        return

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if state.forward_depth > 0:  # inside a forward already: its hooks have run
            return method(*args, **kwargs)
        if counts_in_class(module):  # a submodule: no hooks, counted as its forward is
            if torch.compiler.is_compiling():
                return method(*args, **kwargs)
            return counted_call(state, method, *args, **kwargs)
        args, kwargs = _pre_hooks(module, args, kwargs)
        if torch.compiler.is_compiling():  # as nn.Module does: no unwinding while tracing
            return _post_hooks(module, args, kwargs, method(*args, **kwargs))
        try:
            output = method(*args, **kwargs)
        except BaseException:
            for key, hook in module._forward_hooks.items():  # the forward count unwinds
                if key in module._forward_hooks_always_called and is_graphshard_hook(hook):
                    hook(module, args, None)
            raise
        return _post_hooks(module, args, kwargs, output)

    setattr(wrapped, _METHOD_ATTR, True)
    setattr(module, method_name, wrapped)


def _pre_hooks(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """graphshard's forward pre-hooks of ``module``, in order, as ``nn.Module`` runs them."""
    for key, hook in module._forward_pre_hooks.items():
        if not is_graphshard_hook(hook):
            continue
        if key in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def _post_hooks(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """graphshard's forward hooks of ``module``, in order, as ``nn.Module`` runs them."""
    for key, hook in module._forward_hooks.items():
        if not is_graphshard_hook(hook):
            continue
        if key in module._forward_hooks_with_kwargs:
            result = hook(module, args, kwargs, output)
        else:
            result = hook(module, args, output)
        if result is not None:
            output = result
    return output
