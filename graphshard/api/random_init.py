"""In-place random initialisation of CPU DTensors draws the full tensor, then keeps the rows.

``nn.init`` on a sharded parameter runs an in-place random op (``normal_``, ``uniform_``, ...)
on a DTensor. On CUDA, DTensor's offset-based RNG tracker gives each shard its part of one
Philox stream. On a CPU mesh torch has no such tracker: every rank would fill its local rows
from the start of its own generator, so with one seed every rank draws the same numbers and
the model would change with the world size. Here, for a CPU DTensor that is sharded or
replicated (no ``Partial``; tensor-parallel ``_StridedShard`` layouts included), each rank
draws the whole tensor from the generator exactly as one process would, and keeps its piece:
the same seed gives the same model at any world size, and the same model as the unsharded
one. Cost: one temporary of the parameter's full size
(the largest parameter bounds it) and N times the draws; initialisation only. Other devices,
meta tensors and ``Partial`` placements take DTensor's own path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from graphshard.api.dtensor_handlers import through_dtensor

__all__ = ["install"]

_aten = torch.ops.aten
_INPLACE_RANDOM = (
    _aten.normal_.default,
    _aten.uniform_.default,
    _aten.log_normal_.default,
    _aten.exponential_.default,
    _aten.geometric_.default,
    _aten.cauchy_.default,
    _aten.bernoulli_.float,
    _aten.random_.default,
    getattr(_aten.random_, "from"),
    _aten.random_.to,
)


def _draws_full(target: Any, args: tuple, kwargs: dict) -> bool:
    if not isinstance(target, DTensor) or target.device.type != "cpu":
        return False
    if target.to_local().is_meta:
        return False
    if any(p.is_partial() for p in target.placements):
        return False  # a Partial DTensor has no single full value to draw
    return not any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values()))


def _inplace_random(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    target = args[0]
    if not _draws_full(target, args, kwargs):
        return through_dtensor(op, args, kwargs)
    local = target.to_local()
    full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
    op(full, *args[1:], **kwargs)
    # this rank's piece of ``full`` by DTensor's own split (nested and strided shards too);
    # src_data_rank=None: every rank holds ``full``, so nothing is sent
    mine = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
    with torch.no_grad():
        local.copy_(mine.to_local())
    return target


def install() -> None:
    """Route DTensor's in-place random ops through :func:`_inplace_random` (idempotent)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _INPLACE_RANDOM:
        handlers.setdefault(op, _inplace_random)
