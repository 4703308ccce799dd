"""CUDA, NCCL world 1: ``graphshard.CPUOffload``, eager and compiled, both recipes: the model
built on the CPU and sharded onto the cuda mesh with no manual moves, or built on the meta
device, sharded, ``to_empty(device="cpu")`` and initialised. Each trains like one process
and like the run without offload, with host shards, host gradients, buffers on the GPU,
and a lower peak of device memory than the run without offload."""

from __future__ import annotations

import gpu_cases
import pytest
import torch
from gpu_harness import MODES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", ["cpu", "meta"])
def test_cpu_offload(nccl_world, recipe, mode):
    gpu_cases.case_offload(nccl_world, mode, recipe)


@pytest.mark.parametrize("options", [
    {"shard_copy_stream": True}, {"grad_copy_stream": True, "shard_copy_stream": True},
], ids=["shards", "both"])
def test_cpu_offload_copies_on_copy_streams(nccl_world, options):
    gpu_cases.case_offload_copy_streams(nccl_world, options)
