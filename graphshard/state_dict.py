"""State dicts of a sharded model."""

from __future__ import annotations

import torch
from torch import nn

from graphshard.sharding import shard_state
from passes.markers import UNSHARD

__all__ = ["full_state_dict"]


@torch.no_grad()
def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors on every rank, keyed like ``state_dict()`` of the plain model.

    A collective: every rank must call it. Tied parameters appear under each of their names,
    buffers as they are.
    """
    root = getattr(module, "_orig_mod", module)
    state = shard_state(root)
    full_of = {}
    for entry in state.params:
        full = UNSHARD(
            entry.shard.detach(), list(entry.full_shape), entry.bucket, True, True,
            entry.names[0], state.world_size, state.group_name,
        )
        for name in entry.names:
            full_of[name] = full
    out = {}
    for key, value in root.state_dict().items():
        out[key] = full_of.get(key, value)
    return out
