"""``OddMLP``: a small MLP with awkward layer sizes, to exercise uneven shard padding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from graphshard.errors import GraphshardValueError

__all__ = ["OddMLP", "MLPOutput"]


class MLPOutput(NamedTuple):
    """What :meth:`OddMLP.forward` returns: the MSE loss (None without targets) and output."""

    loss: torch.Tensor | None
    output: torch.Tensor


class OddMLP(nn.Module):
    """Linear + GELU layers of sizes ``sizes`` (no activation after the last Linear).

    The default sizes (13, 29, 7, 3) are odd on purpose: no weight's first dimension divides
    evenly by 2, 4 or 8 ranks, so every shard is padded.
    """

    def __init__(self, sizes: Sequence[int] = (13, 29, 7, 3)) -> None:
        super().__init__()
        if len(sizes) < 2:
            raise GraphshardValueError(
                f"OddMLP needs at least an input and output size, got {sizes}"
            )
        self.sizes = tuple(sizes)
        layers: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers.append(nn.Linear(n_in, n_out))
            if i < len(sizes) - 2:
                layers.append(nn.GELU())
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> MLPOutput:
        out = self.layers(x)
        return MLPOutput(None if y is None else _mse_loss(out, y), out)


def _mse_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``F.mse_loss(out, y)``, with both in their promoted dtype first where they differ (a
    bf16 output, fp32 targets): torch 2.11's mse_loss backward fails on mixed dtypes. The
    forward already computes in the promoted dtype, so the loss is the same."""
    if out.dtype != y.dtype:
        dtype = torch.promote_types(out.dtype, y.dtype)
        out, y = out.to(dtype), y.to(dtype)
    return F.mse_loss(out, y)
