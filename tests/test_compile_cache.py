"""Inductor's FX-graph cache hits for graphshard graphs across processes.

DTensor parameters bring their DeviceMesh into the graphs; its pickled state used to carry a
per-process hash into the cache key, so a restarted job (or another rank, or the next test)
never reused a compiled graph. Two processes with different hash seeds, one cache directory:
the second compiles nothing and computes the same numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
compiled = torch.compile(model, backend="graphshard")
loss = compiled(torch.randn(4, 16)).square().mean()
loss.backward()
grads = [p.grad.full_tensor().sum().item() for p in model.parameters()]
print(json.dumps({"counters": dict(counters["inductor"]), "loss": loss.item(), "grads": grads}))
dist.destroy_process_group()
"""


def _run(tmp_path: Path, seed: str, name: str) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(ROOT),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    done = subprocess.run([sys.executable, "-c", _JOB, str(tmp_path / name)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_reuses_the_compiled_graphs(tmp_path):
    first = _run(tmp_path, "1", "store1")
    second = _run(tmp_path, "2", "store2")
    graphs = first["counters"].get("fxgraph_cache_miss", 0)
    assert graphs == 2  # the forward and the backward, compiled and stored
    assert second["counters"].get("fxgraph_cache_hit", 0) == graphs
    assert second["counters"].get("fxgraph_cache_miss", 0) == 0
    assert second["loss"] == first["loss"] and second["grads"] == first["grads"]


def test_the_mesh_pickles_as_before_outside_a_compile():
    """The fix is scoped to graphshard's compile: a mesh pickled elsewhere is unchanged."""
    import pickle

    from torch.distributed.device_mesh import DeviceMesh

    from graphshard.compiler.cache_key import meshes_pickle_without_hash

    state = {"_hash": 123, "_device_type": "cpu"}
    mesh = DeviceMesh.__new__(DeviceMesh)
    mesh.__dict__.update(state)
    with meshes_pickle_without_hash():
        inside = mesh.__getstate__()
    assert "_hash" not in inside and inside["_device_type"] == "cpu"
    assert mesh.__getstate__()["_hash"] == 123
    assert pickle.loads(pickle.dumps(mesh)).__dict__["_hash"] == 123
