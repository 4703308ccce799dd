"""Lower the ``reduce_grad`` markers of each bucket into one reduce-scatter.

Each full gradient is laid out rank-major, ``[world, piece_numel]`` with dim-0 padding
(``graphshard.passes.layout``); the bucket's gradients are concatenated along dim 1 so that rank r's
slice of the flat buffer is exactly the concatenation of its padded pieces. One averaging
reduce-scatter then hands each rank its pieces, of which it keeps its own rows (with
``shard(gradient_divide_factor=f)`` a summing one, each gradient multiplied by ``1 / f``
first, as FSDP2's pre-multiplied sum does; replicas then sum). Mixed
precision casts the gradients to ``reduce_dtype`` first and the result back to the shard's
dtype; on a 2-D mesh the reduced pieces are then all-reduced (averaged) across replicas;
gradients held back by ``no_sync`` are added in, full ones before the reduce-scatter and
reduce-scattered partials before the all-reduce. It is issued once the bucket's last
gradient exists; its wait sits just after it (the scheduling passes delay it).

Where the group's reduce-scatter is an all-reduce in disguise (gloo: see
``graphshard.api.reduce_scatter``), ``Plan.reduce_scatter_via`` makes it an all-to-all of
the same flat buffer (each rank receives every rank's copy of its own pieces) followed,
after the wait, by their sum in rank order (and the division of an average): half the bytes
on the wire. The all-to-all carries the same ``graphshard`` tag as the reduce-scatter would.

With CPU offload the markers carry an ``out_device`` (the host): the bucket's reduced flat
buffer (after the replica all-reduce and the cast back) is copied there in one blocking
``graphshard::to_host`` into pinned memory (tagged ``meta["graphshard_copy"]``), and the
shards' gradients are views of the host copy. It depends on the wait, so
``overlap_reduce`` moves it with the wait.

With ``Plan.reduce_scatter_via == "coalesced"`` a bucket of several final gradients (nothing
held back to add, no replicas, no cast back, no host copy: those steps read the flat buffer)
is reduced by one ``reduce_scatter_tensor_coalesced`` of each gradient's rank-major layout,
taken where the gradient lives, each output one parameter's padded piece: no copy into a
buffer.

At world 1 without replicas there is nothing to reduce: each gradient is handed straight to
its shard (after the casts and held-back additions its marker asks for), with no buffer,
copy or collective, as in a plain model's graph.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from graphshard.passes.errors import GraphLoweringError
from graphshard.passes.fx_util import (
    NodeMaker,
    aten,
    c10d,
    copy_to_host,
    graph_order,
    prims,
    replace_and_erase,
)
from graphshard.passes.layout import Dim0Layout, local_from_reduced, rank_major, sum_received
from graphshard.passes.markers import is_reduce_grad, marker_args, reduce_op, replica_divide_factor
from graphshard.passes.plan import Bucket, Plan, collect_buckets, use_all_to_all

__all__ = ["lower_reduce_grad"]


def lower_reduce_grad(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Replace every bucket's ``reduce_grad`` markers with one reduce-scatter and views."""
    make = NodeMaker(gm.graph)
    for bucket in collect_buckets(gm.graph, is_reduce_grad):
        first = marker_args(bucket.nodes[0])
        if first.world_size == 1 and not (first.all_reduce and first.replica_size > 1):
            for node in bucket.nodes:
                _lower_local(gm.graph, make, node, bucket.index)
        else:
            backend = bucket.nodes[-1].meta.get("group_backend")
            _lower_bucket(gm.graph, make, bucket,
                          all_to_all=use_all_to_all(plan.reduce_scatter_via, backend),
                          coalesced=plan.reduce_scatter_via == "coalesced")
    return gm


def _lower_local(graph: fx.Graph, make: NodeMaker, node: fx.Node, bucket: int) -> None:
    """World 1, no replicas: a gradient averaged over one rank is itself, so it goes straight
    to the shard's ``.grad``, through only the casts and held-back additions the eager
    kernel makes, in its order (the same numbers): no buffer, no copy, no collective."""
    args = marker_args(node)
    with graph.inserting_before(node), make.provenance(node), make.lowering("reduce_grad", bucket):
        grad = _in_reduce_dtype(make, args.grad, args.reduce_dtype)
        if args.pending_full is not None:
            grad = make(aten.add.Tensor, grad, args.pending_full)
        if args.divide_factor not in (None, 1.0):  # summed over one rank, then divided
            _, factor = reduce_op(grad.meta["val"].dtype, 1, args.divide_factor)
            grad = make(aten.mul.Tensor, grad, factor)
        if args.pending_partial is not None:
            shape = list(grad.meta["val"].shape)
            grad = make(aten.add.Tensor, grad,
                        make(aten.view.default, args.pending_partial, shape))
        if args.out_dtype is not None and args.out_dtype != grad.meta["val"].dtype:
            grad = make(prims.convert_element_type.default, grad, args.out_dtype)
        if args.out_device:  # CPU offload: the gradient goes to the host shard
            grad = copy_to_host(make, grad, bucket)
        if not grad.meta["val"].is_contiguous() and any(u.op != "output" for u in node.users):
            # the marker's users were traced on a dense gradient (a view of it must work)
            grad = make(aten.clone.default, grad, memory_format=torch.contiguous_format)
        shape = list(node.meta["val"].shape)
        if list(grad.meta["val"].shape) != shape:  # a 0-D partial accumulates as one row
            grad = make(aten.view.default, grad, shape)
    replace_and_erase(node, grad)


def _check_users_after(graph: fx.Graph, bucket: Bucket, anchor: fx.Node) -> None:
    order = graph_order(graph)
    for node in bucket.nodes:
        for user in node.users:
            if order[user] < order[anchor]:
                raise GraphLoweringError(
                    f"{user.format_node()} uses the gradient of {marker_args(node).name!r} "
                    f"(bucket {bucket.index}: {', '.join(bucket.names)}) before the bucket's "
                    "last gradient exists, so the bucket cannot be reduced as one collective. "
                    "Give that parameter's module a bucket of its own with "
                    "graphshard.shard(buckets=[...]); if your code does not use that gradient "
                    "during backward, report this as a graphshard bug with the graphs that "
                    "GRAPHSHARD_DUMP_DIR=<dir> writes."
                )


def _lower_bucket(graph: fx.Graph, make: NodeMaker, bucket: Bucket, all_to_all: bool,
                  coalesced: bool) -> None:
    anchor = bucket.nodes[-1]
    _check_users_after(graph, bucket, anchor)
    first = marker_args(bucket.nodes[0])
    world, group = first.world_size, first.group_name
    with (graph.inserting_before(anchor), make.provenance(anchor),
          make.lowering("reduce_grad", bucket.index)):
        columns, layouts = [], []
        for node in bucket.nodes:
            args = marker_args(node)
            layouts.append(Dim0Layout(args.grad.meta["val"].shape, world))
            grad = _in_reduce_dtype(make, args.grad, args.reduce_dtype)
            if args.pending_full is not None:  # full gradients of no_sync micro-batches
                grad = make(aten.add.Tensor, grad, args.pending_full)
            dense = grad.meta["val"].is_contiguous()
            columns.append(rank_major(make, grad, layouts[-1], contiguous=dense))
        if coalesced and _coalescable(bucket, columns):
            shards = _reduce_coalesced(make, bucket, columns, layouts, world, group)
        else:
            shards = _reduce_flat(make, bucket, columns, layouts, world, group, all_to_all)
    for node, shard in zip(list(bucket.nodes), shards, strict=True):
        replace_and_erase(node, shard)


def _coalescable(bucket: Bucket, columns: list[fx.Node]) -> bool:
    """A bucket of several final gradients whose reduced pieces go straight to the shards:
    nothing held back is added, no replica all-reduce, no cast back, no host copy."""
    first = marker_args(bucket.nodes[0])
    dtype = columns[0].meta["val"].dtype
    return (len(bucket.nodes) > 1 and first.all_reduce and first.replica_size <= 1
            and not first.out_device
            and (first.out_dtype is None or first.out_dtype == dtype)
            and all(marker_args(n).pending_partial is None for n in bucket.nodes))


def _reduce_coalesced(make: NodeMaker, bucket: Bucket, columns: list[fx.Node],
                      layouts: list[Dim0Layout], world: int, group: str) -> list[fx.Node]:
    """One coalesced reduce-scatter of each gradient's rank-major layout; each output is
    this rank's padded piece of one parameter, cut to its rows."""
    op, factor = reduce_op(columns[0].meta["val"].dtype, world,
                           marker_args(bucket.nodes[0]).divide_factor)
    inputs = []
    for column in columns:
        flat = make(aten.view.default, column, [-1])
        inputs.append(flat if factor == 1.0 else make(aten.mul.Tensor, flat, factor))
    reduced = make(c10d.reduce_scatter_tensor_coalesced.default, inputs, op, world, group)
    reduced.meta["graphshard"] = {"kind": "reduce_grad", "bucket": bucket.index,
                                  "params": bucket.names}
    return [
        local_from_reduced(make, make(c10d.wait_tensor.default, make(operator.getitem, reduced, i)),
                           layout, marker_args(node).local_rows)
        for i, (node, layout) in enumerate(zip(bucket.nodes, layouts, strict=True))
    ]


def _reduce_flat(make: NodeMaker, bucket: Bucket, columns: list[fx.Node],
                 layouts: list[Dim0Layout], world: int, group: str,
                 all_to_all: bool) -> list[fx.Node]:
    """The bucket's gradients concatenated into one flat buffer, reduced by one collective
    (then across replicas, cast back, copied to the host where asked) and cut into shards."""
    first = marker_args(bucket.nodes[0])
    matrix = columns[0] if len(columns) == 1 else make(aten.cat.default, columns, 1)
    flat = make(aten.view.default, matrix, [-1])
    kind = "all_to_all" if all_to_all else "reduce_scatter"
    reduced = _reduce(make, kind, flat, world, group, first.divide_factor)
    reduced.meta["graphshard"] = {
        "kind": "reduce_grad",
        "bucket": bucket.index,
        "params": bucket.names,
    }
    if all_to_all:
        reduced.meta["graphshard"]["group_size"] = world
    result = make(c10d.wait_tensor.default, reduced)
    if all_to_all:  # every rank's copy of this rank's pieces, summed in rank order
        op, _ = reduce_op(flat.meta["val"].dtype, world, first.divide_factor)
        result = sum_received(make, result, world, average=op == "avg")
    pending = [marker_args(n).pending_partial for n in bucket.nodes]
    if any(p is not None for p in pending):  # reduce-scattered partials (HSDP)
        result = make(aten.add.Tensor, result, _flat(make, pending, layouts))
    if first.all_reduce and first.replica_size > 1:
        across = _reduce(make, "all_reduce", result, first.replica_size, first.replica_group,
                         replica_divide_factor(first.divide_factor))
        across.meta["graphshard"] = {
            "kind": "replica_reduce",
            "bucket": bucket.index,
            "group_size": first.replica_size,
        }
        result = make(c10d.wait_tensor.default, across)
    if first.out_dtype is not None and first.out_dtype != result.meta["val"].dtype:
        result = make(prims.convert_element_type.default, result, first.out_dtype)
    if first.out_device:  # CPU offload: one copy of the bucket's gradients to the host
        result = copy_to_host(make, result, bucket.index)
    shards, offset = [], 0
    total = sum(layout.piece_numel for layout in layouts)
    for node, layout in zip(bucket.nodes, layouts, strict=True):
        numel = layout.piece_numel
        piece = result
        if numel != total:
            piece = make(aten.slice.Tensor, result, 0, offset, offset + numel)
        if first.all_reduce:  # final: this rank's rows of the parameter
            shard = local_from_reduced(make, piece, layout, marker_args(node).local_rows)
        else:  # a partial accumulates as the padded piece
            shard = make(aten.view.default, piece, list(layout.piece_shape))
        shards.append(shard)
        offset += numel
    return shards


def _reduce(make: NodeMaker, kind: str, flat: fx.Node, size: int, group: str,
            divide_factor: float | None = None) -> fx.Node:
    """An averaging collective over ``size`` ranks, dividing first where the dtype needs it
    (with ``divide_factor``: a sum, multiplied by the factor's inverse first)."""
    op, factor = reduce_op(flat.meta["val"].dtype, size, divide_factor)
    if factor != 1.0:
        flat = make(aten.mul.Tensor, flat, factor)
    if kind == "reduce_scatter":
        return make(c10d.reduce_scatter_tensor.default, flat, op, size, group)
    if kind == "all_to_all":  # the op is applied by the sum after the wait
        splits = [flat.meta["val"].numel() // size] * size
        return make(c10d.all_to_all_single.default, flat, splits, splits, group)
    return make(c10d.all_reduce.default, flat, op, group)


def _in_reduce_dtype(make: NodeMaker, grad: fx.Node, dtype: torch.dtype | None) -> fx.Node:
    if dtype is None or dtype == grad.meta["val"].dtype:
        return grad
    return make(prims.convert_element_type.default, grad, dtype)


def _flat(make: NodeMaker, tensors: list[fx.Node | None], layouts: list[Dim0Layout]) -> fx.Node:
    """The bucket's flat piece layout of ``tensors`` (zeros where one is missing)."""
    template = next(t for t in tensors if t is not None)
    pieces = []
    for tensor, layout in zip(tensors, layouts, strict=True):
        if tensor is None:
            pieces.append(make(aten.new_zeros.default, template, [layout.piece_numel]))
        else:
            pieces.append(make(aten.view.default, tensor, [-1]))
    return pieces[0] if len(pieces) == 1 else make(aten.cat.default, pieces)
