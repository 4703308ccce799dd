"""The dim-0 layout of a sharded tensor: which rows each rank holds and how they travel.

A tensor of ``full_shape`` is split on dim 0 as ``torch.chunk`` and DTensor's ``Shard(0)``
split it: each rank holds ``rows = ceil(dim0 / world)`` rows, the last ranks fewer (possibly
none). Collectives need equal pieces, so on the wire each rank's rows are padded with zeros
to ``rows``: the all-gather of the padded pieces is the full tensor padded to ``world * rows``
rows (rank-major), and a reduce-scatter of the gradient padded the same way hands each rank
its padded piece, of which it keeps its own rows. The padding exists only inside the
collective's buffers; no tensor a user sees holds it.

A 0-D tensor has no dim 0: every rank holds the value (``Replicate``). It travels as one
row, and its gradient is repeated on every rank's row, so that the averaging reduce-scatter
hands every rank the average.

This module is the one place that knows the layout. The eager kernels apply its functions
to tensors and the lowering passes to FX nodes: each function takes an ``op`` that calls an
aten overload (:func:`eager` for tensors, a ``NodeMaker`` for graphs), so the op sequence
that moves a parameter is written once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Dim0Layout",
    "eager",
    "rows_held",
    "gather_piece",
    "full_from_gathered",
    "rank_major",
    "local_from_reduced",
]

aten = torch.ops.aten
Op = Callable[..., Any]


def eager(target: Any, *args: Any, **kwargs: Any) -> Any:
    """The ``op`` that runs an aten overload on tensors (the eager kernels' caller)."""
    return target(*args, **kwargs)


def rows_held(local_shape: Sequence[int]) -> int:
    """Rows of dim 0 in a rank's local tensor (a 0-D value counts as one row)."""
    return local_shape[0] if len(local_shape) else 1


@dataclass(frozen=True)
class Dim0Layout:
    """How a tensor of ``full_shape`` is split on dim 0 across ``world`` ranks."""

    full_shape: tuple[int, ...]
    world: int

    def __init__(self, full_shape: Sequence[int], world: int) -> None:
        object.__setattr__(self, "full_shape", tuple(full_shape))
        object.__setattr__(self, "world", int(world))

    @property
    def replicated(self) -> bool:
        """A 0-D tensor: every rank holds the whole value."""
        return len(self.full_shape) == 0

    @property
    def dim0(self) -> int:
        """Rows of the full tensor (1 for a 0-D value)."""
        return rows_held(self.full_shape)

    @property
    def inner(self) -> int:
        """Elements per row."""
        return math.prod(self.full_shape[1:])

    @property
    def rows(self) -> int:
        """Rows of every rank's padded piece: ``ceil(dim0 / world)``."""
        return max(1, math.ceil(self.dim0 / self.world))

    @property
    def padded_rows(self) -> int:
        """Rows of the gathered, padded tensor: ``world * rows``."""
        return self.world * self.rows

    @property
    def holding_ranks(self) -> int:
        """Ranks that hold rows (the first ones; the rest hold only padding)."""
        return 1 if self.replicated else math.ceil(self.dim0 / self.rows)

    @property
    def piece_shape(self) -> tuple[int, ...]:
        """Shape of one rank's padded piece (what a collective moves per rank)."""
        return (self.rows, *self.full_shape[1:])

    @property
    def piece_numel(self) -> int:
        """Elements of one rank's padded piece."""
        return self.rows * self.inner

    def valid_rows(self, rank: int) -> int:
        """Rows of the full tensor that ``rank`` holds (0 for a rank past the end)."""
        if self.replicated:
            return 1
        return max(0, min(self.rows, self.dim0 - rank * self.rows))

    def local_shape(self, local_rows: int) -> tuple[int, ...]:
        """Shape of a local tensor of ``local_rows`` rows (``()`` for a 0-D value)."""
        return () if self.replicated else (local_rows, *self.full_shape[1:])

    def local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """The rows of ``full`` that ``rank`` holds (a view; the value itself when 0-D)."""
        if self.replicated:
            return full
        start = min(rank * self.rows, self.dim0)
        return full.narrow(0, start, self.valid_rows(rank))


def gather_piece(op: Op, local: Any, layout: Dim0Layout, local_rows: int) -> Any:
    """The all-gather input: the local tensor flattened in row-major order, zero-padded to
    one piece. A local tensor in another memory format (``model.to(memory_format=
    torch.channels_last)`` after ``shard()``) is copied to a contiguous one first: the
    pieces concatenate into the full tensor row by row."""
    value = local.meta["val"] if hasattr(local, "meta") else local  # a graph node, or eager
    if not value.is_contiguous():
        local = op(aten.clone.default, local, memory_format=torch.contiguous_format)
    flat = op(aten.view.default, local, [-1])
    missing = (layout.rows - local_rows) * layout.inner
    if missing:
        flat = op(aten.constant_pad_nd.default, flat, [0, missing], 0.0)
    return flat


def full_from_gathered(op: Op, gathered: Any, layout: Dim0Layout,
                       ranks: int | None = None) -> Any:
    """The full tensor from the gathered pieces of the first ``ranks`` ranks (contiguous,
    ``ranks * piece_numel`` elements, rank-major; all ranks by default, at least
    :attr:`Dim0Layout.holding_ranks`): padding rows cut off."""
    rows = layout.rows * (layout.world if ranks is None else ranks)
    padded = op(aten.view.default, gathered, [rows, *layout.full_shape[1:]])
    if layout.dim0 != rows:
        padded = op(aten.slice.Tensor, padded, 0, 0, layout.dim0)
    if layout.replicated:
        padded = op(aten.view.default, padded, [])
    return padded


def rank_major(op: Op, grad: Any, layout: Dim0Layout, contiguous: bool = False) -> Any:
    """A full gradient as the reduce-scatter input ``[world, piece_numel]``: row ``r`` is
    rank ``r``'s padded piece (a 0-D gradient repeated on every row).

    Only what the layout needs is copied: a ``contiguous`` gradient is viewed, not cloned;
    so is one of at most two dims that needs padding (the padding writes a dense copy)."""
    if layout.replicated:
        row = op(aten.view.default, grad, [1, 1])
        spread = op(aten.expand.default, row, [layout.world, 1])
        return op(aten.clone.default, spread, memory_format=torch.contiguous_format)
    padded = layout.padded_rows != layout.dim0
    dense = grad
    if not contiguous and not (padded and len(layout.full_shape) <= 2):
        dense = op(aten.clone.default, grad, memory_format=torch.contiguous_format)
    matrix = op(aten.view.default, dense, [layout.dim0, layout.inner])
    if padded:
        pad = [0, 0, 0, layout.padded_rows - layout.dim0]
        matrix = op(aten.constant_pad_nd.default, matrix, pad, 0.0)
    return op(aten.view.default, matrix, [layout.world, layout.piece_numel])


def local_from_reduced(op: Op, piece: Any, layout: Dim0Layout, local_rows: int) -> Any:
    """This rank's gradient from its reduced padded piece (contiguous): padding cut off."""
    shaped = op(aten.view.default, piece, list(layout.piece_shape))
    if layout.replicated:
        return op(aten.view.default, shaped, [])
    if local_rows != layout.rows:
        shaped = op(aten.slice.Tensor, shaped, 0, 0, local_rows)
    return shaped


def sum_received(op: Op, received: Any, world: int, average: bool) -> Any:
    """The pieces an all-to-all reduce-scatter received (``[world * piece]``, rank order)
    reduced to this rank's piece: summed in rank order, divided by ``world`` for an average.
    Eager and compiled paths both use it, so they compute the same numbers."""
    rows = op(aten.view.default, received, [world, -1])
    total = op(aten.sum.dim_IntList, rows, [0])
    return op(aten.div.Tensor, total, world) if average else total
