"""Trainable plain parameters that a sharded model gained after ``shard()``, refused at its
next eager forward.

A module assigned into a sharded model after ``shard()`` (``model.head = nn.Linear(...)``,
a new classifier for fine-tuning) brings plain parameters. graphshard never synchronises
their gradients, so each rank would train its own copy and the ranks' weights would drift
apart with no error. A compiled step refuses such parameters when it compiles
(:func:`graphshard.safety.guards.refuse_unsharded_parameters`); this is the eager side.

It walks the model's parameters only after a plain parameter was registered somewhere in
the process, on its own or inside a module (torch's global registration hooks count them;
a module whose parameters are DTensors already, such as a sharded layer that a
``ModuleList`` slice re-registers at every forward of a Hugging Face model, is not
counted), so a training loop that builds no new layers pays one integer comparison per
forward. The hooks count nothing while Dynamo traces, so that no guard reads the count,
and are installed at the first ``shard()`` (:func:`watch_registrations`), not at import.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from graphshard.errors import ShardedModelError
from graphshard.records import ShardState

__all__ = ["refuse_plain_parameters", "watch_registrations"]

_REGISTRATIONS = [0]  # modules and parameters registered anywhere in the process


def _count_module(parent: nn.Module, name: str, module: Any) -> None:
    if torch.compiler.is_compiling() or not isinstance(module, nn.Module):
        return
    first = next(module.parameters(), None)  # shard() makes all of a module's or none
    if first is not None and not isinstance(first, DTensor):
        _REGISTRATIONS[0] += 1


def _count_parameter(module: nn.Module, name: str, param: Any) -> None:
    if torch.compiler.is_compiling():
        return
    if param is not None and not isinstance(param, DTensor):
        _REGISTRATIONS[0] += 1


_HOOKS: list[Any] = []  # torch's handles, once installed


def watch_registrations() -> None:
    """Start counting registrations (once per process), when the first model is sharded: a
    process that imports graphshard and shards nothing keeps torch's registration path as
    it was."""
    if not _HOOKS:
        _HOOKS.append(nn.modules.module.register_module_module_registration_hook(_count_module))
        _HOOKS.append(
            nn.modules.module.register_module_parameter_registration_hook(_count_parameter))

_CHECKED_ATTR = "_graphshard_registrations_checked"


def refuse_plain_parameters(model: nn.Module, state: ShardState) -> None:
    """Raise if the sharded ``model`` holds a trainable parameter that is not a DTensor, on
    more than one rank; eager forwards only (a compile checks its own inputs)."""
    if torch.compiler.is_compiling():
        return
    count = _REGISTRATIONS[0]
    if model.__dict__.get(_CHECKED_ATTR) == count:
        return
    model.__dict__[_CHECKED_ATTR] = count
    ranks = state.world_size * state.replica_size
    if ranks <= 1:
        return
    # a tensor torch.func.functional_call put in a parameter's place is not a Parameter
    plain = [name for name, p in model.named_parameters()
             if p.requires_grad and isinstance(p, nn.Parameter) and not isinstance(p, DTensor)]
    if plain:
        model.__dict__[_CHECKED_ATTR] = None  # refused again at the next forward
        listed = ", ".join(repr(n) for n in plain[:6]) + (", ..." if len(plain) > 6 else "")
        raise ShardedModelError(
            f"This sharded model holds {len(plain)} trainable parameter(s) that are not "
            f"sharded: {listed}, added after graphshard.shard() (a module assigned into the "
            f"model afterwards). Their gradients would never be synchronised across the "
            f"{ranks} ranks, and the ranks' weights would drift apart. Change the model's "
            f"modules before graphshard.shard(model) (replace the layer, then shard), or "
            f"freeze those parameters (requires_grad_(False))."
        )
