"""What ``no_sync`` held back reaches the synced step even for parameters the synced
micro-batch's forward did not read (``graphshard.api.grad_sync._reduce_unread``): a branch
only earlier micro-batches took, one a compiled block's region gathered without using it, a
parameter frozen inside the window; and only once when two backwards share the synced
forward. On one real gloo rank; the same on 2 and 4 ranks (HSDP) against one process is
``tests/test_accumulation.py``'s ``skips_a_branch_last``."""

from __future__ import annotations

import contextlib

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


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.side = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        out = torch.tanh(self.body(x))
        return out + torch.tanh(self.side(x)) if side else out


class _Blocks(nn.Module):
    """Three like blocks: compiled, each runs in a compile region that gathers every
    parameter of the block, the branch it does not take included."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, side)
        return x.square().mean()


def _branch_then_without(model: nn.Module, run, reference: nn.Module) -> None:
    """Micro-batch 0 takes the branch under ``no_sync``, the synced micro-batch 1 does not;
    the same two backwards of ``reference`` in one process."""
    with graphshard.no_sync(model):
        run(_x(0), True).backward()
    run(_x(1), False).backward()
    reference(_x(0), True).backward()
    reference(_x(1), False).backward()


def test_a_branch_inside_compiled_blocks_gets_its_held_back_gradient(one_rank):
    """The branch's parameters are read (gathered for the block's region) but get no
    gradient back: their held-back gradients are reduced at the end of the backward all the
    same, and nothing of them is left for the next step."""
    model = graphshard.shard(_Blocks())
    run = _run(model, "compiled")
    reference = _Blocks()
    _branch_then_without(model, run, reference)
    for step in range(2):
        for name, param in reference.named_parameters():
            grad = model.get_parameter(name).grad
            assert grad is not None, (step, name)
            torch.testing.assert_close(grad.full_tensor(), param.grad)
        model.zero_grad()
        reference.zero_grad()
        run(_x(2), True).backward()
        reference(_x(2), True).backward()


class _TwoLosses(_Branchy):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.body(x).square().mean(), self.side(x).square().mean()


def test_a_second_backward_of_the_synced_forward_adds_the_held_back_gradient_once(one_rank):
    """Eagerly, the synced forward's read of ``side`` carries its held-back gradient to its
    reduction. The first backward (``body``'s loss) does not reach that reduction, so it
    reduces the held-back gradient itself when it ends; the second (``side``'s loss) then
    runs the read's reduction, which must not add it again."""
    model = graphshard.shard(_TwoLosses())
    reference = _TwoLosses()
    with graphshard.no_sync(model):
        sum(model(_x(0))).backward()
    sum(reference(_x(0))).backward()
    for net in (model, reference):
        body, side = net(_x(1))
        body.backward(retain_graph=True)
        side.backward()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).grad.full_tensor(), param.grad)


class _Recomputed(nn.Module):
    """A layer, then two blocks under a reentrant ``torch.utils.checkpoint``: its backward
    recomputes a block and runs the block's backward as a backward of its own, inside the
    step's, before the step's backward reaches ``first``; and a branch, ``side``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2))
        self.last = nn.Linear(6, 3)
        self.side = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.first(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=True)
        out = self.last(h)
        return (out + torch.tanh(self.side(x)) if side else out).square().mean()


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_reentrant_checkpoints_backward_does_not_end_the_steps(one_rank, mode):
    """The nested backward of a reentrant checkpoint ends before the step's reaches
    ``first``, whose read folds its held-back gradient in: that end is not the step's, so
    nothing is reduced there. Before the fix the held-back gradient was reduced (and zeroed)
    at it: eagerly ``first``'s hook ran twice, compiled the step's backward then found a
    tensor it saved changed ("modified by an inplace operation"). The branch only the first
    micro-batch takes still gets its held-back gradient, at the end of the step's backward."""
    seen = []
    model = _Recomputed()
    model.first.weight.register_hook(lambda grad: seen.append(grad.full_tensor()))
    graphshard.shard(model)
    run = _run(model, mode)
    reference = _Recomputed()
    for step in range(2):
        for micro in range(3):
            with graphshard.no_sync(model) if micro < 2 else contextlib.nullcontext():
                run(_x(10 * step + micro), micro == 0).backward()
            reference(_x(10 * step + micro), micro == 0).backward()
        assert len(seen) == step + 1
        torch.testing.assert_close(seen[-1], reference.first.weight.grad)
        for name, param in reference.named_parameters():
            torch.testing.assert_close(model.get_parameter(name).grad.full_tensor(), param.grad)
        model.zero_grad()
        reference.zero_grad()


class _AllRecomputed(_Blocks):
    """``_Blocks`` with every block under a reentrant checkpoint: each reduction runs in a
    nested backward, none in the step's own."""

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = x.requires_grad_()
        for block in self.blocks:
            x = checkpoint(block, x, side, use_reentrant=True)
        return x.square().mean()


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_branch_inside_reentrant_checkpoints_gets_its_held_back_gradient(one_rank, mode):
    """The branch the synced micro-batch skips is reduced at the end of the step's backward,
    which no reduction of its own runs in: the check moves there from the nested ones."""
    model = graphshard.shard(_AllRecomputed())
    run = _run(model, mode)
    reference = _AllRecomputed()
    _branch_then_without(model, run, reference)
    for name, param in reference.named_parameters():
        grad = model.get_parameter(name).grad
        assert grad is not None, name
        torch.testing.assert_close(grad.full_tensor(), param.grad)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_micro_batches_forwarded_under_no_sync_and_after_it_with_one_backward(one_rank, mode):
    """Three forwards, the first two under ``no_sync``, then one backward of the summed
    losses: that backward holds the first two's gradients back and reduces the third's (the
    reductions it runs first). What it held back is reduced when it ends, with the rest:
    before, it stayed held back and went into the next step (a step late, silently)."""
    model = graphshard.shard(_Branchy())
    run = _run(model, mode)
    reference = _Branchy()
    for step in range(2):
        losses = []
        for micro in range(3):
            with graphshard.no_sync(model) if micro < 2 else contextlib.nullcontext():
                losses.append(run(_x(10 * step + micro), micro == 0))
        sum(losses).backward()
        sum(reference(_x(10 * step + micro), micro == 0) for micro in range(3)).backward()
        for name, param in reference.named_parameters():
            torch.testing.assert_close(model.get_parameter(name).grad.full_tensor(), param.grad)
        with torch.no_grad():  # a step between, so that a gradient a step late shows
            for name, param in reference.named_parameters():
                param.sub_(param.grad)
                model.get_parameter(name).sub_(model.get_parameter(name).grad)
        model.zero_grad()
        reference.zero_grad()
