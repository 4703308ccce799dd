"""Graph passes of graphshard: pure functions ``fn(graph_module, plan) -> graph_module``.

They run on FX graphs with fake tensors and need no process group, so they are unit-tested
in one process and used offline on models far larger than the machine.
"""

from graphshard.passes.bucketing import assign_buckets
from graphshard.passes.dedupe import dedupe_unshard
from graphshard.passes.fold_views import fold_views
from graphshard.passes.gloo_gathers import gloo_gathers
from graphshard.passes.grad_copy_stream import grad_copy_stream
from graphshard.passes.group_reshard import keep_group_pieces, read_forward_gathers
from graphshard.passes.inline_regions import inline_unsupported_regions
from graphshard.passes.layout import Dim0Layout
from graphshard.passes.lower_reduce_grad import lower_reduce_grad
from graphshard.passes.lower_unshard import lower_unshard
from graphshard.passes.markers import REDUCE_GRAD, UNSHARD, is_reduce_grad, is_unshard
from graphshard.passes.merge_reduce_grad import merge_reduce_grad
from graphshard.passes.overlap_reduce import overlap_reduce
from graphshard.passes.plan import Bucket, Plan, collect_buckets
from graphshard.passes.prefetch import prefetch
from graphshard.passes.region_conj import resolve_region_operand_views
from graphshard.passes.region_sizes import sizes_outside_regions
from graphshard.passes.regions import (
    parameters_first_in_regions,
    read_shared_region_outputs_once,
    rewire_region_passthrough,
)
from graphshard.passes.reshard import reshard
from graphshard.passes.shard_copy_stream import shard_copy_stream
from graphshard.passes.split_reduce import split_last_reduce
from graphshard.passes.step_prefetch import step_prefetch

__all__ = [
    "UNSHARD",
    "REDUCE_GRAD",
    "assign_buckets",
    "Bucket",
    "Plan",
    "collect_buckets",
    "dedupe_unshard",
    "Dim0Layout",
    "fold_views",
    "gloo_gathers",
    "grad_copy_stream",
    "inline_unsupported_regions",
    "is_reduce_grad",
    "keep_group_pieces",
    "is_unshard",
    "lower_reduce_grad",
    "lower_unshard",
    "merge_reduce_grad",
    "overlap_reduce",
    "parameters_first_in_regions",
    "prefetch",
    "read_forward_gathers",
    "read_shared_region_outputs_once",
    "reshard",
    "resolve_region_operand_views",
    "rewire_region_passthrough",
    "split_last_reduce",
    "shard_copy_stream",
    "sizes_outside_regions",
    "step_prefetch",
]
