"""FSDP x tensor parallel: shard a TP DTensor's local tensor over the data-parallel mesh.

The order is FSDP2's: ``parallelize_module(model, mesh["tp"], plan)`` first, then
``graphshard.shard(model, mesh["dp"])`` (HSDP x TP: ``mesh["replicate", "shard"]``). Each
TP parameter's local tensor is split on dim 0 across dp exactly as a plain parameter is, and
the result is one DTensor on the concatenated (dp..., tp) mesh: ``Shard(0)`` on dp, or
``_StridedShard(0, split_factor=tp)`` where TP shards dim 0 too (dp then holds rows of each TP
piece, not of the full tensor), followed by the TP placements. So DCP, state dicts,
``full_tensor()`` and ``clip_grad_norm_`` see the true global layout.

Inside the forward the graph gathers along dp only and re-wraps the result as the TP DTensor,
so DTensor inserts its own TP collectives beside graphshard's.

Mistakes in the order are refused with an error that names the right one: a dp mesh that is
not a sub-mesh beside the parameters' TP mesh (same root, disjoint dimensions), a TP model
sharded without a mesh, and ``parallelize_module`` on a model already sharded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from graphshard.errors import ShardedModelError
from graphshard.passes.layout import Dim0Layout

__all__ = ["TPLayout", "tp_mesh_of", "tp_parameter", "refuse_tp_after_shard"]

ORDER = (
    "apply tensor parallelism first, then shard the data-parallel sub-mesh of the same mesh: "
    "parallelize_module(model, mesh['tp'], plan); graphshard.shard(model, mesh['dp']) "
    "(HSDP x TP: mesh['replicate', 'shard'])"
)


@dataclass(frozen=True)
class TPLayout:
    """How to re-wrap the dp-gathered local tensor as the parameter's TP DTensor inside the
    forward: its TP mesh and placements, global shape and stride."""

    mesh: DeviceMesh
    placements: tuple
    shape: torch.Size
    stride: tuple

    def wrap(self, local: torch.Tensor) -> DTensor:
        """The TP DTensor whose local tensor is ``local`` (this rank's TP piece, gathered)."""
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=self.stride)


def tp_mesh_of(module: nn.Module, dp_mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The one mesh of ``module``'s DTensor parameters (None without TP), checked against the
    data-parallel mesh given to :func:`graphshard.shard`."""
    tp_params = [(n, p) for n, p in module.named_parameters() if isinstance(p, DTensor)]
    if not tp_params:
        return None
    name, first = tp_params[0]
    tp_mesh = first.device_mesh
    for other, p in tp_params[1:]:
        if p.device_mesh != tp_mesh:
            raise ShardedModelError(
                f"Parameters '{name}' and '{other}' are DTensors on different meshes "
                f"({tp_mesh} and {p.device_mesh}); graphshard shards a model whose tensor "
                "parallelism uses one mesh."
            )
    for n, p in tp_params:
        if any(q.is_partial() for q in p.placements):
            raise ShardedModelError(
                f"Parameter '{n}' is a Partial DTensor ({p.placements}); a parameter must be "
                "Shard or Replicate on its TP mesh."
            )
    if dp_mesh is None:
        raise ShardedModelError(
            f"Parameter '{name}' is already a DTensor on {tp_mesh} (tensor parallel), and "
            f"graphshard.shard() got no mesh: {ORDER}."
        )
    if tp_mesh.ndim != 1:
        raise ShardedModelError(
            f"Parameter '{name}' is a DTensor on the {tp_mesh.ndim}-D mesh {tp_mesh}; graphshard "
            "composes with 1-D tensor parallelism (parallelize_module on mesh['tp'])."
        )
    dp_names = dp_mesh.mesh_dim_names or ()
    tp_names = tp_mesh.mesh_dim_names or ()
    if not dp_names or not tp_names or set(dp_names) & set(tp_names):
        raise ShardedModelError(
            f"graphshard.shard() got the mesh {dp_mesh}, but the parameters are tensor parallel "
            f"on {tp_mesh}: the data-parallel mesh must be the named sub-mesh beside the TP "
            f"dimension, not one that contains it: {ORDER}."
        )
    try:
        spmd_mesh(dp_mesh, tp_mesh)
    except RuntimeError as err:
        raise ShardedModelError(
            f"graphshard.shard() got the mesh {dp_mesh}, which is not a sub-mesh of the mesh "
            f"the tensor-parallel parameters live on ({tp_mesh}; {err}): {ORDER}."
        ) from err
    return tp_mesh


@functools.lru_cache(maxsize=8)
def spmd_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The (dp..., tp) mesh that both meshes are slices of (RuntimeError if there is none);
    one object per pair. Real rank arithmetic also when tracing under fake tensors."""
    with unset_fake_temporarily():
        return DeviceMesh._concatenate([dp_mesh, tp_mesh])


def tp_parameter(
    p: torch.Tensor, dp_mesh: DeviceMesh, dp_places: tuple, rank: int, tp_mesh: DeviceMesh
) -> tuple[nn.Parameter, TPLayout | None]:
    """``p``'s TP piece split on dim 0 across the last (shard) dimension of ``dp_mesh``,
    ``rank`` being this rank's index there: a DTensor on the (dp..., tp) mesh, and the layout
    that re-wraps the gathered piece as ``p``. ``dp_places`` are a plain parameter's
    placements on ``dp_mesh``; where TP shards dim 0 too, the dp shard is strided.

    A plain parameter of a TP model (an embedding or a norm the plan leaves alone) is whole on
    every tp rank: it becomes ``Replicate()`` on tp, so that every parameter lives on the one
    (dp..., tp) mesh (``clip_grad_norm_`` stacks their norms), and it is read as the plain
    gathered tensor (layout None), as the plan left it."""
    is_tp = isinstance(p, DTensor)
    tp_places, local_tp = (tuple(p.placements), p.to_local()) if is_tp else ((Replicate(),), p)
    layout = Dim0Layout(local_tp.shape, dp_mesh.size(dp_mesh.ndim - 1))
    local = layout.local(local_tp.detach(), rank).clone()
    if any(isinstance(q, Shard) and q.dim == 0 for q in tp_places):
        dp_places = (*dp_places[:-1], _StridedShard(0, split_factor=tp_mesh.size()))
    stride = p.stride() if is_tp else torch.empty(p.shape, device="meta").stride()
    dtensor = DTensor.from_local(local, spmd_mesh(dp_mesh, tp_mesh), (*dp_places, *tp_places),
                                 run_check=False, shape=p.shape, stride=stride)
    param = nn.Parameter(dtensor, requires_grad=p.requires_grad)
    return param, TPLayout(tp_mesh, tp_places, p.shape, stride) if is_tp else None


def _sharded_part(module: nn.Module) -> str | None:
    for name, sub in module.named_modules():
        if sub.__dict__.get("_graphshard_specs"):
            return name or "<root>"
    return None


def _refusing(apply: Any) -> Any:
    @functools.wraps(apply)
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sharded = _sharded_part(module)
        if sharded is not None:
            raise ShardedModelError(
                f"{type(self).__name__} applied to a module already sharded by graphshard "
                f"('{sharded}' holds graphshard shards): {ORDER}. Build the model again (or "
                "on the meta device) and parallelize it before graphshard.shard()."
            )
        return apply(self, module, device_mesh)

    _apply._graphshard_refusing = True
    return _apply


def refuse_tp_after_shard() -> None:
    """Make torch's parallel styles (``ColwiseParallel``, ``RowwiseParallel``, ...) refuse a
    module that graphshard has sharded, naming the right order; torch's own error would be a
    mesh mismatch, or none at all for styles that only add hooks. Idempotent; called by
    :func:`graphshard.shard`, so importing graphshard alone changes nothing in torch."""
    from torch.distributed.tensor.parallel.style import ParallelStyle

    pending = list(ParallelStyle.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        apply = cls.__dict__.get("_apply")
        if apply is not None and not getattr(apply, "_graphshard_refusing", False):
            cls._apply = _refusing(apply)
