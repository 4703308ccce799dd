"""Merge repeated ``unshard`` calls on the same parameter into one.

A tied parameter (embedding and output projection) or a parameter read twice in a forward
produces one marker per read, each on its own ``to_local()`` of the parameter's DTensor.
Merging them before AOTAutograd gives one gather and one gradient reduction per parameter,
so the gradient is summed locally before it is communicated.

A read traced under ``torch.no_grad()`` (a weight's norm taken as a constant, a logged
statistic) gives a marker whose output carries no autograd history. A later read that trains must
not be pointed at it: its parameter would get no gradient at all. So a read that carries
gradients merges only into an earlier one that does; a read without them merges into any
earlier read (using a tensor with history under ``no_grad`` records nothing). As in eager
mode, a parameter read first without gradients and then with them is gathered twice.
"""

from __future__ import annotations

from torch import fx

from graphshard.passes.fx_util import replace_and_erase
from graphshard.passes.markers import is_unshard, marker_args
from graphshard.passes.plan import Plan

__all__ = ["dedupe_unshard"]


def _parameter_of(shard: fx.Node) -> fx.Node:
    """The graph input a marker reads: through ``to_local()`` of a DTensor parameter."""
    if shard.op == "call_method" and shard.target == "to_local":
        return shard.args[0]
    return shard


def _carries_grad(marker: fx.Node) -> bool:
    """Whether the read was traced with autograd recording (Dynamo's example value requires
    grad); without an example value, assume it was."""
    value = marker.meta.get("example_value")
    return True if value is None else bool(value.requires_grad)


def dedupe_unshard(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Point every later ``unshard`` of a parameter at the earliest one that serves it (one
    that carries gradients for a read that does) and drop the repeats (and the
    ``to_local()`` calls only they used)."""
    kept: dict[fx.Node, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if not is_unshard(node):
            continue
        shard = marker_args(node).shard
        param = _parameter_of(shard)
        earlier = kept.get(param)
        if earlier is not None and (_carries_grad(earlier) or not _carries_grad(node)):
            replace_and_erase(node, earlier)
            if shard is not param and not shard.users:
                gm.graph.erase_node(shard)
        else:
            kept[param] = node
    return gm
