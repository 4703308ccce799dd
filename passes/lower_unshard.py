"""Lower the ``unshard`` markers of each bucket into one all-gather.

One collective per bucket pays the latency once for all its parameters: the bucket's local
shards are cast to the mixed-precision ``param_dtype`` (if any), padded to equal pieces and
flattened into one buffer (``graphshard.passes.layout``), gathered rank-major, and each parameter is
rebuilt from its column of the gathered ``[world, bucket_numel]`` matrix, padding cut off.
The gather is placed just before the bucket's first marker (its first use); the scheduling
passes move it earlier.

With CPU offload the markers carry a ``compute_device``: each host shard is first copied
there (``prims.device_put``, non-blocking, tagged ``meta["graphshard_copy"]``), then cast and
gathered. The copies are inputs of the gather, so ``prefetch`` moves them with it.

Where ``shard()`` laid a bucket's shards out in one flat, padded buffer and the markers hand
it over, the gather reads that buffer and nothing is copied in
(:mod:`graphshard.passes.bucket_storage`; not with ``step_prefetch`` or ``break_prefetch``,
where the optimizer step or the graph before a break builds the buffers it gathers, nor with
``plan.gather_from_storage`` off).

With ``plan.all_gather_via == "coalesced"`` a bucket of several parameters is gathered by one
coalesced all-gather instead: each shard (padded or cast only where it must be) goes in as
it is, each parameter comes out whole, and neither the copy into a flat buffer nor the copy
out of the rank-major result is made.

At world 1 there is no one to gather from: each marker becomes its shard itself (after the
offload copy and the cast, where asked), so the graph is the plain model's.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.torch_version import TorchVersion

from graphshard.passes.bucket_storage import bucket_storage
from graphshard.passes.errors import GraphLoweringError
from graphshard.passes.fx_util import (
    NodeMaker,
    aten,
    c10d,
    copy_to_device,
    graph_order,
    prims,
    replace_and_erase,
)
from graphshard.passes.layout import Dim0Layout, full_from_gathered, gather_piece, rows_held
from graphshard.passes.markers import is_unshard, marker_args
from graphshard.passes.plan import Bucket, Plan, collect_buckets

__all__ = ["lower_unshard"]


def lower_unshard(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Replace every bucket's ``unshard`` markers with one all-gather, its wait and views."""
    make = NodeMaker(gm.graph)
    # a gather the step or the graph before a break may issue is rebuilt from its shards
    # there: one flat buffer of their pieces, built as that code builds it
    prefetched = plan.step_prefetch or plan.break_prefetch
    coalesced = plan.all_gather_via == "coalesced" and not prefetched
    for bucket in collect_buckets(gm.graph, is_unshard):
        _lower_bucket(gm.graph, make, bucket, coalesced,
                      plan.gather_from_storage and not prefetched)
    return gm


def _insert_point(graph: fx.Graph, bucket: Bucket) -> fx.Node:
    """The first marker of the bucket, or later if a shard input is defined after it."""
    order = graph_order(graph)
    anchor = bucket.nodes[0]
    for node in bucket.nodes:
        shard = marker_args(node).shard
        if order[shard] >= order[anchor]:
            anchor = shard.next
    return anchor


def _lower_bucket(graph: fx.Graph, make: NodeMaker, bucket: Bucket, coalesced: bool,
                  from_storage: bool) -> None:
    # Tied parameters appear once per shard input: one slot in the flat buffer each.
    slots: dict[fx.Node, list[fx.Node]] = {}
    for node in bucket.nodes:
        slots.setdefault(marker_args(node).shard, []).append(node)
    first = marker_args(bucket.nodes[0])
    for node in bucket.nodes:  # one collective: every marker over the same group
        args = marker_args(node)
        if (args.world_size, args.group_name) != (first.world_size, first.group_name):
            raise GraphLoweringError(
                f"bucket {bucket.index} gathers {first.name!r} over group "
                f"{first.group_name!r} of {first.world_size} and {args.name!r} over "
                f"{args.group_name!r} of {args.world_size}: a bucket is one collective. "
                "This is a bug in graphshard; please report it with the graph dump.")
    if first.world_size == 1:
        _lower_local(graph, make, bucket, slots)
        return

    layouts = {shard: Dim0Layout(marker_args(nodes[0]).full_shape, first.world_size)
               for shard, nodes in slots.items()}
    stored = bucket_storage(slots, layouts, first) if from_storage and not coalesced else None
    if stored is not None:  # the gather reads the bucket's storage: order the slots as it
        slots = {shard: slots[shard] for shard in stored[1]}
    tag = {"kind": "unshard", "bucket": bucket.index,
           "params": [marker_args(nodes[0]).name for nodes in slots.values()]}
    backend = bucket.nodes[-1].meta.get("group_backend")  # recorded by the backend
    with (graph.inserting_before(_insert_point(graph, bucket)),
          make.provenance(bucket.nodes[0]), make.lowering("unshard", bucket.index)):
        if stored is not None:
            pieces = [stored[0]]
        else:
            pieces = [
                gather_piece(make, _cast(make, _to_compute(make, shard, first, bucket.index),
                                         first),
                             layouts[shard], rows_held(shard.meta["val"].shape))
                for shard in slots
            ]
        gather = _gather_coalesced if coalesced and len(pieces) > 1 else _gather_flat
        fulls = gather(make, pieces, [layouts[shard] for shard in slots], first.world_size,
                       first.group_name, tag, backend)
    for nodes, full in zip(slots.values(), fulls, strict=True):
        for node in nodes:
            replace_and_erase(node, full)
        if _CONV_BIAS_AS_AN_ADD:
            _bias_added_after_conv(graph, make, full)


# torch 2.11's (and 2.12's) Inductor lowers a convolution by freezing its bias's layout, which
# a view of the gathered buffer does not have ("LoweringException: NotImplementedError: View";
# a clone of it is removed as a no-op). There the bias is added to the convolution's output
# instead, per output channel: the same sum. 2.13 and later take the view as it is.
_CONV_BIAS_AS_AN_ADD = TorchVersion(torch.__version__) < (2, 13)


def _bias_added_after_conv(graph: fx.Graph, make: NodeMaker, full: fx.Node) -> None:
    """Each convolution that takes ``full`` as its bias runs without it; the bias, viewed as
    ``[1, C, 1, ...]``, is added to its output."""
    for conv in list(full.users):
        if not (conv.target is aten.convolution.default and len(conv.args) > 2
                and conv.args[2] is full):
            continue
        rank = conv.meta["val"].dim()
        with graph.inserting_before(conv.next), make.provenance(conv):
            shaped = make(aten.view.default, full, [1, -1] + [1] * (rank - 2))
            added = make(aten.add.Tensor, conv, shaped)
        conv.replace_all_uses_with(
            added, delete_user_cb=lambda user, added=added: user is not added)
        conv.update_arg(2, None)


def _gather_flat(make: NodeMaker, pieces: list[fx.Node], layouts: list[Dim0Layout],
                 world: int, group: str, tag: dict, backend: str | None) -> list[fx.Node]:
    """One all-gather of the pieces concatenated (or of the bucket's storage, one piece that
    holds them all); each parameter rebuilt from its column of the rank-major
    ``[world, bucket_numel]`` result."""
    flat = pieces[0] if len(pieces) == 1 else make(aten.cat.default, pieces)
    gathered = make(c10d.all_gather_into_tensor.default, flat, world, group)
    gathered.meta["graphshard"] = tag
    gathered.meta["group_backend"] = backend
    waited = make(c10d.wait_tensor.default, gathered)
    total = sum(layout.piece_numel for layout in layouts)
    matrix = waited if len(layouts) == 1 else make(aten.view.default, waited, [world, total])
    fulls, offset = [], 0
    for layout in layouts:
        column, ranks = _column(make, matrix, offset, layout, total)
        fulls.append(full_from_gathered(make, column, layout, ranks))
        offset += layout.piece_numel
    return fulls


def _gather_coalesced(make: NodeMaker, pieces: list[fx.Node], layouts: list[Dim0Layout],
                      world: int, group: str, tag: dict, backend: str | None) -> list[fx.Node]:
    """One coalesced all-gather of the pieces as they are; each output is one parameter,
    padded (``world * rows`` rows), so the parameter is a view of it."""
    gathered = make(c10d.all_gather_into_tensor_coalesced.default, pieces, world, group)
    gathered.meta["graphshard"] = tag
    gathered.meta["group_backend"] = backend
    return [
        full_from_gathered(
            make, make(c10d.wait_tensor.default, make(operator.getitem, gathered, i)), layout)
        for i, layout in enumerate(layouts)
    ]


def _lower_local(graph: fx.Graph, make: NodeMaker, bucket: Bucket,
                 slots: dict[fx.Node, list[fx.Node]]) -> None:
    """World 1: the shard is the whole parameter, so there is nothing to gather, pad or cut
    out. Each marker becomes its shard itself (copied to the compute device and cast where
    the marker asks), the graph a plain model's."""
    for shard, nodes in slots.items():
        args = marker_args(nodes[0])
        if tuple(shard.meta["val"].shape) != tuple(args.full_shape):
            raise GraphLoweringError(
                f"{nodes[0].format_node()}: a world-1 shard of shape "
                f"{tuple(shard.meta['val'].shape)} for a parameter of shape "
                f"{tuple(args.full_shape)}; this is a graphshard bug, please report it"
            )
        with (graph.inserting_before(nodes[0]), make.provenance(nodes[0]),
              make.lowering("unshard", bucket.index)):
            full = _cast(make, _to_compute(make, shard, args, bucket.index), args)
        for node in nodes:
            replace_and_erase(node, full)


def _to_compute(make: NodeMaker, shard: fx.Node, args, bucket: int) -> fx.Node:
    """CPU offload: the host shard copied to the compute device (the marker's
    ``compute_device``), non-blocking; the shard itself when it is gathered where it lives."""
    if not args.compute_device:
        return shard
    return copy_to_device(make, shard, args.compute_device, bucket)


def _cast(make: NodeMaker, shard: fx.Node, args) -> fx.Node:
    """The shard in the dtype it is gathered in: mixed precision halves the bytes sent."""
    if args.param_dtype is None or args.param_dtype == shard.meta["val"].dtype:
        return shard
    return make(prims.convert_element_type.default, shard, args.param_dtype)


def _column(make: NodeMaker, matrix: fx.Node, offset: int, layout: Dim0Layout,
            total: int) -> tuple[fx.Node, int]:
    """One parameter's pieces, contiguous, and how many ranks' they are: its column block of
    the gathered ``[world, total]`` matrix (the buffer itself, all ranks', when alone). The
    copy that reorders it takes only the ranks holding rows: the rest are padding."""
    numel = layout.piece_numel
    if total == numel:
        return matrix, layout.world
    ranks = layout.holding_ranks
    if ranks < layout.world:
        matrix = make(aten.slice.Tensor, matrix, 0, 0, ranks)
    column = make(aten.slice.Tensor, matrix, 1, offset, offset + numel)
    return make(aten.clone.default, column, memory_format=torch.contiguous_format), ranks
