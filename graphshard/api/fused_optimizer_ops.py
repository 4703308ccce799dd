"""The fused optimizers' steps on DTensor parameters, run straight on the local tensors.

A fused torch optimizer (``AdamW(fused=True)``, ``Adam``, ``SGD``, ``Adagrad``) steps a
parameter group with one call such as ``_fused_adamw_(params, grads, exp_avgs, ...)``. On
DTensor parameters that call goes through DTensor's dispatch, which propagates a sharding over
every tensor of every list before it runs the kernel on the local tensors. For this op it
leaves DTensor's native fast path and costs a step more than the kernel itself on a mid-sized
model (fused AdamW on llama-medium's shards, this machine's CPU: 24.8 ms a step through
DTensor's dispatch, 15.6 ms on the local tensors), although its answer never changes: an
elementwise update of tensors that share one placement at each list position is computed
locally, in that placement.

:func:`run_fused_optimizers_locally` registers a handler for the fused optimizer ops with
DTensor's dispatcher (``DTensor._op_dispatcher._custom_op_handlers``, the hook torch's own
``loss_parallel`` uses), once per process, and the parameters ``graphshard.shard()`` made.
A call runs on the local tensors when:

- every parameter it steps is one of graphshard's (other DTensors, FSDP2's for one, keep
  DTensor's dispatch: a peer in the same process is measured as its users run it);
- at each list position, every DTensor has the same mesh, placements and shape, and the
  placements are ``Shard`` or ``Replicate`` (a ``Partial`` is not elementwise-safe);
- every other tensor is 0-dim: a plain one (the step counts, a tensor ``lr``, a
  ``grad_scale``), or a DTensor replicated on the lists' mesh.

The result is then exactly DTensor's (tested bit for bit), without the propagation. Any other
call goes through DTensor's own dispatch, unchanged. The ``foreach`` ops are left to DTensor:
its native fast path already serves them, faster than a Python handler.
"""

from __future__ import annotations

import contextlib
import operator
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from graphshard.api.dtensor_handlers import handlers_aside, same_mesh, through_dtensor

__all__ = ["LOCAL_OPS", "dtensor_dispatch", "holds_graphshard_shards",
           "run_fused_optimizers_locally"]

aten = torch.ops.aten

# The fused optimizers' in-place steps (each list position updated on its own).
_FUSED = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")


def _ops() -> frozenset[Any]:
    found = set()
    for name in _FUSED:
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        found.update(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(found)


LOCAL_OPS: frozenset[Any] = _ops()

_lock = threading.Lock()
_installed = False
# The ids of graphshard's parameters, while their model lives. No reference to them: a weak
# one would stop ``module.to_empty()`` from swapping their contents (``swap_tensors`` refuses a
# tensor with weak references; the swap keeps each parameter's identity). Were an id reused
# by another tensor while here, a call would still run locally only where that is exact.
_SHARD_IDS: set[int] = set()


def run_fused_optimizers_locally(root: nn.Module, params: Iterable[torch.Tensor]) -> None:
    """From now on, this process runs the fused optimizer steps of :data:`LOCAL_OPS` on the
    local tensors of ``params`` (the sharded parameters of ``root``, until ``root`` is
    garbage) wherever that gives DTensor's own result (module docstring). The handler is
    registered once; ops that already have one keep it."""
    global _installed
    ids = {id(param) for param in params}
    # outside the lock: making the finalizer may start a collection, which runs the
    # finalizers of models that are garbage (they take no lock either)
    weakref.finalize(root, _forget, ids)
    with _lock:
        _SHARD_IDS.update(ids)
        if _installed:
            return
        handlers = DTensor._op_dispatcher._custom_op_handlers
        for op in LOCAL_OPS:
            handlers.setdefault(op, _local_or_default)
        _installed = True


def holds_graphshard_shards(params: Iterable[torch.Tensor]) -> bool:
    """Whether one of ``params`` is a sharded parameter that :func:`graphshard.shard` made
    (its model alive)."""
    return any(id(param) in _SHARD_IDS for param in params)


def _forget(ids: set[int]) -> None:
    """A sharded model is garbage: its parameters' ids, and every remembered list of specs
    (which holds its specs, and through them its mesh), go. A finalizer, run by whatever
    allocation started the collection: it takes no lock (one set operation is atomic)."""
    _SHARD_IDS.difference_update(ids)
    _AGREED.clear()


def dtensor_dispatch() -> contextlib.AbstractContextManager[None]:
    """Within, the fused steps go through DTensor's own dispatch again (what they cost, and
    compute, without the local path: the benchmark's and the tests' reference)."""
    return handlers_aside(_local_or_default)


def _local_or_default(op: Any, args: tuple, kwargs: dict) -> Any:
    """DTensor's handler for ``op``: on the local tensors where exact, else DTensor's own."""
    local = _localized(args, kwargs)
    if local is None:
        return through_dtensor(op, args, kwargs)
    local_args, local_kwargs = local
    return op(*local_args, **local_kwargs)  # in place: the local tensors are the DTensors' data


def _localized(args: tuple, kwargs: dict) -> tuple[list, dict] | None:
    """The arguments with every DTensor replaced by its local tensor; None where running
    locally would not be exact, or the parameters stepped (the first list) are not all
    graphshard's."""
    if not args or not isinstance(args[0], (list, tuple)) or not _SHARD_IDS.issuperset(
            map(id, args[0])):
        return None
    uniform = _localized_uniform(args, kwargs)
    if uniform is not None:
        return uniform
    lists: list[list | tuple] = []
    mesh = None
    local_args: list[Any] = []
    for arg in args:
        value, mesh = _local_value(arg, lists, mesh)
        if value is _REFUSED:
            return None
        local_args.append(value)
    local_kwargs: dict[str, Any] = {}
    for key, arg in kwargs.items():
        value, mesh = _local_value(arg, lists, mesh)
        if value is _REFUSED:
            return None
        local_kwargs[key] = value
    firsts = _first_dtensors(lists)
    if firsts is None or any(
            first is None or (mesh is not None and not same_mesh(first._spec.mesh, mesh))
            for first in firsts):
        return None  # a position without a DTensor, or a 0-dim DTensor on another mesh
    return local_args, local_kwargs


_REFUSED = object()

_spec_of = operator.attrgetter("_spec")
_local_of = operator.attrgetter("_local_tensor")
# Lists of specs already found to agree, position by position, with a parameter list's
# (``_specs_agree``), keyed by both lists' spec ids. The entries hold the specs themselves,
# so no id here is reused while its entry lives; bounded by clearing.
_AGREED: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[list, list]] = {}
_AGREED_MAX = 256
_PLAIN = {torch.Tensor}


def _localized_uniform(args: tuple, kwargs: dict) -> tuple[list, dict] | None:
    """:func:`_localized` for the call every optimizer step makes, with the per-tensor work
    out of Python loops: every list all DTensors (each position's spec agreeing with its
    parameter's, checked once per list of spec objects) or all plain 0-dim tensors, and no
    other tensor argument but 0-dim plain ones. None for anything else, which the general
    check then decides (about 0.26 ms a step against 0.07 here at 147 parameters)."""
    try:
        specs = list(map(_spec_of, args[0]))
        local_params = list(map(_local_of, args[0]))
    except AttributeError:
        return None
    param_ids = tuple(map(id, specs))
    if (param_ids, param_ids) not in _AGREED:
        if any(p.is_partial() for spec in specs for p in spec.placements):
            return None
        _remember(param_ids, param_ids, specs, specs)
    local_args: list[Any] = [local_params]
    for arg in args[1:]:
        value = _uniform_value(arg, specs, param_ids)
        if value is _REFUSED:
            return None
        local_args.append(value)
    local_kwargs = {}
    for key, arg in kwargs.items():
        value = _uniform_value(arg, specs, param_ids)
        if value is _REFUSED:
            return None
        local_kwargs[key] = value
    return local_args, local_kwargs


def _uniform_value(arg: Any, specs: list, param_ids: tuple[int, ...]) -> Any:
    if isinstance(arg, (list, tuple)):
        if not arg:
            return arg
        if len(arg) != len(specs):
            return _REFUSED
        try:
            locals_ = list(map(_local_of, arg))
        except AttributeError:  # plain tensors (the step counts): 0-dim ones only
            if set(map(type, arg)) != _PLAIN or any(map(torch.Tensor.dim, arg)):
                return _REFUSED
            return list(arg)
        arg_specs = list(map(_spec_of, arg))
        ids = tuple(map(id, arg_specs))
        if ids != param_ids and (ids, param_ids) not in _AGREED:
            if not all(map(_specs_agree, arg_specs, specs)):
                return _REFUSED
            _remember(ids, param_ids, arg_specs, specs)
        return locals_
    if isinstance(arg, DTensor) or (isinstance(arg, torch.Tensor) and arg.dim() != 0):
        return _REFUSED  # a 0-dim DTensor's mesh is the general check's to compare
    return arg


def _specs_agree(spec: Any, param_spec: Any) -> bool:
    """Whether a DTensor on ``spec`` is updated elementwise in step with a parameter on
    ``param_spec``: the same mesh, placements and global shape. Equal meshes count as the
    same: DTensor's sharding cache can give an op's output (an optimizer state made by
    ``zeros_like``, say) the mesh object of an earlier equal call, and each rank's pieces
    are the same slices on either."""
    if spec is param_spec:
        return True
    return (same_mesh(spec.mesh, param_spec.mesh)
            and spec.placements == param_spec.placements
            and spec.tensor_meta.shape == param_spec.tensor_meta.shape)


def _remember(ids: tuple[int, ...], param_ids: tuple[int, ...], specs: list,
              param_specs: list) -> None:
    if len(_AGREED) >= _AGREED_MAX:
        _AGREED.clear()
    _AGREED[ids, param_ids] = (specs, param_specs)


def _local_value(arg: Any, lists: list, mesh: Any) -> tuple[Any, Any]:
    """One argument made local (a tensor list is recorded in ``lists``); ``_REFUSED`` where
    it cannot be. ``mesh`` is the mesh of the 0-dim DTensors seen so far."""
    if isinstance(arg, (list, tuple)) and arg and any(isinstance(t, torch.Tensor) for t in arg):
        lists.append(arg)
        return [t._local_tensor if isinstance(t, DTensor) else t for t in arg], mesh
    if isinstance(arg, DTensor):
        spec = arg._spec
        if arg.dim() != 0 or not all(p.is_replicate() for p in spec.placements):
            return _REFUSED, mesh
        if mesh is not None and not same_mesh(spec.mesh, mesh):
            return _REFUSED, mesh
        return arg._local_tensor, spec.mesh
    if isinstance(arg, torch.Tensor) and arg.dim() != 0:
        return _REFUSED, mesh
    return arg, mesh


def _first_dtensors(lists: list) -> list | None:
    """The first DTensor at each list position, whose spec the others there share; None
    where they differ, hold a ``Partial``, or sit beside a plain tensor that is not 0-dim.
    Runs once per optimizer step over every tensor it steps: list by list, with a shared
    spec object (a gradient graphshard set carries its parameter's) taken as a match."""
    if not lists:
        return None
    length = len(lists[0])
    if any(len(items) != length for items in lists):
        return None
    firsts: list[Any] = [None] * length
    for items in lists:
        for position, tensor in enumerate(items):
            if isinstance(tensor, DTensor):
                first = firsts[position]
                if first is None:
                    if any(p.is_partial() for p in tensor._spec.placements):
                        return None
                    firsts[position] = tensor
                    continue
                if not _specs_agree(tensor._spec, first._spec):
                    return None
            elif isinstance(tensor, torch.Tensor) and tensor.dim() != 0:
                return None
    return firsts
