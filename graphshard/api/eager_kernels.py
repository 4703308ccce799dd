"""Eager kernels and autograd for the marker ops.

The uncompiled sharded model runs these: ``unshard`` casts, really all-gathers and unpads;
``reduce_grad`` pads, reduce-scatters with averaging and, on a 2-D mesh, all-reduces across
replicas. They are the numerical reference for the compiled path, which replaces the
markers with bucketed collectives doing the same arithmetic in the same order.

With CPU offload (``graphshard.CPUOffload``) ``unshard`` first copies the host shard to the
compute device (non-blocking: the shard is pinned and stays untouched until the optimizer
step), and ``reduce_grad`` copies the reduced gradient back into pinned host memory
(``graphshard::to_host``: full bandwidth, and blocking, so that it has arrived when autograd
accumulates it and the optimizer reads it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from graphshard.api import copy_streams  # noqa: F401  (the copies' kernels)
from graphshard.api.reduce_scatter import issue_reduce_scatter
from graphshard.errors import GraphshardRuntimeError
from graphshard.passes.host_copy import TO_HOST
from graphshard.passes.layout import (
    Dim0Layout,
    eager,
    full_from_gathered,
    gather_piece,
    local_from_reduced,
    rank_major,
    rows_held,
)
from graphshard.passes.markers import (
    REDUCE_GRAD,
    UNSHARD,
    GradSync,
    ReduceGradArgs,
    UnshardArgs,
    reduce_op,
    replica_divide_factor,
)
from graphshard.safety.gloo_gather import all_gather

_c10d = torch.ops._c10d_functional


def gather_full(local: torch.Tensor, layout: Dim0Layout, group_name: str) -> torch.Tensor:
    """The full tensor from every rank's local rows (a new tensor, padding cut off)."""
    piece = gather_piece(eager, local, layout, rows_held(local.shape))
    if layout.world == 1:
        return full_from_gathered(eager, piece, layout).clone()
    gathered = _c10d.wait_tensor(all_gather(piece, layout.world, group_name))
    return full_from_gathered(eager, gathered, layout)


def _unshard_eager(shard, full_shape, *args, **kwargs):
    m = UnshardArgs(shard, full_shape, *args, **kwargs)
    local = shard
    if m.compute_device:  # CPU offload: host shard -> device, then cast and gather there
        local = local.to(m.compute_device, non_blocking=True)
    if m.param_dtype is not None:
        local = local.to(m.param_dtype)
    return gather_full(local, Dim0Layout(full_shape, m.world_size), m.group_name)


def issue_reduction(tensor: torch.Tensor, kind: str, group_size: int, group_name: str,
                    divide_factor: float | None = None) -> Callable[[], torch.Tensor]:
    """Issue the reduction ``reduce_grad`` makes of ``tensor`` over the group (the average,
    or the sum divided by ``divide_factor``): ``kind`` ``"reduce_scatter"`` of the rank-major
    tensor (gloo's as an all-to-all, as the compiled path's) or ``"all_reduce"``. Returns
    the function that waits for it and returns the result (this rank's piece)."""
    op, factor = reduce_op(tensor.dtype, group_size, divide_factor)
    if group_size == 1:
        out = tensor * factor if divide_factor is not None else tensor.clone()
        return lambda: out
    if factor != 1.0:
        tensor = tensor * factor
    if kind == "reduce_scatter":
        return issue_reduce_scatter(tensor, op, group_size, group_name)
    reduced = _c10d.all_reduce(tensor.contiguous(), op, group_name)
    return lambda: _c10d.wait_tensor(reduced)


def reduce_over_group(tensor: torch.Tensor, kind: str, group_size: int, group_name: str,
                      divide_factor: float | None = None) -> torch.Tensor:
    """:func:`issue_reduction`, waited for."""
    return issue_reduction(tensor, kind, group_size, group_name, divide_factor)()


def _reduce_grad_eager(grad, *args, **kwargs):
    m = ReduceGradArgs(grad, *args, **kwargs)
    layout = Dim0Layout(grad.shape, m.world_size)
    if m.reduce_dtype is not None:
        grad = grad.to(m.reduce_dtype)
    if m.pending_full is not None:
        grad = grad + m.pending_full
    matrix = rank_major(eager, grad, layout)
    out = reduce_over_group(matrix.view(-1), "reduce_scatter", m.world_size, m.group_name,
                            m.divide_factor)
    if m.pending_partial is not None:
        out = out + m.pending_partial.reshape(out.shape)
    if m.all_reduce and m.replica_size > 1:
        out = reduce_over_group(out, "all_reduce", m.replica_size, m.replica_group,
                                replica_divide_factor(m.divide_factor))
    if m.out_dtype is not None:
        out = out.to(m.out_dtype)
    if m.out_device:  # CPU offload: the reduced pieces go back to the host shard (pinned)
        out = TO_HOST(out)
    if not m.all_reduce:  # a partial accumulates as the padded piece
        return out.view(layout.piece_shape)
    return local_from_reduced(eager, out, layout, m.local_rows)


def _take_group_piece_eager(full: torch.Tensor, group_size: int, group_name: str
                            ) -> torch.Tensor:
    """This rank's padded piece of ``full`` over its group of ``group_size`` ranks: what
    ``shard(reshard_after_forward=k)`` keeps of a gathered parameter for the backward."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    layout = Dim0Layout(full.shape, group_size)
    if layout.replicated:  # a 0-D value: every rank keeps it, as one row
        return full.reshape(1).clone()
    place = dist.get_rank(_resolve_process_group(group_name))
    rows = layout.local(full, place)
    piece = full.new_zeros(layout.piece_shape)
    piece[:rows.shape[0]].copy_(rows)
    return piece


torch.library.register_kernel("graphshard::unshard", None, _unshard_eager)
torch.library.register_kernel("graphshard::reduce_grad", None, _reduce_grad_eager)
torch.library.register_kernel("graphshard::take_group_piece", None, _take_group_piece_eager)


_ACCUM = UnshardArgs._fields.index("accum")  # the input a held-back gradient goes to


def _unshard_setup(ctx, inputs, output):
    ctx.marker = UnshardArgs(*inputs)
    ctx.shard_dtype = inputs[0].dtype
    ctx.local_rows = rows_held(inputs[0].shape)
    ctx.shard_device = inputs[0].device.type


@functools.cache
def _to_local_keeps_history() -> bool:
    """Whether ``DTensor.to_local()``'s backward makes the gradient with ``from_local``
    (torch >= 2.12), which autograd differentiates; torch 2.11's calls the constructor, so
    under ``create_graph`` the parameter's gradient comes back without its history."""
    from torch.distributed.tensor import _api

    return "from_local" in _api._ToTorchTensor.backward.__code__.co_names


def unshard_backward(ctx, grad):
    """Where the gradient goes depends on ``sync``: the shard (reduced), or the accumulator."""
    if torch.is_grad_enabled() and not _to_local_keeps_history():
        raise GraphshardRuntimeError(
            f"graphshard: a backward with create_graph=True (a gradient penalty, "
            f"higher-order gradients) through the eager sharded model needs torch 2.12 or "
            f"newer. torch {torch.__version__}'s DTensor.to_local() backward makes the "
            f"parameter's gradient without its history, so a loss built from the gradients "
            f"would silently add nothing to them. Upgrade torch, or keep create_graph off.")
    m = ctx.marker
    reduce_dtype = m.reduce_dtype
    grads: list = [None] * len(m)
    if m.sync == GradSync.NONE:
        grads[_ACCUM] = grad.to(m.accum.dtype)
        return tuple(grads)
    final = m.sync == GradSync.FULL
    # CPU offload: a final gradient goes to the host shard; a partial one accumulates on the
    # compute device, where it is folded into a later reduction.
    out_device = ctx.shard_device if final and m.compute_device else ""
    reduced = REDUCE_GRAD(
        grad, m.bucket, m.name, m.world_size, m.group_name, reduce_dtype,
        ctx.shard_dtype if final else m.accum.dtype, m.replica_group, m.replica_size, final,
        m.pending_full, m.pending_partial, ctx.local_rows, out_device, m.divide_factor,
    )  # fmt: skip
    grads[0 if final else _ACCUM] = reduced
    return tuple(grads)


torch.library.register_autograd(
    "graphshard::unshard", unshard_backward, setup_context=_unshard_setup
)


class _FromGathered(torch.autograd.Function):
    """``unshard`` whose gather already ran (its bucket's, ``graphshard.api.bucket_gathers``):
    the forward hands the copy over, the backward is ``unshard``'s."""

    @staticmethod
    def forward(full, *unshard_inputs):
        return full.view_as(full)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _unshard_setup(ctx, inputs[1:], output)

    @staticmethod
    def backward(ctx, grad):
        return (None, *unshard_backward(ctx, grad))


def from_gathered(full: torch.Tensor, *unshard_inputs) -> torch.Tensor:
    """``UNSHARD(*unshard_inputs)`` given the gathered ``full`` (eagerly): the same output and
    the same gradients, without a collective."""
    return _FromGathered.apply(full, *unshard_inputs)


_PENDING_FULL = ReduceGradArgs._fields.index("pending_full")
_PENDING_PARTIAL = ReduceGradArgs._fields.index("pending_partial")


def _reduce_grad_setup(ctx, inputs, output):
    m = ReduceGradArgs(*inputs)
    ctx.marker = m._replace(grad=None, pending_full=None, pending_partial=None)
    ctx.grad_dtype = m.grad.dtype
    ctx.grad_shape = tuple(m.grad.shape)
    ctx.reduced = (m.reduce_dtype or m.grad.dtype, m.grad.device)
    ctx.pending_partial_shape = (None if m.pending_partial is None
                                 else tuple(m.pending_partial.shape))
    ctx.has_pending_full = m.pending_full is not None


def _reduce_grad_backward(ctx, cotangent):
    """The adjoint of ``reduce_grad``, for a second backward through the eager sharded model
    (``create_graph=True``: a gradient penalty), by DTensor's rule that the gradient of a
    partial (per-rank) value is replicated: every rank's cotangent rows are gathered into
    the full tensor, which becomes each rank's gradient of its own full gradient (a
    replicated 0-D value's, and the replicas' all-reduce, pass it unchanged). Each rank's
    second backward then follows its own data, and the parameters' final reduction averages
    them: a penalty built the DTensor way (``g.full_tensor()``, DTensor ops on the sharded
    gradients) counts once, as in one process, while the losses average. Without it autograd
    ran the kernel's collectives as constants, and at world >= 2 the penalty's gradient was
    silently wrong."""
    if torch.is_grad_enabled():
        raise GraphshardRuntimeError(
            "graphshard: third-order gradients (create_graph=True in a backward that already "
            "differentiates a gradient) are not supported through the eager sharded model. "
            "Differentiate the gradients once, or use an unsharded model for this part.")
    m = ctx.marker
    dtype, device = ctx.reduced
    layout = Dim0Layout(ctx.grad_shape, m.world_size)
    back = cotangent.to(device=device, dtype=dtype)  # the adjoint of the casts and copies
    d_partial = (None if ctx.pending_partial_shape is None
                 else back.reshape(ctx.pending_partial_shape))
    full = back if layout.replicated else gather_full(back, layout, m.group_name)
    grads: list = [None] * len(ReduceGradArgs._fields)
    grads[0] = full.to(ctx.grad_dtype)
    if ctx.has_pending_full:
        grads[_PENDING_FULL] = full
    grads[_PENDING_PARTIAL] = d_partial
    return tuple(grads)


torch.library.register_autograd(
    "graphshard::reduce_grad", _reduce_grad_backward, setup_context=_reduce_grad_setup
)

__all__ = ["UNSHARD", "REDUCE_GRAD", "from_gathered", "gather_full", "issue_reduction",
           "reduce_over_group", "unshard_backward"]
