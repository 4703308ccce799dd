"""``torch.func.functional_call`` on a sharded model runs its forward eagerly.

``functional_call(model, tensors, args)`` puts the given tensors in the named parameters'
places in ``module._parameters`` for one call. An eager forward reads them there
(:mod:`graphshard.api.param_reads`): a plain tensor is taken as the full parameter, a DTensor
is made full (``full_tensor()``, whose backward gives it this rank's gradient, as for a
plain tensor; the model's own gradient buffers and ``no_sync`` accumulators stay out of it).
A compiled forward does not: its graphs read each parameter's local shard through
graphshard's own table, which keeps Dynamo from guarding the DTensor parameters at every
step, so they would silently compute with the model's own weights. A swap of
``_parameters`` leaves no trace that Dynamo checks, and a guard that would see it would cost
every step of every model.

So :func:`watch_functional_calls` (installed with the first ``shard()``) wraps torch's
``torch.nn.utils.stateless._reparametrize_module``, through which ``torch.func.
functional_call`` and ``torch.nn.utils.stateless.functional_call`` swap the tensors. When
the swap names a sharded parameter:

- inside a function Dynamo traces, it raises, and Dynamo runs that function eagerly instead
  (under ``fullgraph=True`` the error reaches the caller and says why);
- under ``torch.export``, which swaps in its own inputs the same way, it raises: a sharded
  model cannot be exported (a strict export is refused where Dynamo reads a parameter), and
  the error says what to export instead;
- eagerly, the forward runs with Dynamo off for the swap's duration, so a compiled model
  (``functional_call(torch.compile(model), ...)``), compiled blocks, or a compiled function
  around the call run the model eagerly with the given tensors. That warns once per process
  (:class:`graphshard.EagerForwardWarning`) where Dynamo was active.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.utils.stateless as stateless
from torch import nn
from torch._C._dynamo.eval_frame import set_eval_frame
from torch._dynamo.eval_frame import OptimizedModule

from graphshard.api.eager_roots import run_eagerly_as_root, warn_once
from graphshard.errors import ShardedModelError

__all__ = ["exporting", "refuse_export", "watch_functional_calls"]

_ORIGINAL: list[Any] = []  # torch's _reparametrize_module, once wrapped


def _sharded_names(module: nn.Module, names: Mapping[str, Any]) -> list[str]:
    """Which of ``names`` (dotted, relative to ``module``) are sharded parameters."""
    sharded = []
    for name in names:
        path, _, attr = name.rpartition(".")
        try:
            owner = module.get_submodule(path)
        except AttributeError:
            continue
        if attr in (owner.__dict__.get("_graphshard_specs") or ()):
            sharded.append(name)
    return sharded


def _unwrapped(compiled: OptimizedModule, tensors: dict[str, Any]
               ) -> tuple[nn.Module, dict[str, Any]]:
    """The module ``torch.compile`` wrapped, and ``tensors`` named relative to it. (Swapped on
    the wrapper, a parameter of the root itself would be assigned through its
    ``__setattr__``, which a sharded module refuses.)"""
    prefix = "_orig_mod."
    if any(name.startswith(prefix) for name in tensors):
        tensors = {name.removeprefix(prefix): value for name, value in tensors.items()}
    return compiled._orig_mod, tensors


@contextlib.contextmanager
def _eagerly(swap: contextlib.AbstractContextManager, compiled_module: bool) -> Iterator[None]:
    """``swap`` with Dynamo off: no frame starts a trace (as ``torch._dynamo.disable`` does
    it), and a compiled module or block called inside runs eagerly (``force_eager``, which
    torch allows only outside a compiled region, hence the first step)."""
    outer = set_eval_frame(None)
    if compiled_module or outer not in (None, False):
        warn_once("torch.func.functional_call",
                  "torch.func.functional_call swaps sharded parameters inside torch.compile: the "
                  "model's forward runs eagerly with the tensors given (graphshard's compiled "
                  "graphs read the model's own shards). It computes exactly, with one gather "
                  "per parameter and no overlap.", stacklevel=4)
    try:
        with torch.compiler.set_stance("force_eager"), swap:
            yield
    finally:
        set_eval_frame(outer)


@run_eagerly_as_root  # called by code Dynamo runs eagerly: eager itself (api.eager_roots)
def _reparametrize_checked(module: nn.Module, parameters_and_buffers: dict[str, Any],
                           *args: Any, **kwargs: Any) -> Any:
    """torch's ``_reparametrize_module``; a swap of sharded parameters runs eagerly (module
    docstring)."""
    sharded = _sharded_names(module, parameters_and_buffers)
    if not sharded:
        return _ORIGINAL[0](module, parameters_and_buffers, *args, **kwargs)
    if exporting():  # export swaps in its own inputs, this way too
        refuse_export()
    if torch.compiler.is_compiling():
        raise ShardedModelError(
            f"torch.func.functional_call swaps sharded parameter(s) {sharded[:3]}: graphshard's "
            "compiled graphs read the model's own shards and would ignore the tensors given, "
            "so the call runs eagerly. Call it outside torch.compile(fullgraph=True).")
    compiled_module = isinstance(module, OptimizedModule)
    if compiled_module:  # swap on the model itself (the root's own parameters included)
        module, parameters_and_buffers = _unwrapped(module, parameters_and_buffers)
    return _eagerly(_ORIGINAL[0](module, parameters_and_buffers, *args, **kwargs),
                    compiled_module)


def exporting() -> bool:
    """Whether ``torch.export`` is tracing, read where Dynamo traces a parameter's read.
    ``torch.compiler.is_exporting()`` is a constant there, without a guard; torch 2.11's
    Dynamo answers True for every trace, so the flag behind it then decides (one guard on
    it, on 2.11 only)."""
    return torch.compiler.is_exporting() and torch.compiler._is_exporting_flag


def refuse_export() -> None:
    """Raise: ``torch.export`` of a sharded model, non-strict (through the swap above) or
    strict (:mod:`graphshard.api.param_reads` calls this where Dynamo reads a parameter),
    would capture graphshard's gathers with this rank's shards as constants."""
    raise ShardedModelError(
        "torch.export cannot capture a sharded model: its parameters are shards that "
        "graphshard gathers at run time. Export the model before graphshard.shard(), or "
        "load the full state (torch.distributed.checkpoint.state_dict."
        "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))) "
        "into a plain copy of the model and export that.")


def watch_functional_calls() -> None:
    """Wrap torch's ``_reparametrize_module`` (once per process; module docstring)."""
    if not _ORIGINAL:
        _ORIGINAL.append(stateless._reparametrize_module)
        stateless._reparametrize_module = _reparametrize_checked
