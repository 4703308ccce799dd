"""``shard()``: replace every parameter of a module by its rank's padded dim-0 shard.

The shard stays in ``module._parameters`` so ``parameters()``, optimizers and ``state_dict()``
see shards. Attribute access (``self.weight``) goes through a per-instance subclass whose
property returns ``unshard(shard)``: eagerly that all-gathers, and under ``torch.compile`` it
leaves a marker node that the passes lower into bucketed collectives.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from graphshard import ops  # noqa: F401  (registers the eager kernels)
from passes.markers import UNSHARD, shard_rows

__all__ = ["shard", "ShardedParam", "ShardState", "shard_state", "is_sharded"]

_STATE_ATTR = "_graphshard_state"


@dataclass
class ShardedParam:
    """What one sharded parameter is: its names, full shape and bucket."""

    names: list[str]
    full_shape: torch.Size
    bucket: int
    pinned: bool  # chosen by the user's ``buckets=[...]``: strategies keep it
    shard: nn.Parameter


@dataclass
class ShardState:
    """Per-root record of a sharding: the group and every sharded parameter."""

    group: dist.ProcessGroup
    world_size: int
    rank: int
    reshard_after_forward: bool
    params: list[ShardedParam] = field(default_factory=list)
    bucket_names: list[str] = field(default_factory=list)

    @property
    def group_name(self) -> str:
        """The name the functional collectives use for ``group``."""
        return self.group.group_name


def shard_state(module: nn.Module) -> ShardState:
    """The sharding record of a module passed to :func:`shard` (unwraps ``torch.compile``)."""
    module = getattr(module, "_orig_mod", module)
    state = getattr(module, _STATE_ATTR, None)
    if state is None:
        raise ValueError(
            f"{type(module).__name__} is not sharded: call graphshard.shard(module) first."
        )
    return state


def is_sharded(module: nn.Module) -> bool:
    """True when ``module`` (or the module it wraps) was passed to :func:`shard`."""
    return hasattr(getattr(module, "_orig_mod", module), _STATE_ATTR)


def _resolve_group(mesh) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "graphshard.shard() needs an initialised process group: call "
            "torch.distributed.init_process_group(...) first (torchrun sets the environment), "
            "or pass a 1-D DeviceMesh."
        )
    if mesh is None:
        return dist.group.WORLD
    ndim = getattr(mesh, "ndim", None)
    if ndim != 1:
        raise ValueError(
            f"graphshard.shard() takes a 1-D DeviceMesh, got a mesh with {ndim} dimensions "
            f"(shape {tuple(getattr(mesh, 'shape', ()))}). Pass a 1-D mesh such as "
            "init_device_mesh(device, (world_size,)), or mesh[...] of one dimension."
        )
    return mesh.get_group()


def _main_block_list(module: nn.Module) -> nn.Module | None:
    """The ModuleList/Sequential with most parameters and at least two children, if any."""
    best, best_numel = None, 0
    for sub in module.modules():
        if isinstance(sub, (nn.ModuleList, nn.Sequential)) and len(sub) >= 2:
            numel = sum(p.numel() for p in sub.parameters())
            if numel > best_numel:
                best, best_numel = sub, numel
    return best


def _module_groups(module: nn.Module, buckets) -> list[list[nn.Module]]:
    if buckets is None:
        blocks = _main_block_list(module)
        return [] if blocks is None else [[child] for child in blocks]
    groups = []
    for group in buckets:
        members = [group] if isinstance(group, nn.Module) else list(group)
        for m in members:
            if not isinstance(m, nn.Module):
                raise TypeError(
                    f"buckets must be a list of modules or lists of modules, got {type(m).__name__}"
                )
        groups.append(members)
    return groups


def _assign_buckets(
    module: nn.Module, groups: Sequence[Sequence[nn.Module]]
) -> tuple[dict[int, int], list[str]]:
    """Map id(param) -> bucket index: one bucket per group, then one for the rest."""
    names_of = {id(m): n or "<root>" for n, m in module.named_modules(remove_duplicate=False)}
    bucket_of: dict[int, int] = {}
    bucket_names: list[str] = []
    for index, group in enumerate(groups):
        labels = []
        for m in group:
            if id(m) not in names_of:
                raise ValueError(
                    f"buckets[{index}] holds a {type(m).__name__} that is not a submodule of "
                    f"the module being sharded."
                )
            labels.append(names_of[id(m)])
            for p in m.parameters():
                if bucket_of.setdefault(id(p), index) != index:
                    raise ValueError(
                        f"A parameter of {names_of[id(m)]} is in buckets[{bucket_of[id(p)]}] and "
                        f"buckets[{index}]: each parameter may belong to one bucket only."
                    )
        bucket_names.append("+".join(labels))
    rest = len(groups)
    bucket_names.append("<rest>")
    for p in module.parameters():
        bucket_of.setdefault(id(p), rest)
    return bucket_of, bucket_names


def _local_shard(full: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    rows = shard_rows(full.shape, world_size)
    flat = full.detach().reshape(full.shape[0] if full.dim() else 1, -1)
    padded = F.pad(flat, (0, 0, 0, rows * world_size - flat.shape[0]))
    local = padded[rank * rows : (rank + 1) * rows]
    return local.reshape((rows, *full.shape[1:])).clone()


def _sharded_class(cls: type, names: Iterable[str]) -> type:
    def make_property(pname: str) -> property:
        def get(self):
            spec = self._graphshard_specs[pname]
            return UNSHARD(self._parameters[pname], *spec)

        return property(get)

    attrs = {name: make_property(name) for name in names}
    attrs["_graphshard_original_class"] = cls
    return type(f"Sharded{cls.__name__}", (cls,), attrs)


def shard(
    module: nn.Module,
    mesh=None,
    *,
    buckets: Sequence[nn.Module | Sequence[nn.Module]] | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard every parameter of ``module`` in place across the ranks of ``mesh``.

    Args:
        module: any ``nn.Module`` with the same initial parameters on every rank.
        mesh: a 1-D ``DeviceMesh``, or None for the default process group.
        buckets: None for one bucket per block of the model's main ModuleList/Sequential plus
            one for the rest; or a list of module groups (a module or a list of modules, which
            need not be neighbours), each gathered as one bucket; what no group holds goes to
            a last bucket.
        reshard_after_forward: free unsharded parameters after forward and gather them again
            in backward (ZeRO-3, default); False keeps them for backward (ZeRO-2).

    Returns:
        ``module`` itself, whose ``parameters()`` are now the local shards.
    """
    if is_sharded(module):
        raise RuntimeError(
            f"{type(module).__name__} is already sharded: call graphshard.shard() once per "
            "model, on the root module."
        )
    group = _resolve_group(mesh)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    for name, p in module.named_parameters():
        if p.is_meta:
            raise ValueError(
                f"Parameter {name!r} is on the meta device: materialise it first (e.g. "
                "module.to_empty(device=...) then initialise it identically on every rank) "
                "before graphshard.shard()."
            )
    bucket_of, bucket_names = _assign_buckets(module, _module_groups(module, buckets))
    state = ShardState(group, world_size, rank, reshard_after_forward, bucket_names=bucket_names)

    by_param: dict[int, ShardedParam] = {}
    owners: dict[int, tuple[nn.Module, list[str]]] = {}
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        for pname, p in list(sub._parameters.items()):
            if p is None:
                continue
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            entry = by_param.get(id(p))
            if entry is None:
                local = _local_shard(p, world_size, rank).to(p.device)
                shard_param = nn.Parameter(local, requires_grad=p.requires_grad)
                bucket = bucket_of[id(p)]
                pinned = buckets is not None and bucket < len(bucket_names) - 1
                entry = ShardedParam([fqn], p.shape, bucket, pinned, shard_param)
                by_param[id(p)] = entry
                state.params.append(entry)
            elif fqn not in entry.names:
                entry.names.append(fqn)
            owners.setdefault(id(sub), (sub, []))[1].append(pname)

    for sub, pnames in owners.values():
        if getattr(sub, "_graphshard_specs", None) is not None:
            continue
        specs = {}
        for pname in dict.fromkeys(pnames):
            entry = by_param[id(sub._parameters[pname])]
            sub._parameters[pname] = entry.shard
            specs[pname] = (
                list(entry.full_shape),
                entry.bucket,
                entry.pinned,
                reshard_after_forward,
                entry.names[0],
                world_size,
                state.group_name,
            )
        sub._graphshard_specs = specs
        sub.__class__ = _sharded_class(type(sub), specs)
    setattr(module, _STATE_ATTR, state)
    return module
