"""Eager kernels and autograd for the marker ops.

The uncompiled sharded model runs these: ``unshard`` really all-gathers and unpads,
``reduce_grad`` pads and reduce-scatters with averaging. They are the numerical reference
for the compiled path, which replaces the markers with bucketed collectives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from passes.markers import REDUCE_GRAD, UNSHARD, UnshardArgs, shard_rows

_c10d = torch.ops._c10d_functional


def _unshard_eager(shard, full_shape, *rest):
    world_size, group_name = rest[-2:]
    if world_size == 1:
        return shard.reshape(full_shape).clone()
    gathered = _c10d.wait_tensor(
        _c10d.all_gather_into_tensor(shard.contiguous(), world_size, group_name)
    )
    dim0 = full_shape[0] if len(full_shape) else 1
    return gathered.narrow(0, 0, dim0).reshape(full_shape).clone()


def _reduce_grad_eager(grad, bucket, name, world_size, group_name):
    rows = shard_rows(grad.shape, world_size)
    flat = grad.reshape(grad.shape[0] if grad.dim() else 1, -1)
    padded = F.pad(flat, (0, 0, 0, rows * world_size - flat.shape[0]))
    if world_size == 1:
        out = padded.clone()
    else:
        out = _c10d.wait_tensor(
            _c10d.reduce_scatter_tensor(padded.contiguous(), "avg", world_size, group_name)
        )
    return out.reshape((rows, *grad.shape[1:]))


torch.library.register_kernel("graphshard::unshard", None, _unshard_eager)
torch.library.register_kernel("graphshard::reduce_grad", None, _reduce_grad_eager)


def _unshard_setup(ctx, inputs, output):
    ctx.marker = UnshardArgs(*inputs)


def _unshard_backward(ctx, grad):
    m = ctx.marker
    shard_grad = REDUCE_GRAD(grad, m.bucket, m.name, m.world_size, m.group_name)
    return (shard_grad,) + (None,) * (len(m) - 1)


torch.library.register_autograd(
    "graphshard::unshard", _unshard_backward, setup_context=_unshard_setup
)

__all__ = ["UNSHARD", "REDUCE_GRAD"]
