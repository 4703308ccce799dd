"""Warm restarts with ``aot_cache=True``: AOTAutograd's own cache answers a graph seen by an
earlier process (no tracing, partitioning or graphshard pass runs), and a changed plan misses.

Three fresh processes on one Inductor cache directory: the first compiles and stores, the
second (same plan) is answered by AOTAutogradCache with the same numbers, the third (another
plan) must not reuse the first plan's code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import graphshard
from graphshard.compiler.cache_key import aot_cache_unsupported
from graphshard.errors import GraphshardNotImplementedError

ROOT = Path(__file__).resolve().parents[1]

_JOB = r"""
import json, sys, torch, torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
import graphshard
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 8))
graphshard.shard(model)
backend = graphshard.backend(aot_cache=True, prefetch_depth=int(sys.argv[2]))
compiled = torch.compile(model, backend=backend)
loss = compiled(torch.randn(4, 16)).square().mean()
loss.backward()
grads = [p.grad.full_tensor().sum().item() for p in model.parameters()]
print(json.dumps({"aot": dict(counters["aot_autograd"]), "hits": backend.aot_cache_hits,
                  "stages": sorted(backend.graphs[0]), "loss": loss.item(), "grads": grads}))
dist.destroy_process_group()
"""


def _run(tmp_path: Path, name: str, prefetch_depth: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ind"))
    done = subprocess.run([sys.executable, "-c", _JOB, str(tmp_path / name), str(prefetch_depth)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_restart_is_answered_by_aot_autograd_cache_and_a_new_plan_is_not(tmp_path):
    why = aot_cache_unsupported()
    if why is not None:  # torch 2.11: its AOTAutogradCache refuses DTensor.to_local()
        with pytest.raises(GraphshardNotImplementedError, match="aot_cache"):
            graphshard.backend(aot_cache=True)
        return
    first = _run(tmp_path, "s1", 1)
    assert first["aot"].get("autograd_cache_saved") == 1 and first["hits"] == 0
    second = _run(tmp_path, "s2", 1)
    assert second["aot"].get("autograd_cache_hit") == 1 and second["hits"] == 1
    assert second["stages"] == ["dynamo"]  # no pass ran: nothing after the Dynamo stage
    assert second["loss"] == first["loss"] and second["grads"] == first["grads"]
    other_plan = _run(tmp_path, "s3", 0)
    assert other_plan["aot"].get("autograd_cache_hit", 0) == 0 and other_plan["hits"] == 0
    assert other_plan["loss"] == first["loss"]


def test_the_key_follows_the_plan():
    from torch._inductor import config

    from graphshard.compiler.cache_key import plan_in_cache_key
    from graphshard.passes import Plan

    with plan_in_cache_key(Plan(prefetch_depth=1)):
        one = config.joint_custom_pre_pass.uuid()
        with plan_in_cache_key(Plan(prefetch_depth=1)):  # nested: replaced, not chained
            assert config.joint_custom_pre_pass.uuid() == one
    with plan_in_cache_key(Plan(prefetch_depth=0)):
        assert config.joint_custom_pre_pass.uuid() != one
    assert config.joint_custom_pre_pass is None
