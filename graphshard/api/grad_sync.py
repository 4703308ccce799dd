"""Gradient accumulation: hold back the gradient reduction over several micro-batches.

Two ways, as in FSDP2:
- ``no_sync(model)`` (``set_requires_gradient_sync(model, False)``): no collective at all;
  each parameter's full gradient accumulates locally (in the reduce dtype) and the next
  synced backward reduces it together with its own, in one reduce-scatter. Fastest, but
  holds a full-size gradient per parameter.
- ``no_sync(model, reduce_scatter=True)`` (``set_requires_all_reduce(model, False)``): every
  micro-batch is reduce-scattered, so only sharded gradients are held. On a 2-D (HSDP) mesh
  the reduce-scattered partials are accumulated and all-reduced across replicas once, by the
  synced backward; on a 1-D mesh this is simply accumulation into ``.grad``.

The mode is read when the model runs; a compiled model is recompiled once per mode (the
graphs differ: the no_sync backward has no collective), then each graph is reused.

The synced backward reduces everything held back, as DDP does: a parameter its forward read
folds its held-back gradient into its own reduction; one it did not read (a branch only
earlier micro-batches took), or read without a gradient coming back (a block's compile region
gathers the branch too), has it reduced at the end of that backward (:func:`_reduce_unread`).
Before 2026-12-06 such a gradient stayed held back: the step went without it and a later
step that read the parameter added it in. The end is the step's backward's, not that of a
backward nested in it (a reentrant checkpoint's).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from graphshard.api.eager_kernels import from_gathered
from graphshard.api.forward_depth import mark_forward_hook
from graphshard.api.sharding import shard_state
from graphshard.errors import GraphshardRuntimeError
from graphshard.passes.layout import Dim0Layout
from graphshard.passes.markers import GradSync
from graphshard.records import ShardedParam, ShardState

__all__ = ["no_sync", "set_requires_gradient_sync", "set_requires_all_reduce"]


def _stub_leaf(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A leaf of ``shape`` that takes gradients but stores one element (stride 0)."""
    storage = torch.zeros(1, dtype=dtype, device=device)
    return storage.as_strided(tuple(shape), (0,) * len(shape)).detach().requires_grad_()


def _accum_dtype(state: ShardState, entry: ShardedParam) -> torch.dtype:
    policy = state.mixed_precision
    return (policy and policy.gradient_dtype) or entry.param.dtype


def _accum_device(state: ShardState, entry: ShardedParam) -> torch.device:
    """Where held-back gradients accumulate: on the compute device under CPU offload (a
    later reduction there folds them in), else on the shard's device."""
    return torch.device(state.compute_device) if state.compute_device else entry.param.device


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``a`` and ``b`` name one device (``cuda`` is the current ``cuda:N``)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _pending(state: ShardState, attr: str) -> list[str]:
    return [
        e.names[0] for e in state.params
        if getattr(e, attr) is not None and getattr(e, attr).grad is not None
    ]  # fmt: skip


def _set_mode(model: nn.Module, state: ShardState, mode: int) -> None:
    if mode == state.sync:
        return
    if not state.folds_held_back:
        _install_folding(getattr(model, "_orig_mod", model), state)
    clash = {GradSync.NONE: "partial", GradSync.PARTIAL: "unreduced"}.get(mode)
    if clash is not None and _pending(state, clash):
        held = "reduce-scattered partial" if clash == "partial" else "unreduced full"
        raise GraphshardRuntimeError(
            f"Gradients of {_pending(state, clash)[:3]} are held back as {held} gradients; "
            "run one synced backward (outside no_sync) before switching between "
            "no_sync(model) and no_sync(model, reduce_scatter=True)."
        )
    for entry in state.params:
        if not entry.param.requires_grad:
            continue
        device, dtype = _accum_device(state, entry), _accum_dtype(state, entry)
        if mode == GradSync.NONE and not _usable(entry.unreduced, device, dtype, entry):
            entry.unreduced = _stub_leaf(entry.full_shape, dtype, device)
            entry.unreduced.register_hook(_note_held_back(state))
        if mode == GradSync.PARTIAL and not _usable(entry.partial, device, dtype, entry):
            piece = Dim0Layout(entry.full_shape, state.world_size).piece_shape
            entry.partial = _stub_leaf(piece, dtype, device)
            entry.partial.register_hook(_note_held_back(state))
    state.sync = mode


def _usable(leaf: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
            entry: ShardedParam) -> bool:
    """Whether an accumulator still fits its shard (``.to()`` may have moved the model)."""
    if leaf is None:
        return False
    if _same_device(leaf.device, device) and leaf.dtype == dtype:
        return True
    if leaf.grad is not None:
        raise GraphshardRuntimeError(
            f"{entry.names[0]!r} moved to {device}/{dtype} while no_sync held back gradients "
            f"on {leaf.device}/{leaf.dtype}: move the model between accumulation windows "
            "(after the synced backward)."
        )
    return False


def _install_folding(root: nn.Module, state: ShardState) -> None:
    """On the first use of no_sync (never before: a model that does not accumulate pays
    nothing per forward): arm held-back gradients before each forward, drop them once a
    backward has folded them in."""
    for entry in state.params:
        if entry.param.requires_grad:
            entry.param.register_hook(_drop_when_folded(state, entry))
    root.register_forward_pre_hook(_arm_held_back(state))
    state.folds_held_back = True


def _arm_held_back(state: ShardState):
    """Before each forward, arm what no_sync held back for the first read of each parameter
    (re-armed every forward: a forward without a backward loses nothing)."""

    @mark_forward_hook
    def hook(module: nn.Module, args: tuple) -> None:
        synced = state.sync == GradSync.FULL
        for entry in state.params:
            full = None if entry.unreduced is None else entry.unreduced.grad
            part = None if entry.partial is None else entry.partial.grad
            entry.armed = None if not synced or (full is None and part is None) else (full, part)

    return hook


def _drop_when_folded(state: ShardState, entry: ShardedParam):
    """Once the shard receives a reduced gradient that folded in what no_sync held back,
    drop it. (A backward that held its gradient back hands the shard None.) Every reduced
    gradient also makes sure that this backward reduces what its forward did not read."""

    def hook(grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        _reduce_unread_after_this_backward(state)
        if not entry.folding:
            return
        entry.folding = False
        _drop_held_back(entry)

    return hook


def _drop_held_back(entry: ShardedParam) -> None:
    for leaf in (entry.unreduced, entry.partial):
        if leaf is not None:
            leaf.grad = None


def _reduce_unread_after_this_backward(state: ShardState) -> None:
    """Once per backward that reduces: if held-back gradients wait to be folded in (armed: the
    forward did not read the parameter; folding: it did), or this backward also held some
    back, check when it ends that each one was (:func:`_reduce_unread`). The ranks ran the
    same forwards (``safety.rank_agreement``), so they reduce the same parameters in the
    same order."""
    task = torch._C._current_graph_task_id()
    if state.unread_check_task == task:
        return
    state.unread_check_task = task
    if state.held_back_task == task or any(
            entry.armed is not None or entry.folding for entry in state.params):
        _check_at_the_end(state, task)


def _note_held_back(state: ShardState):
    """A hook on no_sync's accumulators: a gradient held back in a backward that also reduces
    (micro-batches forwarded under no_sync and after it, then one backward of their summed
    losses) is reduced when that backward ends, with the rest."""

    def hook(grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        state.held_back_task = task
        if state.unread_check_task == task:
            _check_at_the_end(state, task)

    return hook


def _check_at_the_end(state: ShardState, task: int) -> None:
    if state.unread_queued_task != task:
        state.unread_queued_task = task
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(_reduce_unread, state))


def _check_after_enclosing_node(state: ShardState, grad_inputs: tuple,
                                grad_outputs: tuple) -> None:
    """After the node that ran a nested backward, in the enclosing backward: check at its end
    (a second check queued there, where one already is, finds nothing left)."""
    state.unread_check_task = state.unread_queued_task = -1
    _reduce_unread_after_this_backward(state)


def _held_back_left(entry: ShardedParam) -> tuple | None:
    """What no_sync held back for ``entry`` that the reducing backward just ended did not
    fold in, else None: the armed gradients of a parameter the forward did not read; those
    of one it read whose reduction never ran (a block's compile region gathers every
    parameter of the block, a branch it did not take included); those this backward held
    back itself."""
    if entry.armed is not None:
        return entry.armed
    held = tuple(None if leaf is None else leaf.grad for leaf in (entry.unreduced, entry.partial))
    return None if held == (None, None) else held


def _reduce_unread(state: ShardState) -> None:
    """Reduce each held-back gradient left unfolded into its parameter's ``.grad``, as a read
    would have folded it into its reduction: through ``unshard``'s own backward (the same
    collectives, dtypes, divide factor, replicas and offload copy), with a zero gradient of
    its own. A trainable parameter gets it through autograd (its hooks run, on the sum, as
    for a read); a parameter frozen since it was held back gets it added to ``.grad``, as
    autograd left it in one process.

    A backward that ends inside another backward's node (a reentrant
    ``torch.utils.checkpoint`` recomputes its body and runs the body's backward from within
    its own node) is not the end: the enclosing backward may still reduce what is held back
    (the layers before the checkpointed ones). The check moves to the end of the enclosing
    one."""
    enclosing = torch._C._current_autograd_node()
    if enclosing is not None:
        enclosing.register_hook(functools.partial(_check_after_enclosing_node, state))
        return
    unread = [(entry, held) for entry in state.params
              if (held := _held_back_left(entry)) is not None]
    for entry in state.params:
        entry.armed, entry.folding = None, False
    if not unread:  # the common case: every read folded its own in
        return
    specs = {id(entry): spec for members in state.bucket_members.values()
             for entry, spec in members}
    for entry, held in unread:
        spec = specs[id(entry)]
        param = entry.param
        with torch.enable_grad():  # the callback runs with gradients off
            shard = param.to_local().detach().requires_grad_()
            zero = torch.zeros((), dtype=spec.param_dtype or shard.dtype,
                               device=spec.compute_device or shard.device)
            full = zero.expand(entry.full_shape)
            from_gathered(full, shard, *spec, GradSync.FULL, None, *held).backward(full)
            if param.requires_grad:
                torch.autograd.backward(param.to_local(), shard.grad)
        if not param.requires_grad:
            grad = DTensor.from_local(shard.grad, param.device_mesh, param.placements,
                                      shape=param.shape, stride=param.stride())
            param.grad = grad if param.grad is None else param.grad + grad
        for tensor in held:  # a read's marker may still hold it: a later backward adds 0
            if tensor is not None:
                tensor.zero_()
        _drop_held_back(entry)


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Reduce gradients in the coming backwards (True, the default), or accumulate them
    unreduced (False) until a backward with it True reduces everything once."""
    state = shard_state(model)
    _set_mode(model, state, GradSync.FULL if requires_gradient_sync else GradSync.NONE)


def set_requires_all_reduce(model: nn.Module, requires_all_reduce: bool) -> None:
    """HSDP: False keeps reduce-scattering each backward but defers the all-reduce across
    replicas (partials accumulate, sharded) until a backward with it True. On a 1-D mesh
    there is no all-reduce: gradients simply accumulate in ``.grad``."""
    state = shard_state(model)
    deferred = not requires_all_reduce and state.replica_size > 1
    _set_mode(model, state, GradSync.PARTIAL if deferred else GradSync.FULL)


@contextlib.contextmanager
def no_sync(model: nn.Module, *, reduce_scatter: bool = False) -> Iterator[None]:
    """Within the block, backwards hold back gradient communication; see the module doc.

    Args:
        model: the sharded model (or its ``torch.compile`` wrapper).
        reduce_scatter: False skips every collective (full gradients accumulate); True
            still reduce-scatters each micro-batch (only shards are held) and on an HSDP
            mesh defers just the all-reduce across replicas.

    The first backward after the block reduces what was held back. Example::

        for micro in batches[:-1]:
            with graphshard.no_sync(model):
                loss_fn(model(micro)).backward()
        loss_fn(model(batches[-1])).backward()   # reduces all micro-batches once
        optimizer.step()
    """
    state = shard_state(model)
    previous = state.sync
    if reduce_scatter:
        set_requires_all_reduce(model, False)
    else:
        set_requires_gradient_sync(model, False)
    try:
        yield
    finally:
        _set_mode(model, state, previous)
