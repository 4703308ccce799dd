"""A score matrix whose rows are updated in place one after another, each from the rows
before it (Qwen3-Next's chunked gated delta rule, as Hugging Face writes it). Compiled at one
rank it gets eager's gradients.

The backward scatters each row's gradient back through nested masked loads. torch 2.11's
vectorized C++ code generation marked a scalar that such a load's body shared with the rest
of the kernel as a vector, and g++ rejected the kernel: the model did not compile, graphshard
or plain ``torch.compile`` (docs/torch-versions.md). graphshard's compiles keep it scalar
(graphshard/safety/masked_vec.py); on 2.11 this test fails without that."""

from __future__ import annotations

import torch
from dist_utils import assert_compiled_gets_eager_grads
from torch import nn

SIZE = 4  # rows per chunk: 4 and 16 met the bug on 2.11, 8 did not


class _RowUpdates(nn.Module):
    """Projects each sample to two SIZE x SIZE score matrices, masks their upper triangle,
    updates each row from the rows above it, and reads the result out."""

    def __init__(self) -> None:
        super().__init__()
        self.scores = nn.Linear(8, 2 * SIZE * SIZE)
        self.readout = nn.Linear(2 * SIZE * SIZE, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        upper = torch.triu(torch.ones(SIZE, SIZE, dtype=torch.bool, device=x.device))
        attn = self.scores(x).view(-1, 2, SIZE, SIZE).masked_fill(upper, 0)
        for i in range(1, SIZE):
            row = attn[..., i, :i].clone()
            above = attn[..., :i, :i].clone()
            attn[..., i, :i] = row + (row.unsqueeze(-1) * above).sum(-2)
        attn = attn + torch.eye(SIZE, device=x.device)
        return self.readout(attn.flatten(1))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _RowUpdates()


def _backward(run) -> None:
    samples = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    run(samples).square().sum().backward()


def test_rows_updated_in_place_one_after_another_get_the_eager_gradients(one_rank):
    assert_compiled_gets_eager_grads(_model, _backward)
