"""The autograd of a bucket's reads that train, eagerly: one reduce-scatter per bucket, finished
under the next bucket's backward.

:func:`read_bucket` hands out the gathered copies of a bucket's parameters (those that train
with nothing held back) as the outputs of one autograd node. Autograd runs its backward once
every copy's gradient is in, and the backward reduce-scatters them in one collective, with
``reduce_grad``'s arithmetic for each parameter.

Waiting for that collective where it is issued keeps the backward's compute from running
beside it: on a GPU the compute stream waits for NCCL's, on gloo the step's thread for the
worker. So a bucket's reduction is finished by the read of the bucket the forward gathered
just before it, whose backward runs next (FSDP2 waits for a reduce-scatter when the next
one is issued, for the same reason):

- the earlier read takes the later bucket's shards as inputs of its own (:class:`Relay`
  names them, from the order the last complete forward read the buckets in) and returns an
  empty tensor, the relay's token;
- the later read, if it is the bucket expected, takes that token as an input. Its backward
  then only issues the collective and hands it to the relay; the token's gradient makes
  autograd run the earlier read's backward after it (and at all, even where no gradient
  reaches the earlier copies);
- the earlier read's backward issues its own reduction first, then waits for the handed
  one and returns its gradients as those of the later shards. Autograd delivers them to the
  parameters as it delivered them before: ``.grad``, tensor hooks and post-accumulate hooks
  see the same values, one bucket later.

The first bucket of the forward, which no read precedes, and a read under ``create_graph``
reduce where they run, as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor._api import _ToTorchTensor

from graphshard.api.eager_kernels import (
    issue_reduction,
    reduce_over_group,
    unshard_backward,
)
from graphshard.passes.host_copy import TO_HOST
from graphshard.passes.layout import Dim0Layout, eager, local_from_reduced, rank_major, rows_held
from graphshard.passes.markers import GradSync, UnshardArgs, replica_divide_factor

__all__ = ["Relay", "local_of", "read_bucket"]


class Relay:
    """Between two consecutive bucket reads of one forward: the parameter records of the later
    bucket the earlier read will return gradients for (``members``), whether a later read
    took it, and the later bucket's reduction once its backward has issued it (``pending``,
    a function that waits and returns the gradients).

    It holds no tensor: the earlier read's context holds the relay, and a tensor here whose
    autograd node is that read would close a reference cycle through autograd's graph,
    which Python's garbage collector then breaks from the tensor's side. The token travels
    beside it (:func:`read_bucket`)."""

    __slots__ = ("members", "taken", "pending")

    def __init__(self, members: list) -> None:
        self.members = members
        self.taken = False
        self.pending: Callable[[], list] | None = None

    def expects(self, members: list) -> bool:
        """Whether ``members`` (records, in order) are the ones this relay was made for, and
        no read took it yet."""
        return (not self.taken and len(members) == len(self.members)
                and all(a is b for a, b in zip(members, self.members, strict=True)))


class _BucketReads(torch.autograd.Function):
    """The reads of a bucket's parameters that train: each output but the last is one
    parameter's copy, the last the token of the relay to the next bucket (module docstring).
    Inputs after the relays and the token taken: this bucket's shards, then the next
    bucket's. An output whose gradient is None (not used) is left out of the reduction, as
    its own ``unshard`` backward would not have run."""

    @staticmethod
    def forward(ctx, specs, fulls, taken: Relay | None, handed: Relay | None, token,
                *shards):
        ctx.set_materialize_grads(False)
        ctx.specs, ctx.taken, ctx.handed = specs, taken, handed
        ctx.token = None if token is None else (token.dtype, token.device)  # not the tensor
        ctx.shards = [(s.dtype, rows_held(s.shape), s.device.type) for s in shards[:len(specs)]]
        new_token = fulls[0].new_empty(0)
        return (*(full.view_as(full) for full in fulls), new_token)

    @staticmethod
    def backward(ctx, *grads):
        own = len(ctx.specs)
        grads = grads[:own]
        reduced: list = [None] * own
        present = [i for i, grad in enumerate(grads) if grad is not None]
        if torch.is_grad_enabled():  # create_graph: each through reduce_grad's own autograd
            for i in present:
                reduced[i] = unshard_backward(_MemberContext(ctx, i), grads[i])[0]
        finish = None
        if present and not torch.is_grad_enabled():
            finish = _issue_reduction(ctx.specs, ctx.shards, present, grads)
            if ctx.taken is not None:  # the read before this one finishes it
                ctx.taken.pending, finish = finish, None
        handed = ctx.handed  # the next bucket's, issued before this one's
        later: list = [None] * (0 if handed is None else len(handed.members))
        if handed is not None and handed.pending is not None:
            later, handed.pending = handed.pending(), None
        if finish is not None:
            reduced = finish()
        token_grad = None
        if ctx.token is not None:
            dtype, device = ctx.token
            token_grad = torch.zeros(0, dtype=dtype, device=device)
        return (None, None, None, None, token_grad, *reduced, *later)


class _MemberContext:
    """What :func:`unshard_backward` reads of its context, for one of a bucket's reads."""

    def __init__(self, ctx, i: int) -> None:
        self.marker = UnshardArgs(None, *ctx.specs[i], GradSync.FULL)
        self.shard_dtype, self.local_rows, self.shard_device = ctx.shards[i]


def _issue_reduction(specs: list, shards: list, present: list[int], grads: tuple
                     ) -> Callable[[], list]:
    """Issue ``reduce_grad`` (final, nothing pending) of each gradient in ``present`` as one
    reduce-scatter of their rank-major matrices side by side; return the function that
    waits for it and returns every member's reduced local gradient (None where absent)."""
    first = specs[present[0]]
    layouts, matrices = [], []
    for i in present:
        spec, grad = specs[i], grads[i]
        layout = Dim0Layout(grad.shape, spec.world_size)
        if spec.reduce_dtype is not None:
            grad = grad.to(spec.reduce_dtype)
        layouts.append(layout)
        matrices.append(rank_major(eager, grad, layout))
    joined = matrices[0] if len(matrices) == 1 else torch.cat(matrices, dim=1)
    wait = issue_reduction(joined.view(-1), "reduce_scatter", first.world_size,
                           first.group_name, first.divide_factor)

    sent = [joined]  # held until the collective is waited for (whatever the backend keeps)

    def finish() -> list:
        out = wait()
        sent.clear()
        if first.replica_size > 1:
            out = reduce_over_group(out, "all_reduce", first.replica_size, first.replica_group,
                             replica_divide_factor(first.divide_factor))
        results: list = [None] * len(specs)
        offset = 0
        for i, layout in zip(present, layouts, strict=True):
            shard_dtype, local_rows, _ = shards[i]
            piece = out[offset:offset + layout.piece_numel].to(shard_dtype)
            offset += layout.piece_numel
            if specs[i].compute_device:  # CPU offload: the reduced piece goes back to the host
                piece = TO_HOST(piece)
            results[i] = local_from_reduced(eager, piece, layout, local_rows)
        return results

    return finish


class _ToLocalKeepingNone(_ToTorchTensor):
    """``DTensor.to_local()`` whose backward passes an absent gradient on as absent. torch
    2.11's materialises it as zeros, so a parameter of a bucket that no read took would get
    a zero ``.grad`` where one process leaves it None (and AdamW's weight decay then moves
    it); torch 2.13's already passes None on."""

    @staticmethod
    def forward(ctx, input, grad_placements):
        ctx.set_materialize_grads(False)
        return _ToTorchTensor.forward(ctx, input, grad_placements)

    @staticmethod
    def backward(ctx, grad_output):
        if grad_output is None:
            return None, None
        return _ToTorchTensor.backward(ctx, grad_output)


def local_of(param: torch.Tensor) -> torch.Tensor:
    """``param.to_local()`` for :func:`read_bucket`: a parameter no read used gets no
    gradient, on every torch version."""
    return _ToLocalKeepingNone.apply(param, None)


def read_bucket(specs: list, fulls: list[torch.Tensor], params: list[torch.Tensor],
                taken: tuple[Relay, torch.Tensor] | None = None, handed: Relay | None = None
                ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The reads that train of a bucket's parameters (``params``, each read as its
    ``UnshardSpec`` in ``specs`` with gradient sync and nothing held back), given their
    gathered copies ``fulls``: the copies, whose gradients are reduced in one collective,
    and this read's token. ``taken``: the relay of the read before, which expects this
    bucket, with that read's token; ``handed``: a new relay to the bucket expected next,
    for which the returned token is meant."""
    relay, token = taken if taken is not None else (None, None)
    if relay is not None:
        relay.taken = True
    later = [] if handed is None else [local_of(e.param) for e in handed.members]
    outputs = _BucketReads.apply(specs, fulls, relay, handed, token,
                                 *(local_of(p) for p in params), *later)
    return outputs[:-1], outputs[-1]
