"""``graphshard.clip_grad_norm_``: torch's ``clip_grad_norm_``, its result bit for bit, with the
per-gradient work done on the shards' local tensors.

``torch.nn.utils.clip_grad_norm_`` works on graphshard's DTensor gradients unchanged, and its
norms already skip DTensor's dispatch (:mod:`graphshard.api.grad_norm_ops`). Its other steps
still pay DTensor's dispatch per gradient or per scalar: each gradient's norm wrapped into a
DTensor, the norms stacked and scaled through DTensor's dispatch, three ops on the total,
and the gradients scaled. At llama-1b's 147 gradients on this machine's CPU (world 1, in a
training loop) that made a clip 1.9 ms against 1.0 ms on plain tensors (``docs/benchmark-log.md``).

This function takes the same arguments and gives the same answer, the total norm as torch
returns it (a replicated DTensor) and the same scaled gradients, bit for bit, but runs
torch's own steps on the local tensors where that is exact: when every gradient is a DTensor
on one mesh with one placement, none partial, and torch would take the norms with
``_foreach_norm`` (``foreach`` not False). It groups the local gradients by device and dtype
as torch does, takes each group's norms, stacks them, and hands that one vector to DTensor as
the partial norms DTensor's own ``_foreach_norm`` would have made (placements asked of
DTensor once per layout); the total is then DTensor's ``vector_norm`` of it, with its one
reduction across the ranks. The scale factor and the scaling run on the local values of that
replicated total. Anything else goes to ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

from graphshard.api.dtensor_handlers import same_mesh
from graphshard.errors import GraphshardRuntimeError

__all__ = ["clip_grad_norm_"]

# (id of the mesh, the gradients' placements, norm type) -> (the mesh, kept alive; the
# placements of DTensor's stacked norms of such gradients)
_NORM_PLACEMENTS: dict[tuple, tuple[Any, tuple]] = {}
_NORM_PLACEMENTS_MAX = 64


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """Clip the gradients of ``parameters`` to the global norm ``max_norm``, in place, and
    return their total norm: ``torch.nn.utils.clip_grad_norm_`` with the same arguments and
    result, bit for bit, faster on sharded parameters (module docstring).

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is clipped.
        max_norm: the largest total norm the gradients keep.
        norm_type: the p of the p-norm (``inf`` for the largest absolute value).
        error_if_nonfinite: raise if the total norm is nan or infinite.
        foreach: torch's choice of implementation (None: its default).

    Returns:
        The total norm of the gradients, as torch returns it (a replicated DTensor for
        sharded gradients).
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    layout = (None if torch.compiler.is_compiling()  # traced: torch's code as it is
              else _local_layout(grads, float(norm_type), foreach))
    if layout is None:  # an emptied generator stays one: torch warns about it
        return torch.nn.utils.clip_grad_norm_(params or parameters, max_norm, norm_type,
                                              error_if_nonfinite, foreach)
    norm_placements, groups = layout
    with torch.no_grad():  # as torch's: the gradients are scaled in place, untracked
        return _clip_locally(grads[0], groups, float(max_norm), float(norm_type),
                             norm_placements, error_if_nonfinite)


def _clip_locally(first: DTensor, groups: list[tuple[torch.device, list[torch.Tensor]]],
                  max_norm: float, norm_type: float, norm_placements: tuple,
                  error_if_nonfinite: bool) -> torch.Tensor:
    """torch's steps on the local gradients ``groups`` (by device and dtype, in torch's
    order), whose first gradient is ``first`` (module docstring)."""
    norms: list[torch.Tensor] = []
    for _, device_locals in groups:
        norms.extend(torch._foreach_norm(device_locals, norm_type))
    first_device = first.device
    stacked = torch.stack([norm.to(first_device) for norm in norms])
    mesh = first._spec.mesh
    partial = DTensor.from_local(stacked, mesh, norm_placements, run_check=False,
                                 shape=stacked.shape, stride=stacked.stride())
    total = torch.linalg.vector_norm(partial, norm_type)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise GraphshardRuntimeError(
            f"The total norm of order {norm_type} of the gradients is not finite, so they "
            "cannot be clipped. Pass error_if_nonfinite=False to scale them by it anyway.")
    coef = torch.clamp(max_norm / (total.to_local() + 1e-6), max=1.0)
    for device, device_locals in groups:
        torch._foreach_mul_(device_locals, coef.to(device))
    return total


def _local_layout(grads: list[Any], norm_type: float, foreach: bool | None,
                  ) -> tuple[tuple, list[tuple[torch.device, list[torch.Tensor]]]] | None:
    """Where the local path gives torch's answer (module docstring): the placements of the
    stacked norms of ``grads``, and their local tensors grouped by device and dtype as torch
    groups them. None where it may not."""
    if not grads or foreach is False or not all(type(g) is DTensor for g in grads):
        return None
    spec = grads[0]._spec
    mesh, placements = spec.mesh, spec.placements
    if any(p.is_partial() for p in placements) or not all(
            same_mesh(g._spec.mesh, mesh) and g._spec.placements == placements for g in grads):
        return None
    groups = []
    for (device, _), ([device_grads], _) in _group_tensors_by_device_and_dtype([grads]).items():
        if not ((foreach is None and _has_foreach_support(device_grads, device))
                or (foreach and _device_has_foreach_support(device))):
            return None  # torch would take the norms one by one
        groups.append((device, [g._local_tensor for g in device_grads]))
    key = (id(mesh), placements, norm_type)
    known = _NORM_PLACEMENTS.get(key)
    if known is None:
        # DTensor's own placements for such a norm, stacked: asked once per layout
        norms = torch._foreach_norm([grads[0]], norm_type)
        stacked = torch.stack([norms[0]])
        if len(_NORM_PLACEMENTS) >= _NORM_PLACEMENTS_MAX:
            _NORM_PLACEMENTS.clear()
        known = _NORM_PLACEMENTS[key] = (mesh, tuple(stacked.placements))
    return known[1], groups
