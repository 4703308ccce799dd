"""Lower the ``reduce_grad`` markers of each bucket into one reduce-scatter.

Each full gradient is padded on dim 0 and laid out as ``[world, rows * inner]``; the bucket's
gradients are concatenated along dim 1 so that rank r's slice of the flat buffer is exactly
the concatenation of its shards. One averaging reduce-scatter then hands each rank its
gradient shards. It is issued once the bucket's last gradient exists; its wait sits just
after it (the scheduling passes delay it).
"""

from __future__ import annotations

import math

import torch
from torch import fx

from passes.fx_util import NodeMaker, aten, c10d, graph_order, replace_and_erase
from passes.markers import is_reduce_grad, marker_args, shard_shape
from passes.plan import Bucket, Plan, collect_buckets

__all__ = ["lower_reduce_grad"]


def lower_reduce_grad(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Replace every bucket's ``reduce_grad`` markers with one reduce-scatter and views."""
    make = NodeMaker(gm.graph)
    for bucket in collect_buckets(gm.graph, is_reduce_grad):
        _lower_bucket(gm.graph, make, bucket)
    gm.graph.lint()
    gm.recompile()
    return gm


def _check_users_after(graph: fx.Graph, bucket: Bucket, anchor: fx.Node) -> None:
    order = graph_order(graph)
    for node in bucket.nodes:
        for user in node.users:
            if order[user] < order[anchor]:
                raise AssertionError(
                    f"{user.format_node()} uses a gradient of bucket {bucket.index} before the "
                    "bucket's last gradient exists; it cannot be reduced as one collective."
                )


def _lower_bucket(graph: fx.Graph, make: NodeMaker, bucket: Bucket) -> None:
    anchor = bucket.nodes[-1]
    _check_users_after(graph, bucket, anchor)
    first = marker_args(bucket.nodes[0])
    world, group = first.world_size, first.group_name
    with graph.inserting_before(anchor):
        columns, shapes = [], []
        for node in bucket.nodes:
            grad = marker_args(node).grad
            full_shape = list(grad.meta["val"].shape)
            shapes.append(shard_shape(full_shape, world))
            columns.append(_as_rank_major(make, grad, full_shape, world))
        matrix = columns[0] if len(columns) == 1 else make(aten.cat.default, columns, 1)
        flat = make(aten.view.default, matrix, [-1])
        reduced = make(c10d.reduce_scatter_tensor.default, flat, "avg", world, group)
        reduced.meta["graphshard"] = {
            "kind": "reduce_grad",
            "bucket": bucket.index,
            "params": bucket.names,
        }
        waited = make(c10d.wait_tensor.default, reduced)
        shards, offset = [], 0
        for shape in shapes:
            numel = math.prod(shape)
            piece = waited
            if numel != sum(math.prod(s) for s in shapes):
                piece = make(aten.slice.Tensor, waited, 0, offset, offset + numel)
            shards.append(make(aten.view.default, piece, list(shape)))
            offset += numel
    for node, shard in zip(list(bucket.nodes), shards, strict=True):
        replace_and_erase(node, shard)


def _as_rank_major(make: NodeMaker, grad: fx.Node, full_shape: list[int], world: int) -> fx.Node:
    """``grad`` padded on dim 0 and viewed as ``[world, rows * inner]``."""
    dim0 = full_shape[0] if full_shape else 1
    inner = math.prod(full_shape[1:])
    rows = shard_shape(full_shape, world)[0]
    dense = make(aten.clone.default, grad, memory_format=torch.contiguous_format)
    matrix = make(aten.view.default, dense, [dim0, inner])
    if rows * world != dim0:
        matrix = make(aten.constant_pad_nd.default, matrix, [0, 0, 0, rows * world - dim0], 0.0)
    return make(aten.view.default, matrix, [world, rows * inner])
