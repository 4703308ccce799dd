"""Trace a sharded model without ranks or memory: fake process group + fake tensors.

Everything the compiler does (Dynamo, AOTAutograd, the passes) runs on shapes only, so a
70B-parameter model at 1024 ranks is planned on a laptop: parameters, activations and
collectives are fake tensors, nothing is allocated, nothing is sent.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from graphshard.compiler import GraphshardBackend
from graphshard.sharding import shard

__all__ = ["fake_process_group", "load_factory", "trace_offline", "scalar_loss"]

Factory = Callable[[], tuple[nn.Module, tuple]]


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """A process group of ``world_size`` fake ranks in this one process (no communication)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "A process group is already initialised in this process; offline tracing needs "
            "its own fake one. Run it in a fresh process (e.g. the `graphshard` CLI)."
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def load_factory(spec: str) -> Factory:
    """``MODULE:FACTORY`` -> the function. MODULE is a .py file (path or in the current
    directory) or an importable module; FACTORY returns ``(model, example_inputs_tuple)``."""
    if ":" not in spec:
        raise ValueError(f"expected MODULE:FACTORY (e.g. mymodels.py:build), got {spec!r}")
    module_name, factory_name = spec.rsplit(":", 1)
    path = Path(module_name if module_name.endswith(".py") else f"{module_name}.py")
    if path.is_file():
        loader = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[path.stem] = module
        loader.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ValueError(f"{module_name} has no function {factory_name!r}")
    return factory


def scalar_loss(output: Any) -> torch.Tensor:
    """A scalar to call ``backward()`` on: ``output.loss`` if present, else a sum."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor):
        return output.float().sum()
    if isinstance(output, (tuple, list)):
        return sum(scalar_loss(o) for o in output if isinstance(o, torch.Tensor))
    raise TypeError(f"cannot make a loss out of a {type(output).__name__}; return a tensor")


def trace_offline(
    factory: Factory,
    world_size: int,
    *,
    shard_options: dict | None = None,
    backward: bool = True,
    **backend_options: Any,
) -> list[dict[str, fx.GraphModule]]:
    """Shard, compile and run one step of ``factory()``'s model on fake ranks and tensors.

    Returns the backend's graphs (one dict of stage -> transformed graph per compiled graph).
    ``backend_options`` go to :class:`GraphshardBackend` (``dump_dir`` included).
    """
    with fake_process_group(world_size):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            model, inputs = factory()
            shard(model, **(shard_options or {}))
        backend = GraphshardBackend(inductor=False, **backend_options)
        compiled = torch.compile(model, backend=backend)
        with mode:
            output = compiled(*inputs)
            if backward:
                scalar_loss(output).backward()
        return backend.graphs
