"""Blocks that concatenate a skip connection train compiled as they do eagerly: the gradient
of a concatenated operand is a slice at a storage offset, which torch's region lowering read
at twice the offset (graphshard/safety/region_offsets.py)."""

from __future__ import annotations

import torch
import torch.compiler.config as compiler_config
from dist_utils import assert_eager_grads
from torch import nn
from torch._inductor.ir import InvokeSubgraph

import graphshard
from graphshard.safety import region_offsets
from graphshard.safety.region_offsets import CACHE_TAG, region_offsets_counted_once

C = 8


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(2, 2 * C)
        self.conv = nn.Conv2d(2 * C, C, 3, padding=1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.nn.functional.silu(self.norm(h)))


class _Up(nn.Module):
    """A U-Net's up block: each layer concatenates the next skip connection."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])

    def forward(self, h: torch.Tensor, skips: tuple[torch.Tensor, ...]) -> torch.Tensor:
        for layer in self.layers:
            h = layer(torch.cat([h, skips[-1]], dim=1))
            skips = skips[:-1]
        return h


class _UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(4, C, 1)
        self.down = nn.Conv2d(C, C, 3, padding=1)
        self.mid = nn.Conv2d(C, C, 3, padding=1)
        self.ups = nn.ModuleList([_Up(), _Up()])  # identical: one region body, called twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s0 = self.stem(x)
        s1 = self.down(s0)
        skips = (s0, s1, s0, s1)
        h = self.mid(s1)
        for up in self.ups:
            h, skips = up(h, skips[-2:]), skips[:-2]
        return h


def _backward(model) -> None:
    x = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    model(x).pow(2).mean().backward()


def test_blocks_concatenating_skips_get_the_eager_gradients(one_rank, tmp_path):
    torch.manual_seed(0)
    reference = _UNet()
    _backward(reference)
    torch.manual_seed(0)
    model = graphshard.shard(_UNet())
    _backward(torch.compile(model, backend=graphshard.backend(dump_dir=str(tmp_path))))
    backward = "\n".join(path.read_text() for path in tmp_path.rglob("bw_00_input.txt"))
    assert backward.count("invoke_subgraph(") == 2  # the blocks stayed region calls
    assert_eager_grads(model, reference)


def test_graphshards_compiles_tag_the_cache_keys_with_it():
    with compiler_config.patch(cache_key_tag="users-tag"), region_offsets_counted_once():
        assert compiler_config.cache_key_tag.split("|") == ["users-tag", CACHE_TAG]


def test_the_lowering_is_patched_once_and_for_good(monkeypatch):
    create = InvokeSubgraph.__dict__["create"]
    monkeypatch.setattr(region_offsets.REGION_OFFSETS_COUNTED_ONCE, "_applied", False)
    monkeypatch.setattr(InvokeSubgraph, "create", create)
    torchs_own = getattr(create.__func__, "torch_create", create.__func__)
    monkeypatch.setattr(InvokeSubgraph, "create", classmethod(torchs_own))
    region_offsets.region_offsets_counted_once_in_this_process()
    patched = InvokeSubgraph.__dict__["create"].__func__
    assert patched.torch_create is torchs_own
    region_offsets.region_offsets_counted_once_in_this_process()  # idempotent
    with region_offsets_counted_once():
        assert InvokeSubgraph.__dict__["create"].__func__ is patched
    assert InvokeSubgraph.__dict__["create"].__func__ is patched  # for good
