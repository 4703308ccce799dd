"""Decide per ``unshard`` marker of the joint graph whether the full parameter is kept.

Resharding after forward (ZeRO-3) means the forward must not save the gathered parameter:
tagging the marker ``MUST_RECOMPUTE`` makes the min-cut partitioner save the shard instead
and gather again in the backward. ``MUST_SAVE`` keeps it (ZeRO-2: no second gather, more
memory). This runs before partitioning; the markers are lowered only afterwards, because the
partitioner always saves plain collectives.

``reshard_after_forward="auto"`` markers (``RESHARD_AUTO``) are kept or freed bucket by
bucket as :func:`graphshard.passes.auto_reshard.choose_reshard` decides against the plan's
``memory_budget`` (default: the CUDA device's memory; none on the CPU: everything kept). The
choice depends only on the joint graph and the plan, so every rank makes the same; it is
recorded as ``gm.meta["graphshard_reshard"]`` (a ``ReshardChoice``), and its prefetch depth
is the one the forward and backward passes then use (:func:`plan_after_joint`).

Activation checkpointing: the partitioner saves a recomputable node whose user sits in a
checkpointed region with a higher ``ac_graph_id`` (the boundary between two regions). A
marker read inside a checkpointed region from outside it (a tied weight, or a weight passed
into ``checkpoint``) would so be saved whole. Markers get an ``ac_graph_id`` above every
region's, so they are recomputed (gathered again) like any other.
"""

from __future__ import annotations

import dataclasses

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from graphshard.passes.auto_reshard import ReshardChoice, choose_reshard, resolve_budget
from graphshard.passes.markers import RESHARD_AUTO, is_unshard, marker_args
from graphshard.passes.plan import Plan

__all__ = ["reshard", "reshard_choice", "plan_after_joint", "CHOICE_KEY"]

CHOICE_KEY = "graphshard_reshard"  # gm.meta key of the joint graph's ReshardChoice


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
    choice = None
    if any(is_unshard(n) and marker_args(n).reshard == RESHARD_AUTO for n in gm.graph.nodes):
        choice = choose_reshard(gm, plan, resolve_budget(gm, plan))
        gm.meta[CHOICE_KEY] = choice
    regions = [n.meta["ac_graph_id"] for n in gm.graph.nodes if "ac_graph_id" in n.meta]
    above = 1 + max(regions, default=0)
    for node in gm.graph.nodes:
        if is_unshard(node):
            args = marker_args(node)
            if args.reshard == RESHARD_AUTO:
                keep = choice.keeps(args.bucket)
            else:
                keep = not args.reshard or args.bucket == last
            node.meta["recompute"] = (
                CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.MUST_RECOMPUTE
            )
            node.meta["ac_graph_id"] = above
    return gm


def reshard_choice(joint: fx.GraphModule) -> ReshardChoice | None:
    """What ``reshard_after_forward="auto"`` chose for this joint graph (None: no auto)."""
    return joint.meta.get(CHOICE_KEY)


def plan_after_joint(joint: fx.GraphModule, plan: Plan) -> Plan:
    """The plan for the forward and backward graphs of ``joint``: ``plan`` with the prefetch
    depth ``reshard_after_forward="auto"`` chose, if it chose one."""
    choice = reshard_choice(joint)
    if choice is None or choice.prefetch_depth == plan.prefetch_depth:
        return plan
    return dataclasses.replace(plan, prefetch_depth=choice.prefetch_depth)
