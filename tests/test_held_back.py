"""What ``no_sync`` held back reaches the synced step even for parameters the synced
micro-batch's forward did not read (``graphshard.api.grad_sync._reduce_unread``): a branch
only earlier micro-batches took, a parameter frozen inside the window. On one real gloo
rank; the same on 2 and 4 ranks (HSDP) against one process is ``tests/test_accumulation.py``'s
``skips_a_branch_last``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphshard


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 3)
        self.side = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        out = self.body(x)
        if side:
            out = out + torch.tanh(self.side(x))
        return out.square().mean()


def _x(seed: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))


def _run(model: nn.Module, mode: str):
    return torch.compile(model, backend=graphshard.backend(inductor=False)) \
        if mode == "compiled" else model


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_branch_the_synced_micro_batch_skips_gets_its_held_back_gradient(one_rank, mode):
    """Micro-batch 0 (held back) takes the side branch, micro-batch 1 (synced) does not: the
    side's gradient is micro-batch 0's after the synced backward, its hook runs once on it,
    and the next step's gradient holds nothing of it (before the fix: None, then added in)."""
    seen = []

    def record(grad):
        # compiled, a backward whose forward did not read the parameter calls its hooks with
        # None (docs/api.md): what is recorded is every gradient it was given
        if grad is not None:
            seen.append(grad.full_tensor())

    model = _Branchy()
    model.side.weight.register_hook(record)
    graphshard.shard(model)
    run = _run(model, mode)
    with graphshard.no_sync(model):
        run(_x(0), True).backward()
    run(_x(1), False).backward()
    reference = _Branchy()
    reference(_x(0), True).backward()
    reference(_x(1), False).backward()
    assert model.side.weight.grad is not None
    torch.testing.assert_close(model.side.weight.grad.full_tensor(), reference.side.weight.grad)
    torch.testing.assert_close(model.body.weight.grad.full_tensor(), reference.body.weight.grad)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], reference.side.weight.grad)

    model.zero_grad()
    reference.zero_grad()
    run(_x(2), True).backward()
    reference(_x(2), True).backward()
    torch.testing.assert_close(model.side.weight.grad.full_tensor(), reference.side.weight.grad)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_parameter_frozen_inside_the_window_keeps_its_held_back_gradient(one_rank, mode):
    """As in one process, freezing a parameter does not take away the gradient it
    accumulated before: the synced step hands it over, and the optimizer steps it."""
    model = graphshard.shard(_Branchy())
    run = _run(model, mode)
    with graphshard.no_sync(model):
        run(_x(0), True).backward()
    model.side.requires_grad_(False)
    run(_x(1), True).backward()
    reference = _Branchy()
    reference(_x(0), True).backward()
    reference.side.requires_grad_(False)
    reference(_x(1), True).backward()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).grad.full_tensor(), param.grad)
