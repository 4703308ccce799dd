"""CUDA fake world of 8 (``bench.fake_world``): the collectives move real data on the GPU,
the other 7 ranks are imagined to hold what rank 0 holds. Each case is checked against one
process training the model the fake world computes (rank 0's blocks tiled, see
``gpu_harness``), eager and compiled: fp32, bf16 and fp16 mixed precision, ``no_sync``,
HSDP 2 x 4 (also summing with ``gradient_divide_factor=1.0``), tensor parallel dp 4 x tp 2,
activation checkpointing, ``step_prefetch``, coalesced collectives, ``clip_grad_norm_`` on
the local path against DTensor's, and meta-device construction with ``init_weights`` or a
broadcast load."""

from __future__ import annotations

import gpu_cases
import pytest
import torch
from gpu_harness import MODES, PRECISIONS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_precision(fake_world8, precision, mode):
    gpu_cases.case_precision(fake_world8, mode, precision)


@pytest.mark.parametrize("mode", MODES)
def test_no_sync(fake_world8, mode):
    gpu_cases.case_no_sync(fake_world8, mode)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_divide_factor_hsdp_2x4(fake_world8, mode):
    gpu_cases.case_gradient_divide_factor(fake_world8, mode, replicas=2)


@pytest.mark.parametrize("mode", MODES)
def test_hsdp_2x4(fake_world8, mode):
    gpu_cases.case_hsdp(fake_world8, mode, replicas=2)


@pytest.mark.parametrize("mode", MODES)
def test_tensor_parallel_dp4_tp2(fake_world8, mode):
    gpu_cases.case_tensor_parallel(fake_world8, mode, tp=2)


@pytest.mark.parametrize("mode", MODES)
def test_activation_checkpointing(fake_world8, mode):
    gpu_cases.case_activation_checkpointing(fake_world8, mode)


@pytest.mark.parametrize("mode", MODES)
def test_clip_grad_norm(fake_world8, mode):
    gpu_cases.case_clip_grad_norm(fake_world8, mode)


def test_step_prefetch(fake_world8):
    gpu_cases.case_step_prefetch(fake_world8)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_coalesced_collectives(fake_world8, precision):
    gpu_cases.case_coalesced(fake_world8, precision)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["init", "broadcast"])
def test_meta_init(fake_world8, how, mode):
    gpu_cases.case_meta_init(fake_world8, mode, how)
