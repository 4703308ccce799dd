"""State dicts of a sharded model: full tensors for export, DTensors for sharded checkpoints.

Two views of the same sharded parameters:

- *full*: plain tensors of the unsharded shapes, keyed like the plain model's ``state_dict()``
  (:func:`full_state_dict`, :func:`load_full_state_dict`): for export to a single-device
  model and back, ``torch.save`` files, Hugging Face-style weights.
- *sharded*: every parameter as a ``DTensor`` placed ``Shard(0)`` on the sharding mesh with
  the global (unpadded) shape (:func:`sharded_state_dict`, :func:`sharded_optim_state_dict`).
  Each rank's local tensor is its shard with the padding rows cut off, which is exactly the
  ``torch.chunk`` layout DTensor uses, so ``torch.distributed.checkpoint`` writes each rank's
  rows once and can load them back at any world size. They live in
  :mod:`graphshard.sharded_state`; this module holds the full view and the layout helpers
  both share. :mod:`graphshard.checkpoint` builds
  atomic, resumable checkpoints on top of these.

Parameters of 0 dimensions have no dim 0 to split: rank 0 of the shard group holds the value,
and the sharded view is a ``Replicate()`` DTensor whose value is broadcast from that rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from graphshard.ops import gather_full
from graphshard.sharding import ShardedParam, ShardState, shard_state
from passes.markers import shard_rows

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "full_state_dict",
    "load_full_state_dict",
    "StateDictMismatchError",
]


class StateDictMismatchError(ValueError):
    """A state dict or checkpoint does not fit the model: the message lists every key."""


# --------------------------------------------------------------------------- layout helpers


def _root(module: nn.Module) -> nn.Module:
    return getattr(module, "_orig_mod", module)


def _dim0(full_shape: torch.Size) -> int:
    return full_shape[0] if len(full_shape) else 1


def valid_rows(full_shape: torch.Size, world_size: int, rank: int) -> int:
    """Rows of the shard of ``rank`` that hold data (the rest are padding)."""
    rows = shard_rows(full_shape, world_size)
    return max(0, min(rows, _dim0(full_shape) - rank * rows))


def local_slice(full: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """The rows of ``full`` that ``rank`` holds, without padding (a view)."""
    rows = shard_rows(full.shape, world_size)
    flat = full.reshape(1) if full.dim() == 0 else full
    return flat[rank * rows : rank * rows + valid_rows(full.shape, world_size, rank)]


def _shard_coords(state: ShardState) -> tuple[int, int]:
    """(rank, size) of this process along the dimension parameters are split on."""
    return state.rank, state.world_size


def _device_type(state: ShardState) -> str:
    for entry in state.params:
        return entry.shard.device.type
    return "cpu"


def sharding_mesh(state: ShardState):
    """The DeviceMesh the sharded DTensors live on.

    ``state.mesh`` when the sharding has one (1-D: shard; 2-D: replicate x shard), else a
    1-D mesh over ``state.group``, made once and kept on the state.
    """
    mesh = getattr(state, "mesh", None)
    if mesh is not None:
        return mesh
    mesh = getattr(state, "_graphshard_dcp_mesh", None)
    if mesh is None:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(state.group, _device_type(state))
        state._graphshard_dcp_mesh = mesh
    return mesh


def is_dtensor(value: Any) -> bool:
    """``is_dtensor(value)``, without importing DTensor before it is needed."""
    if not isinstance(value, torch.Tensor) or type(value) is torch.Tensor:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _placements(mesh, sharded: bool) -> tuple:
    from torch.distributed.tensor import Replicate, Shard

    inner = Shard(0) if sharded else Replicate()
    return (*([Replicate()] * (mesh.ndim - 1)), inner)


def _dtensor(local: torch.Tensor, full_shape: torch.Size, state: ShardState) -> DTensor:
    from torch.distributed.tensor import DTensor

    mesh = sharding_mesh(state)
    shape = torch.Size(full_shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, mesh, _placements(mesh, len(shape) > 0), run_check=False, shape=shape,
        stride=stride,
    )


def _scalar_values(state: ShardState, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Values of 0-D parameters (or their state), held in row 0 of shard-rank 0: broadcast."""
    if not tensors:
        return []
    flat = torch.cat([t.detach().reshape(-1)[:1].to(torch.float64) for t in tensors])
    if state.world_size > 1:
        src = dist.get_global_rank(state.group, 0)
        dist.broadcast(flat, src=src, group=state.group)
    return [flat[i].to(t.dtype).reshape(()) for i, t in enumerate(tensors)]


def _to_dtensors(state: ShardState, items: list[tuple[torch.Tensor, torch.Size]]) -> list:
    """Each padded local shard (with the full shape of its parameter) as a DTensor."""
    rank, world = _shard_coords(state)
    scalars = [t for t, shape in items if len(shape) == 0]
    values = iter(_scalar_values(state, scalars))
    out = []
    for local, shape in items:
        if len(shape) == 0:
            out.append(_dtensor(next(values), shape, state))
        else:
            out.append(_dtensor(local.detach()[: valid_rows(shape, world, rank)], shape, state))
    return out


def _copy_into_shard(shard: torch.Tensor, local: torch.Tensor, full_shape, state) -> None:
    """Write the unpadded rows ``local`` (or a 0-D value) into a padded shard; zero the pad."""
    rank, world = _shard_coords(state)
    n = valid_rows(full_shape, world, rank)
    with torch.no_grad():
        if len(full_shape) == 0:
            shard.zero_()
            if rank == 0:
                shard.reshape(-1)[0] = local.reshape(())
            return
        shard[:n].copy_(local.reshape(shard[:n].shape))
        shard[n:].zero_()


def _local_of(value: Any) -> torch.Tensor:
    return value.to_local() if is_dtensor(value) else value


# --------------------------------------------------------------------------- mismatch checks


def _describe(problems: dict[str, list[str]], what: str, hint: str) -> str:
    lines = [f"{what} does not fit the model:"]
    for title, items in problems.items():
        if items:
            shown = items[:20]
            more = f" ... and {len(items) - 20} more" if len(items) > 20 else ""
            lines.append(f"  {title} ({len(items)}): " + ", ".join(shown) + more)
    lines.append(hint)
    return "\n".join(lines)


def check_keys_and_shapes(
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[int, ...]],
    *,
    what: str,
    hint: str,
    strict: bool = True,
) -> None:
    """Raise :class:`StateDictMismatchError` naming missing, unexpected and mis-shaped keys."""
    missing = [k for k in expected if k not in found] if strict else []
    unexpected = [k for k in found if k not in expected]
    shapes = [
        f"{k}: {what.split()[0]} {tuple(found[k])} vs model {tuple(v)}"
        for k, v in expected.items()
        if k in found and tuple(found[k]) != tuple(v)
    ]
    if missing or unexpected or shapes:
        problems = {
            "missing from the " + what.split()[0]: missing,
            "not in the model": unexpected,
            "shape differs": shapes,
        }
        raise StateDictMismatchError(_describe(problems, what, hint))


def _param_names(state: ShardState) -> dict[str, ShardedParam]:
    return {name: entry for entry in state.params for name in entry.names}


def _buffers(root: nn.Module, state: ShardState) -> dict[str, torch.Tensor]:
    """Persistent buffers (and anything else in ``state_dict()`` that is not a parameter)."""
    names = _param_names(state)
    return {
        k: v for k, v in root.state_dict(keep_vars=True).items()
        if k not in names and isinstance(v, torch.Tensor)
    }


# --------------------------------------------------------------------------- full state dict


@torch.no_grad()
def _gather_full(entry: ShardedParam, state: ShardState) -> torch.Tensor:
    return gather_full(entry.shard.detach(), entry.full_shape, state.world_size, state.group_name)


@torch.no_grad()
def full_state_dict(
    module: nn.Module, *, rank0_only: bool = False, cpu_offload: bool = False
) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors keyed like ``state_dict()`` of the plain model.

    A collective: every rank must call it. Tied parameters appear under each of their names,
    buffers as they are.

    Args:
        module: a model passed to :func:`graphshard.shard` (or its ``torch.compile`` wrapper).
        rank0_only: only rank 0 of the group returns the tensors; the other ranks take part
            in the gathers and return an empty dict.
        cpu_offload: move every tensor to the CPU as soon as it is gathered (with
            ``rank0_only``, a GPU run then never holds more than one full parameter).

    Returns:
        ``{name: tensor}``, loadable by the unsharded model's ``load_state_dict``.
    """
    root = _root(module)
    state = shard_state(root)
    keep = not rank0_only or state.rank == 0
    full_of: dict[str, torch.Tensor] = {}
    for entry in state.params:
        full = _gather_full(entry, state)
        if not keep:
            continue
        if cpu_offload:
            full = full.cpu()
        for name in entry.names:
            full_of[name] = full
    if not keep:
        return {}
    out = {}
    for key, value in root.state_dict().items():
        value = full_of.get(key, value)
        out[key] = value.cpu() if cpu_offload else value
    return out


def _check_full(root, state, sd: Mapping[str, Any], strict: bool) -> None:
    expected = {k: tuple(e.full_shape) for k, e in _param_names(state).items()}
    expected.update({k: tuple(v.shape) for k, v in _buffers(root, state).items()})
    # non-tensor entries (a module's ``get_extra_state()``) are not graphshard's to load
    found = {k: tuple(v.shape) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    if any(is_dtensor(v) for v in sd.values()):
        raise StateDictMismatchError(
            "load_full_state_dict() got DTensors: that is a sharded state dict; load it with "
            "graphshard.load_sharded_state_dict(model, state_dict)."
        )
    check_keys_and_shapes(
        expected, found, what="state dict", strict=strict,
        hint="Load a state dict of the same (unsharded) model, e.g. one from "
        "graphshard.full_state_dict() or the plain model's state_dict(); strict=False "
        "allows a subset of the keys.",
    )


def _broadcast_state_dict(sd: Mapping[str, Any] | None, state: ShardState, root) -> dict:
    """Rank 0's tensors on every rank of the default group, one broadcast per tensor."""
    rank = dist.get_rank()
    header: list[Any] = [None]
    if rank == 0:
        header = [[(k, tuple(v.shape), v.dtype) for k, v in sd.items()]]
    dist.broadcast_object_list(header, src=0)
    device = next((e.shard.device for e in state.params), torch.device("cpu"))
    out = {}
    for key, shape, dtype in header[0]:
        tensor = sd[key].to(device) if rank == 0 else torch.empty(shape, dtype=dtype,
                                                                  device=device)
        dist.broadcast(tensor, src=0)
        out[key] = tensor
    return out


@torch.no_grad()
def load_full_state_dict(
    module: nn.Module,
    state_dict: Mapping[str, torch.Tensor] | None,
    *,
    strict: bool = True,
    from_rank0: bool = False,
) -> None:
    """Load full (unsharded) tensors into a sharded model: each rank keeps its own rows.

    The inverse of :func:`full_state_dict`; takes what the plain model's ``state_dict()``
    holds (a ``torch.save`` file, exported weights). Keys and shapes are checked before
    anything is written: a mismatch raises :class:`StateDictMismatchError` naming the keys.

    Args:
        module: a model passed to :func:`graphshard.shard` (or its compiled wrapper).
        state_dict: ``{name: full tensor}``; tied parameters may appear under any one of
            their names. With ``from_rank0`` only rank 0's is read (others may pass None).
        strict: every parameter and buffer must be present (False: load a subset).
        from_rank0: rank 0 alone holds the state dict; its tensors are broadcast (a
            collective: every rank of the default group must call).
    """
    root = _root(module)
    state = shard_state(root)
    if from_rank0:
        error: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                _check_full(root, state, state_dict or {}, strict)
            except StateDictMismatchError as exc:
                error = [str(exc)]
        dist.broadcast_object_list(error, src=0)
        if error[0] is not None:
            raise StateDictMismatchError(f"(checked on rank 0) {error[0]}")
        state_dict = _broadcast_state_dict(state_dict, state, root)
    else:
        _check_full(root, state, state_dict or {}, strict)
    state_dict = state_dict or {}
    rank, world = _shard_coords(state)
    for entry in state.params:
        key = next((n for n in entry.names if n in state_dict), None)
        if key is None:
            continue
        full = state_dict[key].to(device=entry.shard.device, dtype=entry.shard.dtype)
        _copy_into_shard(entry.shard, local_slice(full, world, rank), entry.full_shape, state)
    for key, buf in _buffers(root, state).items():
        if key in state_dict:
            buf.copy_(state_dict[key])
