"""State dicts of a sharded model: full tensors for export, DTensors for sharded checkpoints.

Two views of the same sharded parameters:

- *full*: plain tensors of the unsharded shapes, keyed like the plain model's ``state_dict()``
  (:func:`full_state_dict`, :func:`load_full_state_dict`): for export to a single-device
  model and back, ``torch.save`` files, Hugging Face-style weights.
- *sharded*: every parameter as a ``DTensor`` placed ``Shard(0)`` on the sharding mesh with
  the global (unpadded) shape (:func:`sharded_state_dict`, :func:`sharded_optim_state_dict`).
  Each rank's local tensor is its shard with the padding rows cut off, which is exactly the
  ``torch.chunk`` layout DTensor uses, so ``torch.distributed.checkpoint`` writes each rank's
  rows once and can load them back at any world size. :mod:`graphshard.checkpoint` builds
  atomic, resumable checkpoints on top of these.

Parameters of 0 dimensions have no dim 0 to split: rank 0 of the shard group holds the value,
and the sharded view is a ``Replicate()`` DTensor whose value is broadcast from that rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from graphshard.sharding import ShardedParam, ShardState, shard_state
from passes.markers import shard_rows

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "full_state_dict",
    "load_full_state_dict",
    "sharded_state_dict",
    "load_sharded_state_dict",
    "sharded_optim_state_dict",
    "load_sharded_optim_state_dict",
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
    shard = entry.shard.detach()
    if state.world_size == 1:
        full = shard
    else:
        out = shard.new_empty((shard.shape[0] * state.world_size, *shard.shape[1:]))
        dist.all_gather_into_tensor(out, shard.contiguous(), group=state.group)
        full = out
    return full.narrow(0, 0, _dim0(entry.full_shape)).reshape(entry.full_shape).clone()


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


# --------------------------------------------------------------------------- sharded: model


def sharded_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters as ``DTensor`` (``Shard(0)`` on the sharding mesh, padding hidden), buffers
    as plain tensors, keyed like the plain model's ``state_dict()``.

    The DTensors are views of the live shards (no copy), so ``torch.distributed.checkpoint``
    saves each rank's rows once: ``dcp.save({"model": sharded_state_dict(model)}, ...)``.
    A collective only when the model has 0-D parameters (their value is broadcast).
    """
    root = _root(module)
    state = shard_state(root)
    dtensors = _to_dtensors(state, [(e.shard, e.full_shape) for e in state.params])
    by_name = {n: d for e, d in zip(state.params, dtensors, strict=True) for n in e.names}
    out: dict[str, torch.Tensor] = {}
    for key, value in root.state_dict().items():
        out[key] = by_name.get(key, value)
    return out


def load_sharded_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a state dict of the form :func:`sharded_state_dict` returns (DTensors for
    parameters, at any world size that produced the same global shapes), after checking
    keys and shapes (:class:`StateDictMismatchError`)."""
    root = _root(module)
    state = shard_state(root)
    expected = {k: tuple(e.full_shape) for k, e in _param_names(state).items()}
    expected.update({k: tuple(v.shape) for k, v in _buffers(root, state).items()})
    check_keys_and_shapes(
        expected, {k: tuple(v.shape) for k, v in state_dict.items()}, what="state dict",
        hint="Load a sharded state dict of the same model (graphshard.sharded_state_dict).",
    )
    rank, world = _shard_coords(state)
    for entry in state.params:
        value = state_dict[entry.names[0]]
        if is_dtensor(value):
            value = _dtensor_local_rows(value, entry.full_shape, state)
        else:
            value = local_slice(value, world, rank)
        _copy_into_shard(entry.shard, value, entry.full_shape, state)
    with torch.no_grad():
        for key, buf in _buffers(root, state).items():
            buf.copy_(_local_of(state_dict[key]))


def _dtensor_local_rows(value: DTensor, full_shape, state: ShardState) -> torch.Tensor:
    """This rank's rows of ``value``: its local tensor when laid out like ours, else
    redistributed through the full tensor."""
    rank, world = _shard_coords(state)
    mesh = sharding_mesh(state)
    if value.device_mesh == mesh and tuple(value.placements) == _placements(
        mesh, len(full_shape) > 0
    ):
        return value.to_local()
    return local_slice(value.full_tensor(), world, rank)


# --------------------------------------------------------------------------- sharded: optimizer


@dataclass
class _OptimParam:
    """One parameter an optimizer steps: its name and sharding entry."""

    fqn: str
    entry: ShardedParam


def optimizer_params(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[_OptimParam]:
    """The optimizer's parameters in ``param_groups`` order, each with its model name.

    Raises a ValueError naming the first parameter that is not a shard of ``module``.
    """
    state = shard_state(_root(module))
    of_shard = {id(e.shard): e for e in state.params}
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            entry = of_shard.get(id(p))
            if entry is None:
                replaced = getattr(p, "_graphshard_replaced", None)
                why = (
                    f"it is the unsharded parameter {replaced!r} from before graphshard.shard(): "
                    "build the optimizer after sharding, on model.parameters()"
                    if replaced
                    else "it is not a parameter of this sharded model"
                )
                raise ValueError(
                    f"Optimizer param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) "
                    f"cannot be checkpointed with this model: {why}."
                )
            out.append(_OptimParam(entry.names[0], entry))
    return out


def _state_kind(value: Any, entry: ShardedParam) -> str:
    """``sharded`` (shaped like the shard), ``scalar`` (a 0-D tensor) or ``object``."""
    if isinstance(value, torch.Tensor):
        if value.shape == entry.shard.shape:
            return "sharded"
        if value.dim() == 0:
            return "scalar"
        raise NotImplementedError(
            f"Optimizer state of {entry.names[0]!r} holds a tensor of shape "
            f"{tuple(value.shape)}, neither the shard's {tuple(entry.shard.shape)} nor a "
            "scalar: graphshard checkpoints support element-wise optimizers (SGD, Adam, "
            "AdamW, RMSprop, Adagrad, ...) whose state is shaped like the parameter."
        )
    return "object"


def sharded_optim_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, per-parameter tensors as DTensors.

    ``{"state": {name: {key: DTensor | tensor | object}}, "param_groups": [{..., "params":
    [names]}]}``: state shaped like the shard becomes a ``Shard(0)`` DTensor with the
    parameter's full shape (padding hidden), scalars (``step``) stay plain. This is the
    layout of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``.
    A collective only when the model has 0-D parameters.
    """
    state = shard_state(_root(module))
    params = optimizer_params(module, optimizer)
    raw = optimizer.state_dict()
    items, where = [], []
    out_state: dict[str, dict[str, Any]] = {}
    for index, op in enumerate(params):
        per = raw["state"].get(index)
        if per is None:
            continue
        out_state[op.fqn] = {}
        for key, value in per.items():
            if _state_kind(value, op.entry) == "sharded":
                items.append((value, op.entry.full_shape))
                where.append((op.fqn, key))
            else:
                out_state[op.fqn][key] = value
    for (fqn, key), dt in zip(where, _to_dtensors(state, items), strict=True):
        out_state[fqn][key] = dt
    groups = []
    for group in raw["param_groups"]:
        groups.append({**group, "params": [params[i].fqn for i in group["params"]]})
    return {"state": out_state, "param_groups": groups}


def load_sharded_optim_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer, osd: Mapping[str, Any]
) -> None:
    """Load what :func:`sharded_optim_state_dict` returned (possibly saved at another world
    size) into ``optimizer``, built on ``module.parameters()`` after sharding."""
    state = shard_state(_root(module))
    params = optimizer_params(module, optimizer)
    index_of = {op.fqn: i for i, op in enumerate(params)}
    check_param_groups(
        live_param_groups(optimizer, params), [g["params"] for g in osd["param_groups"]]
    )
    rank, world = _shard_coords(state)
    new_state: dict[int, dict[str, Any]] = {}
    for fqn, per in osd["state"].items():
        if fqn not in index_of:
            raise StateDictMismatchError(
                f"Optimizer state for {fqn!r}, which is not a parameter of the optimizer."
            )
        entry = params[index_of[fqn]].entry
        out = {}
        for key, value in per.items():
            if is_dtensor(value) or (
                isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(entry.full_shape)
                and value.dim() > 0
            ):
                if is_dtensor(value):
                    rows = _dtensor_local_rows(value, entry.full_shape, state)
                else:
                    rows = local_slice(value, world, rank)
                shard = torch.zeros_like(entry.shard, dtype=rows.dtype)
                _copy_into_shard(shard, rows, entry.full_shape, state)
                out[key] = shard
            else:
                out[key] = value
        new_state[index_of[fqn]] = out
    groups = []
    offset = 0
    for saved, live in zip(osd["param_groups"], optimizer.param_groups, strict=True):
        ids = list(range(offset, offset + len(live["params"])))
        offset += len(live["params"])
        groups.append({**saved, "params": ids})
    optimizer.load_state_dict({"state": new_state, "param_groups": groups})


def live_param_groups(
    optimizer: torch.optim.Optimizer, params: list[_OptimParam]
) -> list[list[str]]:
    """The parameter names of each of the optimizer's groups."""
    groups, start = [], 0
    for group in optimizer.param_groups:
        groups.append([op.fqn for op in params[start : start + len(group["params"])]])
        start += len(group["params"])
    return groups


def check_param_groups(live: list[list[str]], saved: list[list[str]]) -> None:
    """Raise :class:`StateDictMismatchError` unless the optimizer's groups hold the same
    parameter names, in the same order, as the saved ones."""
    if [list(g) for g in live] == [list(g) for g in saved]:
        return
    problems = []
    if len(live) != len(saved):
        problems.append(f"{len(saved)} param group(s) saved, the optimizer has {len(live)}")
    for i, (a, b) in enumerate(zip(live, saved, strict=False)):
        if a != b:
            gone = [n for n in b if n not in a]
            new = [n for n in a if n not in b]
            detail = f"saved only: {gone[:10]}; optimizer only: {new[:10]}" if gone or new \
                else "same names, different order"
            problems.append(f"param_groups[{i}]: {detail}")
    raise StateDictMismatchError(
        "The optimizer's parameters do not match the saved optimizer state: "
        + "; ".join(problems)
        + ". Build the optimizer on the same parameters, in the same groups, as when saving."
    )
