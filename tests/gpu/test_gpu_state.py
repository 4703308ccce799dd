"""CUDA, NCCL world 1: building and loading against one process, eager and compiled:
meta-device construction with ``init_weights`` or a broadcast load, ``dcp.save`` /
``dcp.load`` of the model and optimizer mid-training, and a Hugging Face Llama loaded from
safetensors (each rank its rows, or rank 0 broadcasting)."""

from __future__ import annotations

import gpu_cases
import pytest
import torch
from gpu_harness import MODES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["init", "broadcast"])
def test_meta_init(nccl_world, how, mode):
    gpu_cases.case_meta_init(nccl_world, mode, how)


@pytest.mark.parametrize("mode", MODES)
def test_dcp_save_load(nccl_world, mode, tmp_path):
    gpu_cases.case_dcp(nccl_world, mode, str(tmp_path / "dcp"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    """A random tiny ``LlamaForCausalLM`` (tied embeddings) written by ``save_pretrained``."""
    import hf_jobs

    path = str(tmp_path_factory.mktemp("hf_llama"))
    hf_jobs.save_random(path, tie=True)
    return path


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("way", ["per_rank", "rank0"])
def test_hf_llama_from_safetensors(nccl_world, hf_dir, way, mode):
    gpu_cases.case_hf_llama(nccl_world, mode, hf_dir, way)
