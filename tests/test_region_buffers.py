"""Blocks that hold buffers (``graphshard/api/block_regions.py``): a non-persistent buffer, a
cache computed at init and only read (torchtitan's attention keeps its rotary table as one),
enters the block's compile region as an operand, so such blocks are compiled once; persistent
buffers (BatchNorm's running statistics, which training updates) keep their block inline;
a block that writes a non-persistent buffer anyway gets an error that says what to change."""

from __future__ import annotations

import copy

import pytest
import torch
from graph_utils import exception_chain
from torch import nn

import graphshard
from graphshard.errors import GraphshardRuntimeError
from graphshard.passes.regions import region_calls

SEQ, DIM = 16, 8


class _Rotary(nn.Module):
    """A complex rotary table as torchtitan's attention holds it: a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        angles = torch.arange(SEQ * 1.0)[:, None] * torch.arange(1, DIM // 2 + 1)[None] / DIM
        self.register_buffer("cache", torch.polar(torch.ones_like(angles), angles),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * self.cache[: x.shape[1]]).flatten(-2)


class _Block(nn.Module):
    def __init__(self, extra: str) -> None:
        super().__init__()
        self.q, self.o, self.rotary = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), _Rotary()
        self.norm = nn.BatchNorm1d(SEQ) if extra == "batch_norm" else None
        if extra == "counter":  # written in forward, though not persistent
            self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.o(torch.relu(self.rotary(self.q(x))))
        if self.norm is not None:
            h = self.norm(h)
        if hasattr(self, "calls"):
            self.calls.add_(1)
        return x + h


class _Model(nn.Module):
    def __init__(self, extra: str = "") -> None:
        super().__init__()
        self.embed = nn.Embedding(32, DIM)
        self.layers = nn.ModuleList(_Block(extra) for _ in range(3))
        self.head = nn.Linear(DIM, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 32, (2, SEQ), generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("extra,regions", [("", 3), ("batch_norm", 0)],
                         ids=["rotary-cache", "batch-norm"])
def test_blocks_with_read_only_buffers_are_regions_and_train_like_eager(one_rank, extra,
                                                                       regions):
    torch.manual_seed(0)
    reference = _Model(extra)
    model = graphshard.shard(copy.deepcopy(reference))
    backend = graphshard.backend(inductor=False)
    run = torch.compile(model, backend=backend)
    for step in range(2):
        run(_tokens(step)).backward()
        reference(_tokens(step)).backward()
    for (name, want), got in zip(reference.named_parameters(), model.parameters(),
                                 strict=True):
        torch.testing.assert_close(got.grad.full_tensor(), want.grad, msg=name)
    for (name, want), got in zip(reference.named_buffers(), model.buffers(), strict=True):
        torch.testing.assert_close(got, want, msg=name)  # the running statistics too
    (graphs,) = backend.graphs
    assert len(list(region_calls(graphs["fw"]))) == regions
    assert len(list(region_calls(graphs["bw"]))) == regions


def test_a_block_that_writes_a_non_persistent_buffer_is_told_to_compile_inline(one_rank):
    torch.manual_seed(0)
    model = graphshard.shard(_Model("counter"))
    run = torch.compile(model, backend=graphshard.backend(inductor=False))
    with pytest.raises(Exception) as caught:
        run(_tokens(0)).backward()
    (ours,) = [e for e in exception_chain(caught.value)  # torch wraps it
               if isinstance(e, GraphshardRuntimeError)]
    assert "compile_blocks_once=False" in str(ours) and "persistent" in str(ours)
    torch._dynamo.reset()  # inline, as the error says, it trains
    inline = graphshard.shard(_Model("counter"), compile_blocks_once=False)
    torch.compile(inline, backend=graphshard.backend(inductor=False))(_tokens(0)).backward()
    assert all(block.calls.item() == 1 for block in inline.layers)
