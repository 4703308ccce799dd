"""Warm restarts (``aot_cache``, on by default): AOTAutograd's own cache answers a graph seen
by an earlier process (no tracing, partitioning or graphshard pass runs), and a changed plan
misses.

Three fresh processes on one Inductor cache directory: the first compiles and stores, the
second (same plan) is answered by AOTAutogradCache with the same numbers, and the graphs it
reports (traced when read) are the first one's; the third (another plan) must not reuse the
first plan's code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
backend = graphshard.backend(prefetch_depth=int(sys.argv[2]))
compiled = torch.compile(model, backend=backend)
loss = compiled(torch.randn(4, 16)).square().mean()
loss.backward()
grads = [p.grad.full_tensor().sum().item() for p in model.parameters()]
at_compile = sorted(backend._graphs[0])  # before anything reads ``graphs``
code = {stage: gm.code for stage, gm in backend.graphs[0].items() if stage != "dynamo"}
print(json.dumps({"aot": dict(counters["aot_autograd"]), "hits": backend.aot_cache_hits,
                  "at_compile": at_compile, "code": code, "loss": loss.item(),
                  "grads": grads}))
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
        assert graphshard.backend().aot_cache is False  # the default turns itself off
        return
    first = _run(tmp_path, "s1", 1)
    assert first["aot"].get("autograd_cache_saved") == 1 and first["hits"] == 0
    assert first["at_compile"] == ["bw", "dynamo", "fw", "joint"]
    second = _run(tmp_path, "s2", 1)
    assert second["aot"].get("autograd_cache_hit") == 1 and second["hits"] == 1
    assert second["at_compile"] == ["dynamo"]  # no pass ran: nothing after the Dynamo stage
    assert second["code"] == first["code"]  # read later, the same graphs as a compile's
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


def test_the_key_holds_each_ranks_local_shard_layout(fake2):
    """An uneven split: rank 0 holds 15 of 29 rows, rank 1 holds 14, under one global shape.
    AOTAutogradCache's own key sees only the global shape, so the key must tell them apart
    (in a suite run, rank 1 once loaded rank 0's code and failed its size assertion)."""
    from torch._inductor import config
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from graphshard.compiler.cache_key import plan_in_cache_key
    from graphshard.passes import Plan

    mesh = init_device_mesh("cpu", (2,))

    def shard_of(rows: int) -> DTensor:
        return DTensor.from_local(torch.zeros(rows, 13), mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size([29, 13]), stride=(13, 1))

    keys = []
    for rows in (15, 14, 15):
        with plan_in_cache_key(Plan(), [torch.ones(2), shard_of(rows)]):
            keys.append(config.joint_custom_pre_pass.uuid())
    assert keys[0] != keys[1] and keys[0] == keys[2]
