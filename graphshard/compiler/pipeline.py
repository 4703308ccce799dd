"""The pass pipeline: which graph passes run at which stage of a compile, in what order.

Stages and their passes (each dumped before and after when a dump directory is set):
- ``dynamo``: ``inline_unsupported_regions`` (a block region called with a float operand,
  which ``invoke_subgraph`` refuses, becomes inline code), ``dedupe_unshard`` (one marker
  per shard, so tied weights gather once),
  ``parameters_first_in_regions`` (a block region's gathered parameters become its first
  inputs, which its partitioner relies on), ``resolve_region_operand_views`` (below);
- ``joint``: ``rewire_region_passthrough`` (a block region's parameter operand, saved for its
  backward, is read as the operand, so it is gathered again rather than kept),
  ``read_shared_region_outputs_once`` (region outputs that share storage, a result returned
  as output and as saved tensor, are read as one, so that Inductor does not write over it),
  ``fold_views`` (markers read parameters and return gradients directly, not
  through the no-op views of DTensor's ``to_local``), ``merge_reduce_grad`` (one
  reduction per parameter read under several markers, e.g. inside and outside a checkpoint),
  ``assign_buckets`` (the ``size``/``auto`` strategies),
  ``reshard`` (tag markers so the min-cut partitioner frees full parameters),
  ``keep_group_pieces`` (``reshard_after_forward=k``: the backward gathers again over a
  group of ``k`` ranks, from the piece the forward kept);
- ``fw``: ``read_forward_gathers`` (the forward reads its own gathers, not those
  ``keep_group_pieces`` added for the backward), ``lower_unshard``, ``prefetch``,
  ``step_prefetch`` (the leading gathers may come from the previous optimizer step),
  ``shard_copy_stream`` (on by default: offloaded shards go to the device on a copy
  stream, a bucket ahead), ``sizes_outside_regions`` (an op outside a block region that
  reads a size the region returned reads the graph's own size input instead: Inductor
  cannot take the region's as a size),
  ``resolve_region_operand_views`` (a region operand with the conjugate or negative bit,
  which ``invoke_subgraph`` has no kernel for, is cloned first), ``gloo_gathers`` (on
  gloo groups, each all-gather becomes the single-tensor one: gloo's coalesced one corrupts
  the heap beside another collective in flight);
- ``inference``: ``fold_views``, ``assign_buckets``, ``lower_unshard``, ``prefetch``,
  ``shard_copy_stream``, ``sizes_outside_regions``, ``resolve_region_operand_views``,
  ``gloo_gathers``;
- ``bw``: ``lower_unshard`` (the re-gather), ``split_last_reduce`` (early gradients of the
  last buckets reduced on their own), ``lower_reduce_grad``, ``prefetch``, ``overlap_reduce``,
  ``grad_copy_stream`` (on by default: offloaded gradients go to the host on a copy
  stream, waited for once), ``shard_copy_stream``, ``sizes_outside_regions``,
  ``resolve_region_operand_views``, ``gloo_gathers``.
Markers are lowered only after partitioning: the partitioner force-saves plain collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from graphshard.api.reduce_scatter import group_backend
from graphshard.compiler.dump import GraphDumper
from graphshard.passes import (
    Plan,
    assign_buckets,
    dedupe_unshard,
    fold_views,
    gloo_gathers,
    grad_copy_stream,
    inline_unsupported_regions,
    keep_group_pieces,
    lower_reduce_grad,
    lower_unshard,
    merge_reduce_grad,
    overlap_reduce,
    parameters_first_in_regions,
    prefetch,
    read_forward_gathers,
    read_shared_region_outputs_once,
    reshard,
    resolve_region_operand_views,
    rewire_region_passthrough,
    shard_copy_stream,
    sizes_outside_regions,
    split_last_reduce,
    step_prefetch,
)
from graphshard.passes.cost_model import GROUP_RANKS, collective_group, collective_kind
from graphshard.passes.gloo_gathers import FUNCTIONAL_GATHERS
from graphshard.passes.markers import is_reduce_grad, is_unshard, marker_args
from graphshard.passes.runner import PassRunner

__all__ = ["PIPELINE", "Pass", "run_passes", "record_group_facts"]

Pass = Callable[[fx.GraphModule, Plan], fx.GraphModule]

PIPELINE: dict[str, list[Pass]] = {
    "dynamo": [inline_unsupported_regions, dedupe_unshard, parameters_first_in_regions,
               resolve_region_operand_views],
    "joint": [rewire_region_passthrough, read_shared_region_outputs_once, fold_views,
              merge_reduce_grad, assign_buckets, reshard, keep_group_pieces],
    "fw": [read_forward_gathers, lower_unshard, prefetch, step_prefetch, shard_copy_stream,
           sizes_outside_regions, resolve_region_operand_views, gloo_gathers],
    "inference": [fold_views, assign_buckets, lower_unshard, prefetch, shard_copy_stream,
                  sizes_outside_regions, resolve_region_operand_views, gloo_gathers],
    "bw": [lower_unshard, split_last_reduce, lower_reduce_grad, prefetch, overlap_reduce,
           grad_copy_stream, shard_copy_stream, sizes_outside_regions,
           resolve_region_operand_views, gloo_gathers],
}

def run_passes(stage: str, gm: fx.GraphModule, plan: Plan, dumper: GraphDumper,
               seconds: dict[str, float] | None = None) -> fx.GraphModule:
    """Run the passes of ``stage`` through the :class:`PassRunner` (lint, recompile and
    invariants after each), dumping the graph before and after each; each pass's wall time
    is added to ``seconds``."""
    runner = PassRunner(after_each=lambda step, name, g: dumper.write(stage, step, name, g),
                        seconds={} if seconds is None else seconds)
    return runner.run(stage, PIPELINE[stage], gm, plan)


def _device_of(read: Any) -> torch.device | str:
    """The device of a node's value (the first of a list's), ``"cpu"`` where it has none."""
    node = read[0] if isinstance(read, (list, tuple)) and read else read
    value = getattr(node, "meta", {}).get("val")
    return value.device if isinstance(value, torch.Tensor) else "cpu"


def record_group_facts(gm: fx.GraphModule) -> None:
    """Write down, on the nodes of ``gm``, what the passes need from the live process groups
    (the passes themselves never look at one):

    - ``node.meta["group_size"]`` on every all-reduce and all-to-all whose arguments only
      name their group (DTensor's tensor-parallel collectives), so that the cost model can
      price them;
    - ``node.meta["group_backend"]`` (``"gloo"``, ``"nccl"``, ...) on every ``reduce_grad``
      marker, so that ``lower_reduce_grad`` picks the reduce-scatter algorithm of the group
      (``Plan.reduce_scatter_via="auto"``), and on every ``unshard`` marker and functional
      all-gather, so that ``gloo_gathers`` finds the gathers of gloo groups (the lowering
      passes a marker's on to the gather it becomes);
    - ``gm.meta[GROUP_RANKS]``: the global ranks of every group the graph's markers and
      collectives name, so that the cost model prices a group within a node and one across
      nodes at their own links (``HardwareProfile.node_size``).

    Groups this process does not know are left alone."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed.distributed_c10d import _resolve_process_group

    names: set[str] = set()
    for node in gm.graph.nodes:
        if is_reduce_grad(node) or is_unshard(node):
            args = marker_args(node)
            read = args.grad if is_reduce_grad(node) else args.shard
            node.meta["group_backend"] = group_backend(args.group_name, _device_of(read))
            names.update(v for k, v in args._asdict().items() if "group" in k and v)
            continue
        if collective_kind(node) is not None:
            names.add(collective_group(node)[0])
        if node.target in FUNCTIONAL_GATHERS:  # DTensor's, in tensor-parallel graphs
            node.meta["group_backend"] = group_backend(node.args[2], _device_of(node.args[0]))
            continue
        if collective_kind(node) not in ("all_reduce", "all_to_all"):
            continue
        name, size = collective_group(node)
        if size is None:
            try:
                node.meta["group_size"] = _resolve_process_group(name).size()
            except (ValueError, RuntimeError, KeyError):
                pass
    ranks = gm.meta.setdefault(GROUP_RANKS, {})
    for name in names - ranks.keys():
        try:
            ranks[name] = tuple(dist.get_process_group_ranks(_resolve_process_group(name)))
        except (ValueError, RuntimeError, KeyError):
            pass
