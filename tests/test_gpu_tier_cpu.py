"""The CUDA tier's cases (``tests/gpu``) run eagerly on the CPU, so that their code and their
one-process references are proven right where no GPU is: at gloo world 1 and in the CPU
fake world of 8 (``bench.fake_world``), whose reference is the tiled model
(``tests/gpu/gpu_harness.py``). Compiled runs, CPU offload and NCCL are the GPU's; the
compiled path on the CPU is tested by the rest of the suite.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import gpu_cases  # noqa: E402
from gpu_harness import fake_world, world1  # noqa: E402


@pytest.fixture
def gloo_world():
    with world1("cpu") as world:
        yield world


@pytest.fixture
def cpu_fake_world():
    with fake_world(8, "cpu") as world:
        yield world


def test_world1_cases_run_eagerly_on_the_cpu(gloo_world, tmp_path):
    for precision in ("fp32", "bf16", "fp16"):
        gpu_cases.case_precision(gloo_world, "eager", precision)
    gpu_cases.case_no_sync(gloo_world, "eager")
    gpu_cases.case_activation_checkpointing(gloo_world, "eager")
    gpu_cases.case_clip_grad_norm(gloo_world, "eager")
    for how in ("init", "broadcast"):
        gpu_cases.case_meta_init(gloo_world, "eager", how)
    gpu_cases.case_dcp(gloo_world, "eager", str(tmp_path / "dcp"))


def test_world1_hf_llama_runs_eagerly_on_the_cpu(gloo_world, tmp_path):
    import hf_jobs

    hf_jobs.save_random(str(tmp_path), tie=True)
    for way in ("per_rank", "rank0"):
        gpu_cases.case_hf_llama(gloo_world, "eager", str(tmp_path), way)


def test_fake_world_cases_match_the_tiled_reference_on_the_cpu(cpu_fake_world):
    for precision in ("fp32", "bf16", "fp16"):
        gpu_cases.case_precision(cpu_fake_world, "eager", precision)
    gpu_cases.case_no_sync(cpu_fake_world, "eager")
    gpu_cases.case_hsdp(cpu_fake_world, "eager")
    gpu_cases.case_gradient_divide_factor(cpu_fake_world, "eager", replicas=2)
    gpu_cases.case_tensor_parallel(cpu_fake_world, "eager")
    gpu_cases.case_activation_checkpointing(cpu_fake_world, "eager")
    gpu_cases.case_clip_grad_norm(cpu_fake_world, "eager")
    for how in ("init", "broadcast"):
        gpu_cases.case_meta_init(cpu_fake_world, "eager", how)
