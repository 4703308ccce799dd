"""``MixedPrecision``: compute in low precision while the sharded master weights stay fp32.

The cast happens on the shard, before the all-gather, so the wire carries half the bytes
and no full-size fp32 copy of a parameter ever exists. Gradients are reduced in
``reduce_dtype`` and land on the fp32 shard, where the optimizer state lives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from graphshard.api.forward_depth import mark_forward_hook
from graphshard.errors import GraphshardTypeError

__all__ = ["MixedPrecision"]


@dataclass(frozen=True)
class MixedPrecision:
    """The dtypes of a mixed-precision run, given to ``graphshard.shard(mixed_precision=...)``.

    Attributes:
        param_dtype: dtype the parameters are gathered and computed in (None: their own).
        reduce_dtype: dtype gradients are reduced (and accumulated under ``no_sync``) in;
            None means ``param_dtype``. fp32 costs twice the bytes of bf16 but loses
            nothing in the sum across ranks.
        output_dtype: floating-point outputs of the root module are cast to this (None:
            left as computed).
        cast_forward_inputs: cast the root module's floating-point inputs to
            ``param_dtype``, so the first layer does not mix dtypes.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype)
                                          and value.is_floating_point):
                raise GraphshardTypeError(
                    f"MixedPrecision.{name} must be a floating-point torch.dtype such as "
                    f"torch.bfloat16, or None; got {value!r}."
                )

    @property
    def gradient_dtype(self) -> torch.dtype | None:
        """The dtype gradients are reduced in."""
        return self.reduce_dtype or self.param_dtype


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def install_casts(module: nn.Module, policy: MixedPrecision) -> None:
    """Cast the root's floating inputs to ``param_dtype`` and its outputs to ``output_dtype``."""
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        dtype = policy.param_dtype

        @mark_forward_hook
        def cast_inputs(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return _cast_floats(args, dtype), _cast_floats(kwargs, dtype)

        module.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    if policy.output_dtype is not None:
        out_dtype = policy.output_dtype

        @mark_forward_hook
        def cast_outputs(mod: nn.Module, args: tuple, output: Any) -> Any:
            return _cast_floats(output, out_dtype)

        module.register_forward_hook(cast_outputs)
