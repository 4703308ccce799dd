"""Choose bucket boundaries from the traced execution order (the ``size`` and ``auto`` strategies).

Runs on the joint graph, before partitioning, and rewrites the ``bucket`` argument of every
``unshard`` marker the user did not pin, and of the matching ``reduce_grad``. Buckets follow
execution order, so the embedding is gathered with the first layer and the final norm and
output projection with the last, never together in a root bucket that spans the whole step.

- ``size``: pack consecutive parameters up to ``plan.bucket_bytes``.
- ``auto``: dynamic programming over the boundaries, minimising the exposed communication the
  cost model predicts with one gather prefetched (forward: bucket j's gather hides under
  bucket j-1's compute; backward: under bucket j+1's, sharing the wire with its
  reduce-scatter), within ``plan.max_unsharded_bytes`` for two buckets alive at once.
"""

from __future__ import annotations

import itertools
import math

from torch import fx

from graphshard.passes.cost_model import all_gather_time, node_time, reduce_scatter_time
from graphshard.passes.markers import is_reduce_grad, is_unshard, marker_args
from graphshard.passes.plan import Plan

__all__ = ["assign_buckets", "pack_by_size", "auto_boundaries"]

MAX_BUCKET_PARAMS = 48  # longest bucket the ``auto`` search considers, in parameters
BUCKET_PENALTY = 1e-6  # seconds per bucket: prefer fewer buckets among equal schedules


def _param_bytes(node: fx.Node) -> int:
    args = marker_args(node)
    return math.prod(args.full_shape) * node.meta["val"].element_size()


def pack_by_size(sizes: list[int], cap: int, kinds: list | None = None) -> list[int]:
    """Bucket index per item: consecutive items packed while the bucket stays within ``cap``
    and holds one kind (dtype) only."""
    kinds = kinds or [None] * len(sizes)
    index, used, out = 0, 0, []
    for i, size in enumerate(sizes):
        if used and (used + size > cap or kinds[i] != kinds[i - 1]):
            index, used = index + 1, 0
        used += size
        out.append(index)
    return out


def _forward_compute(graph: fx.Graph, markers: list[fx.Node], profile) -> list[float]:
    """Predicted forward compute from each marker up to the next (the last: to forward's end)."""
    backward: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
            a in backward for a in node.all_input_nodes
        ):
            backward.add(node)
    starts = set(markers)
    compute, current = [], -1
    for node in graph.nodes:
        if node in starts:
            compute.append(0.0)
            current += 1
        elif current >= 0 and node.op == "call_function" and node not in backward:
            if not is_unshard(node) and "val" in node.meta:
                compute[current] += node_time(node, profile)
    return compute


def auto_boundaries(
    sizes: list[int],
    compute: list[float],
    gather_time,
    reduce_time,
    cap: int | None = None,
    max_len: int = MAX_BUCKET_PARAMS,
    kinds: list | None = None,
) -> list[int]:
    """Bucket index per item minimising predicted exposed communication (see module doc).

    ``gather_time(bytes)`` and ``reduce_time(bytes)`` price one bucket's collectives. A
    bucket holds items of one kind (dtype) only.
    """
    n = len(sizes)
    kinds = kinds or [None] * n
    run_start = [0] * n  # where the run of equal kinds that holds item i starts
    for i in range(1, n):
        run_start[i] = run_start[i - 1] if kinds[i] == kinds[i - 1] else i
    size_sum = [0, *itertools.accumulate(sizes)]
    comp_sum = [0.0, *itertools.accumulate(compute)]

    def span(s: int, e: int) -> tuple[int, float]:
        return size_sum[e + 1] - size_sum[s], comp_sum[e + 1] - comp_sum[s]

    def fits(*spans: tuple[int, int]) -> bool:
        return cap is None or sum(span(s, e)[0] for s, e in spans) <= cap

    best: dict[tuple[int, int], tuple[float, tuple[int, int] | None]] = {}
    for e in range(n):
        for s in range(max(0, e - max_len + 1), e + 1):
            nbytes, _ = span(s, e)
            if run_start[e] > s or (not fits((s, e)) and s != e):
                continue
            if s == 0:  # exposed: its forward gather, and its reduce-scatter ending backward
                best[(s, e)] = (gather_time(nbytes) + reduce_time(nbytes) + BUCKET_PENALTY, None)
                continue
            options = []
            for p in range(max(0, s - max_len), s):
                # Two neighbours must fit the cap together, except two single parameters:
                # the finest split is always possible (prefetch then waits, and warns).
                finest = p == s - 1 and s == e
                if (p, s - 1) not in best or not (fits((p, s - 1), (s, e)) or finest):
                    continue
                prev_bytes, prev_compute = span(p, s - 1)
                _, cur_compute = span(s, e)
                forward = max(0.0, gather_time(nbytes) - prev_compute)
                backward = max(0.0, gather_time(prev_bytes) + reduce_time(nbytes) - 2 * cur_compute)
                cost = best[(p, s - 1)][0] + forward + backward + BUCKET_PENALTY
                options.append((cost, (p, s - 1)))
            if options:
                best[(s, e)] = min(options)
    finals = []
    for (s, e), (cost, _) in best.items():
        if e == n - 1:  # the last bucket's backward gather starts backward, exposed
            finals.append((cost + gather_time(span(s, e)[0]), (s, e)))
    _, last = min(finals)
    ranges = []
    while last is not None:
        ranges.append(last)
        last = best[last][1]
    out = [0] * n
    for index, (s, e) in enumerate(reversed(ranges)):
        out[s : e + 1] = [index] * (e - s + 1)
    return out


def assign_buckets(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Rewrite unpinned markers' buckets by ``plan.bucketing`` (``block`` leaves them)."""
    if plan.bucketing == "block":
        return gm
    unshards = [n for n in gm.graph.nodes if is_unshard(n)]
    reads = [n for n in unshards if not marker_args(n).pinned]
    if not reads:
        return gm
    # One entry per parameter, at its first read: a parameter read twice (inside and outside
    # an activation checkpoint keeps two markers here) is packed and gathered once.
    first_reads: dict[str, fx.Node] = {}
    for node in reads:
        first_reads.setdefault(marker_args(node).name, node)
    free = list(first_reads.values())
    sizes = [_param_bytes(n) for n in free]
    # One dtype per bucket (its shards share one flat buffer): the shard's and the gathered;
    # and one reshard_after_forward (a bucket is kept or freed, and gathered again over one
    # group, as a whole).
    kinds = [(n.args[0].meta["val"].dtype, n.meta["val"].dtype, marker_args(n).reshard,
              marker_args(n).reshard_group) for n in free]
    if plan.bucketing == "size":
        indices = pack_by_size(sizes, plan.bucket_bytes, kinds)
    else:
        profile = plan.profile
        world = marker_args(free[0]).world_size
        indices = auto_boundaries(
            sizes,
            _forward_compute(gm.graph, free, profile),
            lambda b: all_gather_time(b, world, profile),
            lambda b: reduce_scatter_time(b, world, profile),
            plan.max_unsharded_bytes,
            kinds=kinds,
        )
    base = 1 + max((marker_args(n).bucket for n in unshards if marker_args(n).pinned), default=-1)
    bucket_of_name = {marker_args(node).name: base + index
                      for node, index in zip(free, indices, strict=True)}
    for node in reads:
        node.update_arg(2, bucket_of_name[marker_args(node).name])
    for node in gm.graph.nodes:
        if is_reduce_grad(node) and marker_args(node).name in bucket_of_name:
            node.update_arg(1, bucket_of_name[marker_args(node).name])
    return gm
