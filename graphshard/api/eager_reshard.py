"""Eagerly, ``reshard_after_forward=True``: the gathered copies a forward saves for the
backward are let go and gathered again when the backward needs them.

Compiled, ``reshard`` frees each bucket's gathered parameters after the forward and the
backward gathers them again. Eagerly, autograd itself kept them: ``F.linear`` saves its
weight, so every gathered parameter stayed alive from its read to the backward, and an eager
forward held the whole model unsharded at its end, as DDP does (FSDP2 frees them).

So while an eager forward of a model sharded with ``reshard_after_forward=True`` (or
``"auto"``, which eagerly runs as ``True``) runs and records gradients, saved-tensor hooks
are in place (:func:`begin`, :func:`end`). A tensor autograd saves that is a gathered copy,
or a view of one, is saved as a :class:`_Saved` handle: the parameter's record and the
view's geometry. The copy goes when the reads let go of it. When the backward unpacks a
handle, the copy is gathered again, together with the other parameters of its bucket whose
handles are still alive (one collective), and the view made over it. It is let go once the
last handle of its parameter is (autograd frees a saved tensor after the node that saved it
has run), and at the latest at the end of the backward. The bucket saved last keeps its
copies: the backward starts with it (the compiled step keeps the bucket read last too).
When a bucket is gathered again, the gather of the bucket saved before it (the next one the
backward needs) is issued too, one bucket ahead as FSDP2 prefetches in its backward, and
waited for at that bucket's first unpack.

- Hooks a user had in place around the forward (``torch.autograd.graph.save_on_cpu``) still
  pack and unpack every other saved tensor: graphshard's hooks hand those on. Hooks pushed
  inside the forward (``torch.utils.checkpoint``'s) take precedence there, as they would over
  any outer hooks.
- A backward with ``create_graph=True`` (a gradient penalty) needs the copy's autograd
  history: the unpacked copy is gathered again through ``unshard``'s autograd, whose backward
  reduces into the shard as the forward's read would have.
- ``reshard_after_forward=False`` keeps the copies for the backward, as before: no second
  gather, the memory of the unsharded model at the end of the forward.
- ``reshard_after_forward=k``: a parameter's first handle also keeps this rank's piece of the
  copy over its group of ``k`` ranks (``graphshard::take_group_piece``), let go with its
  last handle; the backward gathers the pieces over that group, as the compiled step does.
  The bucket saved last, kept whole, lets its pieces go at the end of the forward.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

from graphshard.api.bucket_gathers import gather_copies, issue_gather, travels_as
from graphshard.errors import GraphshardRuntimeError
from graphshard.passes.markers import (
    RESHARD_KEEP,
    TAKE_GROUP_PIECE,
    UNSHARD,
    GradSync,
    UnshardSpec,
)
from graphshard.records import ShardedParam, ShardState

__all__ = ["begin", "end", "register_copy"]

_FORWARDS = itertools.count()


class _ForwardSaves:
    """What one forward saved, shared by its handles: the buckets in the order of their
    first handle, and the bucket saved last (whose handles keep their copies)."""

    __slots__ = ("buckets", "kept")

    def __init__(self) -> None:
        self.buckets: dict[int, None] = {}
        self.kept: int | None = None


class _Saved:
    """What is saved for the backward in place of a gathered copy (or a view of one)."""

    __slots__ = ("state", "key", "entry", "spec", "geometry", "shard", "copy", "saves")

    def __init__(self, state: ShardState, key: tuple[int, int], entry: ShardedParam,
                 spec: UnshardSpec, t: torch.Tensor, copy: torch.Tensor,
                 saves: _ForwardSaves) -> None:
        self.state, self.key, self.entry, self.spec = state, key, entry, spec
        self.saves = saves
        saves.buckets.setdefault(entry.bucket, None)
        saves.kept = entry.bucket
        # the view's shape, strides and offset from the copy's first element (a copy may
        # start inside its storage, and one gathered again elsewhere in its own)
        self.geometry = (tuple(t.shape), t.stride(), t.storage_offset() - copy.storage_offset())
        self.shard = _shard_versions(entry)
        self.copy: torch.Tensor | None = None  # the forward's copy, kept (the last bucket)
        live = state.resharded_live
        live[key] = live.get(key, 0) + 1
        if spec.reshard_size > 1 and key not in state.group_pieces:
            with torch.no_grad():  # reshard_after_forward=k: this rank's piece over its group
                state.group_pieces[key] = TAKE_GROUP_PIECE(copy, spec.reshard_size,
                                                           spec.reshard_group)

    def __del__(self) -> None:  # autograd let go of it: after its node ran, or unused
        _let_go(self.state, self.key)


def _let_go(state: ShardState, key: tuple[int, int]) -> None:
    """A handle was freed: with its parameter's last one, its copy gathered again goes."""
    live = state.resharded_live
    left = live.get(key, 0) - 1
    if left > 0:
        live[key] = left
        return
    live.pop(key, None)
    state.regathered.pop(key, None)
    state.group_pieces.pop(key, None)


def begin(state: ShardState) -> bool:
    """At the start of an eager forward (none running): put the hooks in place where the
    model reshards after the forward and autograd records; whether it did."""
    if state.regathered_clear_queued and torch._C._current_graph_task_id() == -1:
        # the last backward that gathered again raised before its end, where what it
        # gathered (and the gather it issued ahead) would have gone: they go now
        _clear(state)
    if (all(setting is False for setting in state.reshard_of_bucket)
            or not torch.is_grad_enabled()
            or torch.is_inference_mode_enabled()
            or not torch._C._autograd._saved_tensors_hooks_is_enabled()
            or torch._C._current_graph_task_id() != -1):
        return False
    outer = torch._C._autograd._top_saved_tensors_default_hooks(True)
    forward, saves = next(_FORWARDS), _ForwardSaves()
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(t: torch.Tensor) -> Any:
        saved = _as_saved(state, forward, saves, t)
        if saved is not None:
            return saved
        return outer_pack(t) if outer_pack is not None else t

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _Saved):
            return _unpack(packed)
        return outer_unpack(packed) if outer_unpack is not None else packed

    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
    state.reshard_copies = {}
    return True


def end(state: ShardState) -> None:
    """At the end of a forward :func:`begin` put the hooks in place for."""
    torch._C._autograd._pop_saved_tensors_default_hooks()
    state.reshard_copies = None
    for handle in state.reshard_kept:  # kept whole: their pieces over a group are not needed
        state.group_pieces.pop(handle.key, None)
    state.reshard_kept = []  # the last bucket's handles keep their copies, autograd the handles


def register_copy(state: ShardState, full: Any, entry: ShardedParam, spec: UnshardSpec
                  ) -> None:
    """A read gathered ``full``, the copy of ``entry``'s parameter: what the hooks save of it
    is a handle (while :func:`begin`'s hooks are in place)."""
    copies = state.reshard_copies
    if copies is None or type(full) is not torch.Tensor or full.numel() == 0:
        return
    copies.setdefault(full.untyped_storage().data_ptr(), []).append(
        (weakref.ref(full), entry, spec))


def _as_saved(state: ShardState, forward: int, saves: _ForwardSaves, t: torch.Tensor
              ) -> _Saved | None:
    """The handle for ``t`` if it is a gathered copy this forward read, or a view of one."""
    copies = state.reshard_copies
    if not copies or type(t) is not torch.Tensor or t.numel() == 0:
        return None
    known = copies.get(t.untyped_storage().data_ptr())
    if not known:
        return None
    first, last = _extent(t)
    for ref, entry, spec in known:
        copy = ref()  # None: let go already, its memory may hold another tensor now
        if (spec.reshard == RESHARD_KEEP  # kept for the backward (per module, False)
                or copy is None or copy.dtype != t.dtype or copy.device != t.device
                or not copy.is_contiguous()):  # a copy gathered again is contiguous
            continue
        start, end = _extent(copy)
        if start <= first and last <= end:  # t lies within this copy
            saved = _Saved(state, (forward, id(entry)), entry, spec, t, copy, saves)
            _keep_while_last(state, saved, copy)
            return saved
    return None


def _keep_while_last(state: ShardState, saved: _Saved, copy: torch.Tensor) -> None:
    """The handles of the bucket saved last keep their copies: the backward starts with
    that bucket, so gathering it again would be a collective for nothing (the compiled step
    keeps the bucket read last too, as FSDP2 keeps its root's). A handle of another bucket
    lets the previous bucket's copies go."""
    kept = state.reshard_kept
    if kept and kept[0].entry.bucket != saved.entry.bucket:
        for handle in kept:
            handle.copy = None
        kept.clear()
    saved.copy = copy
    kept.append(saved)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The first and last storage elements ``t`` reaches."""
    first = t.storage_offset()
    return first, first + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))


def _shard_versions(entry: ShardedParam) -> tuple[int, int, int]:
    """What tells that ``entry``'s shard changed: its local tensor and the version counters
    of the DTensor and of that tensor (an update counts on one of them). (Not the model's
    optimizer steps: a step over other parameters of the model, a GAN's discriminator,
    changes nothing this backward reads. graphshard's fused step, which bumps no counter,
    goes unseen.)"""
    param = entry.param
    local = param._local_tensor
    return id(local), param._version, local._version


def _unpack(saved: _Saved) -> torch.Tensor:
    """The saved view, over the copy gathered again (module docstring); raises if the
    parameter changed since the forward, where autograd would have refused the saved tensor
    of an unsharded model too."""
    if _shard_versions(saved.entry) != saved.shard:
        raise GraphshardRuntimeError(
            f"graphshard: parameter {saved.entry.names[0]!r}, which the backward needs, was "
            f"modified in place since the forward (an optimizer step, or an update of the "
            f"parameter, between the forward and its backward). On one process autograd "
            f"refuses this too (\"one of the variables needed for gradient computation has "
            f"been modified by an inplace operation\"). Run the backward before updating the "
            f"parameters, or pass reshard_after_forward=False to graphshard.shard() to keep "
            f"the values the forward read for the backward.")
    shape, stride, offset = saved.geometry
    if torch.is_grad_enabled():  # create_graph: the copy needs its autograd history
        full = _regathered_with_history(saved)
    elif saved.copy is not None:  # kept: the bucket saved last in the forward
        full = saved.copy
    else:
        full = saved.state.regathered.get(saved.key)
        if full is None:
            full = _gather_again(saved)
    full = full.contiguous()
    return full.as_strided(shape, stride, full.storage_offset() + offset)


def _gather_again(saved: _Saved) -> torch.Tensor:
    """Gather ``saved``'s parameter again, with the other members of its bucket whose
    handles from the same forward are alive and not gathered again yet, in one collective
    (issued ahead by the previous bucket's, :func:`_prefetch_before`, where it was); keep
    the copies until their last handle goes or the backward ends. (Outside a backward, where
    a saved tensor is read through its node, ``grad_fn._saved_self``, only ``saved``'s,
    kept by nobody.)"""
    state, forward, bucket = saved.state, saved.key[0], saved.entry.bucket
    if torch._C._current_graph_task_id() == -1:
        return gather_copies([(saved.entry, saved.spec)])[0]
    key = travels_as(saved.entry, saved.spec)
    pending = state.regather_pending.pop((forward, bucket, key), None)
    if pending is None or all(e is not saved.entry for e, _ in pending.reads):
        if pending is not None:
            pending.drop()
        reads = _waiting(state, forward, bucket, key, saved.entry)
        if all(e is not saved.entry for e, _ in reads):
            return gather_copies([(saved.entry, saved.spec)])[0]
        pending = issue_gather(reads, key, _group_pieces(state, forward, reads))
    _prefetch_before(state, saved.saves, forward, bucket)
    for (e, _), full in zip(pending.reads, pending.copies(), strict=True):
        if e is saved.entry or (forward, id(e)) in state.resharded_live:
            state.regathered[(forward, id(e))] = full
    if not state.regathered_clear_queued:  # whatever is left goes with the backward
        state.regathered_clear_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: _clear(state))
    return state.regathered[saved.key]


def _waiting(state: ShardState, forward: int, bucket: int, key: tuple | None,
             entry: ShardedParam | None = None) -> list[tuple[ShardedParam, UnshardSpec]]:
    """The members of ``bucket`` (travelling as ``key``) that ``forward``'s handles still
    wait for: alive and not gathered again yet; ``entry`` whatever its handles."""
    return [(e, spec) for e, spec in state.bucket_members.get(bucket, ())
            if e is entry or ((forward, id(e)) in state.resharded_live
                              and (forward, id(e)) not in state.regathered
                              and travels_as(e, spec) == key)]


def _prefetch_before(state: ShardState, saves: _ForwardSaves, forward: int, bucket: int
                     ) -> None:
    """Issue the gather of the bucket ``forward`` saved before ``bucket`` (the nearest with
    handles waiting), which the backward needs next, unless it is issued already."""
    order = list(saves.buckets)
    if bucket not in saves.buckets:
        return
    for before in reversed(order[:order.index(bucket)]):
        if before == saves.kept:  # its handles keep their copies
            continue
        members = state.bucket_members.get(before, ())
        key = next((travels_as(e, spec) for e, spec in members
                    if (forward, id(e)) in state.resharded_live
                    and (forward, id(e)) not in state.regathered), None)
        if key is None:
            continue  # nothing of it waits
        if (forward, before, key) not in state.regather_pending:
            reads = _waiting(state, forward, before, key)
            state.regather_pending[(forward, before, key)] = issue_gather(
                reads, key, _group_pieces(state, forward, reads))
        return


def _group_pieces(state: ShardState, forward: int,
                  reads: list[tuple[ShardedParam, UnshardSpec]]) -> list[torch.Tensor] | None:
    """With ``reshard_after_forward=k``, the pieces ``forward`` kept of the members in
    ``reads``, to gather over their group of ``k``; None to gather their shards (no group,
    or a piece missing: the whole group then gathers, the same values)."""
    if reads[0][1].reshard_size <= 1:
        return None
    pieces = [state.group_pieces.get((forward, id(e))) for e, _ in reads]
    return None if any(p is None for p in pieces) else pieces


def _clear(state: ShardState) -> None:
    state.regathered.clear()
    state.regathered_clear_queued = False
    for pending in state.regather_pending.values():
        pending.drop()
    state.regather_pending.clear()


def _regathered_with_history(saved: _Saved) -> torch.Tensor:
    """The copy gathered again through ``unshard``, for a backward that records its own
    (``create_graph=True``): the gradient through it reaches the shard as the forward read's
    would, when that read synchronised gradients."""
    state, entry = saved.state, saved.entry
    if state.sync != GradSync.FULL:
        raise GraphshardRuntimeError(
            f"graphshard: a backward with create_graph=True through the eager model inside "
            f"no_sync (or with set_requires_all_reduce(False)) cannot gather parameter "
            f"{entry.names[0]!r} again with its gradient held back. Pass "
            f"reshard_after_forward=False to graphshard.shard() (the gathered parameters are "
            f"kept for the backward), or leave create_graph off inside no_sync.")
    return UNSHARD(entry.param.to_local(), *saved.spec)
