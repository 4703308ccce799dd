"""The training systems the benchmark compares, and the data they all train on.

Every system starts from the same model (``torch.manual_seed(seed)`` then ``Llama(cfg)``),
uses AdamW with the same learning rate, and is fed the same synthetic batches, so their step
times, memory and losses can be read side by side:

- ``graphshard-compiled``: ``graphshard.shard`` + ``torch.compile(backend=graphshard.backend())``
- ``graphshard-eager``: the sharded model without ``torch.compile`` (one gather per use)
- ``fsdp2-eager``: ``fully_shard`` on every block of ``model.layers``, then on the root
- ``fsdp2-compiled``: the same, then ``torch.compile(model)`` (Inductor)
- ``ddp-compiled``: ``DistributedDataParallel`` + ``torch.compile`` (no sharding)
- ``single-compiled``: rank 0 alone trains the unsharded model compiled with Inductor on its
  local batch (the compute floor); the other ranks wait.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

import graphshard
from graphshard import GraphshardBackend
from graphshard.models.llama import Llama, LlamaConfig

__all__ = [
    "SYSTEMS",
    "BenchContext",
    "System",
    "build_model",
    "build_system",
]

SYSTEMS: tuple[str, ...] = (
    "graphshard-compiled",
    "graphshard-eager",
    "fsdp2-eager",
    "fsdp2-compiled",
    "ddp-compiled",
    "single-compiled",
)


@dataclass(frozen=True)
class BenchContext:
    """What every system is built from: model shape, seed, optimizer settings, placement."""

    cfg: LlamaConfig
    seed: int
    lr: float
    device: torch.device
    world_size: int


@dataclass
class System:
    """A built system, ready to train.

    ``run`` maps a batch of token ids to the model output (``.loss``); ``module`` is the module
    whose parameters, buffers and gradients are the model state (for memory accounting);
    ``distributed`` is False when only this rank trains (no barriers, no collectives).
    """

    name: str
    run: Callable[[torch.Tensor], object]
    module: nn.Module
    optimizer: torch.optim.Optimizer
    distributed: bool = True
    backend: GraphshardBackend | None = None
    notes: list[str] = field(default_factory=list)


def build_model(ctx: BenchContext) -> Llama:
    """The same freshly initialised model on every rank and for every system."""
    torch.manual_seed(ctx.seed)
    return Llama(ctx.cfg).to(ctx.device)


def _adamw(module: nn.Module, ctx: BenchContext) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=ctx.lr)


def _graphshard(ctx: BenchContext, compiled: bool) -> System:
    model = graphshard.shard(build_model(ctx))
    if not compiled:
        return System("graphshard-eager", model, model, _adamw(model, ctx))
    backend = graphshard.backend()
    run = torch.compile(model, backend=backend)
    return System("graphshard-compiled", run, model, _adamw(model, ctx), backend=backend)


def _fsdp2(ctx: BenchContext, compiled: bool) -> System:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    model = build_model(ctx)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    run = torch.compile(model) if compiled else model
    name = "fsdp2-compiled" if compiled else "fsdp2-eager"
    return System(name, run, model, _adamw(model, ctx))


def _ddp_compiled(ctx: BenchContext) -> System:
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(ctx)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids)
    notes = []
    if ctx.device.type == "cpu":
        notes.append(
            "peak_mem_bytes leaves out DDP's gradient buckets (held in C++ from construction, "
            "about one copy of the parameters)"
        )
    return System("ddp-compiled", torch.compile(ddp), model, _adamw(model, ctx), notes=notes)


def _single_compiled(ctx: BenchContext) -> System:
    model = build_model(ctx)
    notes = [
        f"rank 0 alone trains on its local batch (1/{ctx.world_size} of the global batch): "
        "final_loss is rank 0's loss, so it follows a different trajectory than the "
        "distributed systems' global-batch loss"
    ]
    return System(
        "single-compiled", torch.compile(model), model, _adamw(model, ctx), False, notes=notes
    )


_BUILDERS: dict[str, Callable[[BenchContext], System]] = {
    "graphshard-compiled": lambda ctx: _graphshard(ctx, compiled=True),
    "graphshard-eager": lambda ctx: _graphshard(ctx, compiled=False),
    "fsdp2-eager": lambda ctx: _fsdp2(ctx, compiled=False),
    "fsdp2-compiled": lambda ctx: _fsdp2(ctx, compiled=True),
    "ddp-compiled": _ddp_compiled,
    "single-compiled": _single_compiled,
}


def build_system(name: str, ctx: BenchContext) -> System:
    """Build the system ``name`` (one of :data:`SYSTEMS`) from a fresh model."""
    if name not in _BUILDERS:
        raise KeyError(f"Unknown system {name!r}; choose from {', '.join(SYSTEMS)}")
    if name != "single-compiled" and not dist.is_initialized():
        raise RuntimeError(f"{name} needs an initialised process group")
    return _BUILDERS[name](ctx)
