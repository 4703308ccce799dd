"""examples/from_fsdp2.py: the FSDP2 script and its graphshard counterpart train alike, and
graphshard resumes from the DCP checkpoint FSDP2 wrote (world 2, gloo, fp32)."""

from __future__ import annotations

import pytest
from docs_jobs import run_from_fsdp2

COMMON = ["--model", "tiny", "--param-dtype", "fp32", "--steps", "4"]


def test_fsdp2_and_graphshard_train_alike():
    fsdp2, graphshard, resumed = run_from_fsdp2(
        ["--impl", "fsdp2", "--no-compile", *COMMON,
         "--checkpoint-dir", "{tmp}/ckpt", "--save-every", "2"],
        ["--impl", "graphshard", *COMMON],
        ["--impl", "graphshard", *COMMON, "--resume", "{tmp}/ckpt/step_2"],
    )
    assert len(fsdp2) == len(graphshard) == 4 and len(resumed) == 2
    assert graphshard == pytest.approx(fsdp2, abs=1e-5, rel=0)
    assert resumed == pytest.approx(fsdp2[2:], abs=1e-5, rel=0)
    assert fsdp2[-1] < fsdp2[0]
