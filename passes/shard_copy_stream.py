"""Offloaded shards go to the device on a copy stream, one bucket ahead of their use.

Under CPU offload ``lower_unshard`` copies each bucket's host shards to the device
(``prims.device_put``) just before they are cast and gathered, and ``prefetch`` moves the
copies with the gather. Either way the copy runs on the compute stream: no kernel runs while
a bucket's shards cross the bus, and at world 1, where nothing is gathered, no copy is issued
ahead at all. On an H100 (llama-1b, bf16) the step's copies took about as long as the whole
step's compute (docs/cpu-offload.md).

With ``Plan.shard_copy_stream`` (on by default) each such copy becomes two nodes
(:mod:`graphshard.passes.device_copy`):

- ``to_device``, which issues the copy on the copy stream. Every bucket's copies move to
  just before the first wait of the bucket used before it (the first bucket's, before the
  graph's first node that is not an input), so they cross the bus while that bucket
  computes and gathers;
- ``wait_copy``, where the copy was: the compute stream waits for it there, before the cast
  and the gather read it.

So at most two buckets' shards are on the device before their gather (one more bucket of
shards, 1/N of a gathered bucket). A copy whose host input is made inside the graph is issued
no earlier than that input. On the CPU the copies are synchronous either way.
"""

from __future__ import annotations

from torch import fx

from graphshard.passes.device_copy import TO_DEVICE, WAIT_COPY
from graphshard.passes.fx_util import DEVICE_COPY, LOWERED, graph_order, move_before
from graphshard.passes.plan import Plan

__all__ = ["shard_copy_stream"]


def _split(graph: fx.Graph, copy: fx.Node) -> tuple[fx.Node, fx.Node]:
    """Replace ``copy`` by a ``to_device`` (its value, tag and provenance) and a
    ``wait_copy`` of it in its place."""
    source, device = copy.args[0], copy.args[1]
    with graph.inserting_before(copy):
        start = graph.call_function(TO_DEVICE, (source, device))
        wait = graph.call_function(WAIT_COPY, (start,))
    start.meta.update(copy.meta)
    wait.meta["val"] = None
    if LOWERED in copy.meta:  # graphshard's data movement; only the issue is the copy
        wait.meta[LOWERED] = dict(copy.meta[LOWERED])
    copy.replace_all_uses_with(start)
    graph.erase_node(copy)
    return start, wait


def shard_copy_stream(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Split every host-to-device shard copy into an issue on the copy stream, one bucket
    ahead, and a wait where the copy was (module docstring)."""
    if not plan.shard_copy_stream:
        return gm
    graph = gm.graph
    copies = [node for node in graph.find_nodes(op="call_function", target=DEVICE_COPY)
              if node.meta.get("graphshard_copy", {}).get("direction") == "h2d"]
    if not copies:
        return gm
    starts: dict[int, list[fx.Node]] = {}
    first_wait: dict[int, fx.Node] = {}
    for copy in copies:  # graph order, so a bucket's first copy's wait is its first wait
        bucket = copy.meta["graphshard_copy"]["bucket"]
        start, wait = _split(graph, copy)
        starts.setdefault(bucket, []).append(start)
        first_wait.setdefault(bucket, wait)
    position = graph_order(graph)
    in_use_order = sorted(first_wait, key=lambda b: position[first_wait[b]])
    first_node = next(n for n in graph.nodes if n.op != "placeholder")
    anchors = [first_node] + [first_wait[b] for b in in_use_order[:-1]]
    for bucket, anchor in zip(in_use_order, anchors, strict=True):
        for start in starts[bucket]:
            position = graph_order(graph)
            source = start.args[0]
            if position[source] >= position[anchor]:  # made in the graph: issue it after
                anchor_here = source.next
            else:
                anchor_here = anchor
            if position[anchor_here] < position[start]:
                move_before([start], anchor_here)
    graph.lint()
    gm.recompile()
    return gm
