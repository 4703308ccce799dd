"""CUDA, NCCL world 1: training against one process, eager and compiled: fp32, bf16 and
fp16 mixed precision, ``no_sync`` gradient accumulation, activation checkpointing,
``clip_grad_norm_`` on the local path against DTensor's, ``torch.compile``'s mode for
Inductor, and Inductor's C++ wrapper."""

from __future__ import annotations

import gpu_cases
import pytest
import torch
from gpu_harness import MODES, PRECISIONS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_precision(nccl_world, precision, mode):
    gpu_cases.case_precision(nccl_world, mode, precision)


@pytest.mark.parametrize("mode", MODES)
def test_no_sync(nccl_world, mode):
    gpu_cases.case_no_sync(nccl_world, mode)


@pytest.mark.parametrize("mode", MODES)
def test_activation_checkpointing(nccl_world, mode):
    gpu_cases.case_activation_checkpointing(nccl_world, mode)


def test_activation_checkpointing_in_one_graph(nccl_world):
    gpu_cases.case_activation_checkpointing(nccl_world, "compiled", block_regions=False)


@pytest.mark.parametrize("mode", MODES)
def test_clip_grad_norm(nccl_world, mode):
    gpu_cases.case_clip_grad_norm(nccl_world, mode)


def test_compile_mode(nccl_world):
    gpu_cases.case_compile_mode(nccl_world)


def test_cpp_wrapper(nccl_world):
    gpu_cases.case_cpp_wrapper(nccl_world, "bf16")
