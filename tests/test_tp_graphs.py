"""FSDP x TP at graph level, on a fake process group of 4 (dp 2 x tp 2): graphshard's passes
bucket and prefetch the dp gathers, and leave DTensor's TP collectives as DTensor made them."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from functorch.compile import make_boxed_func
from graph_utils import (
    MATMULS,
    BlockStack,
    c10d,
    calls,
    derived_before_matmul,
    fake_process_group,
)
from torch import fx, nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

import graphshard

BLOCKS = 4


def _tp_model(mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = BlockStack(BLOCKS, 16, 32)
    plan = {}
    for i in range(BLOCKS):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    return parallelize_module(model, mesh["tp"], plan)


@pytest.fixture(scope="module")
def graphs():
    """The transformed fw/bw graphs of graphshard (fp32 and bf16), the same TP model's graphs
    compiled without graphshard, and the two groups' names."""
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = torch.randn(8, 16)
        found = {"dp": mesh["dp"].get_group().group_name,
                 "tp": mesh["tp"].get_group().group_name}
        for name, policy in (("fp32", None), ("bf16", graphshard.MixedPrecision(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32))):
            torch._dynamo.reset()
            model = graphshard.shard(_tp_model(mesh), mesh["dp"], mixed_precision=policy)
            backend = graphshard.backend(inductor=False, reshard_last_bucket=True)
            torch.compile(model, backend=backend)(x).sum().backward()
            found[name] = backend.graphs[-1]  # (bf16: the input cast is a graph of its own)
        torch._dynamo.reset()
        plain: dict[str, fx.GraphModule] = {}

        def keep(stage):
            def compiler(gm, _inputs):
                plain[stage] = gm
                return make_boxed_func(gm)
            return compiler

        tp_only = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"),
                               partition_fn=min_cut_rematerialization_partition)
        torch.compile(_tp_model(mesh), backend=tp_only)(x).sum().backward()
        found["plain"] = plain
        yield found


def _group(node: fx.Node) -> str:
    return node.args[-1]


def _collectives(gm: fx.GraphModule, group: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and n.target.namespace == "_c10d_functional"
            and n.target is not c10d.wait_tensor.default and _group(n) == group]


@pytest.mark.parametrize("stage", ["fw", "bw"])
def test_dp_gathers_are_bucketed_and_prefetched(graphs, stage):
    gm = graphs["fp32"][stage]
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    gathers = calls(gm, c10d.all_gather_into_tensor.default)
    assert len(gathers) == BLOCKS  # one per block: its up and down pieces, weights and biases
    assert {_group(g) for g in gathers} == {graphs["dp"]}
    first_matmul = []
    for gather in gathers:
        values = derived_before_matmul(gather)
        mms = [n for n in gm.graph.nodes if n.target in MATMULS and set(n.args) & values]
        assert mms, "every gathered bucket feeds a matmul"
        first_matmul.append(mms[0])
    for k in range(BLOCKS - 1):  # bucket k+1's gather is in flight over bucket k's compute
        (wait,) = [u for u in gathers[k + 1].users if u.target is c10d.wait_tensor.default]
        assert pos[gathers[k + 1]] < pos[first_matmul[k]] < pos[wait]


@pytest.mark.parametrize("stage", ["fw", "bw"])
def test_tp_collectives_are_left_as_dtensor_made_them(graphs, stage):
    ours, plain = graphs["fp32"][stage], graphs["plain"][stage]
    ours_tp = _collectives(ours, graphs["tp"])
    plain_tp = _collectives(plain, graphs["tp"])
    assert plain_tp, "the TP plan puts collectives in the graph"
    assert Counter(n.target for n in ours_tp) == Counter(n.target for n in plain_tp)
    assert [tuple(n.meta["val"].shape) for n in ours_tp] == [
        tuple(n.meta["val"].shape) for n in plain_tp]
    for node in ours_tp:  # each still waited on exactly once
        assert [u.target for u in node.users] == [c10d.wait_tensor.default]
    # and graphshard added nothing on the TP group, nothing of DTensor's moved to dp
    assert not _collectives(plain, graphs["dp"])
    dp_ops = Counter(n.target for n in _collectives(ours, graphs["dp"]))
    assert set(dp_ops) <= {c10d.all_gather_into_tensor.default,
                           c10d.reduce_scatter_tensor.default}


def test_reduce_scatters_run_on_dp_only(graphs):
    bw = graphs["fp32"]["bw"]
    scatters = calls(bw, c10d.reduce_scatter_tensor.default)
    assert len(scatters) == BLOCKS
    assert {_group(n) for n in scatters} == {graphs["dp"]}


def test_bf16_policy_gathers_bf16_pieces_and_reduces_fp32(graphs):
    fw, bw = graphs["bf16"]["fw"], graphs["bf16"]["bw"]
    gathers = calls(fw, c10d.all_gather_into_tensor.default)
    assert gathers and {g.meta["val"].dtype for g in gathers} == {torch.bfloat16}
    scatters = calls(bw, c10d.reduce_scatter_tensor.default)
    assert scatters and {s.meta["val"].dtype for s in scatters} == {torch.float32}
    # what is gathered is each block's TP pieces: up (Colwise) 16x16 + 16, down (Rowwise)
    # 16x16, and down's bias whole (TP replicates it): half the block, plus that bias
    tp_piece = 16 * 16 + 16 + 16 * 16 + 16
    assert [g.meta["val"].numel() for g in gathers] == [tp_piece] * BLOCKS
