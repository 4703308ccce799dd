"""Issue each bucket's all-gather ahead of the compute it feeds (forward and backward alike).

With depth d, the gather of the k-th bucket in graph order is issued right after the wait
of bucket k-d (the first gather before any compute, the first d+1 before the first wait),
so it runs on the wire while buckets k-d..k-1 compute; its wait stays just before its first
use. At most d + 1 gathered buckets are alive at once. ``plan.max_unsharded_bytes`` caps
the gathered bytes alive at once: where the cap would be exceeded, that gather is issued
later. The move depends only on the graph and the plan, so every rank issues the same order.
"""

from __future__ import annotations

import warnings

from torch import fx

from graphshard.passes.cost_model import tensor_bytes
from graphshard.passes.fx_util import (
    ancestors_after,
    collectives,
    graph_order,
    move_before,
    wait_of,
)
from graphshard.passes.plan import Plan

__all__ = ["prefetch", "gathered_bytes"]


def gathered_bytes(gather: fx.Node) -> int:
    """Bytes of the gathered (unsharded) buffer an all-gather produces."""
    return tensor_bytes(gather.meta["val"])


def _issue_after(sizes: list[int], depth: int, cap: int | None) -> list[int | None]:
    """For bucket k, the bucket whose wait it is issued after: -1 before the first wait,
    None to leave it in place (just before its own wait)."""
    anchors: list[int | None] = []
    floor = -1  # issue order must follow bucket order
    for k in range(len(sizes)):
        d = depth
        while d > 0 and cap is not None and sum(sizes[max(k - d, 0) : k + 1]) > cap:
            d -= 1
        j = max(k - d, floor, -1)
        anchors.append(None if j == k or (k == 0) else j)
        floor = j
    return anchors


def prefetch(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Move the all-gathers earlier by ``plan.prefetch_depth`` buckets, within the memory cap."""
    gathers = collectives(gm.graph, "unshard")
    if plan.prefetch_depth <= 0 or not gathers:
        return gm
    sizes = [gathered_bytes(g) for g in gathers]
    cap = plan.max_unsharded_bytes
    if cap is not None and max(sizes) > cap:
        big = max(range(len(sizes)), key=sizes.__getitem__)
        warnings.warn(
            f"bucket {gathers[big].meta['graphshard']['bucket']} gathers {sizes[big]:,} bytes, "
            f"more than max_unsharded_bytes={cap:,} on its own: use smaller buckets "
            "(bucketing='size' or 'auto', or finer shard(buckets=...)) or raise the cap.",
            stacklevel=2,
        )
    # The first gather needs only shards: issue it before any compute (in backward, that
    # hides it under the loss gradient).
    first_compute = next(n for n in gm.graph.nodes if n.op != "placeholder")
    move_before(ancestors_after(gathers[0], graph_order(gm.graph), 0), first_compute)
    for k, j in enumerate(_issue_after(sizes, plan.prefetch_depth, plan.max_unsharded_bytes)):
        if j is None:
            continue
        anchor = wait_of(gathers[0], last=False) if j < 0 else wait_of(gathers[j]).next
        position = graph_order(gm.graph)
        chain = ancestors_after(gathers[k], position, position[anchor])
        move_before(chain, anchor)
    return gm
