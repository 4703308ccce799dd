"""torch's Adafactor and Rprop on sharded parameters, which DTensor alone cannot step.

Most of torch's optimizers step a sharded parameter through DTensor's dispatch unchanged: their
update is elementwise. Two are not, and fail on DTensor parameters (FSDP2's as well, torch
2.11 to 2.14.1):

- ``Adafactor`` keeps the second moment of a matrix as a row factor and a column factor, the
  means of the squared gradient along each of its last two dimensions. A mean along the
  sharded dimension is a sum over ranks: DTensor returns it ``Partial`` (``_NormPartial``
  for ``torch.norm``), and the step's next op, in place (``square_()``, ``clamp_()``), has no
  strategy for a ``Partial`` input.
- ``Rprop`` sets the step sizes through a boolean mask (``sign[sign.gt(0)] = etaplus``, an
  ``index_put_``), and its foreach path copies lists (``_foreach_copy_``): DTensor has no
  strategy for either, although both are elementwise when the mask, or the source, is
  placed like the tensor written.

While such an optimizer steps parameters that :func:`graphshard.shard` made, graphshard's
handlers in DTensor's dispatcher (the hook torch's ``loss_parallel`` uses) serve those ops:

- a reduction (``sum``, ``mean``, ``linalg_vector_norm``, ``amax``, ``amin``) whose result is
  ``Partial`` is reduced across the ranks there and then: the result is ``Replicate``, the
  value DTensor would give when it reduced it later. That is one small all-reduce per
  factored parameter and step (two with ``clamp``'s row mean), the least the algorithm
  needs;
- ``grad.new_zeros(size)``, where Adafactor makes its factors, is placed like the gradient
  along each sharded dimension ``size`` keeps and replicated along one it reduces
  (:func:`reduced_state_placements`): the row factor holds this rank's rows, the column
  factor (one row) is whole on every rank. DTensor replicates both, so every rank would
  compute the whole update from the whole gradient, all-gathered;
- ``index_put_`` with a boolean mask, and ``_foreach_copy_``, run on the local tensors where
  every DTensor of a position has the same mesh, placements and shape (none ``Partial``)
  and the value put is a 0-dim tensor: exactly DTensor's answer, had it one. So does an
  ``index_put_`` into a replicated tensor (a 0-dim parameter, whose mask reaches the op as
  plain integer indices), which every rank writes alike;
- an element-wise update in place (``add_``, ``mul_``, ``lerp_``, ..., and their list forms)
  that DTensor refuses goes on each rank's shard, with the matching slice of a replicated
  operand. DTensor refuses it where the tensor updated is sharded on a dimension shorter
  than the mesh (a rank holds no row) and the operand is replicated; it serves every other
  call as before.

The handlers are registered by a global optimizer step pre-hook and removed by its
post-hook, only for the steps of :data:`OPTIMIZERS` (and their subclasses) that hold one of
graphshard's parameters: every other op, and every other optimizer, keeps DTensor's own
dispatch. (A step that raises skips torch's post-hooks; the next step of any optimizer
removes the handlers it left.)
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor import zeros as distributed_zeros
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from graphshard.api.dtensor_handlers import same_mesh, through_dtensor
from graphshard.api.fused_optimizer_ops import holds_graphshard_shards

__all__ = ["OPTIMIZERS", "reduced_state_placements", "step_reducing_optimizers"]

aten = torch.ops.aten

# The optimizers whose steps get the handlers below.
OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adafactor,
                                                         torch.optim.Rprop)

# Reductions whose Partial result is reduced at once.
_REDUCTIONS = (aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim,
               aten.linalg_vector_norm.default, aten.amax.default, aten.amin.default)
_ELEMENTWISE = (aten.index_put_.default, aten._foreach_copy_.default)
# Element-wise updates in place, which DTensor refuses where the tensor updated is sharded on
# a dimension shorter than its mesh (a rank holds no row) and another operand is replicated.
_IN_PLACE = (aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor, aten.div_.Tensor,
             aten.lerp_.Scalar, aten.lerp_.Tensor, aten.addcmul_.default,
             aten.addcdiv_.default, aten.copy_.default)
_REFUSED_IN_PLACE = "in-place operations that require placement changes are not supported"
_NO_RULE = "does not have a sharding strategy registered"
# The list ops the two optimizers call. DTensor refuses one as a whole for a single position
# it refuses (above), and has no rule for some on torch 2.11 (``_foreach_rsqrt_``,
# ``_foreach_lerp_.ScalarList``): each position then takes the op's single-tensor form.
_FOREACH_NAMES = ("add", "sub", "mul", "div", "lerp", "neg", "sign", "rsqrt", "clamp_min",
                  "addcmul", "addcdiv")
_SINGLE_OVERLOAD = {"List": "Tensor", "ScalarList": "Scalar"}


def _single_form(op: Any) -> Any:
    """``aten._foreach_add_.List`` -> ``aten.add_.Tensor``; None where there is none."""
    packet = getattr(aten, op._schema.name.split("::")[1][len("_foreach_"):], None)
    overload = _SINGLE_OVERLOAD.get(op._overloadname, op._overloadname)
    return getattr(packet, overload, None) or getattr(packet, "default", None)


_FOREACH = {
    op: single
    for name in _FOREACH_NAMES for suffix in ("", "_")
    if (packet := getattr(aten, f"_foreach_{name}{suffix}", None)) is not None
    for op in (getattr(packet, overload) for overload in packet.overloads())
    if op._overloadname != "Tensor" and not op._overloadname.endswith("out")
    and (single := _single_form(op)) is not None}

_lock = threading.Lock()
_hooks: list[Any] = []
_added: dict[Any, Any] = {}  # the handlers this module put into DTensor's table, by op


def step_reducing_optimizers() -> None:
    """From now on, steps of :data:`OPTIMIZERS` over graphshard's parameters run with the
    handlers of this module (module docstring). Idempotent."""
    with _lock:
        if not _hooks:
            _hooks.extend((register_optimizer_step_pre_hook(_before_step),
                           register_optimizer_step_post_hook(_after_step)))


def _before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    _remove_handlers()  # what a step that raised left
    if (not isinstance(optimizer, OPTIMIZERS) or torch.compiler.is_compiling()
            or not holds_graphshard_shards(
                p for group in optimizer.param_groups for p in group["params"])):
        return
    table = DTensor._op_dispatcher._custom_op_handlers
    for op, handler in _handlers().items():
        if op not in table:  # an op that has a handler already keeps it
            table[op] = _added[op] = handler


@functools.cache
def _handlers() -> dict[Any, Any]:
    """Every op this module serves, with its handler."""
    by_op: dict[Any, Any] = {}
    for ops, handler in ((_REDUCTIONS, _reduced_at_once), (_ELEMENTWISE, _local_or_default),
                         (_IN_PLACE, _in_place_on_shards), (_FOREACH, _foreach_on_shards),
                         ((aten.new_zeros.default,), _state_placed_like)):
        by_op.update(dict.fromkeys(ops, handler))
    return by_op


def _after_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    _remove_handlers()


def _remove_handlers() -> None:
    if not _added:
        return
    table = DTensor._op_dispatcher._custom_op_handlers
    for op, handler in _added.items():
        if table.get(op) is handler:
            del table[op]
    _added.clear()


def _reduced_at_once(op: Any, args: tuple, kwargs: dict) -> Any:
    """DTensor's result of the reduction ``op``, with its ``Partial`` placements reduced
    across their ranks now (``Replicate``)."""
    out = through_dtensor(op, args, kwargs)
    if isinstance(out, DTensor) and any(p.is_partial() for p in out.placements):
        out = out.redistribute(out.device_mesh, [
            Replicate() if p.is_partial() else p for p in out.placements])
    return out


def _local_or_default(op: Any, args: tuple, kwargs: dict) -> Any:
    """``op`` on the local tensors when that is DTensor's answer (module docstring), else
    DTensor's own dispatch."""
    local = _localized(op, args, kwargs)
    if local is None:
        return through_dtensor(op, args, kwargs)
    local_args, local_kwargs = local
    op(*local_args, **local_kwargs)
    # index_put_ returns the tensor it updated; _foreach_copy_ returns nothing
    return args[0] if op is aten.index_put_.default else None


def _localized(op: Any, args: tuple, kwargs: dict) -> tuple[list, dict] | None:
    if op is aten.index_put_.default:
        target, indices, value, *rest = args
        if not isinstance(target, DTensor) or not _scalar(value):
            return None
        value = value._local_tensor if isinstance(value, DTensor) else value
        if len(indices) == 1 and isinstance(indices[0], DTensor) and \
                indices[0].dtype == torch.bool and _placed_alike(target, indices[0]):
            return [target._local_tensor, [indices[0]._local_tensor], value, *rest], kwargs
        if all(p.is_replicate() for p in target.placements) and all(
                not isinstance(i, DTensor) or all(p.is_replicate() for p in i.placements)
                for i in indices if i is not None):
            # every rank holds the whole tensor and the same indices (a 0-dim mask becomes
            # plain integer indices on the way here): each writes the same entries
            return [target._local_tensor, [i._local_tensor if isinstance(i, DTensor) else i
                                           for i in indices], value, *rest], kwargs
        return None
    targets, sources = args[0], args[1]
    if len(targets) != len(sources) or not all(
            isinstance(t, DTensor) and _placed_alike(t, s)
            for t, s in zip(targets, sources, strict=True)):
        return None
    return [[t._local_tensor for t in targets], [s._local_tensor for s in sources],
            *args[2:]], kwargs


def _placed_alike(target: DTensor, other: Any) -> bool:
    """``other`` is a DTensor split across the ranks exactly as ``target`` (none Partial)."""
    if not isinstance(other, DTensor):
        return False
    a, b = target._spec, other._spec
    return (a.placements == b.placements and a.shape == b.shape
            and same_mesh(a.mesh, b.mesh) and not any(p.is_partial() for p in a.placements))


def _scalar(value: Any) -> bool:
    """A value every position gets alike: a 0-dim plain tensor, or a replicated 0-dim
    DTensor."""
    if isinstance(value, DTensor):
        return value.dim() == 0 and all(p.is_replicate() for p in value.placements)
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _in_place_on_shards(op: Any, args: tuple, kwargs: dict) -> Any:
    """DTensor's dispatch of the in-place ``op``; where DTensor refuses it (module docstring),
    each rank updates its shard with the matching slices of the replicated operands."""
    try:
        # through DTensor: past this handler, or straight for a list op's single form
        # that has none (rsqrt_, sign_, ...)
        handled = op in DTensor._op_dispatcher._custom_op_handlers
        return through_dtensor(op, args, kwargs) if handled else op(*args, **kwargs)
    except RuntimeError as e:
        if _REFUSED_IN_PLACE not in str(e):
            raise
        target = args[0]
        local_args = [_slice_for(target, arg) for arg in args[1:]]
        local_kwargs = {key: _slice_for(target, arg) for key, arg in kwargs.items()}
        if any(arg is None for arg in (*local_args, *local_kwargs.values())) or any(
                p.is_partial() for p in target.placements):
            raise
    op(target._local_tensor, *local_args, **local_kwargs)
    return target


def _slice_for(target: DTensor, arg: Any) -> Any:
    """``arg``'s part that broadcasts against this rank's shard of ``target``: its own local
    tensor if placed alike, a replicated one's slice along ``target``'s sharded dimensions
    (itself where it broadcasts there); None where neither holds."""
    if not isinstance(arg, DTensor):
        return arg
    if _placed_alike(target, arg):
        return arg._local_tensor
    if not same_mesh(target._spec.mesh, arg._spec.mesh) or not all(
            p.is_replicate() for p in arg.placements):
        return None
    offset = target.dim() - arg.dim()
    placements = []
    for p in target.placements:
        dim = p.dim - offset if p.is_shard() else -1
        if dim >= 0 and arg.size(dim) == target.size(p.dim) and arg.size(dim) > 1:
            placements.append(Shard(dim))
        else:
            placements.append(Replicate())  # broadcast along the sharded dimension
    return arg.redistribute(arg.device_mesh, placements).to_local()


def _state_placed_like(op: Any, args: tuple, kwargs: dict) -> Any:
    """``grad.new_zeros(size)``, Adafactor's factored state: sharded where ``size`` keeps the
    gradient's sharded dimension (the row factor), replicated where it reduces it to 1 (the
    column factor). DTensor's own answer replicates both: every rank would then compute the
    whole update from the whole gradient, gathered."""
    source, size = args[0], list(args[1])
    if len(size) != source.dim() or any(p.is_partial() for p in source.placements):
        return through_dtensor(op, args, kwargs)
    dtype = kwargs.get("dtype") or source.dtype
    return distributed_zeros(size, dtype=dtype, device_mesh=source.device_mesh,
                             placements=reduced_state_placements(source, size))


def reduced_state_placements(param: DTensor, size: Sequence[int]) -> list[Placement]:
    """Where a state of ``param`` (or of its gradient) with some dimensions reduced to 1,
    ``size``, lives: sharded as ``param`` along each sharded dimension it keeps (of more
    than one entry), replicated along the others. Also how a checkpoint's such state is read
    back (:mod:`graphshard.state.checkpoint`), on whatever mesh ``param`` has then."""
    return [Shard(p.dim) if p.is_shard() and size[p.dim] == param.size(p.dim) > 1
            else Replicate() for p in param.placements]


def _foreach_on_shards(op: Any, args: tuple, kwargs: dict) -> Any:
    """DTensor's dispatch of the list ``op``; where DTensor refuses it, or has no rule for
    it, its single-tensor form at each position (in place through
    :func:`_in_place_on_shards` where DTensor refuses that too)."""
    try:
        return through_dtensor(op, args, kwargs)
    except (RuntimeError, NotImplementedError) as e:
        if _REFUSED_IN_PLACE not in str(e) and _NO_RULE not in str(e):
            raise
    single, in_place = _FOREACH[op], op._schema.name.endswith("_")
    results = []
    for i, target in enumerate(args[0]):
        position = [arg[i] if isinstance(arg, (list, tuple)) else arg for arg in args[1:]]
        position_kwargs = dict(kwargs)
        if op._overloadname == "ScalarList" and single.__name__.startswith("addc"):
            position_kwargs["value"] = position.pop()  # addcmul's scalars: its value=
        if in_place:
            _in_place_on_shards(single, (target, *position), position_kwargs)
        else:
            results.append(single(target, *position, **position_kwargs))
    return None if in_place else results
