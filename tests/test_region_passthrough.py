"""Blocks compiled once that return a tensor they were given, as it is.

T5's blocks return the position bias the first block computed beside their output, and
``invoke_subgraph`` may not return one of its inputs: before, every such block broke the step
graph (Dynamo's "Higher order ops do not support aliasing"), so the step ran in pieces and no
gather overlapped across them. The region now leaves such an output out and the block's call
returns the operand itself (``graphshard.api.block_regions``). Structure on the graphs the
passes leave and gradients against the model run eagerly (one real gloo rank).
"""

from __future__ import annotations

from collections import Counter

import torch
from dist_utils import assert_eager_grads, compiled_backward
from torch import nn

from graphshard.compiler.graph_breaks import GraphBreakWarning
from graphshard.passes.regions import region_calls


class _HandsOn(nn.Module):
    """T5's pattern: the output, and the bias it was given, handed on as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.proj(x)) + bias, bias


class _HandsOnStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)  # every block's input then has a gradient: one kind
        self.bias = nn.Linear(8, 8)  # the bias has a gradient, through every block
        self.blocks = nn.ModuleList([_HandsOn() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias(x)
        x = self.stem(x)
        for block in self.blocks:
            x, handed_on = block(x, bias)
            if handed_on is not bias:  # (traced: a constant to Dynamo)
                raise AssertionError("the block did not return the bias it was given")
            bias = handed_on
        return x.square().mean() + bias.mean()


class _Gate(nn.Module):
    """Open: a residual layer; closed: the input returned as it is (the whole output)."""

    def __init__(self, open_: bool) -> None:
        super().__init__()
        self.open = open_
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x)) if self.open else x


class _GateStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([_Gate(i % 2 == 0) for i in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _compiled_backward(make: type[nn.Module]) -> tuple[nn.Module, nn.Module, object, list]:
    torch.manual_seed(0)
    return compiled_backward(make, torch.randn(4, 8))


def test_blocks_handing_on_a_tensor_they_were_given_keep_one_graph(one_rank):
    reference, model, backend, caught = _compiled_backward(_HandsOnStack)
    assert not [w for w in caught if w.category is GraphBreakWarning]
    (stages,) = backend.graphs  # one step graph: before, a break at every block
    bodies = Counter(node.args[0].target for node in region_calls(stages["fw"]))
    assert sorted(bodies.values()) == [3]  # every block in the one body
    assert_eager_grads(model, reference)


def test_a_block_returning_its_input_as_it_is_keeps_one_graph(one_rank):
    reference, model, backend, caught = _compiled_backward(_GateStack)
    assert not [w for w in caught if w.category is GraphBreakWarning]
    assert len(backend.graphs) == 1
    assert_eager_grads(model, reference)
