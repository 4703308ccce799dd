"""Each bucket's shards in one flat, padded buffer, so that its all-gather copies nothing in.

The all-gather of a bucket sends one buffer per rank: its shards flattened, each padded to
its piece (``graphshard.passes.layout``) and concatenated. Built in the compiled graph, that
buffer is a copy of the bucket's shards at every gather, forward and backward. Stored that
way to begin with, it is not: :func:`store_buckets` lays each bucket's shards out in one flat
buffer, piece after piece (padding zeroed), and every parameter's local tensor lives in it.
The compiled reads pass the buffer to the ``unshard`` marker (``storage``, with the
parameter's place in it, ``storage_index``, a constant of the trace), and the lowering
gathers it as it is (``graphshard.passes.bucket_storage``). The parameters are the same
DTensors; the optimizer, state dicts and DCP read and write them in place as before.

Each local tensor is a tensor of its own over its piece of the buffer (DLPack hands it out
with its own storage, at offset 0, holding the buffer alive), not a view at an offset:
torch's DTensor takes its local tensor's storage offset, and a DTensor at a nonzero offset
fails ``copy.deepcopy`` and ``torch.save`` (torch 2.11 to 2.14), which users run on state
dicts. FSDP2's padded buffers are per parameter, at offset 0, for the same reason. So
nothing in torch sees the sharing; graphshard keeps it true, below.

A bucket is stored this way when the gather could read it as it is: more than one rank
gathers, without CPU offload or tensor parallelism, no mixed-precision cast (a cast writes a
new buffer anyway, and the copy-in is fused into it), and its shards have one dtype and
device. Only a trainable parameter's compiled read hands the buffer over (a frozen one is read
through its DTensor), so a bucket with a frozen parameter is copied in, as before.

The layout can be lost: ``to_empty()``, ``.to()``, ``load_state_dict(assign=True)`` give each
parameter a new local tensor (a model sharded on the meta device has no memory to lay out
yet). A graph traced before reads the bucket's buffer, not that tensor, and Dynamo's guards
check a tensor's metadata, not its identity: left alone, it would go on gathering the old
values. So :func:`follow_new_storage` (called by ``graphshard.safety.guards`` as soon as a
parameter may hold new storage) copies a new local tensor of the same dtype, device and shape
into the parameter's piece and makes the piece its local tensor again: the buffer holds the
new values, and graphs traced before stay valid. A tensor that cannot go there (another dtype
or device, ``.to(torch.float64)`` say) drops the buffer: the modules' buffer slots become
None, which fails those graphs' guards, and before the next trace reads a parameter,
:func:`keep_stored` lays the bucket out again (one copy of its shards). The parameters'
plain tensors are re-made with it (:mod:`graphshard.api.local_inputs`). No graph runs on a
buffer its parameters no longer live in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor
from torch.utils.dlpack import from_dlpack

from graphshard.passes.layout import Dim0Layout
from graphshard.records import ShardedParam, ShardState

__all__ = ["STORAGES_ATTR", "BucketStorage", "follow_new_storage", "keep_stored", "place",
           "register_storage_slots", "store_buckets"]

# On a sharded module: parameter name -> its bucket's flat buffer, or None. (Its place there
# is fixed by ``shard()``: :func:`place`, which the reads take as a constant.)
# A dict in the module's own ``__dict__``, as ``local_inputs.LOCALS_ATTR``, so that Dynamo
# can skip the module's guards while it is unchanged; :func:`_publish` is the one writer.
STORAGES_ATTR = "_graphshard_storages"


class BucketStorage:
    """One bucket's records and, while it is laid out, its buffer and the local tensors
    made in it (the parameters' ``_local_tensor`` then, object for object)."""

    def __init__(self, entries: list[ShardedParam]) -> None:
        self.entries = entries
        self.flat: torch.Tensor | None = None
        self.locals: list[torch.Tensor] = []

    def laid_out(self) -> bool:
        return self.flat is not None and all(
            _local(e) is t for e, t in zip(self.entries, self.locals, strict=True))


def store_buckets(state: ShardState) -> None:
    """At ``shard()``: group ``state``'s records by bucket where the bucket's storage may be
    one buffer (module docstring), and lay out those that qualify now."""
    if state.world_size == 1 or state.offload is not None:
        return
    buckets: dict[int, list[ShardedParam]] = {}
    for entry in state.params:
        buckets.setdefault(entry.bucket, []).append(entry)
    cast = state.mixed_precision.param_dtype if state.mixed_precision is not None else None
    for entries in buckets.values():
        if any(entry.tp is not None for entry in entries):
            continue
        if cast is not None and cast != entries[0].param.dtype:
            continue
        group = BucketStorage(entries)
        for entry in entries:
            entry.storage_group = group
        keep_stored(entries[0])


def keep_stored(entry: ShardedParam, attach: Callable[[ShardedParam], None] | None = None
                ) -> None:
    """Lay ``entry``'s bucket out in one buffer if it is not (any more) and can be; forget a
    buffer its parameters no longer live in. ``attach`` re-makes a record's plain tensor
    after its local tensor changed."""
    group: BucketStorage | None = entry.storage_group
    if group is None:
        return
    locals_ = [_local(e) for e in group.entries]
    if any(t is None or t.is_meta for t in locals_):
        return  # no memory to lay out yet (a meta model before to_empty)
    laid_out = group.laid_out()
    if not laid_out and group.flat is not None:  # lost since: no read may pass that buffer
        group.flat, group.locals = None, []
        _publish(group)
    if laid_out or not _qualifies(locals_) or not _lay_out(group, locals_):
        return
    _publish(group)
    if attach is not None:
        for e in group.entries:
            attach(e)


def follow_new_storage(entry: ShardedParam) -> None:
    """``entry``'s parameter may hold a new local tensor (``.to()``, ``to_empty()``, an
    assigned replacement): keep its bucket's buffer true (module docstring). Its values go to
    the parameter's piece, which is its local tensor again, where they fit there; otherwise
    the buffer is dropped, to be laid out again by the next trace."""
    group: BucketStorage | None = entry.storage_group
    if group is None or group.flat is None:
        return
    index = group.entries.index(entry)
    made, new = group.locals[index], _local(entry)
    if new is made:
        return
    if _fits(new, made):
        with torch.no_grad():
            made.copy_(new)
        entry.param._local_tensor = made
        return
    group.flat, group.locals = None, []
    _publish(group)


def _fits(new: Any, made: torch.Tensor) -> bool:
    """Whether ``new`` can be copied into the piece ``made`` and replaced by it."""
    return (
        isinstance(new, torch.Tensor)
        and not new.is_meta
        and is_fake(new) == is_fake(made)
        and new.dtype == made.dtype
        and new.device == made.device
        and new.shape == made.shape
        and new.stride() == made.stride()
    )


def register_storage_slots(entry: ShardedParam, slots: dict, key: Any) -> None:
    """``slots[key]`` (a module's :data:`STORAGES_ATTR` dict under the parameter's name, or a
    served block's dict under the bucket's index) follows ``entry``'s buffer."""
    entry.storage_slots.append((slots, key))
    slots[key] = _slot_value(entry)


def _lay_out(group: BucketStorage, locals_: list[torch.Tensor]) -> bool:
    """One zeroed buffer, each shard copied to its piece, each parameter's local tensor made
    over that piece; False (nothing changed) where DLPack cannot hand out the dtype."""
    pieces = [_piece(e) for e in group.entries]
    flat = locals_[0].new_zeros(sum(pieces))
    made, offset = [], 0
    with torch.no_grad():
        for t, piece in zip(locals_, pieces, strict=True):
            view = flat[offset:offset + t.numel()].view(t.shape)
            view.copy_(t)
            try:
                made.append(_unaliased(view) if is_fake(view) else from_dlpack(view))
            except (BufferError, RuntimeError, TypeError):
                return False  # a dtype DLPack lacks: the bucket keeps its shards as they are
            offset += piece
    for e, local in zip(group.entries, made, strict=True):
        e.param._local_tensor = local  # as FSDP2 re-points a sharded parameter
    torch._dynamo.mark_static(flat)  # a graph input, static as a Parameter (see set_local)
    group.flat, group.locals = flat, made
    return True


def _unaliased(view: torch.Tensor) -> torch.Tensor:
    """A fake piece's local tensor: a fake tensor of its own, at offset 0. DLPack hands out no
    fake tensor, and the view itself (at its offset in the buffer) is one Dynamo cannot
    convert where it wraps the DTensor (a frozen parameter's read in an offline trace, where
    every tensor is fake): "Attempted to set the storage of a tensor on device cpu to a
    storage on different device meta". A fake tensor holds no values to share."""
    return view.new_empty(view.shape)


def _publish(group: BucketStorage) -> None:
    for e in group.entries:
        value = _slot_value(e)
        for slots, name in e.storage_slots:
            slots[name] = value


def _slot_value(entry: ShardedParam) -> torch.Tensor | None:
    group: BucketStorage | None = entry.storage_group
    return None if group is None else group.flat


def place(entry: ShardedParam) -> int:
    """``entry``'s piece among its bucket's in the buffer (fixed by ``shard()``), or -1 for
    a bucket never laid out in one buffer."""
    group: BucketStorage | None = entry.storage_group
    return -1 if group is None else group.entries.index(entry)


def _local(entry: ShardedParam) -> Any:
    param = entry.param
    return param._local_tensor if isinstance(param, DTensor) else None


def _piece(entry: ShardedParam) -> int:
    return Dim0Layout(entry.full_shape, entry.param.device_mesh.size(-1)).piece_numel


def _qualifies(locals_: list[torch.Tensor]) -> bool:
    first = locals_[0]
    return all(t.dtype == first.dtype and t.device == first.device and t.is_contiguous()
               for t in locals_)
