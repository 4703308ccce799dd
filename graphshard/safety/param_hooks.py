"""Gradient hooks a user put on a parameter stay on it when graphshard or torch replaces it.

``shard()`` replaces every parameter by a new ``nn.Parameter`` wrapping a DTensor. Hooks
registered on the old one (``p.register_hook(fn)``, ``p.register_post_accumulate_grad_hook
(fn)``) would stay behind on a tensor no longer in the model, and the gradients they change
would come out silently unchanged. So they move to the sharded parameter
(:func:`carry_grad_hooks`), as they do when a sharded parameter is replaced later
(``load_state_dict(assign=True)``, :mod:`graphshard.safety.guards`).

``.to()`` and ``to_empty()`` give a DTensor parameter new contents with
``torch.utils.swap_tensors``: the Python object and its hook dicts stay, but autograd no
longer calls the hooks (torch 2.11, 2.13 and 2.14.1). :func:`reinstall_grad_hooks` hands
autograd the dicts again.

The new parameter takes the old one's hook dicts themselves, not copies: a handle the user
kept still removes its hook. A hook then sees what a hook on a sharded parameter sees:
the DTensor gradient after the reduce-scatter, which is the whole batch's gradient, as a
hook in one process sees it (``g * 2`` and ``g.clamp(...)`` give one process's values at
world 2). A post-accumulate-grad hook is handed the sharded parameter.
"""

from __future__ import annotations

import torch

__all__ = ["carry_grad_hooks", "reinstall_grad_hooks"]

# Tensor attributes that hold a tensor's gradient hooks; setting one hands autograd the
# dict's hooks (in C++), in place of any it had.
_HOOK_DICTS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def carry_grad_hooks(old: torch.Tensor, new: torch.Tensor) -> None:
    """Move ``old``'s gradient hooks to ``new``, its replacement in the model."""
    for attr in _HOOK_DICTS:
        hooks = getattr(old, attr, None)
        if hooks:
            setattr(new, attr, hooks)


def reinstall_grad_hooks(param: torch.Tensor) -> None:
    """Hand autograd ``param``'s own hook dicts again (after a swap of its contents)."""
    carry_grad_hooks(param, param)
