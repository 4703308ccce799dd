"""ConvNeXt's head (torchvision's): a channel layer norm over the pooled 1 x 1 map, after one
over the full map. Compiled at one rank it gets eager's gradients.

torch 2.11's CPU fusion drops the dependency of the kernel that writes the pooling's gradient
into fresh zeros on the kernel that zeroes them: plain ``torch.compile`` raises
``UnboundLocalError`` in the generated code, and graphshard's graph trained every parameter
before the head on a zero gradient, silently (docs/torch-versions.md). graphshard's compiles
keep the dependency there (graphshard/safety/fusion_deps.py); on 2.11 this test fails without
that."""

from __future__ import annotations

import torch
from dist_utils import assert_compiled_gets_eager_grads
from torch import nn


class _ChannelNorm(nn.LayerNorm):
    """A layer norm over the channels of an NCHW map (torchvision's ``LayerNorm2d``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape,
                                     self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 4, stride=4), _ChannelNorm(16),
                         nn.AdaptiveAvgPool2d(1), _ChannelNorm(16), nn.Flatten(1),
                         nn.Linear(16, 10))


def _backward(run) -> None:
    pixels = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(2))
    nn.functional.cross_entropy(run(pixels), labels).backward()


def test_a_norm_after_a_pool_to_one_pixel_gets_the_eager_gradients(one_rank):
    assert_compiled_gets_eager_grads(_model, _backward)
