"""Reduce each parameter's gradient once, even when it was read through several markers.

``dedupe_unshard`` merges repeated reads of a shard in the Dynamo graph, but it cannot see
into the body of a higher-order op: a parameter read inside ``torch.utils.checkpoint`` (a
``tag_activation_checkpoint`` body) and again outside it, or twice inside it, keeps one
``unshard`` marker per read. AOTAutograd inlines the body, so the joint graph then holds one
``reduce_grad`` per read and adds their (already reduced) results. That would reduce-scatter
the parameter's gradient twice, and the sum uses a reduced gradient before its bucket's
collective exists, which lowering cannot express. Reduction is linear, so on the joint graph
the full gradients are summed first and reduced once; the tree of adds that summed the
reduced copies is replaced by the one reduction. (The forward and backward gathers of such a
parameter are already one per bucket: lowering gives each shard one slot.)
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from graphshard.passes.fx_util import NodeMaker
from graphshard.passes.markers import REDUCE_GRAD, is_reduce_grad, marker_args
from graphshard.passes.plan import Plan

__all__ = ["merge_reduce_grad"]

_ADDS = {torch.ops.aten.add.Tensor, operator.add}


def _sum_tree(markers: list[fx.Node]) -> list[fx.Node] | None:
    """The add nodes that sum exactly ``markers`` (through adds used only by each other),
    root last; None if their results are used any other way."""
    tree = set(markers)
    for node in markers[-1].graph.nodes:
        if (
            node.op == "call_function"
            and node.target in _ADDS
            and not node.kwargs
            and len(node.args) == 2
            and all(isinstance(a, fx.Node) and a in tree for a in node.args)
        ):
            tree.add(node)
    roots = [n for n in tree if any(u not in tree for u in n.users) or not n.users]
    if len(roots) != 1 or roots[0] in markers:
        return None
    order = {n: i for i, n in enumerate(markers[-1].graph.nodes)}
    return sorted(tree - set(markers), key=order.__getitem__)


def _merged_args(markers: list[fx.Node], total: fx.Node):
    """The last marker's arguments on the summed gradient, keeping what ``no_sync`` held
    back: only one read of a parameter carries it, not necessarily the last."""
    args = [marker_args(m) for m in markers]
    pending_full = next((a.pending_full for a in args if a.pending_full is not None), None)
    pending_partial = next(
        (a.pending_partial for a in args if a.pending_partial is not None), None
    )
    return args[-1]._replace(
        grad=total, pending_full=pending_full, pending_partial=pending_partial
    )


def merge_reduce_grad(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Replace several ``reduce_grad`` of one parameter, summed, by one on the summed grads."""
    by_name: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if is_reduce_grad(node):
            by_name.setdefault(marker_args(node).name, []).append(node)
    make = NodeMaker(gm.graph)
    for markers in by_name.values():
        if len(markers) < 2:
            continue
        adds = _sum_tree(markers)
        if adds is None:
            continue  # left as is: lowering reports what it cannot reduce
        last = markers[-1]
        with gm.graph.inserting_before(last):
            total = marker_args(markers[0]).grad
            for marker in markers[1:]:
                total = make(torch.ops.aten.add.Tensor, total, marker_args(marker).grad)
            merged = make(REDUCE_GRAD, *_merged_args(markers, total))
        merged.meta.update({k: v for k, v in last.meta.items() if k != "val"})
        adds[-1].replace_all_uses_with(merged)
        for dead in [*reversed(adds), *markers]:  # users before what they use
            gm.graph.erase_node(dead)
    return gm
