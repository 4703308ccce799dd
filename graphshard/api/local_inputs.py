"""Trainable sharded parameters enter the compiled graphs as plain tensors.

Read inside a compiled forward as ``param.to_local()``, a DTensor parameter costs host time
at every step, per parameter, in code that does no work on the data:

- Dynamo's guards on a DTensor input: two Python guards (its spec, compared field by field,
  and its mesh's identity) besides the tensor's own;
- AOTAutograd's runtime wraps the parameter's gradient into a new DTensor
  (``DTensor.__tensor_unflatten__`` builds a spec from scratch);
- autograd's ``AccumulateGrad`` detaches that DTensor gradient through DTensor's dispatch.

At world 1 on a small model, where no collective runs, this is most of what graphshard's
step costs beyond one process's (``docs/benchmark.md``).

So each trainable parameter's record (:class:`~graphshard.records.ShardedParam`) holds a
plain leaf tensor, :attr:`~graphshard.records.ShardedParam.local`, that shares the local
shard's storage, and the compiled graphs read that leaf. The graph's input is then a plain
tensor, and so is its gradient. A hook on the leaf hands the gradient to the DTensor
parameter's ``.grad`` (a DTensor on the parameter's own spec), as ``AccumulateGrad`` would:

- the tensor hooks registered on the parameter (``param.register_hook``) run on it first;
- it is the new ``.grad``, or is added to the one there;
- the parameter's post-accumulate-grad hooks run after.

The optimizer, ``clip_grad_norm_``, state dicts and DCP see the DTensor parameters and
gradients they always did; eager reads are unchanged.

The leaf follows its parameter:

- ``.to()``, ``to_empty()``, ``load_state_dict(assign=True)`` and the other ways torch
  gives a parameter new storage re-make it (:func:`attach_local`, which
  :mod:`graphshard.safety.guards` calls where it re-points the record);
- a trace asks :func:`trains` first, which also re-makes a stale leaf;
- ``requires_grad``: a parameter that trains when traced is read through its leaf, whose
  own flag Dynamo guards; one that is frozen then is read through ``to_local()``, as before,
  whose guards include the parameter's flag. Unfreezing it fails that guard, and the retrace
  reads the leaf. Freezing a parameter read through its leaf: the next gradient reaching
  the leaf is dropped (a frozen parameter gets none), and the leaf is frozen too, which
  fails its guard so that the next call retraces.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor

from graphshard.records import ShardedParam
from graphshard.safety.guards import on_new_storage

__all__ = ["LOCAL_INDEX_ATTR", "attach_local", "register_local", "trains"]

# On a sharded module: parameter name -> its record's index for :func:`trains`.
LOCAL_INDEX_ATTR = "_graphshard_local_index"

# index -> the record of a parameter read in compiled graphs (a weak reference: the table
# outlives models). Dynamo passes :func:`trains` an index: a constant, never a guard.
_RECORDS: list[weakref.ref] = []


def register_local(entry: ShardedParam) -> int:
    """Give ``entry`` its leaf and an index for :func:`trains`."""
    attach_local(entry)
    _RECORDS.append(weakref.ref(entry))
    return len(_RECORDS) - 1


def _fresh(entry: ShardedParam) -> bool:
    """Whether ``entry.local`` is a leaf over its parameter's local shard as it is now."""
    leaf, param = entry.local, entry.param
    if leaf is None or not isinstance(param, DTensor):
        return False
    shard = param._local_tensor
    return (  # one storage (its C++ object: no data pointer to read on meta or fake tensors)
        leaf.untyped_storage()._cdata == shard.untyped_storage()._cdata
        and leaf.storage_offset() == shard.storage_offset()
        and leaf.dtype == shard.dtype
        and leaf.shape == shard.shape
        and leaf.stride() == shard.stride()
    )


def attach_local(entry: ShardedParam) -> None:
    """(Re)make ``entry.local``: a leaf sharing the local shard's storage, trainable as the
    parameter is, whose gradient goes to the parameter (module docstring). A leaf that is
    still fresh is kept (its flag matched to the parameter's)."""
    param = entry.param
    if not isinstance(param, DTensor):
        entry.local = None
        return
    if _fresh(entry):
        if entry.local.requires_grad != param.requires_grad:
            entry.local.requires_grad_(param.requires_grad)
        return
    leaf = param._local_tensor.detach().requires_grad_()
    leaf.register_post_accumulate_grad_hook(_to_parameter(weakref.ref(entry)))
    entry.local = leaf.requires_grad_(param.requires_grad)  # the hook stays for a later True


@torch.compiler.assume_constant_result
def trains(index: int) -> bool:
    """While Dynamo traces: whether the parameter of record ``index`` trains, so that the
    trace reads its leaf (whose flag is then matched to the parameter's, and which is
    re-made if its parameter has new storage). A constant of the trace, not a guard: the
    leaf's flag, or the parameter's, is guarded where it is read."""
    entry = _RECORDS[index]()
    if entry is None or not isinstance(entry.param, DTensor):
        return False
    with unset_fake_temporarily():
        attach_local(entry)
    return bool(entry.param.requires_grad)


on_new_storage(attach_local)  # .to(), to_empty(), accepted replacements (safety.guards)


def _to_parameter(entry_ref: weakref.ref):
    """The leaf's post-accumulate-grad hook: its gradient becomes the parameter's."""

    def hook(leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        entry = entry_ref()
        if grad is None or entry is None:
            return
        param = entry.param
        if not param.requires_grad:  # frozen since the trace: no gradient, retrace next call
            leaf.requires_grad_(False)
            return
        _accumulate(param, DTensor(grad, param._spec, requires_grad=False))

    return hook


def _accumulate(param: Any, grad: torch.Tensor) -> None:
    """What autograd's ``AccumulateGrad`` does for ``param`` with ``grad``: its tensor hooks,
    then into ``.grad``, then its post-accumulate-grad hooks."""
    for tensor_hook in tuple((getattr(param, "_backward_hooks", None) or {}).values()):
        changed = tensor_hook(grad)
        if changed is not None:
            grad = changed
    if param.grad is None:
        param.grad = grad
    else:
        with torch.no_grad():
            param.grad += grad
    for after in tuple((getattr(param, "_post_accumulate_grad_hooks", None) or {}).values()):
        after(param)
