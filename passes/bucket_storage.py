"""Gather a bucket straight from its storage, when its shards already lie as the gather needs.

A flat all-gather sends one buffer per rank: every shard of the bucket flattened, padded to
its piece and concatenated (``graphshard.passes.layout``). Building that buffer is a copy of
the bucket's shards at every gather, forward and backward. ``graphshard.shard`` stores each
bucket's shards that way to begin with (``graphshard.api.bucket_storage``): one flat, padded
buffer per bucket, every parameter's local tensor living in its piece. The compiled reads
hand that buffer to the ``unshard`` marker (``storage``, and the shard's place there,
``storage_index``), and the gather reads it: no copy is made.

A bucket is gathered from its storage only when every marker of it names the same buffer,
the places are 0, 1, ... in one order with nothing missing (the buffer holds exactly the
bucket's pieces, no more: gathering it must not send another parameter), the buffer has the
shards' dtype, and the shards are gathered as they are (no cast, no copy to another device).
Anything else is built into a buffer as before: a bucket read only in part (a backward that
gathers weights but not biases), buckets that a bucketing strategy merged, a read that passes
no buffer.
"""

from __future__ import annotations

from typing import Any

from torch import fx

from graphshard.passes.layout import Dim0Layout
from graphshard.passes.markers import marker_args

__all__ = ["bucket_storage"]


def bucket_storage(slots: dict[fx.Node, list[fx.Node]], layouts: dict[fx.Node, Dim0Layout],
                   args: Any) -> tuple[fx.Node, list[fx.Node]] | None:
    """The buffer node the bucket's gather can read as its whole input, and the shard nodes
    in its order; None when there is none (module docstring). ``slots``: each shard node's
    markers; ``layouts``: each shard node's layout; ``args``: the bucket's first marker's
    arguments."""
    if args.compute_device:
        return None  # the copy to the device makes a new buffer anyway
    places: dict[int, fx.Node] = {}
    storage = None
    for shard, nodes in slots.items():
        for node in nodes:
            m = marker_args(node)
            if m.storage is None or (storage is not None and m.storage is not storage):
                return None
            storage = m.storage
            if places.setdefault(m.storage_index, shard) is not shard:
                return None
    if storage is None or sorted(places) != list(range(len(slots))):
        return None
    order = [places[i] for i in range(len(slots))]
    val = storage.meta.get("val")
    first = order[0].meta.get("val")
    if val is None or first is None or val.dim() != 1 or val.dtype != first.dtype:
        return None
    if args.param_dtype not in (None, first.dtype):
        return None  # a cast makes a new buffer anyway: the copy-in is fused into it
    if val.numel() != sum(layouts[shard].piece_numel for shard in order):
        return None
    if len(order) == 1 and first.numel() == val.numel():
        return None  # the shard is its whole piece: the gather reads it as it is anyway
    return storage, order
