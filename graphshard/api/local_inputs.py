"""Trainable sharded parameters enter the compiled graphs as plain tensors.

Read inside a compiled forward as ``param.to_local()``, a DTensor parameter costs host time
at every step, per parameter, in code that does no work on the data:

- Dynamo's guards on a DTensor input: two Python guards (its spec, compared field by field,
  and its mesh's identity) besides the tensor's own;
- AOTAutograd's runtime wraps the parameter's gradient into a new DTensor
  (``DTensor.__tensor_unflatten__`` builds a spec from scratch).

At world 1 on a small model, where no collective runs, this is most of what graphshard's
step costs beyond one process's (``docs/benchmark.md``).

So each trainable parameter's record (:class:`~graphshard.records.ShardedParam`) holds
:attr:`~graphshard.records.ShardedParam.local`: a plain tensor over the local shard's
storage, made once by :class:`_ToParameter` from the DTensor parameter, and the compiled
graphs read it. The graph's input is then a plain tensor, and so is its gradient. Autograd
still links it to the parameter: its backward node hands the gradient on as a DTensor on the
parameter's own spec (built directly, not through ``from_local``), and autograd's own
``AccumulateGrad`` of the parameter takes it from there. So everything autograd does with a
parameter still holds: its hooks, ``.grad`` accumulation, ``torch.autograd.grad(loss,
params)``, ``loss.backward(inputs=params)``. The node saves nothing, so it serves every
backward, not just the first. The optimizer, ``clip_grad_norm_``, state dicts and DCP see the
same DTensors as before; eager reads are unchanged.

The tensor follows its parameter:

- ``.to()``, ``to_empty()``, ``load_state_dict(assign=True)`` and the other ways torch
  gives a parameter new storage re-make it (:func:`attach_local`, which
  :mod:`graphshard.safety.guards` calls where it re-points the record);
- a trace asks :func:`trains` first, which also re-makes a stale one;
- ``requires_grad``: a parameter that trains when traced is read through its tensor, whose
  own flag Dynamo guards; one that is frozen then is read through ``to_local()``, as before,
  whose guards include the parameter's flag. Unfreezing it fails that guard, and the retrace
  reads the tensor. Freezing a parameter read through its tensor: autograd gives a frozen
  parameter no gradient, and the backward node re-makes the tensor without ``requires_grad``,
  which fails its guard so that the next call retraces.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor

from graphshard.records import ShardedParam
from graphshard.safety.guards import on_new_storage

__all__ = ["LOCAL_INDEX_ATTR", "attach_local", "register_local", "same_view", "trains"]

# On a sharded module: parameter name -> its record's index for :func:`trains`.
LOCAL_INDEX_ATTR = "_graphshard_local_index"

# index -> the record of a parameter read in compiled graphs (a weak reference: the table
# outlives models). Dynamo passes :func:`trains` an index: a constant, never a guard.
_RECORDS: list[weakref.ref] = []


def register_local(entry: ShardedParam) -> int:
    """Give ``entry`` its plain tensor and an index for :func:`trains`."""
    attach_local(entry)
    _RECORDS.append(weakref.ref(entry))
    return len(_RECORDS) - 1


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` view one storage (its C++ object: no data pointer to read on
    meta or fake tensors) the same way: offset, dtype, shape and strides. True of a tensor
    and its ``detach()``, which are different Python objects."""
    return (
        a.untyped_storage()._cdata == b.untyped_storage()._cdata
        and a.storage_offset() == b.storage_offset()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def _fresh(entry: ShardedParam) -> bool:
    """Whether ``entry.local`` is still made from its parameter as it is now: the same
    Parameter, storage, layout and ``requires_grad``."""
    local, param = entry.local, entry.param  # param: a DTensor (attach_local checks)
    return (
        local is not None
        and getattr(local, _MADE_FROM, None) == id(param)
        and local.requires_grad == param.requires_grad
        and same_view(local, param._local_tensor)
    )


_MADE_FROM = "_graphshard_made_from"  # on ``entry.local``: the id of the Parameter it is of


def attach_local(entry: ShardedParam) -> None:
    """(Re)make ``entry.local`` (module docstring) unless it is still fresh."""
    param = entry.param
    if not isinstance(param, DTensor):
        entry.local = None
        return
    if _fresh(entry):
        return
    if param.requires_grad:
        local = _ToParameter.apply(param, weakref.ref(entry))
    else:
        local = param._local_tensor.detach()
    setattr(local, _MADE_FROM, id(param))
    entry.local = local


class _ToParameter(torch.autograd.Function):
    """The parameter's local shard as a plain tensor (its storage), whose gradient goes back
    to the parameter as a DTensor on the parameter's spec. Saves no tensor: one application
    serves every backward."""

    @staticmethod
    def forward(ctx: Any, param: DTensor, entry_ref: weakref.ref) -> torch.Tensor:
        ctx.spec, ctx.entry_ref = param._spec, entry_ref
        return param._local_tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None]:
        entry = ctx.entry_ref()
        if entry is not None and not entry.param.requires_grad:
            attach_local(entry)  # frozen since the trace: retrace at the next call
            return None, None
        return DTensor(grad, ctx.spec, requires_grad=False), None


@torch.compiler.assume_constant_result
def trains(index: int) -> bool:
    """While Dynamo traces: whether the parameter of record ``index`` trains, so that the
    trace reads its tensor (re-made first if its parameter changed). A constant of the trace,
    not a guard: the tensor's flag, or the parameter's, is guarded where it is read."""
    entry = _RECORDS[index]()
    if entry is None or not isinstance(entry.param, DTensor):
        return False
    with unset_fake_temporarily():
        attach_local(entry)
    return bool(entry.param.requires_grad)


on_new_storage(attach_local)  # .to(), to_empty(), accepted replacements (safety.guards)
