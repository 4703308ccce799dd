"""Reduce the early gradients of the backward's last buckets in a reduce-scatter of their own.

A bucket's reduce-scatter is issued once its last gradient exists. At the end of the
backward nothing computes under it, so the last buckets' reductions are exposed whole even
when some of their gradients were ready long before: the output projection of a root bucket
that also holds the embedding (ready first and last in backward), or the feed-forward
weights of the first block (ready before its attention's backward runs). For each bucket
whose reduction the cost model (``plan.profile``) finds exposed, this pass looks for the cut
of its gradients, in the order they become ready, where sending the earlier ones as soon as
they exist hides the most: they get a bucket index of their own, so ``lower_reduce_grad``
issues them as a separate reduce-scatter where the last of them is ready, and
``overlap_reduce`` waits for it under the compute that follows. A cut is taken only when the
predicted exposed time drops by more than one collective's latency beyond the extra
collective's own. Gradients are reduced exactly as before (the same values per element),
only in two collectives; nothing reads them earlier. Runs on the backward graph before
``lower_reduce_grad``; ``plan.split_last_reduce`` turns it off.
"""

from __future__ import annotations

from torch import fx

from graphshard.passes.cost_model import node_time, reduce_scatter_time
from graphshard.passes.errors import UnpricedSizeError
from graphshard.passes.fx_util import graph_order
from graphshard.passes.layout import Dim0Layout
from graphshard.passes.markers import is_reduce_grad, is_unshard, marker_args
from graphshard.passes.plan import Plan, collect_buckets

__all__ = ["split_last_reduce"]


def _compute_after(graph: fx.Graph, plan: Plan) -> list[float]:
    """``after[i]``: predicted compute seconds of the nodes from position ``i`` to the end."""
    times = []
    for node in graph.nodes:
        comm = (is_unshard(node) or is_reduce_grad(node)
                or getattr(node.target, "namespace", None) == "_c10d_functional")
        times.append(0.0 if comm or node.op != "call_function" else node_time(node, plan.profile))
    after = [0.0] * (len(times) + 1)
    for i in range(len(times) - 1, -1, -1):
        after[i] = after[i + 1] + times[i]
    return after


def _reduced_bytes(node: fx.Node) -> int:
    """Bytes of one gradient in the reduce-scatter's input (dim-0 padded, reduce dtype)."""
    m = marker_args(node)
    val = m.grad.meta["val"]
    layout = Dim0Layout(val.shape, m.world_size)
    dtype = m.reduce_dtype or val.dtype
    return layout.world * layout.piece_numel * dtype.itemsize


def split_last_reduce(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Give the early-ready gradients of each exposed last reduce-scatter a bucket (and so a
    reduce-scatter) of their own, where the cost model predicts it hides the most."""
    if not plan.split_last_reduce:
        return gm
    graph = gm.graph
    buckets = collect_buckets(graph, is_reduce_grad)
    if not buckets:
        return gm
    order = graph_order(graph)
    try:
        after = _compute_after(graph, plan)
        cuts = _choose_cuts(buckets, order, after, plan)
    except UnpricedSizeError:  # data-dependent sizes: no prediction, no split
        return gm
    markers = [n for n in graph.nodes if is_unshard(n) or is_reduce_grad(n)]
    fresh = max(marker_args(n).bucket for n in markers) + 1
    for bucket, j in cuts:
        for node in bucket.nodes[:j]:
            node.args = (node.args[0], fresh, *node.args[2:])
        fresh += 1
    return gm


def _choose_cuts(buckets, order, after, plan) -> list[tuple]:
    """``(bucket, j)`` for each bucket whose first ``j`` gradients (in the order they are
    ready) are best reduced on their own."""
    issues = sorted(order[b.nodes[-1]] for b in buckets)  # where each reduce-scatter is issued
    world = marker_args(buckets[0].nodes[0]).world_size

    def rs(nbytes: float) -> float:
        return reduce_scatter_time(nbytes, world, plan.profile)

    def next_issue(position: int, last: int) -> int:
        return next((p for p in issues if p > position), last)

    cuts = []
    for bucket in buckets:
        nodes = sorted(bucket.nodes, key=lambda n: order[marker_args(n).grad])
        if len(nodes) < 2 or nodes != bucket.nodes:
            continue  # one gradient, or markers out of readiness order: left as lowered
        sizes = [_reduced_bytes(n) for n in nodes]
        last = order[nodes[-1]]
        tail = after[last]  # compute left once the bucket's reduce-scatter is issued
        exposed = max(0.0, rs(sum(sizes)) - tail)
        if exposed <= 0.0:
            continue
        # A cut must save more than one more collective's latency beyond what the model
        # counts: per-collective overheads it does not price.
        best, best_j = exposed - plan.profile.alpha_s * (world - 1), None
        for j in range(1, len(nodes)):
            at = order[nodes[j - 1]]
            hidden_by = after[at] - after[next_issue(at, last)]
            early = max(0.0, rs(sum(sizes[:j])) - hidden_by)
            late = max(0.0, rs(sum(sizes[j:])) - tail)
            if early + late < best:
                best, best_j = early + late, j
        if best_j is not None:
            cuts.append((bucket, best_j))
    return cuts
