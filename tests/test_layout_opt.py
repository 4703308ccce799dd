"""A convolution net from Hugging Face diffusers trains compiled as it does eagerly: torch
2.13's layout optimization drops the upsampler's gradient of its ``UNet2DConditionModel``
(graphshard/safety/layout_opt.py), so graphshard's compiles run without it there."""

from __future__ import annotations

import pytest
import torch
from dist_utils import assert_compiled_gets_eager_grads

from graphshard._torch_version import installed_torch_version
from graphshard.safety.layout_opt import BROKEN_RELEASES, layout_optimization_off_where_broken


def _unet() -> torch.nn.Module:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(16, 32), norm_num_groups=8,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"), cross_attention_dim=24, attention_head_dim=8)


def _backward(model) -> None:
    gen = torch.Generator().manual_seed(0)
    sample = torch.randn(2, 4, 8, 8, generator=gen)
    context = torch.randn(2, 5, 24, generator=gen)
    out = model(sample, torch.tensor([1, 5]), encoder_hidden_states=context).sample
    torch.nn.functional.mse_loss(out, torch.randn(out.shape, generator=gen)).backward()


def test_a_diffusers_unet_compiled_gets_the_eager_gradients(one_rank):
    assert_compiled_gets_eager_grads(_unet, _backward)


def test_layout_optimization_is_off_only_on_the_broken_release():
    from torch._inductor import config

    before = config.layout_optimization
    with layout_optimization_off_where_broken():
        inside = config.layout_optimization
    assert config.layout_optimization == before
    broken = installed_torch_version() in BROKEN_RELEASES
    assert inside is (False if broken else before)
