"""Hugging Face architectures unlike Llama (T5 encoder-decoder, Mamba), sharded with
the defaults on 2 gloo ranks, eager and compiled, train as one process does (one launch,
jobs in ``hf_architectures_jobs``)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks

WORLD = 2


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    pytest.importorskip("transformers")
    import hf_architectures_jobs as jobs

    return run_ranks(jobs.run_jobs, WORLD, [(n, m) for n in jobs.MODELS for m in jobs.MODES])


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("name", ["t5", "mamba"])
def test_trains_like_one_process(ranks, name, mode):
    import hf_architectures_jobs as jobs

    want = jobs.reference(name, WORLD)
    for rank, result in enumerate(ranks):
        got = result[(name, mode)]
        assert "error" not in got, f"rank {rank} raised:\n{got.get('error')}"
    mean = [sum(r[(name, mode)]["losses"][s] for r in ranks) / WORLD for s in range(jobs.STEPS)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(want["losses"]), rtol=1e-5,
                               atol=1e-6)
    for result in ranks:
        state = result[(name, mode)]["state"]
        assert state.keys() == want["state"].keys()
        for key, value in want["state"].items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
