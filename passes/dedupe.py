"""Merge repeated ``unshard`` calls on the same parameter into one.

A tied parameter (embedding and output projection) or a parameter read twice in a forward
produces one marker per read, each on its own ``to_local()`` of the parameter's DTensor.
Merging them before AOTAutograd gives one gather and one gradient reduction per parameter,
so the gradient is summed locally before it is communicated.
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


def dedupe_unshard(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Point every later ``unshard`` of a parameter at its first one and drop the repeats
    (and the ``to_local()`` calls only they used)."""
    first: dict[fx.Node, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if not is_unshard(node):
            continue
        shard = marker_args(node).shard
        param = _parameter_of(shard)
        if param in first:
            replace_and_erase(node, first[param])
            if shard is not param and not shard.users:
                gm.graph.erase_node(shard)
        else:
            first[param] = node
    return gm
