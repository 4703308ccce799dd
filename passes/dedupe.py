"""Merge repeated ``unshard`` calls on the same shard into one.

A tied parameter (embedding and output projection) or a parameter read twice in a forward
produces one marker per read. Merging them before AOTAutograd gives one gather and one
gradient reduction per shard, so the gradient is summed locally before it is communicated.
"""

from __future__ import annotations

from torch import fx

from passes.fx_util import replace_and_erase
from passes.markers import is_unshard, marker_args
from passes.plan import Plan

__all__ = ["dedupe_unshard"]


def dedupe_unshard(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Point every later ``unshard`` of a shard at its first one and drop the repeats."""
    first: dict[fx.Node, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if not is_unshard(node):
            continue
        shard = marker_args(node).shard
        if shard in first:
            replace_and_erase(node, first[shard])
        else:
            first[shard] = node
    gm.graph.lint()
    gm.recompile()
    return gm
