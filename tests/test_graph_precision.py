"""Graph-level checks of mixed precision, no_sync and HSDP (one process, fake process group)."""

from __future__ import annotations

import math

import pytest
import torch
from graph_utils import TwoBlock, c10d, calls, fake_process_group, saved_for_backward

import graphshard
from graphshard.analysis.report import bucket_rows

AG, RS, AR = (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default,
              c10d.all_reduce.default)
BF16 = graphshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _to_local_keeps_none_grads() -> bool:
    """Whether ``DTensor.to_local()``'s backward passes a None gradient on as None. torch 2.11's
    turns it into zeros (it does not ``set_materialize_grads(False)``; pytorch/pytorch#173865
    fixed that later), so a parameter whose gradient ``no_sync`` held back gets a zero
    ``.grad`` there instead of None."""
    from torch.distributed.tensor._api import _ToTorchTensor

    try:
        return _ToTorchTensor.backward(object(), None) == (None, None)
    except AttributeError:  # it reads the ctx's spec to build a gradient
        return False


def _no_gradient(param) -> bool:
    """``param`` got no gradient: ``.grad`` is None, or zeros where torch makes None zeros."""
    if param.grad is None:
        return True
    return not _to_local_keeps_none_grads() and not param.grad.to_local().any()


def _step(model, backend, x=None):
    out = model(torch.randn(4, 8) if x is None else x)
    out.float().sum().backward()
    return backend.graphs[-1]


def _dtype(node):
    return node.meta["val"].dtype


def _full_shapes(model) -> set[tuple[int, ...]]:
    return {tuple(p.full_shape) for p in graphshard.api.sharding.shard_state(model).params}


def test_bf16_gathers_and_saves_no_fp32_parameter():
    with fake_process_group(2):
        torch.manual_seed(0)
        model = graphshard.shard(TwoBlock(), mixed_precision=BF16)
        backend = graphshard.backend(inductor=False)
        stages = _step(torch.compile(model, backend=backend), backend)
        for stage in ("fw", "bw"):
            gathers = calls(stages[stage], AG)
            assert gathers and all(_dtype(g) == torch.bfloat16 for g in gathers), stage
        # Gradients are reduced in fp32 and the shards' gradients stay fp32.
        reduces = calls(stages["bw"], RS)
        assert reduces and all(_dtype(r.args[0]) == torch.float32 for r in reduces)
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        # No fp32 copy of a full parameter is saved for backward (shards only).
        outputs = stages["fw"].graph.find_nodes(op="output")[0].args[0]
        saved = saved_for_backward(stages["fw"], 1)
        assert len(saved) < len(outputs)
        full = _full_shapes(model)
        tensors = [n for n in saved if isinstance(n.meta.get("val"), torch.Tensor)]
        fp32_full = [n for n in tensors if _dtype(n) == torch.float32
                     and tuple(n.meta["val"].shape) in full]
        assert fp32_full == []


def test_bf16_halves_gathered_bytes():
    def gathered_bytes(mixed_precision):
        with fake_process_group(2):
            torch.manual_seed(0)
            model = graphshard.shard(TwoBlock(), mixed_precision=mixed_precision)
            backend = graphshard.backend(inductor=False)
            stages = _step(torch.compile(model, backend=backend), backend)
            return sum(math.prod(g.meta["val"].shape) * g.meta["val"].element_size()
                       for g in calls(stages["fw"], AG))

    assert gathered_bytes(BF16) * 2 == gathered_bytes(None)


def test_no_sync_backward_has_no_reduce_scatter_and_sync_folds_it_in():
    with fake_process_group(2):
        torch.manual_seed(0)
        model = graphshard.shard(TwoBlock())
        backend = graphshard.backend(inductor=False)
        compiled = torch.compile(model, backend=backend)
        with graphshard.no_sync(model):
            held = _step(compiled, backend)
        assert calls(held["bw"], RS) == [] and calls(held["bw"], AR) == []
        assert all(_no_gradient(p) for p in model.parameters())
        synced = _step(compiled, backend)
        reduces = calls(synced["bw"], RS)
        assert len(reduces) == 3
        # Each reduce-scatter sums this micro-batch's gradients with the held-back ones.
        adds = calls(synced["bw"], torch.ops.aten.add.Tensor)
        placeholders = set(synced["bw"].graph.find_nodes(op="placeholder"))
        held_inputs = [a for a in adds if any(arg in placeholders for arg in a.args)]
        assert len(held_inputs) == sum(1 for _ in model.parameters())
        assert all(p.grad is not None for p in model.parameters())
        # What was held back is dropped once folded in.
        state = graphshard.api.sharding.shard_state(model)
        assert all(e.unreduced.grad is None for e in state.params)


def _hsdp_model(mixed_precision=None):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = graphshard.shard(TwoBlock(), mesh, mixed_precision=mixed_precision)
    return model, mesh


def test_hsdp_reduce_scatters_in_shard_group_then_all_reduces_across_replicas():
    with fake_process_group(4):
        model, mesh = _hsdp_model()
        backend = graphshard.backend(inductor=False)
        stages = _step(torch.compile(model, backend=backend), backend)
        reduces, all_reduces = calls(stages["bw"], RS), calls(stages["bw"], AR)
        assert len(reduces) == len(all_reduces) == 3
        shard_group, replica_group = mesh.get_group(1), mesh.get_group(0)
        assert all(r.args[2:] == (2, shard_group.group_name) for r in reduces)
        assert all(a.args[1:] == ("avg", replica_group.group_name) for a in all_reduces)
        for gather in calls(stages["fw"], AG):
            assert gather.args[1:] == (2, shard_group.group_name)
        # The schedule report names the replica all-reduce and its group size.
        rows = bucket_rows(stages["bw"], backend.plan.profile)
        kinds = [(r["kind"], r["world_size"]) for r in rows if r["kind"] != "all_gather"]
        assert kinds.count(("all_reduce", 2)) == 3 and kinds.count(("reduce_scatter", 2)) == 3
        # Each all-reduce runs under compute: waited only after the next reduce-scatter.
        order = {n: i for i, n in enumerate(stages["bw"].graph.nodes)}
        for ar, next_rs in zip(all_reduces, reduces[1:]):  # noqa: B905
            (wait,) = ar.users
            assert order[wait] > order[next_rs]
        # Each all-reduce reduces what its reduce-scatter produced.
        for rs, ar in zip(reduces, all_reduces, strict=True):
            assert c10d.wait_tensor.default in {n.target for n in ar.all_input_nodes}
            assert rs in ar.args[0].all_input_nodes or ar.args[0].args[0] is rs


def test_hsdp_deferred_all_reduce_accumulates_partials():
    with fake_process_group(4):
        model, _ = _hsdp_model()
        backend = graphshard.backend(inductor=False)
        compiled = torch.compile(model, backend=backend)
        with graphshard.no_sync(model, reduce_scatter=True):
            held = _step(compiled, backend)
        assert len(calls(held["bw"], RS)) == 3 and calls(held["bw"], AR) == []
        synced = _step(compiled, backend)
        assert len(calls(synced["bw"], RS)) == len(calls(synced["bw"], AR)) == 3


@pytest.mark.parametrize("dtype,op,factor", [(torch.float16, "sum", 0.5),
                                             (torch.bfloat16, "avg", None)])
def test_low_precision_divide_factors(dtype, op, factor):
    policy = graphshard.MixedPrecision(param_dtype=dtype, reduce_dtype=dtype)
    with fake_process_group(4):
        model, _ = _hsdp_model(policy)
        backend = graphshard.backend(inductor=False)
        stages = _step(torch.compile(model, backend=backend), backend)
        for collective in calls(stages["bw"], RS) + calls(stages["bw"], AR):
            assert collective.args[1] == op
            source = collective.args[0]
            assert _dtype(source) == dtype
            if factor is None:
                assert source.target is not torch.ops.aten.mul.Tensor
            else:
                assert source.target is torch.ops.aten.mul.Tensor and source.args[1] == factor


def test_mixed_precision_rejects_non_float_dtype():
    with pytest.raises(TypeError, match="floating-point torch.dtype"):
        graphshard.MixedPrecision(param_dtype=torch.int8)


def test_switching_accumulation_kind_mid_window_is_refused():
    with fake_process_group(4):
        model, _ = _hsdp_model()
        with graphshard.no_sync(model):
            model(torch.randn(4, 8)).sum().backward()
        with pytest.raises(RuntimeError, match="run one synced backward"):
            with graphshard.no_sync(model, reduce_scatter=True):
                pass


@pytest.mark.parametrize("compiled", [False, True])
def test_inputs_cast_to_param_dtype_and_outputs_to_output_dtype(compiled):
    policy = graphshard.MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float64)
    with fake_process_group(2):
        torch.manual_seed(0)
        model = graphshard.shard(TwoBlock(), mixed_precision=policy)
        run = torch.compile(model, backend=graphshard.backend(inductor=False)) if compiled \
            else model
        out = run(torch.randn(4, 8))  # an fp32 input meets bf16 weights: cast on the way in
        assert out.dtype == torch.float64
        out.sum().backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_no_sync_after_a_dtype_change_uses_fresh_accumulators():
    with fake_process_group(2):
        torch.manual_seed(0)
        model = graphshard.shard(TwoBlock())
        with graphshard.no_sync(model):
            model(torch.randn(4, 8)).sum().backward()
        model(torch.randn(4, 8)).sum().backward()  # folds in and drops the held-back grads
        model.double()
        with graphshard.no_sync(model):
            model(torch.randn(4, 8, dtype=torch.float64)).sum().backward()
        state = graphshard.api.sharding.shard_state(model)
        assert all(e.unreduced.grad.dtype == torch.float64 for e in state.params)
        model.float()  # with gradients held back: refused, not silently mixed
        with pytest.raises(RuntimeError, match="move the model between accumulation"):
            with graphshard.no_sync(model):
                pass


def test_merged_reads_keep_the_held_back_gradient_of_any_read():
    """Only one read of a parameter carries what no_sync held back; merging the reads' two
    reductions must keep it whichever read it was."""
    from torch import fx

    from graphshard.passes import Plan, merge_reduce_grad
    from graphshard.passes.markers import REDUCE_GRAD, is_reduce_grad, marker_args

    graph = fx.Graph()
    first, second, held = (graph.placeholder(n) for n in ("grad_a", "grad_b", "held"))
    carrying = graph.call_function(
        REDUCE_GRAD, (first, 0, "w", 2, "G", None, None, "", 1, True, held, None))
    plain = graph.call_function(REDUCE_GRAD, (second, 0, "w", 2, "G"))
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, (carrying, plain)))
    gm = merge_reduce_grad(fx.GraphModule({}, graph), Plan())
    (merged,) = [n for n in gm.graph.nodes if is_reduce_grad(n)]
    assert marker_args(merged).pending_full is held
