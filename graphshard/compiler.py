"""The ``graphshard`` torch.compile backend: Dynamo graph -> AOTAutograd -> passes -> Inductor.

Stages and their passes (each dumped before and after when a dump directory is set):
- ``dynamo``: ``dedupe_unshard`` (one marker per shard, so tied weights gather once);
- ``joint``: ``fold_views`` (markers read parameters and return gradients directly, not
  through the no-op views of DTensor's ``to_local``), ``merge_reduce_grad`` (one
  reduction per parameter read under several markers, e.g. inside and outside a checkpoint),
  ``assign_buckets`` (the ``size``/``auto`` strategies),
  ``reshard`` (tag markers so the min-cut partitioner frees full parameters);
- ``fw``: ``lower_unshard``, ``prefetch``;
- ``inference``: ``fold_views``, ``assign_buckets``, ``lower_unshard``, ``prefetch``;
- ``bw``: ``lower_unshard`` (the re-gather), ``lower_reduce_grad``, ``prefetch``,
  ``overlap_reduce``.
Markers are lowered only after partitioning: the partitioner force-saves plain collectives.
A graph that follows a graph break warns with its cost (``graphshard.GraphBreakWarning``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from graphshard import ops  # noqa: F401  (registers the eager kernels)
from graphshard.dump import GraphDumper, dump_dir_from_env
from graphshard.errors import GraphshardTypeError
from graphshard.fingerprint import check_compile_plan
from graphshard.graph_breaks import TRACKER
from graphshard.passes import (
    Plan,
    assign_buckets,
    dedupe_unshard,
    fold_views,
    lower_reduce_grad,
    lower_unshard,
    merge_reduce_grad,
    overlap_reduce,
    prefetch,
    reshard,
)
from graphshard.passes.cost_model import collective_group, collective_kind
from graphshard.passes.runner import PassRunner
from graphshard.report import write_schedule

__all__ = ["backend", "GraphshardBackend", "PIPELINE", "record_group_sizes"]

Pass = Callable[[fx.GraphModule, Plan], fx.GraphModule]

PIPELINE: dict[str, list[Pass]] = {
    "dynamo": [dedupe_unshard],
    "joint": [fold_views, merge_reduce_grad, assign_buckets, reshard],
    "fw": [lower_unshard, prefetch],
    "inference": [fold_views, assign_buckets, lower_unshard, prefetch],
    "bw": [lower_unshard, lower_reduce_grad, prefetch, overlap_reduce],
}

_graph_ids = itertools.count()


def run_passes(stage: str, gm: fx.GraphModule, plan: Plan, dumper: GraphDumper,
               seconds: dict[str, float] | None = None) -> fx.GraphModule:
    """Run the passes of ``stage`` through the :class:`PassRunner` (lint, recompile and
    invariants after each), dumping the graph before and after each; each pass's wall time
    is added to ``seconds``."""
    runner = PassRunner(after_each=lambda step, name, g: dumper.write(stage, step, name, g),
                        seconds={} if seconds is None else seconds)
    return runner.run(stage, PIPELINE[stage], gm, plan)


def record_group_sizes(gm: fx.GraphModule) -> None:
    """Write ``node.meta["group_size"]`` on every all-reduce and all-to-all of ``gm`` whose
    arguments only name their group (DTensor's tensor-parallel collectives), so that the
    cost model, which never sees a process group, can price them. Groups this process does
    not know are left alone."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed.distributed_c10d import _resolve_process_group

    for node in gm.graph.nodes:
        if collective_kind(node) not in ("all_reduce", "all_to_all"):
            continue
        name, size = collective_group(node)
        if size is None:
            try:
                node.meta["group_size"] = _resolve_process_group(name).size()
            except (ValueError, RuntimeError, KeyError):
                pass


def _inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any):
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner

    # Inductor's peak-memory reordering would undo the collective schedule the passes chose.
    with config.patch(reorder_for_peak_memory=False):
        return compile_fx_inner(gm, example_inputs, **kwargs)


def _eager(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any):
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(gm.forward)


class GraphshardBackend:
    """A ``torch.compile`` backend; ``torch.compile(model, backend=GraphshardBackend(...))``.

    Args:
        dump_dir: write every graph before and after every pass here (default: the
            ``GRAPHSHARD_DUMP_DIR`` environment variable; None writes nothing).
        inductor: compile the transformed graphs with Inductor (default); False runs them
            as they are, op by op, which is slower but shows exactly what the passes built.
        **plan_options: the scheduling and bucketing options of :class:`graphshard.passes.Plan`
            (``prefetch_depth``, ``max_unsharded_bytes``, ``bucketing``, ``bucket_bytes``,
            ``profile``, ``reshard_last_bucket``).
    """

    def __init__(
        self, *, dump_dir: str | None = None, inductor: bool = True, **plan_options: Any
    ) -> None:
        unknown = set(plan_options) - {f.name for f in fields(Plan)}
        if unknown:
            known = ", ".join(["dump_dir", "inductor", *(f.name for f in fields(Plan))])
            raise GraphshardTypeError(f"Unknown graphshard backend option(s) {sorted(unknown)}; "
                            f"known: {known}")
        self.dump_dir = dump_dir
        self.inductor = inductor
        self.plan = Plan(**plan_options)
        # One entry per compiled Dynamo graph: stage name -> the graph after all its passes.
        self.graphs: list[dict[str, fx.GraphModule]] = []
        self.pass_seconds: dict[str, float] = {}  # wall time per pass, over every graph

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]):
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        dumper = GraphDumper(self.dump_dir or dump_dir_from_env(), next(_graph_ids), rank)
        plan = self.plan
        check_compile_plan(gm, plan)  # same plan on every rank, before any collective runs
        stages: dict[str, fx.GraphModule] = {}
        self.graphs.append(stages)

        def run(stage: str, graph: fx.GraphModule) -> fx.GraphModule:
            record_group_sizes(graph)
            stages[stage] = run_passes(stage, graph, plan, dumper, self.pass_seconds)
            if dumper.enabled and stage in ("fw", "bw", "inference"):
                write_schedule(stages[stage], plan.profile, dumper.dir, stage)
            return stages[stage]

        gm = run("dynamo", gm)

        def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
            joint = run("joint", joint)
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        finish = _inductor if self.inductor else _eager

        def fw_compiler(fw: fx.GraphModule, inputs: Sequence[Any]):
            return finish(run("fw", fw), inputs)

        def bw_compiler(bw: fx.GraphModule, inputs: Sequence[Any]):
            return finish(run("bw", bw), inputs, is_backward=True)

        def inference_compiler(fw: fx.GraphModule, inputs: Sequence[Any]):
            return finish(run("inference", fw), inputs, is_inference=True)

        from torch._inductor.decomposition import select_decomp_table

        compiler = aot_autograd(
            fw_compiler=fw_compiler,
            bw_compiler=bw_compiler,
            inference_compiler=inference_compiler,
            partition_fn=partition,
            decompositions=select_decomp_table(),
        )
        compiled = compiler(gm, example_inputs)  # compiles the forward (backward: lazily)
        TRACKER.graph_compiled(gm, stages, plan.profile)
        return compiled


def backend(**options: Any) -> GraphshardBackend:
    """A configured graphshard backend for ``torch.compile(model, backend=...)``.

    ``torch.compile(model, backend="graphshard")`` uses the defaults. See
    :class:`GraphshardBackend` and :class:`graphshard.passes.Plan` for the options.
    """
    return GraphshardBackend(**options)


def _default_backend(gm: fx.GraphModule, example_inputs: Sequence[Any]):
    """The backend registered with Dynamo under the name ``graphshard``."""
    return GraphshardBackend()(gm, example_inputs)


try:  # also reachable through the ``torch_dynamo_backends`` entry point of the installed package
    torch._dynamo.register_backend(_default_backend, name="graphshard")
except AssertionError:  # already registered (module reloaded)
    pass
