"""Let each gradient reduce-scatter overlap the next bucket's backward compute.

Lowering issues a bucket's reduce-scatter as soon as its last gradient exists and waits at
once. This pass delays the wait (and the views that cut the result into shards) to just
before the next reduce-scatter is issued, or before the graph's output for the last one:
one reduction in flight under the following bucket's compute, and no more, so the padded
full-size gradients it reads are not all kept alive to the end. On an HSDP mesh each
reduce-scatter is followed by an all-reduce across replicas (issued where the reduce-scatter
is waited); its wait is delayed one bucket further, so it too runs under compute.
"""

from __future__ import annotations

from torch import fx

from graphshard.passes.fx_util import collectives, completed, move_before
from graphshard.passes.plan import Plan

__all__ = ["overlap_reduce"]


def overlap_reduce(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Delay each reduce-scatter's wait to the next reduce-scatter's issue (or the output)."""
    reduces = collectives(gm.graph, "reduce_grad")
    output = gm.graph.find_nodes(op="output")[0]
    for k, reduce in enumerate(reduces):
        anchor = reduces[k + 1] if k + 1 < len(reduces) else output
        move_before(completed(reduce), anchor)
    for k, across in enumerate(collectives(gm.graph, "replica_reduce")):
        anchor = reduces[k + 2] if k + 2 < len(reduces) else output
        move_before(completed(across), anchor)
    return gm
