"""Trace a sharded model without ranks or memory: fake process group + fake tensors.

Everything the compiler does (Dynamo, AOTAutograd, the passes) runs on shapes only, so a
70B-parameter model at 1024 ranks is planned on a laptop: parameters, activations and
collectives are fake tensors, nothing is allocated, nothing is sent.

With ``tp > 1`` the ranks form a ``(dp, tp)`` mesh: the factory's tensor-parallel plan is
applied with torch's ``parallelize_module`` on ``mesh["tp"]``, then ``shard()`` shards over
``mesh["dp"]``, as a user composing graphshard with tensor parallelism does.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Shard

from graphshard.api.sharding import shard, shard_state
from graphshard.compiler.backend import GraphshardBackend
from graphshard.errors import GraphshardRuntimeError, GraphshardTypeError, GraphshardValueError
from graphshard.passes.markers import is_unshard, marker_args

__all__ = [
    "FAKE_ACCELERATOR",
    "fake_process_group",
    "register_fake_accelerator",
    "load_factory",
    "trace_offline",
    "trace_step_offline",
    "OfflineTrace",
    "mesh_shape",
    "scalar_loss",
]

# ``factory()`` returns ``(model, example_inputs)``, or ``(model, example_inputs, tp_plan)``
# where ``tp_plan`` is a ``parallelize_module`` plan (a ParallelStyle, or a dict of module
# name -> ParallelStyle) used when tracing with ``tp > 1``.
Factory = Callable[[], tuple]


# The device name :func:`register_fake_accelerator` gives a stand-in accelerator.
FAKE_ACCELERATOR = "fakeaccel"


def register_fake_accelerator() -> str:
    """Make ``fakeaccel`` a device of this process and return its name: a stand-in
    accelerator for tracing on fake tensors where a CPU-only torch has none (CPU offload
    needs a device other than the host).

    A CPU-only torch cannot differentiate through fake ``cuda`` tensors (autograd asks
    CUDA's device guard, which is not built in). A PrivateUse1 device registered from Python
    has a device guard, so Dynamo, AOTAutograd, the partitioner and the passes run as for
    ``cuda``. The registration is process-wide and cannot be undone (the device becomes
    torch's accelerator, which breaks CUDA autograd on a GPU machine): call it only in a
    process of its own. Autograd then runs every node on the calling thread: the engine
    would run the device's nodes on a thread of their own, and two threads in one
    ``FakeTensorMode`` at once trip its re-entrancy check."""
    torch.autograd.set_multithreading_enabled(False)
    if torch._C._get_privateuse1_backend_name() != FAKE_ACCELERATOR:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(FAKE_ACCELERATOR)
    return FAKE_ACCELERATOR


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """A process group of ``world_size`` fake ranks in this one process (no communication)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise GraphshardRuntimeError(
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
    directory) or an importable module; FACTORY returns ``(model, example_inputs_tuple)``,
    or ``(model, example_inputs_tuple, tp_plan)`` for tensor parallelism (``--tp``)."""
    if ":" not in spec:
        raise GraphshardValueError(
            f"expected MODULE:FACTORY (e.g. mymodels.py:build), got {spec!r}"
        )
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
        raise GraphshardValueError(f"{module_name} has no function {factory_name!r}")
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
    raise GraphshardTypeError(
        f"cannot make a loss out of a {type(output).__name__}; return a tensor"
    )


def mesh_shape(world_size: int, tp: int = 1) -> tuple[int, int]:
    """``(dp, tp)`` for ``world_size`` ranks in all, ``tp`` of them per tensor-parallel group;
    ValueError unless ``tp`` divides ``world_size``."""
    if tp < 1 or world_size < 1:
        raise GraphshardValueError(f"world size ({world_size}) and tp ({tp}) must be positive")
    if world_size % tp:
        raise GraphshardValueError(
            f"tp ({tp}) must divide the world size ({world_size}): the world size counts all "
            f"ranks, dp x tp (e.g. --world-size {tp * max(1, world_size // tp)} --tp {tp})"
        )
    return world_size // tp, tp


@dataclass
class OfflineTrace:
    """What :func:`trace_step_offline` traced: the graphs and the mesh they run on."""

    graphs: list[dict[str, fx.GraphModule]]  # GraphshardBackend.graphs
    dp: int  # ranks graphshard shards across
    tp: int  # ranks of one tensor-parallel group (1: no tensor parallelism)
    groups: dict[str, str]  # process group name -> mesh dimension ("dp" or "tp")
    model_params: int  # parameter elements of the whole model (tied ones once)
    tp_split_params: int  # of which tensor parallelism splits across the tp ranks
    pass_seconds: float = 0.0  # wall time in graphshard's passes (GraphshardBackend)
    # names of the sharded parameters that take no gradient (frozen: no reduce-scatter, no
    # gradient, no optimizer state)
    frozen: frozenset[str] = frozenset()


def _unpack(built: Any, tp: int) -> tuple[nn.Module, tuple, Any]:
    if not isinstance(built, (tuple, list)) or len(built) not in (2, 3):
        raise GraphshardValueError(
            "the factory must return (model, example_inputs) or (model, example_inputs, "
            f"tp_plan), got {type(built).__name__}"
        )
    model, inputs, *rest = built
    plan = rest[0] if rest else None
    if tp > 1 and plan is None:
        raise GraphshardValueError(
            f"tp={tp} needs a tensor-parallel plan: let the factory return (model, inputs, "
            "tp_plan), tp_plan being what torch.distributed.tensor.parallel.parallelize_module"
            " takes (e.g. {'layers.0.attention.wq': ColwiseParallel(), ...}; the Llama presets"
            " use graphshard.models.llama.tensor_parallel_plan)"
        )
    return model, tuple(inputs), plan


def _param_counts(model: nn.Module) -> tuple[int, int]:
    """All parameter elements of the sharded ``model`` and those tensor parallelism splits."""
    total = split = 0
    for entry in shard_state(model).params:
        numel = entry.param.numel()  # the global size of the DTensor parameter
        total += numel
        if entry.tp is not None and any(isinstance(p, Shard) for p in entry.tp.placements):
            split += numel  # a TP plan splits it
    return total, split


def trace_step_offline(
    factory: Factory,
    world_size: int,
    *,
    tp: int = 1,
    shard_options: dict | None = None,
    backward: bool = True,
    **backend_options: Any,
) -> OfflineTrace:
    """Shard, compile and run one step of ``factory()``'s model on fake ranks and tensors.

    ``world_size`` counts all ranks. With ``tp > 1`` they form a ``(world_size // tp, tp)``
    mesh named ``("dp", "tp")``: the factory's plan (its third return value) is applied on
    ``mesh["tp"]`` and the model sharded over ``mesh["dp"]``; the inputs are then one dp
    rank's, the same on every tp rank. ``backend_options`` go to :class:`GraphshardBackend`
    (``dump_dir`` included).
    """
    dp, tp = mesh_shape(world_size, tp)
    with fake_process_group(world_size) as world:
        mesh = None
        if tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            model, inputs, plan = _unpack(factory(), tp)
            if mesh is not None:
                from torch.distributed.tensor.parallel import parallelize_module

                parallelize_module(model, mesh["tp"], plan)
                shard(model, mesh["dp"], **(shard_options or {}))
            else:
                shard(model, **(shard_options or {}))
        if mesh is None:
            groups = {world.group_name: "dp"}
        else:
            groups = {mesh["dp"].get_group().group_name: "dp",
                      mesh["tp"].get_group().group_name: "tp"}
        total, split = _param_counts(model)
        backend = GraphshardBackend(inductor=False, **backend_options)
        compiled = torch.compile(model, backend=backend)
        with mode:
            output = compiled(*inputs)
            if backward:
                scalar_loss(output).backward()
        frozen = frozenset(name for entry in shard_state(model).params
                           if not entry.param.requires_grad for name in entry.names)
        for stages in backend.graphs:  # reshard_after_forward=k: its groups are dp's too
            for gm in stages.values():
                for node in gm.graph.nodes:
                    if is_unshard(node) and marker_args(node).reshard_group:
                        groups.setdefault(marker_args(node).reshard_group, "dp")
        return OfflineTrace(backend.graphs, dp, tp, groups, total, split,
                            sum(backend.pass_seconds.values()), frozen)


def trace_offline(
    factory: Factory, world_size: int, **options: Any
) -> list[dict[str, fx.GraphModule]]:
    """:func:`trace_step_offline` (same arguments), returning only the backend's graphs: one
    dict of stage -> transformed graph per compiled graph."""
    return trace_step_offline(factory, world_size, **options).graphs
