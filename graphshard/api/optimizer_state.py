"""The optimizer state of a 0-D parameter, loaded from a full state dict, made a DTensor again.

A 0-D parameter is a replicated DTensor (``Replicate()``), and a step makes its state
(``exp_avg``, ``variance``, ...) replicated 0-D DTensors too. torch's
``set_optimizer_state_dict(..., StateDictOptions(full_state_dict=True))`` leaves 0-D entries
of the full state dict as they are, plain tensors (it takes them for scalars, like ``step``).
The next step then mixes a plain state with the DTensor gradient: the single-tensor path,
torch's default on the CPU, fails with a bare ``AssertionError`` from DTensor's dispatch
(``exp_avg.lerp_(grad)``; torch 2.13).

A global optimizer step pre-hook (installed by ``shard()``) gives each optimizer it sees a
``load_state_dict`` post-hook once (``set_optimizer_state_dict`` steps the optimizer before it
loads, to make its state). After a load, that hook wraps every plain 0-D tensor in the state of
a replicated 0-D DTensor parameter, ``step`` aside, as a DTensor placed like the parameter.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["keep_scalar_states_replicated"]

_ATTR = "_graphshard_scalar_state_hook"
_lock = threading.Lock()
_hooks: list[Any] = []


def keep_scalar_states_replicated() -> None:
    """Install the step pre-hook of this module (module docstring). Idempotent."""
    with _lock:
        if not _hooks:
            _hooks.append(register_optimizer_step_pre_hook(_give_load_hook))


def _give_load_hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if _ATTR not in optimizer.__dict__ and not torch.compiler.is_compiling():
        optimizer.__dict__[_ATTR] = optimizer.register_load_state_dict_post_hook(
            replicate_scalar_states)


def replicate_scalar_states(optimizer: torch.optim.Optimizer) -> None:
    """Each plain 0-D tensor in the state of a 0-D DTensor parameter of ``optimizer`` (its
    ``step`` aside) becomes a DTensor with the parameter's mesh and placements."""
    for param, state in optimizer.state.items():
        if not isinstance(param, DTensor) or param.dim() != 0:
            continue
        for key, value in state.items():
            if key != "step" and type(value) is torch.Tensor and value.dim() == 0:
                state[key] = DTensor.from_local(value, param.device_mesh, param.placements,
                                                run_check=False)
