"""Sharded state dicts: every parameter (and optimizer state) as a DTensor, for DCP.

Each parameter becomes a ``DTensor`` with its global (unpadded) shape, placed ``Shard(0)``
on the sharding mesh (``(Replicate(), Shard(0))`` on an HSDP mesh); the local tensor is the
rank's shard with the padding rows cut off, the ``torch.chunk`` layout DTensor expects. So
``torch.distributed.checkpoint`` writes each rank's rows once and loads them at any world
size. Loaders check every key and shape before writing anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from graphshard.sharding import ShardedParam, ShardState, shard_state
from graphshard.state_dict import (
    StateDictMismatchError,
    _buffers,
    _copy_into_shard,
    _local_of,
    _param_names,
    _placements,
    _root,
    _shard_coords,
    _to_dtensors,
    check_keys_and_shapes,
    is_dtensor,
    local_slice,
    sharding_mesh,
)

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "sharded_state_dict",
    "load_sharded_state_dict",
    "sharded_optim_state_dict",
    "load_sharded_optim_state_dict",
]


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
