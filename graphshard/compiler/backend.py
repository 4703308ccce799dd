"""The ``graphshard`` torch.compile backend: Dynamo graph -> AOTAutograd -> passes -> Inductor.

Each stage's graph goes through its passes (:mod:`graphshard.compiler.pipeline`): the Dynamo
graph, the joint graph before the min-cut partitioner, then the forward, backward or
inference graph before Inductor. A graph that follows a graph break warns with its cost
(``graphshard.GraphBreakWarning``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from graphshard.analysis.report import write_schedule
from graphshard.api import break_prefetch, eager_kernels, step_prefetch  # noqa: F401 (kernels)
from graphshard.compiler.cache_key import (
    aot_cache_unsupported,
    aot_cacheable,
    inner_tensor_layouts,
    meshes_pickle_without_hash,
    plan_in_cache_key,
    plan_out_of_fx_key,
)
from graphshard.compiler.compile_modes import inductor_config_for, without_cuda_graphs
from graphshard.compiler.dump import GraphDumper, dump_dir_from_env
from graphshard.compiler.graph_breaks import TRACKER
from graphshard.compiler.inductor_joint import inductor_joint_passes
from graphshard.compiler.pipeline import record_group_facts, run_passes
from graphshard.compiler.region_schemas import cached_region_schemas
from graphshard.compiler.share import CompileShare, share_from_default_group
from graphshard.compiler.wrapper_choice import compile_with_wrapper_choice
from graphshard.errors import (
    GraphshardNotImplementedError,
    GraphshardRuntimeError,
    GraphshardTypeError,
    GraphshardValueError,
)
from graphshard.passes import Plan
from graphshard.passes.regions import (
    joint_primal_signature,
    partition_region,
    region_parameter_counts,
)
from graphshard.passes.reshard import plan_after_joint
from graphshard.safety.fingerprint import check_compile_plan
from graphshard.safety.fusion_deps import FUSION_KEEPS_ORDERING_DEPS
from graphshard.safety.guards import refuse_unsharded_parameters
from graphshard.safety.layout_opt import layout_optimization_off_where_broken
from graphshard.safety.masked_vec import MASKED_RESULTS_STAY_SCALAR
from graphshard.safety.mutation import refuse_gathered_parameter_mutation
from graphshard.safety.region_donation import regions_donate_no_inputs
from graphshard.safety.region_offsets import region_offsets_counted_once

__all__ = ["backend", "GraphshardBackend"]

_graph_ids = itertools.count()


def _detached_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with its own graph (nodes and their meta dicts), the same attributes.

    Inductor's post-grad passes rewrite the graph they are given in place, the bodies of its
    block regions (subgraph modules) included; the copy goes to Inductor so that
    ``GraphshardBackend.graphs`` keeps the graphs as the passes left them (what the
    summaries, traffic counts and tests read)."""
    graph = fx.Graph()
    result, output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph.output(result, type_expr=output.type).meta = dict(output.meta)
    graph._codegen = gm.graph._codegen
    copy = fx.GraphModule(gm, graph)
    for name, child in list(copy.named_children()):
        if isinstance(child, fx.GraphModule):  # a block region's body: Inductor rewrites it too
            setattr(copy, name, _detached_copy(child))
    return copy


def _inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
              share: CompileShare | None = None, **kwargs: Any):
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner

    gm = _detached_copy(gm)

    def compile_(flags: dict[str, Any]) -> Any:
        # Inductor's peak-memory reordering would undo the collective schedule the passes
        # chose. Meshes among the inputs must not carry a per-process hash into the FX-cache
        # key; nor the plan (``aot_cache``): the passes' output is the whole story there.
        # Region bodies must not donate their inputs (a torch bug: region_donation.py), nor
        # read an output at a storage offset twice (region_offsets.py); nor may torch 2.13's
        # layout optimization drop a gradient (layout_opt.py), nor torch 2.11's CPU backend
        # lose a kernel's ordering dependencies (fusion_deps.py) or vectorize a shared scalar
        # (masked_vec.py).
        with config.patch(reorder_for_peak_memory=False), meshes_pickle_without_hash(), \
                plan_out_of_fx_key(), regions_donate_no_inputs(), region_offsets_counted_once(), \
                layout_optimization_off_where_broken(), FUSION_KEEPS_ORDERING_DEPS.applied(), \
                MASKED_RESULTS_STAY_SCALAR.applied():
            return compile_fx_inner(gm, example_inputs, **flags)

    def compile_among_ranks(flags: dict[str, Any]) -> Any:
        if share is None:
            return compile_(flags)
        return share.compile(gm, example_inputs, lambda: compile_(flags), **flags)

    return compile_with_wrapper_choice(gm, kwargs, compile_among_ranks)


def _eager(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
           share: CompileShare | None = None, **kwargs: Any):
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(gm.forward)


def _fake_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[Any]:
    """The inputs of ``gm`` as Dynamo traced them (its fake tensors, symbolic sizes kept),
    in place of the real ones: tracing the graph again later then holds no real memory."""
    fakes = []
    placeholders = gm.graph.find_nodes(op="placeholder")
    for node, real in zip(placeholders, example_inputs, strict=True):
        fake = node.meta.get("example_value")
        fakes.append(fake if isinstance(real, torch.Tensor) and fake is not None else real)
    return fakes


class _Untraced:
    """A Dynamo graph that AOTAutogradCache answered: its stages are traced on demand."""

    def __init__(self, backend: GraphshardBackend, gm: fx.GraphModule, inputs: list[Any],
                 stages: dict[str, fx.GraphModule], dumper: GraphDumper) -> None:
        self.backend, self.gm, self.inputs = backend, gm, inputs
        self.stages, self.dumper = stages, dumper

    def trace(self) -> None:
        """AOTAutograd and the passes once more, on fake tensors and without Inductor or
        its cache, the backward traced at once: ``stages`` gets every graph a compile
        that missed the cache would have kept."""
        from torch._dynamo.exc import TensorifyScalarRestartAnalysis
        from torch._dynamo.symbolic_convert import TensorifyState
        from torch._functorch import config as functorch_config

        finish = functools.partial(_eager, share=None)

        def trace_once() -> None:
            with functorch_config.patch(force_non_lazy_backward_lowering=True):
                self.backend._compile_stages(self.gm, self.inputs, self.stages, self.dumper,
                                             finish, cached=False)

        specialised = set(TensorifyState.force_specializations)
        try:
            trace_once()
        except TensorifyScalarRestartAnalysis:
            # A float of the graph that its compile specialised (Dynamo restarted that
            # compile): the pass has noted it, so a second trace keeps it specialised.
            for stage in [name for name in self.stages if name != "dynamo"]:
                del self.stages[stage]
            trace_once()
        finally:
            TensorifyState.clear()
            for name in specialised:
                TensorifyState.specialize(name)


def _with_backward_now(compile_graph: Any) -> Any:
    """``compile_graph`` with the backward compiled along with the forward, not at the first
    backward: its AOTAutogradCache entry is complete when it returns, so a rank that waited
    for it (``share_compiled``) is answered by it. (The publisher cannot wait for its forward
    to run: that needs the waiting ranks in its collectives. The waiting ranks ask the same
    way: the setting is part of AOTAutogradCache's key.)"""
    def compile_both() -> Any:
        from torch._functorch import config as functorch_config

        with functorch_config.patch(force_non_lazy_backward_lowering=True):
            return compile_graph()

    return compile_both


class GraphshardBackend:
    """A ``torch.compile`` backend; ``torch.compile(model, backend=GraphshardBackend(...))``.

    Args:
        dump_dir: write every graph before and after every pass here (default: the
            ``GRAPHSHARD_DUMP_DIR`` environment variable; None writes nothing).
        inductor: compile the transformed graphs with Inductor (default); False runs them
            as they are, op by op, which is slower but shows exactly what the passes built.
        share_compiled: compile each distinct graph on one rank only, meeting through the
            process group's store (:mod:`graphshard.compiler.share`). ``"auto"`` (default):
            with Inductor, more than one rank and a real backend (gloo, NCCL), the ranks of
            one Inductor cache directory (one host, by default) wait for the first of them
            to compile a graph and then hit its cache entries (AOTAutograd's, with
            ``aot_cache``); nothing is sent. ``True``: also across directories, Inductor's
            artifacts travel through the store to ranks that load them. ``False``: every
            rank compiles for itself.
        share_timeout_s: how long a rank waits for another rank's artifacts before it
            compiles the graph itself (default 900 s).
        mode: torch.compile's mode, for Inductor (``"max-autotune-no-cudagraphs"``, ...;
            :mod:`graphshard.compiler.compile_modes`): applied to every Inductor compile of
            the step. ``torch.compile(model, backend="graphshard", mode=...)`` sets it.
            Modes with CUDA graphs raise on a CUDA graph. None (default): Inductor's
            defaults.
        aot_cache: let AOTAutograd's own cache (``AOTAutogradCache``) answer a graph it has
            seen, keyed by the Dynamo graph, the plan and graphshard's source
            (:func:`graphshard.compiler.cache_key.plan_in_cache_key`): a warm restart then
            skips AOTAutograd's tracing, the partitioner and graphshard's passes. The
            stages of such a graph are traced when :attr:`graphs` is first read (or at
            once, with dumps or after a graph break). ``"auto"`` (default): on where the
            installed torch's cache can hold graphshard's graphs (2.13 and newer), off on
            torch 2.11, whose cache refuses graphs that call ``DTensor.to_local()``.
        **plan_options: the fields of :class:`graphshard.passes.Plan` (``prefetch_depth``,
            ``max_unsharded_bytes``, ``bucketing``, ``bucket_bytes``, ``profile``,
            ``reshard_last_bucket``, ``step_prefetch``, ``break_prefetch``,
            ``split_last_reduce``,
            ``reduce_scatter_via``, ``memory_budget``, ``all_gather_via``,
            ``gather_from_storage``, ``grad_copy_stream``, ``shard_copy_stream``).

    Raises:
        GraphshardTypeError: an unknown option, or an option of the wrong type (a str for
            ``prefetch_depth``, ``"no"`` for a bool); checked here, before any compile.
        GraphshardValueError: an option's value is out of range (``prefetch_depth=-1``), an
            unknown ``mode``, or a ``mode`` with ``inductor=False``.
        GraphshardNotImplementedError: ``aot_cache=True`` on a torch whose AOTAutogradCache
            cannot hold graphshard's graphs (torch 2.11; 2.13 and newer can).
    """

    def __init__(
        self, *, dump_dir: str | None = None, inductor: bool = True,
        share_compiled: bool | str = "auto", share_timeout_s: float = 900.0,
        aot_cache: bool | str = "auto", mode: str | None = None,
        **plan_options: Any,
    ) -> None:
        unknown = set(plan_options) - {f.name for f in fields(Plan)}
        if unknown:
            known = ", ".join(["dump_dir", "inductor", "share_compiled", "share_timeout_s",
                               "aot_cache", "mode",
                               *(f.name for f in fields(Plan))])
            from torch._inductor import config as inductor_config

            inductor_names = sorted(n for n in unknown if hasattr(inductor_config, n))
            hint = (f" ({', '.join(inductor_names)}: Inductor's, set on torch._inductor.config, "
                    "which graphshard's compiles read, or chosen by torch.compile's mode)"
                    if inductor_names else "")
            raise GraphshardTypeError(f"Unknown graphshard backend option(s) {sorted(unknown)}; "
                                      f"known: {known}{hint}")
        if dump_dir is not None and not isinstance(dump_dir, (str, os.PathLike)):
            raise GraphshardTypeError(
                f"graphshard backend option dump_dir must be a directory path (a str or "
                f"os.PathLike) or None, got {dump_dir!r} ({type(dump_dir).__name__})"
            )
        if not isinstance(inductor, bool):
            raise GraphshardTypeError(
                f"graphshard backend option inductor must be True (compile with Inductor) or "
                f"False (run the transformed graphs op by op), got {inductor!r} "
                f"({type(inductor).__name__})"
            )
        if share_compiled not in (True, False, "auto"):
            raise GraphshardTypeError(
                f"graphshard backend option share_compiled must be True, False or 'auto', "
                f"got {share_compiled!r} ({type(share_compiled).__name__})"
            )
        if isinstance(share_timeout_s, bool) or not isinstance(share_timeout_s, (int, float)) \
                or not share_timeout_s >= 0:
            raise GraphshardTypeError(
                f"graphshard backend option share_timeout_s must be a number of seconds >= 0, "
                f"got {share_timeout_s!r} ({type(share_timeout_s).__name__})"
            )
        self.dump_dir = dump_dir
        self.inductor = inductor
        self.mode = mode
        self._mode_config = inductor_config_for(mode, inductor)
        if not (isinstance(aot_cache, bool) or aot_cache == "auto"):
            raise GraphshardTypeError(
                f"graphshard backend option aot_cache must be True, False or 'auto', got "
                f"{aot_cache!r} ({type(aot_cache).__name__})"
            )
        why = aot_cache_unsupported() if aot_cache else None
        if aot_cache is True and why is not None:
            raise GraphshardNotImplementedError(why)
        self.aot_cache = bool(aot_cache) and why is None
        self.aot_cache_hits = 0  # Dynamo graphs AOTAutogradCache answered (no pass ran)
        self.share_compiled = share_compiled
        self.share_timeout_s = float(share_timeout_s)
        # the store channel of share_compiled, made at the first compile (the process group
        # may not exist yet when the backend is built); None: every rank compiles alone
        self.share: CompileShare | None = None
        self._share_resolved = False
        self.plan = Plan(**plan_options)
        # One entry per compiled Dynamo graph: stage name -> the graph after all its passes.
        self._graphs: list[dict[str, fx.GraphModule]] = []
        self._untraced: list[_Untraced] = []  # AOTAutogradCache hits whose stages wait
        self.pass_seconds: dict[str, float] = {}  # wall time per pass, over every graph

    @property
    def graphs(self) -> list[dict[str, fx.GraphModule]]:
        """One entry per compiled Dynamo graph: stage name (``dynamo``, ``joint``, ``fw``,
        ``bw``, ``inference``) -> the graph as the passes left it (the ``joint`` of an
        Inductor compile then also went through Inductor's joint-graph passes, in place).

        A graph that AOTAutogradCache answered (``aot_cache``) ran no pass when it compiled;
        its stages are traced here, on first read, from its Dynamo graph on fake tensors
        (the same passes, without Inductor), so every entry is complete. Read it while the
        process groups that compiled them exist: the passes ask a group for its backend
        (which picks the reduce-scatter's algorithm) and, without it, take the default."""
        while self._untraced:
            self._untraced.pop(0).trace()
        return self._graphs

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                 mode: str | None = None, options: dict[str, Any] | None = None):
        """Compile Dynamo's graph ``gm``. ``mode`` and ``options``: torch.compile's own
        keywords, which torch hands to a backend object too (``torch.compile(model,
        backend=graphshard.backend(...), mode=...)``): the mode applies unless this backend
        has another; options belong in :func:`backend`."""
        if options:
            raise GraphshardTypeError(
                f"torch.compile(..., options={options!r}) with a graphshard.backend(...) "
                "object: pass them to graphshard.backend(...) instead")
        config = self._mode_config
        if mode is not None and mode != self.mode:
            if self.mode is not None:
                raise GraphshardValueError(
                    f"torch.compile(..., mode={mode!r}) with a graphshard backend built with "
                    f"mode={self.mode!r}: give one of them")
            config = inductor_config_for(mode, self.inductor)
        else:
            mode = self.mode
        if not config:
            return self._compile(gm, example_inputs, lazy_backward=True)
        config = without_cuda_graphs(config, mode, example_inputs)
        from torch._inductor import config as inductor_config

        with inductor_config.patch(config):  # the backward too: compiled now, under it
            return self._compile(gm, example_inputs, lazy_backward=False)

    def _compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                 lazy_backward: bool) -> Any:
        initialised = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if initialised else 0
        refuse_unsharded_parameters(example_inputs, dist.get_world_size() if initialised else 1)
        dumper = GraphDumper(self.dump_dir or dump_dir_from_env(), next(_graph_ids), rank)
        refuse_gathered_parameter_mutation(gm)  # an update of a gathered copy would be lost
        check_compile_plan(gm, self.plan)  # same plan on every rank, before any collective runs
        stages: dict[str, fx.GraphModule] = {}
        self._graphs.append(stages)
        gm = self._run_stage("dynamo", gm, stages, self.plan, dumper)
        cached = self.inductor and self.aot_cache
        share = self._resolve_share()
        finish = functools.partial(_inductor if self.inductor else _eager, share=share)

        def compile_graph() -> Any:
            return self._compile_stages(gm, example_inputs, stages, dumper, finish, cached)

        if cached and share is not None:  # one rank compiles; the others hit its entry
            compiled = share.compile_whole_graph(
                gm, example_inputs, _with_backward_now(compile_graph), plan=repr(self.plan),
                shards=repr(inner_tensor_layouts(example_inputs)))
        else:
            compiled = compile_graph() if lazy_backward else _with_backward_now(compile_graph)()
        if not stages.get("fw") and not stages.get("inference"):
            self.aot_cache_hits += 1  # AOTAutogradCache answered: no pass ran
            untraced = _Untraced(self, gm, _fake_inputs(gm, example_inputs), stages, dumper)
            if dumper.enabled or TRACKER.reads_forward(gm):
                untraced.trace()  # the dumps, or a graph break's warning, need them now
            else:
                self._untraced.append(untraced)
        TRACKER.graph_compiled(gm, stages, self.plan.profile, self.plan.break_prefetch)
        if self.plan.break_prefetch:  # its end gathers what the graph after a break starts with
            compiled = break_prefetch.run_forward(compiled)
        return compiled

    def _run_stage(self, stage: str, graph: fx.GraphModule, stages: dict[str, fx.GraphModule],
                   plan: Plan, dumper: GraphDumper) -> fx.GraphModule:
        record_group_facts(graph)
        stages[stage] = run_passes(stage, graph, plan, dumper, self.pass_seconds)
        if dumper.enabled and stage in ("fw", "bw", "inference"):
            write_schedule(stages[stage], plan.profile, dumper.dir, stage)
        return stages[stage]

    def _compile_stages(self, gm: fx.GraphModule, example_inputs: Sequence[Any],
                        stages: dict[str, fx.GraphModule], dumper: GraphDumper,
                        finish: Any, cached: bool) -> Any:
        """AOTAutograd on the Dynamo graph ``gm``, each of its stages through the passes into
        ``stages`` and then ``finish`` (Inductor or op by op). ``cached``: AOTAutogradCache
        may answer instead, in which case no stage runs. For Inductor (also when its cache
        answered and the stages are traced again), Inductor's own joint-graph passes run on
        every joint before it is partitioned and on inference graphs, as in
        ``torch.compile``'s Inductor backend (:func:`inductor_joint_passes`)."""
        plan = self.plan
        regions = region_parameter_counts(gm)  # the block regions' joints, by their inputs

        def run(stage: str, graph: fx.GraphModule) -> fx.GraphModule:
            return self._run_stage(stage, graph, stages, plan, dumper)

        def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
            nonlocal plan
            n_params = regions.get(joint_primal_signature(joint)) if regions else None
            if n_params is not None:  # one block region's own joint (partitioned first)
                if self.inductor:
                    joint = inductor_joint_passes(joint, joint_inputs)
                return partition_region(joint, joint_inputs, n_params=n_params, **kwargs)
            joint = run("joint", joint)
            plan = plan_after_joint(joint, plan)  # reshard="auto" may shorten the prefetch
            if self.inductor:
                joint = inductor_joint_passes(joint, joint_inputs)
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        def fw_compiler(fw: fx.GraphModule, inputs: Sequence[Any]):
            return finish(run("fw", fw), inputs)

        def bw_compiler(bw: fx.GraphModule, inputs: Sequence[Any]):
            return finish(run("bw", bw), inputs, is_backward=True)

        def inference_compiler(fw: fx.GraphModule, inputs: Sequence[Any]):
            if self.inductor:  # no partition: Inductor runs them on the graph it compiles
                fw = inductor_joint_passes(fw, inputs, partitioned=False)
            return finish(run("inference", fw), inputs, is_inference=True)

        from torch._inductor.decomposition import select_decomp_table

        compilers: dict[str, Any] = {"fw_compiler": fw_compiler, "bw_compiler": bw_compiler,
                                     "inference_compiler": inference_compiler}
        key = contextlib.nullcontext()
        if cached:
            compilers = aot_cacheable(compilers)
            key = plan_in_cache_key(plan, example_inputs)
        compiler = aot_autograd(
            **compilers,
            partition_fn=partition,
            decompositions=select_decomp_table(),
        )
        with key, meshes_pickle_without_hash(), cached_region_schemas(), \
                _region_mutations_named():
            return compiler(gm, example_inputs)  # compiles the forward (backward: lazily)

    def _resolve_share(self) -> CompileShare | None:
        """The store channel for ``share_compiled`` (made once, at the first compile)."""
        if not self._share_resolved:
            self._share_resolved = True
            if self.inductor and self.share_compiled:
                self.share = share_from_default_group(
                    self.share_timeout_s, transfer=self.share_compiled is True)
        return self.share


# What AOTAutograd raises for a region that updates one of its inputs in training.
_REGION_MUTATION = "invoke_subgraph HigherOrderOperator does not currently support training"


@contextlib.contextmanager
def _region_mutations_named() -> Iterator[None]:
    """AOTAutograd's refusal of a block region that updates a buffer in training (a
    non-persistent buffer, which graphshard takes for a read-only cache) becomes an error
    that says what to change; other errors pass as they are."""
    try:
        yield
    except RuntimeError as e:
        if _REGION_MUTATION not in str(e):
            raise
        raise GraphshardRuntimeError(
            "a block of the model updates a buffer in training (an in-place write to a "
            "buffer registered with persistent=False, which graphshard runs as a read-only "
            "operand of the block's compile region, or to another of the block's inputs); "
            "torch's block regions cannot replay that update. Compile the blocks inline "
            "with graphshard.shard(model, "
            "compile_blocks_once=False), or register the buffer as persistent (blocks with "
            f"persistent buffers run inline). torch: {str(e).splitlines()[0]}") from e


def backend(**options: Any) -> GraphshardBackend:
    """A configured graphshard backend for ``torch.compile(model, backend=...)``.

    ``torch.compile(model, backend="graphshard")`` uses the defaults. See
    :class:`GraphshardBackend` and :class:`graphshard.passes.Plan` for the options.
    """
    return GraphshardBackend(**options)


def _default_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                     mode: str | None = None, options: dict[str, Any] | None = None):
    """The backend registered with Dynamo under the name ``graphshard``: torch.compile's
    ``options`` are :func:`backend`'s options, its ``mode`` Inductor's
    (:mod:`graphshard.compiler.compile_modes`)."""
    if options is not None and not isinstance(options, dict):
        raise GraphshardTypeError(
            f"torch.compile(..., backend='graphshard', options=...) takes a dict of graphshard "
            f"backend options, got {type(options).__name__}")
    return GraphshardBackend(**(options or {}))(gm, example_inputs, mode=mode)


try:  # also reachable through the ``torch_dynamo_backends`` entry point of the installed package
    torch._dynamo.register_backend(_default_backend, name="graphshard")
except AssertionError:  # already registered (module reloaded)
    pass
