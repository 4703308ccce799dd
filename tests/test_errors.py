"""Bad input to shard(): each gets an error that says what to change."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from graph_utils import fake_process_group
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import graphshard
from graphshard.api.sharding import is_sharded, shard_state


def test_no_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        graphshard.shard(nn.Linear(4, 4))


def test_shard_twice():
    with fake_process_group(2):
        model = graphshard.shard(nn.Linear(4, 4))
        with pytest.raises(RuntimeError, match="already sharded"):
            graphshard.shard(model)


def test_shard_twice_through_compiled_wrapper():
    with fake_process_group(2):
        model = torch.compile(graphshard.shard(nn.Linear(4, 4)), backend="graphshard")
        with pytest.raises(RuntimeError, match="already sharded"):
            graphshard.shard(model)


@pytest.mark.parametrize("factor", [0, -2.0, float("nan"), float("inf"), "1", True])
def test_a_gradient_divide_factor_must_be_a_positive_number(factor):
    with fake_process_group(2):
        model = nn.Linear(4, 4)
        with pytest.raises(ValueError, match="gradient_divide_factor must be None .* positive "
                                             "number"):
            graphshard.shard(model, gradient_divide_factor=factor)
        assert not is_sharded(model)  # refused before anything was replaced


def test_ranks_compare_their_gradient_divide_factor():
    """Ranks that divide by different factors would reduce with different ops: the option
    is in the fingerprint every rank compares at shard()."""
    from graphshard.safety.fingerprint import shard_fingerprint

    with fake_process_group(2):
        model = graphshard.shard(nn.Linear(4, 4), gradient_divide_factor=1)
        fingerprint = shard_fingerprint(shard_state(model))
        plain = shard_fingerprint(shard_state(graphshard.shard(nn.Linear(4, 4))))
    assert fingerprint["shard option gradient_divide_factor"] == "1.0"
    assert plain["shard option gradient_divide_factor"] == "None"


def test_three_dimensional_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(8):
        mesh = init_device_mesh("cpu", (2, 2, 2))
        with pytest.raises(ValueError, match="1-D DeviceMesh.*2-D one.*3 dimensions"):
            graphshard.shard(nn.Linear(4, 4), mesh)


def test_one_dimensional_mesh_is_accepted():
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (4,))
        model = graphshard.shard(nn.Linear(6, 4), mesh)
        shards = dict(model.named_parameters())
        assert shards["weight"].shape == (4, 6) and shards["weight"].device_mesh is mesh
        assert shards["weight"].to_local().shape == (1, 6)  # 4 rows over 4 ranks
        assert shards["bias"].to_local().shape == (1,)
        # outside forward an attribute read is the sharded parameter (FSDP2's convention)
        assert model.weight is shards["weight"]


def test_forward_of_a_meta_model_names_to_empty():
    with fake_process_group(2):
        with torch.device("meta"):
            model = nn.Linear(4, 4)
        graphshard.shard(model)  # allocates nothing: the local rows are meta tensors
        assert model.weight.to_local().is_meta and model.weight.to_local().shape == (2, 4)
        with pytest.raises(graphshard.ShardedModelError,
                           match=r"'weight' is still on the meta device.*model\.to_empty\("):
            model(torch.randn(3, 4))
        compiled = torch.compile(model, backend="graphshard")
        with pytest.raises(Exception, match=r"'weight' is still on the meta device.*to_empty"):
            compiled(torch.randn(3, 4))


def test_parameter_in_two_buckets():
    with fake_process_group(2):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        with pytest.raises(ValueError, match=r"buckets\[0\] and buckets\[1\]"):
            graphshard.shard(model, buckets=[[model[0]], [model]])


@pytest.mark.parametrize("group", ["empty", "without parameters"])
def test_a_bucket_without_parameters_is_refused(group):
    """An empty group (a list comprehension that matched nothing) or one of modules without
    parameters made an empty bucket before, silently."""
    with fake_process_group(2):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        buckets = [[model[0]], [] if group == "empty" else [model[1]]]
        with pytest.raises(ValueError, match=r"buckets\[1\] holds no parameters"):
            graphshard.shard(model, buckets=buckets)


def test_bucket_module_outside_the_model():
    with fake_process_group(2):
        model = nn.Sequential(nn.Linear(4, 4))
        with pytest.raises(ValueError, match="not a submodule"):
            graphshard.shard(model, buckets=[nn.Linear(2, 2)])


def test_checkpoint_of_unsharded_model(tmp_path):
    with pytest.raises(ValueError, match="call graphshard.shard"):
        graphshard.save_checkpoint(tmp_path, nn.Linear(2, 2), step=1)
    assert not any(tmp_path.iterdir())


def test_unknown_backend_option_names_the_known_ones():
    with pytest.raises(TypeError, match="prefetch_dept.*known: .*prefetch_depth"):
        graphshard.backend(prefetch_dept=2)


@pytest.mark.parametrize(
    "options,message",
    [
        ({"bucketing": "layers"}, "bucketing must be one of"),
        ({"prefetch_depth": -1}, "prefetch_depth must be >= 0"),
        ({"bucket_bytes": 0}, "bucket_bytes must be positive"),
        ({"reduce_scatter_via": "ring"}, "reduce_scatter_via must be one of"),
    ],
)
def test_bad_plan_values(options, message):
    with pytest.raises(ValueError, match=message):
        graphshard.backend(**options)


# (option, bad value, error, what the message says): every backend and shard() option, each
# checked when it is given (graphshard.backend(...) / shard()), never at the first compile.
BAD_OPTIONS = [
    ("prefetch_depth", "2", TypeError, r"prefetch_depth must be an int .*got '2' \(str\)"),
    ("prefetch_depth", 1.5, TypeError, r"prefetch_depth must be an int .*got 1\.5 \(float\)"),
    ("prefetch_depth", True, TypeError, r"prefetch_depth must be an int .*got True \(bool\)"),
    ("prefetch_depth", -1, ValueError, r"prefetch_depth must be >= 0 .*got -1"),
    ("max_unsharded_bytes", "1GB", TypeError,
     r"max_unsharded_bytes must be an int .*2 \* 2\*\*30, or None.*got '1GB' \(str\)"),
    ("max_unsharded_bytes", 1e9, TypeError, r"max_unsharded_bytes must be an int .*\(float\)"),
    ("max_unsharded_bytes", 0, ValueError, r"max_unsharded_bytes must be positive .*got 0"),
    ("bucketing", "layers", ValueError,
     r"bucketing must be one of \('block', 'size', 'auto'\), got 'layers'"),
    ("bucketing", None, TypeError, r"bucketing must be one of .*got None"),
    ("bucket_bytes", "25MB", TypeError, r"bucket_bytes must be an int .*got '25MB' \(str\)"),
    ("bucket_bytes", 0, ValueError, r"bucket_bytes must be positive .*got 0"),
    ("profile", 3, TypeError, r"profile must be a hardware profile's name .*got 3 \(int\)"),
    ("profile", "h100-nvlnk", ValueError, r"unknown hardware profile 'h100-nvlnk'.*h100-nvlink"),
    ("reshard_last_bucket", 1, TypeError, r"reshard_last_bucket must be True or False, got 1"),
    ("step_prefetch", "no", TypeError, r"step_prefetch must be True or False, got 'no' \(str\)"),
    ("split_last_reduce", None, TypeError, r"split_last_reduce must be True or False, got None"),
    ("grad_copy_stream", 1, TypeError, r"grad_copy_stream must be True or False, got 1 \(int\)"),
    ("shard_copy_stream", "yes", TypeError,
     r"shard_copy_stream must be True or False, got 'yes' \(str\)"),
    ("reduce_scatter_via", "ring", ValueError, r"reduce_scatter_via must be one of .*'ring'"),
    ("all_gather_via", "grouped", ValueError,
     r"all_gather_via must be one of \('flat', 'coalesced'\), got 'grouped'"),
    ("dump_dir", 123, TypeError, r"dump_dir must be a directory path .*got 123 \(int\)"),
    ("inductor", "no", TypeError, r"inductor must be True .*or False .*got 'no' \(str\)"),
    ("shard:reshard_after_forward", "no", TypeError,
     r"reshard_after_forward must be True .*ZeRO-3.*or False .*ZeRO-2.*got 'no' \(str\)"),
    ("shard:mesh", "cpu", TypeError, r"mesh must be a DeviceMesh .*or None.*got 'cpu' \(str\)"),
    ("shard:buckets", nn.Linear(4, 4), TypeError,
     r"buckets must be None or a list of groups .*got Linear; for one group pass buckets=\[\["),
    ("shard:buckets", 2, TypeError, r"buckets must be None or a list of groups .*got int"),
    ("shard:buckets", [3], TypeError, r"buckets must be a list of modules .*got int"),
    ("mode", "fast", ValueError,
     r"Unknown torch.compile mode 'fast' for the graphshard backend; the modes are"),
    ("shard:mixed_precision", torch.bfloat16, TypeError,
     r"mixed_precision must be a graphshard.MixedPrecision, got dtype: for one dtype, "
     r"MixedPrecision\(param_dtype=torch.bfloat16\)"),
    ("shard:mixed_precision", MixedPrecisionPolicy(torch.bfloat16, torch.float32), TypeError,
     r"got MixedPrecisionPolicy: FSDP2's policy; graphshard's takes the same fields: "
     r"MixedPrecision\(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, "
     r"output_dtype=None, cast_forward_inputs=True\)"),
    ("shard:offload", True, TypeError, r"offload must be a graphshard.CPUOffload .*got bool"),
    ("shard:offload", CPUOffloadPolicy(pin_memory=False), TypeError,
     r"got CPUOffloadPolicy: FSDP2's policy; graphshard's is CPUOffload\(pin_memory=False\)"),
]


@pytest.mark.parametrize("option,value,kind,message", BAD_OPTIONS,
                         ids=[f"{o}={v!r}" for o, v, _, _ in BAD_OPTIONS])
def test_every_option_is_checked_when_given(option, value, kind, message):
    if option.startswith("shard:"):
        with fake_process_group(2):
            model = nn.Linear(4, 4)
            with pytest.raises(kind, match=message) as error:
                graphshard.shard(model, **{option.removeprefix("shard:"): value})
            assert not graphshard.api.sharding.is_sharded(model)
            assert not any(isinstance(p, DTensor) for p in model.parameters())  # untouched
    else:
        with pytest.raises(kind, match=message) as error:
            graphshard.backend(**{option: value})
    assert isinstance(error.value, graphshard.GraphshardError)


def test_integer_like_options_are_stored_as_int():
    import numpy as np

    plan = graphshard.backend(prefetch_depth=np.int64(2), max_unsharded_bytes=np.int32(9)).plan
    assert type(plan.prefetch_depth) is int and plan.prefetch_depth == 2
    assert type(plan.max_unsharded_bytes) is int


def test_unknown_hardware_profile_lists_the_known_ones():
    from graphshard.passes.cost_model import get_profile

    with pytest.raises(ValueError, match="h100-nvlink"):
        get_profile("h100-nvlnk")
    with pytest.raises(ValueError, match="h100-nvlink"):
        graphshard.backend(profile="h100-nvlnk")


# --- the error family ---------------------------------------------------------------------

_ROOT = Path(__file__).resolve().parent.parent
_LIBRARY = [_ROOT / "graphshard", _ROOT / "passes"]
_BUILTINS = {
    "ValueError", "TypeError", "RuntimeError", "NotImplementedError", "KeyError",
    "FileNotFoundError", "AssertionError", "IndexError", "Exception",
}


def _library_modules() -> list[str]:
    import graphshard.passes

    names = []
    for package in (graphshard, graphshard.passes):
        names.append(package.__name__)
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            names.append(info.name)
    return names


def test_every_error_class_is_a_graphshard_error():
    """(Warnings are not raised: ``GraphBreakWarning`` stays a ``UserWarning``.)"""
    found = []
    for name in _library_modules():
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and not issubclass(obj, Warning)
                and obj.__module__ == name
            ):
                found.append(obj)
    assert graphshard.ShardedModelError in found and graphshard.CheckpointMismatchError in found
    assert [c for c in found if not issubclass(c, graphshard.GraphshardError)] == []


def test_old_import_paths_and_builtin_bases_are_kept():
    from graphshard.safety.failures import RankFailureError
    from graphshard.safety.fingerprint import PlanMismatchError
    from graphshard.safety.guards import ShardedModelError
    from graphshard.state.checkpoint import CheckpointMismatchError

    for cls in (ShardedModelError, PlanMismatchError, RankFailureError):
        assert issubclass(cls, RuntimeError) and issubclass(cls, graphshard.GraphshardError)
    assert issubclass(CheckpointMismatchError, ValueError)
    assert "GraphshardError" in graphshard.__all__


def test_bad_option_is_both_value_error_and_graphshard_error():
    from graphshard.passes.plan import Plan

    with pytest.raises(graphshard.GraphshardError, match="bucketing must be one of"):
        Plan(bucketing="nope")
    with pytest.raises(ValueError, match="bucketing must be one of"):
        Plan(bucketing="nope")


def _library_sources() -> list[tuple[Path, ast.Module, str]]:
    files = sorted(p for root in _LIBRARY for p in root.rglob("*.py"))
    return [(p, ast.parse(p.read_text()), p.read_text()) for p in files]


def test_library_raises_no_bare_builtin_and_has_no_assert():
    problems = []
    for path, tree, _ in _library_sources():
        for node in ast.walk(tree):
            where = f"{path.relative_to(_ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Assert):
                problems.append(f"{where}: assert statement")
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in _BUILTINS:
                    problems.append(f"{where}: raise {exc.id}")
    assert problems == []


def test_library_suppresses_no_exception():
    problems = [
        str(path.relative_to(_ROOT))
        for path, _, text in _library_sources()
        if re.search(r"suppress\(\s*(Base)?Exception\s*\)", text)
    ]
    assert problems == []


def test_a_collective_with_two_waits_names_the_node():
    """``wait_of`` on a graph a pass broke (two waits on one gather) raises a
    GraphLoweringError naming the collective, not a bare unpacking ValueError."""
    from torch import fx

    from graphshard.passes.errors import GraphLoweringError
    from graphshard.passes.fx_util import wait_of

    c10d = torch.ops._c10d_functional
    graph = fx.Graph()
    shard = graph.placeholder("shard")
    gather = graph.call_function(c10d.all_gather_into_tensor.default, (shard, 2, "0"))
    first = graph.call_function(c10d.wait_tensor.default, (gather,))
    second = graph.call_function(c10d.wait_tensor.default, (gather,))
    graph.output((first, second))
    with pytest.raises(GraphLoweringError, match=f"{gather.name} has 2 wait_tensor"):
        wait_of(gather)
    graph.erase_node(list(graph.nodes)[-1])  # the output
    graph.erase_node(second)
    graph.output(first)
    assert wait_of(gather) is first


def test_sharding_the_root_after_a_submodule_names_buckets():
    """FSDP2's habit (one call per block, then the root) is refused naming the submodule and
    ``buckets=``, not taken for a tensor-parallel model."""
    from graph_utils import TwoBlock

    with fake_process_group(2):
        model = TwoBlock()
        graphshard.shard(model.blocks[0])
        with pytest.raises(graphshard.GraphshardError) as error:
            graphshard.shard(model)
    message = str(error.value)
    assert "blocks.0 (Block)" in message and "already sharded" in message
    assert "buckets=[model.blocks[0], ...]" in message
    assert "tensor parallelism" not in message
    assert not graphshard.api.sharding.is_sharded(model)


def test_sharding_a_submodule_after_the_root_names_buckets():
    from graph_utils import TwoBlock

    with fake_process_group(2):
        model = graphshard.shard(TwoBlock())
        with pytest.raises(graphshard.GraphshardError,
                           match=r"Block is part of a model already sharded.*buckets=\["):
            graphshard.shard(model.blocks[1])
