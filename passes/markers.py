"""The marker ops and the shard layout: the vocabulary shared by ``graphshard`` and the passes.

A sharded parameter is read through ``graphshard::unshard`` and its gradient leaves through
``graphshard::reduce_grad``. Both carry everything the passes need as plain arguments (full
shape, bucket, reshard policy, group), so a traced graph is self-describing: the passes never
look at a module or a process group. Only the schemas and the fake (shape) implementations
live here; the eager kernels that really communicate are registered by ``graphshard.ops``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import fx

__all__ = [
    "UNSHARD",
    "REDUCE_GRAD",
    "shard_rows",
    "shard_shape",
    "is_unshard",
    "is_reduce_grad",
    "UnshardArgs",
    "ReduceGradArgs",
    "marker_args",
]

_lib = torch.library.Library("graphshard", "DEF")
_lib.define(
    "unshard(Tensor shard, SymInt[] full_shape, int bucket, bool pinned, bool reshard, "
    "str name, int world_size, str group_name) -> Tensor"
)
_lib.define(
    "reduce_grad(Tensor grad, int bucket, str name, int world_size, str group_name) -> Tensor"
)

UNSHARD = torch.ops.graphshard.unshard.default
REDUCE_GRAD = torch.ops.graphshard.reduce_grad.default


def shard_rows(full_shape: Sequence[int], world_size: int) -> int:
    """Rows of dim 0 each rank holds: ``ceil(dim0 / world_size)`` (a 0-D tensor has 1 row)."""
    dim0 = full_shape[0] if len(full_shape) else 1
    return max(1, math.ceil(dim0 / world_size))


def shard_shape(full_shape: Sequence[int], world_size: int) -> tuple[int, ...]:
    """Shape of one rank's padded shard of a tensor of ``full_shape``."""
    return (shard_rows(full_shape, world_size), *tuple(full_shape[1:]))


@torch.library.register_fake("graphshard::unshard")
def _unshard_fake(shard, full_shape, *rest):
    return shard.new_empty(full_shape)


@torch.library.register_fake("graphshard::reduce_grad")
def _reduce_grad_fake(grad, bucket, name, world_size, group_name):
    return grad.new_empty(shard_shape(grad.shape, world_size))


def is_unshard(node: fx.Node) -> bool:
    """True for a call of the ``unshard`` marker."""
    return node.op == "call_function" and node.target is UNSHARD


def is_reduce_grad(node: fx.Node) -> bool:
    """True for a call of the ``reduce_grad`` marker."""
    return node.op == "call_function" and node.target is REDUCE_GRAD


class UnshardArgs(NamedTuple):
    """The arguments of an ``unshard`` call, by name."""

    shard: fx.Node
    full_shape: list[int]
    bucket: int
    pinned: bool  # the user chose this bucket: bucketing strategies leave it alone
    reshard: bool
    name: str
    world_size: int
    group_name: str


class ReduceGradArgs(NamedTuple):
    """The arguments of a ``reduce_grad`` call, by name."""

    grad: fx.Node
    bucket: int
    name: str
    world_size: int
    group_name: str


def marker_args(node: fx.Node) -> UnshardArgs | ReduceGradArgs:
    """The arguments of a marker node as a named tuple."""
    if is_unshard(node):
        return UnshardArgs(*node.args, **node.kwargs)
    if is_reduce_grad(node):
        return ReduceGradArgs(*node.args, **node.kwargs)
    raise ValueError(f"{node.format_node()} is not a graphshard marker")
