"""The training systems the benchmark compares, and the data they all train on.

Every system starts from the same model (``torch.manual_seed(seed)`` then ``Llama(cfg)``),
uses AdamW with the same learning rate, and is fed the same synthetic batches, so their step
times, memory and losses can be read side by side:

- ``graphshard-compiled``: ``graphshard.shard`` + ``torch.compile(backend=graphshard.backend())``
- ``graphshard-compiled-step-prefetch``: the same with ``step_prefetch=True`` (the
  optimizer step gathers the next forward's first buckets; off by default): the row that
  shows what it saves
- ``graphshard-eager``: the sharded model without ``torch.compile`` (one gather per use)
- ``fsdp2-eager``: ``fully_shard`` on every block of ``model.layers``, then on the root
- ``fsdp2-compiled``: the same, then ``torch.compile(model)`` (Inductor)
- ``fsdp2-prefetch-eager`` / ``fsdp2-prefetch-compiled``: the same with explicit prefetch,
  one block ahead: block i prefetches block i+1 in forward
  (``set_modules_to_forward_prefetch``) and block i-1 in backward
  (``set_modules_to_backward_prefetch``)
- ``simplefsdp-compiled``: torchtitan's SimpleFSDP (``data_parallel(model, mesh,
  mode="fully_shard")`` from ``torchtitan.experiments.graph_trainer.simple_fsdp``, torchtitan
  0.3.0, the ``bench`` extra), then ``torch.compile(fullgraph=True)`` with Inductor and no
  collective pass: one all-gather and one reduce-scatter per parameter
- ``simplefsdp-block-bucketing``: the same with Inductor's
  ``overlap_manual_scheduling.manual_overlap_bucketing`` as the post-grad pass, one bucket per
  transformer block (plus the embedding, and the final norm with the output layer), set up
  as torchtitan's graph_trainer JIT backend sets up its ``transformer_block_bucketing``
- ``simplefsdp-auto-bucketing``: the same with
  ``overlap_scheduling.schedule_overlap_bucketing_from_inductor_configs``, set up as that
  backend's ``auto_bucketing``
- ``ddp-compiled``: ``DistributedDataParallel`` + ``torch.compile`` (no sharding)
- ``single-compiled``: rank 0 alone trains the unsharded model compiled with Inductor on its
  local batch (the compute floor); the other ranks wait.
- ``graphshard-offload-compiled`` / ``graphshard-offload-eager``: graphshard with
  ``shard(..., offload=graphshard.CPUOffload())`` (shards, gradients and AdamW on the host);
  ``fsdp2-offload-eager`` / ``fsdp2-offload-compiled``: FSDP2 with
  ``fully_shard(..., offload_policy=CPUOffloadPolicy())``. Accelerator only (on the CPU
  there is nothing to offload: skipped), and not in the default list (:data:`OFFLOAD_SYSTEMS`):
  name them in ``--systems``. The step includes the host optimizer, as users run it.
- ``graphshard-compiled[option=value,...]``: a variant of graphshard-compiled with other
  options (:func:`variant_options`), e.g. ``graphshard-compiled[bucketing=size,
  bucket_bytes=8000000]``, ``graphshard-compiled[reshard_after_forward=False]`` or
  ``graphshard-compiled[compile_blocks_once=False]``: interleaved
  with the default in one run, it measures what an option changes on this machine.
  ``graphshard-eager[reshard_after_forward=False]`` (and the offload one's) takes the
  ``graphshard.shard`` options alone.

Mixed precision (``--mixed-precision bf16|fp16``, :data:`MIXED_PRECISION`) is each system's
own mechanism, with gradients reduced in fp32 and fp32 master weights and optimizer state
everywhere: graphshard ``shard(mixed_precision=graphshard.MixedPrecision(param_dtype,
reduce_dtype=torch.float32))``; FSDP2 ``fully_shard(mp_policy=MixedPrecisionPolicy(...))``
with the same two dtypes; SimpleFSDP ``data_parallel(mp_policy=...)`` with torchtitan's own
``MixedPrecisionPolicy`` of the same two dtypes; DDP and single-compiled, which have no
policy, ``torch.autocast(device_type, dtype)`` around forward and loss
(:attr:`System.autocast`). fp16 runs without a ``GradScaler``: a benchmark times the step
and need not protect small gradients from underflow, but its losses may drift from bf16's.

Every distributed system gets a process group of its own (``dist.new_group`` over all ranks),
so a failure that leaves one system's collectives mismatched leaves the others usable, and
the systems can stay alive side by side while the benchmark interleaves their steps.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import graphshard
from graphshard import GraphshardBackend
from graphshard.models.llama import Llama, LlamaConfig, llama_config

__all__ = [
    "ADAMW_IMPLEMENTATIONS",
    "MIXED_PRECISION",
    "OFFLOAD_SYSTEMS",
    "ONE_PROCESS_SYSTEMS",
    "SYSTEMS",
    "SIMPLEFSDP_MODES",
    "BenchContext",
    "PeerUnavailable",
    "System",
    "block_bucket_plans",
    "build_model",
    "build_system",
    "is_offload",
    "is_system",
    "private_llama_class",
    "trains_alone",
    "variant_options",
]

SYSTEMS: tuple[str, ...] = (
    "graphshard-compiled",
    "graphshard-compiled-step-prefetch",
    "graphshard-compiled-rs-collective",
    "graphshard-eager",
    "fsdp2-eager",
    "fsdp2-compiled",
    "fsdp2-prefetch-eager",
    "fsdp2-prefetch-compiled",
    "simplefsdp-compiled",
    "simplefsdp-block-bucketing",
    "simplefsdp-auto-bucketing",
    "ddp-compiled",
    "single-compiled",
    "single-regions-compiled",
)
# CPU offload, graphshard's and FSDP2's: accelerator only, run when named (``--systems``).
OFFLOAD_SYSTEMS: tuple[str, ...] = (
    "graphshard-offload-compiled",
    "graphshard-offload-eager",
    "fsdp2-offload-eager",
    "fsdp2-offload-compiled",
)
# Systems that run in one process, on rank 0 alone (the other ranks have nothing to run).
ONE_PROCESS_SYSTEMS = frozenset({"single-compiled", "single-regions-compiled"})


def sequence_length(parser: Any, model: str, seq_len: int | None, default: int) -> int:
    """``--seq-len`` for the preset ``model``: ``default`` or the model's longest where that is
    shorter when not given; outside ``[2, max_seq_len]`` a usage error from ``parser``."""
    max_seq = llama_config(model).max_seq_len
    if seq_len is None:
        seq_len = min(default, max_seq)
    if not 2 <= seq_len <= max_seq:
        parser.error(f"--seq-len must be in [2, {max_seq}] for {model}")
    return seq_len


def trains_alone(fake_world: bool) -> frozenset[str]:
    """The systems that train the whole model on rank 0's batch: the one-process ones, and in
    a fake world DDP too (its all-reduce of N equal copies leaves rank 0's gradients), where
    the sharded systems train rank 0's shards tiled."""
    return ONE_PROCESS_SYSTEMS | ({"ddp-compiled"} if fake_world else frozenset())


# graphshard-compiled with other options: ``graphshard-compiled[key=value,...]``.
_VARIANT = re.compile(r"graphshard-(?:offload-)?(?P<kind>compiled|eager)\[(?P<options>.*)\]")
# The options a variant passes to ``graphshard.shard``; the rest go to ``graphshard.backend``.
SHARD_OPTIONS = frozenset({"reshard_after_forward", "compile_blocks_once"})


def variant_options(name: str) -> dict[str, Any] | None:
    """The options of a graphshard-compiled variant (or of graphshard-offload-compiled, CPU
    offload's, or of an eager one, which takes :data:`SHARD_OPTIONS` only), None where
    ``name`` is not one.

    ``graphshard-compiled[bucketing=size,bucket_bytes=8_000_000]`` gives
    ``{"bucketing": "size", "bucket_bytes": 8000000}``: each value is a Python literal
    (``8_000_000``, ``False``, ``None``, ``'size'``) or else a bare word, taken as a string.
    :data:`SHARD_OPTIONS` go to ``graphshard.shard``, the others to ``graphshard.backend``,
    which checks them here. Raises ``ValueError`` saying what to change for a malformed
    item, a repeated or unknown option, or a value the backend refuses.
    """
    match = _VARIANT.fullmatch(name)
    if match is None:
        return None
    options: dict[str, Any] = {}
    for item in match["options"].split(","):
        key, sep, text = (part.strip() for part in item.partition("="))
        if not sep or not key.isidentifier() or not text:
            raise ValueError(f"{name}: {item.strip()!r} is not option=value; write e.g. "
                             "graphshard-compiled[bucketing=size,bucket_bytes=8000000]")
        if key in options:
            raise ValueError(f"{name}: option {key!r} is given twice")
        try:
            options[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            options[key] = text
    for key in SHARD_OPTIONS & options.keys():
        value = options[key]
        if isinstance(value, bool) or (key == "reshard_after_forward" and (
                value == "auto" or (isinstance(value, int) and value > 0))):
            continue  # an int is checked against the ranks by shard() itself
        allowed = ("True, False, auto or a positive int" if key == "reshard_after_forward"
                   else "True or False")
        raise ValueError(f"{name}: {key} must be {allowed}, got {value!r}")
    if match["kind"] == "eager" and options.keys() - SHARD_OPTIONS:
        raise ValueError(f"{name}: an eager variant takes only graphshard.shard options "
                         f"({', '.join(sorted(SHARD_OPTIONS))})")
    try:
        graphshard.backend(**{k: v for k, v in options.items() if k not in SHARD_OPTIONS})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: {exc}") from exc
    return options


def is_offload(name: str) -> bool:
    """Whether ``name`` offloads to the host: one of :data:`OFFLOAD_SYSTEMS` or a
    graphshard-offload-compiled variant."""
    return name in OFFLOAD_SYSTEMS or name.startswith(("graphshard-offload-compiled[",
                                                         "graphshard-offload-eager["))


def is_system(name: str) -> bool:
    """Whether ``name`` is one of :data:`SYSTEMS`, of :data:`OFFLOAD_SYSTEMS`, or a
    graphshard-compiled variant (which raises ``ValueError`` here when its options are
    wrong)."""
    return name in SYSTEMS or name in OFFLOAD_SYSTEMS or variant_options(name) is not None


# SimpleFSDP system -> the graph_trainer JIT pass it is compiled with (None: no pass).
SIMPLEFSDP_MODES: dict[str, str | None] = {
    "simplefsdp-compiled": None,
    "simplefsdp-block-bucketing": "transformer_block_bucketing",
    "simplefsdp-auto-bucketing": "auto_bucketing",
}

TORCHTITAN = "torchtitan==0.3.0"

# The profiler's name for the end of a graphshard step waiting for the gathers its optimizer
# step issued (``System.settle``): communication wait like the graphs' own.
SETTLE_EVENT = "bench::settle_step_prefetch"


# --mixed-precision -> the dtype parameters are gathered and computed in (None: fp32 as
# built). Gradients are reduced in fp32 for every setting.
MIXED_PRECISION: dict[str, torch.dtype | None] = {
    "none": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
REDUCE_DTYPE = torch.float32


# --compiler: what the compiled systems' graphs run on (BenchContext.compiler)
COMPILERS = ("inductor", "aot_eager")


class PeerUnavailable(RuntimeError):
    """A peer system cannot be built here (its package is missing): skipped, not failed."""


@dataclass(frozen=True)
class BenchContext:
    """What every system is built from: model shape, seed, optimizer settings, placement."""

    cfg: LlamaConfig
    seed: int
    lr: float
    device: torch.device
    world_size: int
    # AdamW's implementation for every system: "default" (torch's choice: its per-parameter
    # loop on the CPU, foreach on a GPU), or "loop", "foreach", "fused"
    optimizer: str = "default"
    # a key of MIXED_PRECISION: "none" (fp32), "bf16" or "fp16"
    mixed_precision: str = "none"
    # clip_grad_norm_'s threshold after every backward, for every system (None: no clip)
    clip_grad_norm: float | None = None
    # one of COMPILERS: what the compiled systems' graphs run on, "inductor" (the
    # systems as their users run them) or "aot_eager" (op by op: a quick check of the
    # bench's plumbing or of whether a failure is Inductor's; its times are no one's)
    compiler: str = "inductor"

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype parameters are computed in (None: their own, fp32)."""
        return MIXED_PRECISION[self.mixed_precision]


@dataclass
class System:
    """A built system, ready to train.

    ``run`` maps a batch of token ids to the model output (``.loss``); ``module`` is the module
    whose parameters, buffers and gradients are the model state (for memory accounting);
    ``distributed`` is False when only this rank trains (no barriers, no collectives);
    ``group`` is the system's own process group; every step runs inside ``context()``
    (compiler settings that must hold while its graphs compile, forward and backward);
    ``settle()`` runs at the end of every step (graphshard: wait for the gathers its
    optimizer step issued, so that, interleaved, they do not finish under other systems'
    steps for free); ``autocast``, where set, is the dtype the forward and the loss run
    in under ``torch.autocast`` (the mixed precision of systems without a policy of their
    own: DDP, single-compiled); ``clip_grad_norm``, where set, the threshold to which
    ``clip`` (``torch.nn.utils.clip_grad_norm_``; graphshard's systems:
    ``graphshard.clip_grad_norm_``, which their users call) clips the gradients of
    ``module``'s parameters between backward and the optimizer step.
    """

    name: str
    run: Callable[[torch.Tensor], object]
    module: nn.Module
    optimizer: torch.optim.Optimizer
    distributed: bool = True
    backend: GraphshardBackend | None = None
    notes: list[str] = field(default_factory=list)
    group: dist.ProcessGroup | None = None
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    settle: Callable[[], None] = lambda: None
    autocast: torch.dtype | None = None
    clip_grad_norm: float | None = None
    clip: Callable[..., torch.Tensor] = torch.nn.utils.clip_grad_norm_


_PRIVATE_CLASSES: dict[str, type[Llama]] = {}


def private_llama_class(owner: str) -> type[Llama]:
    """``Llama`` from a private copy of its module, for ``owner`` alone.

    Dynamo keeps its state per code object: the graphs compiled for a function, and the
    decision to run a function eagerly from then on when it cannot compile it whole (FSDP2
    under ``torch.compile`` makes it give up on ``Llama.forward`` that way). Systems sharing
    the model's code in one process would change each other's graphs, so each system's
    model runs code of its own: the same source, executed again as another module.
    """
    if owner not in _PRIVATE_CLASSES:
        source = sys.modules[Llama.__module__]
        # numbered: variants' names may differ only in characters \W maps to "_"
        name = f"_bench_model_{len(_PRIVATE_CLASSES)}_" + re.sub(r"\W", "_", owner)
        spec = importlib.util.spec_from_file_location(name, source.__file__)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # a real module: SimpleFSDP registers classes in it
        spec.loader.exec_module(module)
        _PRIVATE_CLASSES[owner] = module.Llama
    return _PRIVATE_CLASSES[owner]


def build_model(ctx: BenchContext, owner: str | None = None, on_host: bool = False) -> Llama:
    """The same freshly initialised model on every rank and for every system; with
    ``owner``, an instance of that system's private class (:func:`private_llama_class`).
    ``on_host``: left on the CPU (CPU offload's recipe: the sharding puts it in place)."""
    cls = Llama if owner is None else private_llama_class(owner)
    torch.manual_seed(ctx.seed)
    model = cls(ctx.cfg)
    return model if on_host else model.to(ctx.device)


class _OwnInductor(torch._TorchCompileInductorWrapper):
    """Inductor (``torch.compile``'s default backend), equal only to itself.

    Dynamo reuses a compiled frame for any equal backend, and two plain Inductor backends
    with the same options are equal: a second system of the same model class (SimpleFSDP's
    three modes, FSDP2 with and without prefetch) would then run the first one's graphs,
    compiled with the first one's passes.
    """

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


class _OwnAotEager:
    """AOTAutograd with no compiler (``torch.compile``'s ``"aot_eager"``), equal only to
    itself for the same reason as :class:`_OwnInductor`."""

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)


def _compile(model: nn.Module, ctx: BenchContext, options: dict[str, Any] | None = None,
             **kwargs: Any):
    """``torch.compile(model)`` with Inductor under ``options`` (or AOTAutograd alone, where
    ``ctx.compiler`` says so), compiled for this system only."""
    if ctx.compiler == "aot_eager":
        return torch.compile(model, backend=_OwnAotEager(), **kwargs)
    return torch.compile(model, backend=_OwnInductor(None, options, None), **kwargs)


# --optimizer -> AdamW keyword arguments (the same for every system)
ADAMW_IMPLEMENTATIONS: dict[str, dict[str, bool]] = {
    "default": {},
    "loop": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def _adamw(module: nn.Module, ctx: BenchContext) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=ctx.lr, **ADAMW_IMPLEMENTATIONS[ctx.optimizer])


def _mesh(group: dist.ProcessGroup, ctx: BenchContext):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, ctx.device.type)


def _needs_accelerator(ctx: BenchContext, name: str) -> None:
    if ctx.device.type == "cpu":
        raise PeerUnavailable(f"{name} offloads to the host from an accelerator: run it with "
                              "--device cuda (on the CPU there is nothing to offload)")


def _graphshard(
    ctx: BenchContext, group: dist.ProcessGroup, name: str, offload: bool = False,
    **options: Any,
) -> System:
    """graphshard's system ``name``: eager (``name`` ends in ``-eager``), or compiled with
    backend ``options`` (and the ``shard`` options among them, :data:`SHARD_OPTIONS`);
    ``offload``: with ``graphshard.CPUOffload()``."""
    from graphshard.api.step_prefetch import wait_issued

    shard_options = {k: options.pop(k) for k in SHARD_OPTIONS & options.keys()}
    if offload:
        shard_options["offload"] = graphshard.CPUOffload()
    if ctx.param_dtype is not None:
        shard_options["mixed_precision"] = graphshard.MixedPrecision(
            param_dtype=ctx.param_dtype, reduce_dtype=REDUCE_DTYPE
        )
    model = graphshard.shard(build_model(ctx, name, on_host=offload), _mesh(group, ctx),
                             **shard_options)
    if name.partition("[")[0].endswith("-eager"):
        return System(name, model, model, _adamw(model, ctx), group=group,
                      clip=graphshard.clip_grad_norm_)
    options.setdefault("inductor", ctx.compiler == "inductor")  # a variant's own wins
    backend = graphshard.backend(**options)
    run = torch.compile(model, backend=backend)

    def settle() -> None:
        with torch.profiler.record_function(SETTLE_EVENT):
            wait_issued()

    return System(
        name, run, model, _adamw(model, ctx), backend=backend, group=group, settle=settle,
        clip=graphshard.clip_grad_norm_,
    )


def _fsdp2(ctx: BenchContext, group: dist.ProcessGroup, compiled: bool, prefetch: bool,
           offload: bool = False):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    name = ("fsdp2" + ("-prefetch" if prefetch else "") + ("-offload" if offload else "")
            + ("-compiled" if compiled else "-eager"))
    mesh = _mesh(group, ctx)
    model = build_model(ctx, name, on_host=offload)
    blocks = list(model.layers)
    options: dict[str, Any] = {"mesh": mesh}
    if offload:
        options["offload_policy"] = CPUOffloadPolicy()
    if ctx.param_dtype is not None:
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=ctx.param_dtype, reduce_dtype=REDUCE_DTYPE
        )
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    if prefetch:  # one block ahead, both directions
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([blocks[i - 1]])
    run = _compile(model, ctx) if compiled else model
    return System(name, run, model, _adamw(model, ctx), group=group)


def block_bucket_plans(model: nn.Module) -> list[list[str] | str]:
    """Module FQN buckets for ``manual_overlap_bucketing``, as torchtitan's graph_trainer
    ``get_transformer_block_buckets`` builds them: the embedding, the final norm with the
    output layer, then one bucket per transformer block."""
    plans: list[list[str] | str] = ["tok_embeddings", ["norm", "output"]]
    return plans + [f"layers.{i}" for i in range(len(model.layers))]


def _inductor_settings(jit_pass: str | None, plans: list[list[str] | str]) -> dict[str, Any]:
    """The Inductor config graph_trainer's JIT backend sets for ``jit_pass`` (its
    ``apply_compile`` and ``get_compile_backend_with_passes``, torchtitan 0.3.0)."""
    settings: dict[str, Any] = {"reorder_for_peak_memory": False}
    if jit_pass is None:
        return settings
    settings.update(
        allow_buffer_reuse=False,
        reorder_for_peak_memory=False,
        reorder_for_compute_comm_overlap=False,
    )
    if jit_pass == "transformer_block_bucketing":
        from torch._inductor.fx_passes.overlap_manual_scheduling import manual_overlap_bucketing

        def block_bucketing(graph: torch.fx.Graph) -> torch.fx.GraphModule:
            return manual_overlap_bucketing(
                graph.owning_module, module_bucket_plans=plans, insert_overlap_deps=True
            )

        settings["post_grad_custom_post_pass"] = block_bucketing
    elif jit_pass == "auto_bucketing":
        from torch._inductor.fx_passes.overlap_scheduling import (
            schedule_overlap_bucketing_from_inductor_configs,
        )

        def auto_bucketing(graph: torch.fx.Graph) -> torch.fx.GraphModule:
            return schedule_overlap_bucketing_from_inductor_configs(graph.owning_module)

        settings.update(
            {
                "aten_distributed_optimizations.collective_bucketing": True,
                "aten_distributed_optimizations.insert_overlap_deps": True,
                "post_grad_custom_post_pass": auto_bucketing,
            }
        )
    else:
        raise ValueError(f"unknown graph_trainer pass {jit_pass!r}")
    return settings


def _compile_context(settings: dict[str, Any]) -> Callable[[], contextlib.AbstractContextManager]:
    """A context that holds Inductor ``settings`` (also passed as the backend's options) and
    graph_trainer's Dynamo setting while a step traces and compiles, forward and backward."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    @contextlib.contextmanager
    def context():
        with inductor_config.patch(settings), dynamo_config.patch(capture_scalar_outputs=True):
            yield

    return context


def _simple_fsdp(ctx: BenchContext, group: dist.ProcessGroup, name: str) -> System:
    try:
        from torchtitan.experiments.graph_trainer.simple_fsdp import (
            MixedPrecisionPolicy,
            data_parallel,
        )
    except ImportError as exc:
        raise PeerUnavailable(
            f"torchtitan is not installed ({type(exc).__name__}: {exc}); install the bench "
            f"extra: pip install -e '.[bench]' (or pip install --no-deps {TORCHTITAN} "
            "spmd_types==0.2.3 tyro)"
        ) from exc
    mp_policy = None  # SimpleFSDP's own policy class (torchtitan 0.3.0), not FSDP2's
    if ctx.param_dtype is not None:
        mp_policy = MixedPrecisionPolicy(param_dtype=ctx.param_dtype, reduce_dtype=REDUCE_DTYPE)
    model = data_parallel(
        build_model(ctx, name), _mesh(group, ctx), mode="fully_shard", mp_policy=mp_policy
    )
    settings = _inductor_settings(SIMPLEFSDP_MODES[name], block_bucket_plans(model))
    run = _compile(model, ctx, settings, fullgraph=True)  # as graph_trainer's JIT mode compiles
    notes = []
    if SIMPLEFSDP_MODES[name] is not None and ctx.compiler != "inductor":
        notes.append(f"its bucketing ({SIMPLEFSDP_MODES[name]}) is an Inductor pass: not run "
                     f"with --compiler {ctx.compiler}")
    return System(
        name, run, model, _adamw(model, ctx), notes=notes, group=group,
        context=_compile_context(settings),
    )


def _ddp_compiled(ctx: BenchContext, group: dist.ProcessGroup) -> System:
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(ctx, "ddp-compiled")
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=group)
    notes = []
    if ctx.device.type == "cpu":
        notes.append(
            "peak_mem_bytes leaves out DDP's gradient buckets (held in C++ from construction, "
            "about one copy of the parameters)"
        )
    return System(
        "ddp-compiled", _compile(ddp, ctx), model, _adamw(model, ctx), notes=notes, group=group,
        autocast=ctx.param_dtype,  # fp16 too, with no GradScaler: a benchmark times steps
    )  # fmt: skip


def _single_compiled(ctx: BenchContext, group: None, regions: bool = False) -> System:
    """The unsharded model in one process, compiled whole; with ``regions``, each block's
    ``forward`` a ``torch.compiler.nested_compile_region`` (torch's regional compilation:
    Dynamo traces one block and Inductor compiles it once for all of them), the floor of
    what compiling a whole step with its blocks compiled once costs."""
    name = "single-regions-compiled" if regions else "single-compiled"
    model = build_model(ctx, name)
    notes = [
        f"rank 0 alone trains on its local batch (1/{ctx.world_size} of the global batch): "
        "final_loss is rank 0's loss, so it follows a different trajectory than the "
        "distributed systems' global-batch loss"
    ]
    options = None
    if regions:  # on this system's own copy of the class (build_model's owner), once
        block = type(model.layers[0])
        if not hasattr(block.forward, "__marked_compile_region_fn__"):
            block.forward = torch.compiler.nested_compile_region(block.forward)
        # Inductor (torch 2.13, 2.14.1) does not see that a region's saved input aliases its
        # operand: it writes the residual sum into the operand's buffer, or puts a later
        # value there, and the blocks got wrong weight gradients (docs/torch-versions.md).
        # Without in-place or reused buffers the step is right, at the price of the
        # allocations it no longer saves.
        options = {"inplace_buffers": False, "allow_buffer_reuse": False}
    return System(
        name, _compile(model, ctx, options), model, _adamw(model, ctx), False, notes=notes,
        autocast=ctx.param_dtype,
    )  # fmt: skip


_BUILDERS: dict[str, Callable[[BenchContext, Any], System]] = {
    "graphshard-compiled": lambda ctx, g: _graphshard(ctx, g, "graphshard-compiled"),
    "graphshard-compiled-step-prefetch": lambda ctx, g: _graphshard(
        ctx, g, "graphshard-compiled-step-prefetch", step_prefetch=True),
    # gloo's own reduce-scatter (an all-reduce of the whole buffer) instead of the all-to-all
    # graphshard picks on gloo; on NCCL the same graphs as graphshard-compiled
    "graphshard-compiled-rs-collective": lambda ctx, g: _graphshard(
        ctx, g, "graphshard-compiled-rs-collective", reduce_scatter_via="reduce_scatter"),
    "graphshard-eager": lambda ctx, g: _graphshard(ctx, g, "graphshard-eager"),
    "fsdp2-eager": lambda ctx, g: _fsdp2(ctx, g, compiled=False, prefetch=False),
    "fsdp2-compiled": lambda ctx, g: _fsdp2(ctx, g, compiled=True, prefetch=False),
    "fsdp2-prefetch-eager": lambda ctx, g: _fsdp2(ctx, g, compiled=False, prefetch=True),
    "fsdp2-prefetch-compiled": lambda ctx, g: _fsdp2(ctx, g, compiled=True, prefetch=True),
    "graphshard-offload-compiled": lambda ctx, g: _graphshard(
        ctx, g, "graphshard-offload-compiled", offload=True),
    "graphshard-offload-eager": lambda ctx, g: _graphshard(
        ctx, g, "graphshard-offload-eager", offload=True),
    "fsdp2-offload-eager": lambda ctx, g: _fsdp2(
        ctx, g, compiled=False, prefetch=False, offload=True),
    "fsdp2-offload-compiled": lambda ctx, g: _fsdp2(
        ctx, g, compiled=True, prefetch=False, offload=True),
    **{
        name: (lambda ctx, g, name=name: _simple_fsdp(ctx, g, name))
        for name in SIMPLEFSDP_MODES
    },
    "ddp-compiled": _ddp_compiled,
    "single-compiled": _single_compiled,
    "single-regions-compiled": lambda ctx, g: _single_compiled(ctx, g, regions=True),
}


def build_system(name: str, ctx: BenchContext) -> System:
    """Build the system ``name`` (one of :data:`SYSTEMS`) from a fresh model.

    Every rank must call it for the same names in the same order: a distributed system
    creates its own process group over all ranks (a collective call). Raises
    :class:`PeerUnavailable` for a peer whose package is not installed.
    """
    options = variant_options(name)
    if name not in _BUILDERS and options is None:
        raise KeyError(f"Unknown system {name!r}; choose from {', '.join(SYSTEMS)} or "
                       "graphshard-compiled[option=value,...]")
    if name in ONE_PROCESS_SYSTEMS:
        system = _BUILDERS[name](ctx, None)
    else:
        if is_offload(name):
            _needs_accelerator(ctx, name)  # the same answer on every rank, before any group
        if not dist.is_initialized():
            raise RuntimeError(f"{name} needs an initialised process group")
        if options is not None:
            system = _graphshard(ctx, dist.new_group(), name, offload=is_offload(name),
                                 **options)
        else:
            system = _BUILDERS[name](ctx, dist.new_group())
    system.clip_grad_norm = ctx.clip_grad_norm
    return system
