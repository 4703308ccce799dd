"""Trainable sharded parameters enter the compiled graphs as plain tensors.

Read inside a compiled forward as ``param.to_local()``, a DTensor parameter costs host time
at every step, per parameter, in code that does no work on the data:

- Dynamo's guards on a DTensor input: two Python guards (its spec, compared field by field,
  and its mesh's identity) besides the tensor's own;
- AOTAutograd's runtime wraps the parameter's gradient into a new DTensor
  (``DTensor.__tensor_unflatten__`` builds a spec from scratch).

At world 1 on a small model, where no collective runs, this is most of what graphshard's
step costs beyond one process's (``docs/benchmark-log.md``).

So each trainable parameter's record (:class:`~graphshard.records.ShardedParam`) holds
:attr:`~graphshard.records.ShardedParam.local`: a plain tensor over the local shard's
storage, made once from the DTensor parameter, and the compiled graphs read it. The graph's
input is then a plain tensor, and so is its gradient. Autograd still links it to the
parameter, through one backward node for all of a model's trainable parameters
(:class:`_ToParameters`; a tensor re-made later gets a node of its own). The node saves
nothing, so it serves every backward, not just the first.

Its backward hands each gradient to the parameter in one of two ways:

- **Directly**, in the common case: a plain ``loss.backward()`` (or ``inputs=`` naming the
  parameter) without ``create_graph``, a parameter with no tensor hook and no
  post-accumulate-grad hook, and a gradient of the shard's dtype, device and strides. The
  node then does what autograd's ``AccumulateGrad`` would: ``.grad`` becomes a DTensor on the
  parameter's own spec around the gradient (built directly, not through ``from_local``), or
  the gradient is added in place to the local tensor of an existing ``.grad`` on that spec.
  This skips, per parameter and step, a Python call of the node and ``AccumulateGrad``'s
  ``detach()`` of a DTensor (a Python dispatch): most of what the gradients cost the host at
  world 1 (``docs/benchmark-log.md``).
- **Through autograd** otherwise: the node returns the DTensor and the parameter's own
  ``AccumulateGrad`` takes it from there, so everything autograd does with a parameter
  still holds: its hooks, ``torch.autograd.grad(loss, params)``, ``create_graph``. Under
  ``create_graph`` the DTensor is made differentiably (``from_local``), so that the gradient
  keeps its history: a loss built from it (a gradient penalty) reaches the compiled
  backward, which refuses a double backward as plain ``torch.compile`` does, instead of
  silently contributing nothing.

The one difference: a hook registered on a parameter's ``AccumulateGrad`` node itself
(``p.view_as(p).grad_fn.next_functions[0][0].register_hook``, as DDP does internally), which
autograd offers no way to see, does not run in the direct case. Register it on the
parameter (``register_hook`` or ``register_post_accumulate_grad_hook``) instead: either one
turns the direct path off for that parameter. The optimizer, ``clip_grad_norm_``, state
dicts and DCP see the same DTensors as before; eager reads are unchanged.

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
  which fails its guard so that the next call retraces. The trace re-makes every tensor of
  a module before it reads any (:func:`trains`), so a whole layer unfrozen at once (weight
  and bias) trains again in full.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch._dynamo import compiled_autograd
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor

from graphshard.api.bucket_storage import follow_new_storage, keep_stored
from graphshard.api.dtensor_handlers import wrap_local
from graphshard.records import ShardedParam
from graphshard.safety.guards import on_new_storage

__all__ = [
    "LOCAL_INDEX_ATTR", "LOCALS_ATTR", "attach_local", "register_locals", "register_module_mates",
    "same_view", "set_local", "trains",
]

# On a sharded module: parameter name -> its record's index for :func:`trains`.
LOCAL_INDEX_ATTR = "_graphshard_local_index"
# On a sharded module: parameter name -> its record's plain tensor (``ShardedParam.local``).
# A dict of tensors in the module's own ``__dict__``, so that Dynamo can skip the module's
# guards while its dicts are unchanged (torch's recursive dict tags); a tensor reached
# through a record (a dataclass) would make Dynamo check the module at every step.
LOCALS_ATTR = "_graphshard_locals"

# index -> the record of a parameter read in compiled graphs (a weak reference: the table
# outlives models). Dynamo passes :func:`trains` an index: a constant, never a guard.
_RECORDS: list[weakref.ref] = []


def register_locals(entries: list[ShardedParam]) -> list[int]:
    """Give each of ``entries`` (one model's records) its plain tensor, the trainable ones
    through one backward node, and an index for :func:`trains` each."""
    trainable = [e for e in entries if isinstance(e.param, DTensor) and e.param.requires_grad]
    if trainable:
        _link(trainable)
    indices = []
    for entry in entries:
        attach_local(entry)  # the frozen ones; a no-op on those just linked (fresh)
        _RECORDS.append(weakref.ref(entry))
        indices.append(len(_RECORDS) - 1)
    return indices


def _link(entries: list[ShardedParam]) -> None:
    """Make the plain tensors of ``entries`` (trainable DTensor parameters) through one
    :class:`_ToParameters` node."""
    group = _Group(entries)
    with torch.enable_grad():  # also where a caller (load_state_dict) disabled it
        locals_ = _ToParameters.apply(group, *(e.param for e in entries))
    group.accumulators = [edge[0] for edge in locals_[0].grad_fn.next_functions]
    for entry, local, accumulator in zip(entries, locals_, group.accumulators, strict=True):
        setattr(local, _MADE_FROM, id(entry.param))
        setattr(local, _LINKED_TO, accumulator)
        set_local(entry, local)


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
    Parameter, storage, layout and ``requires_grad``, and for a trainable one the same
    ``AccumulateGrad`` node. ``Module._apply`` swaps a DTensor parameter's contents even
    where they do not change (``.to(memory_format=...)`` of a Linear), and the swap poisons
    the node the tensor was linked to: the next backward through it would raise."""
    local, param = entry.local, entry.param  # param: a DTensor (attach_local checks)
    return (
        local is not None
        and getattr(local, _MADE_FROM, None) == id(param)
        and local.requires_grad == param.requires_grad
        and same_view(local, param._local_tensor)
        and (not param.requires_grad
             or getattr(local, _LINKED_TO, None) is _accumulator(param))
    )


class _Edge(torch.autograd.Function):
    """Nothing, made from a parameter: its node's one edge leads to the parameter's
    ``AccumulateGrad``. (``torch.autograd.graph.get_gradient_edge`` takes ``view_as`` of
    the parameter, which DTensor's dispatch refuses for a shard with fewer rows than
    others.)"""

    @staticmethod
    def forward(ctx: Any, param: DTensor) -> torch.Tensor:
        return param._local_tensor.new_empty(0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> None:
        return None


def _accumulator(param: DTensor) -> Any:
    """The ``AccumulateGrad`` node of the trainable ``param`` (made if it has none yet)."""
    with torch.enable_grad():
        made = _Edge.apply(param)  # alive while its node is read (torch 2.11 needs it)
    return made.grad_fn.next_functions[0][0]


_MADE_FROM = "_graphshard_made_from"  # on ``entry.local``: the id of the Parameter it is of
_LINKED_TO = "_graphshard_linked_to"  # on a trainable one's: the AccumulateGrad it feeds


def attach_local(entry: ShardedParam) -> None:
    """(Re)make ``entry.local`` (module docstring) unless it is still fresh."""
    param = entry.param
    if not isinstance(param, DTensor):
        set_local(entry, None)
        return
    if _fresh(entry):
        return
    if param.requires_grad:
        _link([entry])
        return
    local = param._local_tensor.detach()
    setattr(local, _MADE_FROM, id(param))
    set_local(entry, local)


def set_local(entry: ShardedParam, local: torch.Tensor | None) -> None:
    """Make ``local`` the plain tensor of ``entry``, where traced code reads it too: the
    owning modules' dicts of plain tensors (``entry.local_slots``).

    Its sizes are marked static, as Dynamo keeps a Parameter's
    (``force_parameter_static_shapes``): a plain tensor would otherwise get dynamic sizes
    when Dynamo takes a compile for a recompile, as it does for a second model of the same
    class (a student beside its teacher), or under ``dynamic=True``, and the compile would
    trace the weights' sizes symbolically."""
    if local is not None:
        torch._dynamo.mark_static(local)
    entry.local = local
    for slot, name in entry.local_slots:
        slot[name] = local


class _Group:
    """What one :class:`_ToParameters` node knows of its parameters: their records (weakly:
    the node outlives a model), the Parameters and specs it was made from, and their
    ``AccumulateGrad`` nodes (which the engine may or may not run in a given backward)."""

    def __init__(self, entries: list[ShardedParam]) -> None:
        self.entries = [weakref.ref(e) for e in entries]
        self.params = [e.param for e in entries]
        self.specs = [e.param._spec for e in entries]
        # the node's next functions, one per parameter (the group argument has no edge)
        self.accumulators: list[Any] = []


class _ToParameters(torch.autograd.Function):
    """Parameters' local shards as plain tensors (their storage), one node for all of them,
    whose gradients go back to the parameters on their own specs (module docstring). Saves
    no tensor: one application serves every backward."""

    @staticmethod
    def forward(ctx: Any, group: _Group, *params: DTensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.set_materialize_grads(False)  # a parameter without a gradient gets none
        return tuple(p._local_tensor.detach() for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        group = ctx.group
        direct = _direct_possible()
        out: list[Any] = [None]  # the group argument
        # one pass over every parameter at every step: what is fixed lives on the group
        for param, spec, accumulator, ref, grad in zip(
                group.params, group.specs, group.accumulators, group.entries, grads,
                strict=True):
            if grad is None:
                out.append(None)
            elif not param.requires_grad and (entry := ref()) is not None and (
                    entry.param is param):
                attach_local(entry)  # frozen since the trace: retrace at the next call
                out.append(None)
            elif direct and _accumulate(param, spec, grad, accumulator):
                out.append(None)
            elif torch.is_grad_enabled():  # create_graph: the gradient keeps its history
                out.append(DTensor.from_local(grad, spec.mesh, spec.placements,
                                              run_check=False, shape=spec.shape,
                                              stride=spec.stride))
            else:
                out.append(wrap_local(grad, spec))
        return tuple(out)


def _direct_possible() -> bool:
    """Whether this backward may set ``.grad`` itself: no graph of the gradients is being
    built (``create_graph``) and compiled autograd is not tracing the backward."""
    if torch.is_grad_enabled():
        return False
    tracing = getattr(compiled_autograd, "in_compiled_autograd_region", False)
    return not (tracing() if callable(tracing) else tracing)  # a function in some releases


def _accumulate(param: DTensor, spec: Any, grad: torch.Tensor, accumulator: Any) -> bool:
    """Do for ``param`` what its ``AccumulateGrad`` would do with ``grad`` (a plain tensor
    on ``spec``), where nothing but that node would see the difference; False (and nothing
    done) where autograd must do it."""
    if param._backward_hooks or param._post_accumulate_grad_hooks is not None:
        return False
    try:
        if not torch._C._will_engine_execute_node(accumulator):
            return False  # backward(inputs=...) without this parameter
    except RuntimeError:
        return False  # torch.autograd.grad: the engine captures the gradient instead
    local = param._local_tensor
    if grad.dtype != local.dtype or grad.device != local.device or grad.shape != local.shape:
        return False
    current = param.grad
    if current is None:
        if grad.stride() != local.stride():
            return False  # AccumulateGrad would copy it into the parameter's layout
        param.grad = wrap_local(grad, spec)
        return True
    if type(current) is DTensor and current._spec is spec:
        current._local_tensor.add_(grad)
        return True
    return False


# index -> the indices of the records read through the same modules' dicts (its own
# included): what :func:`trains` re-makes together.
_MODULE_MATES: dict[int, tuple[int, ...]] = {}


def register_module_mates(indices: Iterable[int]) -> None:
    """Note that the records ``indices`` are one module's parameters, read through that
    module's dict of plain tensors (:data:`LOCALS_ATTR`)."""
    mates = tuple(indices)
    for index in mates:
        _MODULE_MATES[index] = tuple(dict.fromkeys(_MODULE_MATES.get(index, ()) + mates))


@torch.compiler.assume_constant_result
def trains(index: int) -> bool:
    """While Dynamo traces: whether the parameter of record ``index`` trains, so that the
    trace reads its tensor (re-made first if its parameter changed). A constant of the trace,
    not a guard: the tensor's flag, or the parameter's, is guarded where it is read.

    The tensors of its module mates are re-made too, before the trace reads any of them:
    Dynamo takes the module's dict of tensors as it is when first read, so a tensor re-made
    after that read (a bias unfrozen with its weight, read second) would be traced as the
    stale one, frozen, and would get no gradient."""
    entry = _RECORDS[index]()
    if entry is None or not isinstance(entry.param, DTensor):
        return False
    with unset_fake_temporarily():
        for mate_index in _MODULE_MATES.get(index, (index,)):
            mate = _RECORDS[mate_index]()
            if mate is not None and isinstance(mate.param, DTensor):
                keep_stored(mate, attach_local)  # the bucket's flat buffer (api.bucket_storage)
                attach_local(mate)
    return bool(entry.param.requires_grad)


# .to(), to_empty(), accepted replacements (safety.guards): the bucket's buffer first, so that
# the plain tensor is re-made from the parameter's piece of it
on_new_storage(follow_new_storage)
on_new_storage(attach_local)
