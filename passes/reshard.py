"""Decide per ``unshard`` marker of the joint graph whether the full parameter is kept.

Resharding after forward (ZeRO-3) means the forward must not save the gathered parameter:
tagging the marker ``MUST_RECOMPUTE`` makes the min-cut partitioner save the shard instead
and gather again in the backward. ``MUST_SAVE`` keeps it (ZeRO-2: no second gather, more
memory). This runs before partitioning; the markers are lowered only afterwards, because the
partitioner always saves plain collectives.

Activation checkpointing: the partitioner saves a recomputable node whose user sits in a
checkpointed region with a higher ``ac_graph_id`` (the boundary between two regions). A
marker read inside a checkpointed region from outside it (a tied weight, or a weight passed
into ``checkpoint``) would so be saved whole. Markers get an ``ac_graph_id`` above every
region's, so they are recomputed (gathered again) like any other.
"""

from __future__ import annotations

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from graphshard.passes.markers import is_unshard, marker_args
from graphshard.passes.plan import Plan

__all__ = ["reshard"]


def _last_bucket(gm: fx.GraphModule) -> int | None:
    """The bucket of the parameter read last in forward: the first the backward needs."""
    markers = [n for n in gm.graph.nodes if is_unshard(n)]
    return marker_args(markers[-1]).bucket if markers else None


def reshard(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Tag each ``unshard`` with the recompute policy its ``reshard`` argument asks for.

    The bucket holding the parameter read last in forward is the first one the backward
    needs, right away: freeing and gathering it again would only put an exposed gather at
    the start of the backward, so it is kept unless ``plan.reshard_last_bucket``.
    """
    last = None if plan.reshard_last_bucket else _last_bucket(gm)
    regions = [n.meta["ac_graph_id"] for n in gm.graph.nodes if "ac_graph_id" in n.meta]
    above = 1 + max(regions, default=0)
    for node in gm.graph.nodes:
        if is_unshard(node):
            args = marker_args(node)
            keep = not args.reshard or args.bucket == last
            node.meta["recompute"] = (
                CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.MUST_RECOMPUTE
            )
            node.meta["ac_graph_id"] = above
    return gm
