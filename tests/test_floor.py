"""The overhead floor at world N: graphshard's own copies cut to what the layout needs
(graph structure and ``graphshard.passes.traffic`` byte counts on the lowered graphs,
numerics on real gloo ranks)."""

from __future__ import annotations

import pytest
import torch
from graph_utils import BlockStack, TwoBlock, c10d, calls, fake_process_group
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

import graphshard
from graphshard.passes.fx_util import LOWERED, NodeMaker
from graphshard.passes.layout import Dim0Layout, rank_major
from graphshard.passes.traffic import VIEWS, traffic

aten = torch.ops.aten
RS = c10d.reduce_scatter_tensor.default


def _stages(model: nn.Module, world: int, backend_options: dict | None = None, rank: int = 0,
            **shard_options) -> dict[str, fx.GraphModule]:
    with fake_process_group(world, rank):
        torch.manual_seed(0)
        backend = graphshard.backend(inductor=False, **(backend_options or {}))
        compiled = torch.compile(graphshard.shard(model, **shard_options), backend=backend,
                                 fullgraph=True)
        compiled(torch.randn(4, 8)).sum().backward()
        (stages,) = backend.graphs
        return stages


def _through_views(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in VIEWS:
        node = node.args[0]
    return node


def _lowered_clones(gm: fx.GraphModule, side: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is aten.clone.default
            and n.meta.get(LOWERED, {}).get("side") == side]


def test_a_contiguous_gradient_alone_is_reduce_scattered_in_place():
    """One parameter per bucket, nothing to pad: the gradient itself (a view of it) is the
    reduce-scatter's input, no copy into a buffer."""
    model = nn.Sequential(nn.Linear(8, 6, bias=False), nn.ReLU(), nn.Linear(6, 4, bias=False))
    stages = _stages(model, 2, buckets=[[model[0]], [model[2]]])
    bw = stages["bw"]
    reduces = calls(bw, RS)
    assert len(reduces) == 2
    for reduce in reduces:
        source = _through_views(reduce.args[0])
        assert LOWERED not in source.meta, source.format_node()  # the model's gradient
        assert source.meta["val"].is_contiguous()
    assert _lowered_clones(bw, "reduce_grad") == []
    for fused in (True, False):  # (Inductor dropped such a clone; op by op it copied)
        t = traffic(bw, fused=fused)
        assert t.moved["grad_copy_in"] == t.minimum["grad_copy_in"] == 0


def test_contiguous_gradients_are_copied_into_the_buffer_once():
    """Several gradients per bucket, nothing to pad: the concatenation is the one copy, op
    by op too (a padded one is padded, then concatenated: Inductor fuses the two)."""
    stages = _stages(BlockStack(2), 2)
    assert _lowered_clones(stages["bw"], "reduce_grad") == []
    t = traffic(stages["bw"], fused=False)
    assert t.moved["grad_copy_in"] == t.minimum["grad_copy_in"] > 0


def test_the_interleave_copies_only_ranks_that_hold_rows():
    """At world 4 the head ([3, 8] and [3]: one row a rank) lives on ranks 0-2; rank 3's
    piece is padding, so the copy that rebuilds each parameter leaves it out."""
    stages = _stages(TwoBlock(), 4)
    head = next(g for g in calls(stages["fw"], c10d.all_gather_into_tensor.default)
                if "head.weight" in g.meta["graphshard"]["params"])
    bucket = head.meta["graphshard"]["bucket"]
    clones = [n for n in _lowered_clones(stages["fw"], "unshard")
              if n.meta[LOWERED]["bucket"] == bucket]
    assert sorted(tuple(c.meta["val"].shape) for c in clones) == [(3, 1), (3, 8)]
    t = traffic(stages["fw"])
    assert t.moved["interleave"] == t.minimum["interleave"] > 0


def test_a_coalesced_gather_copies_a_shard_only_where_it_must_be_padded():
    """``all_gather_via="coalesced"``: every bucket is one coalesced all-gather of its shards
    as they are, and each parameter is a view of its own output. At world 4 the head
    ([3, 8] and [3], one row a rank) leaves rank 3 no rows: its empty shards are padded to a
    piece, the only copy left on that rank; nothing is concatenated or copied out."""
    flat = _stages(TwoBlock(), 4, rank=3)["fw"]
    fw = _stages(TwoBlock(), 4, {"all_gather_via": "coalesced"}, rank=3)["fw"]
    gathers = calls(fw, c10d.all_gather_into_tensor_coalesced.default)
    assert calls(fw, c10d.all_gather_into_tensor.default) == []
    assert [g.meta["graphshard"]["params"] for g in gathers] == \
        [g.meta["graphshard"]["params"] for g in calls(flat, c10d.all_gather_into_tensor.default)]
    copies = [n.target for n in fw.graph.nodes if LOWERED in n.meta
              and n.target not in VIEWS and n.op == "call_function"
              and n.target not in (aten.constant_pad_nd.default, c10d.wait_tensor.default,
                                   c10d.all_gather_into_tensor_coalesced.default)
              and n.target.__name__ != "getitem"]
    assert copies == []
    pads = [n for n in fw.graph.nodes if n.target is aten.constant_pad_nd.default]
    assert len(pads) == 2  # the head's weight and bias
    t, before = traffic(fw), traffic(flat)
    assert t.moved["interleave"] == t.minimum["interleave"] == 0 < before.moved["interleave"]
    # the flat gathers read their buckets' storage as it lies: no copy-in either
    assert t.moved["copy_in"] == t.minimum["copy_in"] == before.moved["copy_in"] == 0
    # the coalesced gather pads the head's empty shards; the flat one's padding lies in the
    # bucket's storage, zeroed once when shard() laid it out
    assert t.moved["padding"] > before.moved["padding"] == 0


def test_a_coalesced_reduce_scatter_takes_each_gradient_where_it_lives():
    """``reduce_scatter_via="coalesced"``: a bucket of contiguous gradients is one coalesced
    reduce-scatter of the gradients themselves (their rank-major layout is a view), each
    output this rank's shard: no copy into or out of a buffer. A bucket whose reduced
    gradients are cast back (bf16 reduction of fp32 shards) keeps the flat collective."""
    flat = _stages(BlockStack(2), 2)["bw"]
    bw = _stages(BlockStack(2), 2, {"reduce_scatter_via": "coalesced"})["bw"]
    coalesced = calls(bw, c10d.reduce_scatter_tensor_coalesced.default)
    assert len(coalesced) == len(calls(flat, RS)) == 2 and calls(bw, RS) == []
    for reduce in coalesced:
        for piece in reduce.args[0]:
            assert LOWERED not in _through_views(piece).meta  # the model's own gradient
    t, before = traffic(bw), traffic(flat)
    assert t.moved["grad_copy_in"] == t.minimum["grad_copy_in"] == 0 < before.moved["grad_copy_in"]
    cast_back = graphshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    with fake_process_group(2):
        backend = graphshard.backend(inductor=False, reduce_scatter_via="coalesced")
        model = graphshard.shard(BlockStack(2), mixed_precision=cast_back)
        torch.compile(model, backend=backend)(torch.randn(4, 8)).float().sum().backward()
        mixed = backend.graphs[-1]["bw"]
    assert calls(mixed, c10d.reduce_scatter_tensor_coalesced.default) == []
    assert len(calls(mixed, RS)) == 2


def _rank_major_ops(shape, world: int, strided: bool, contiguous: bool) -> list:
    graph = fx.Graph()
    grad = graph.placeholder("grad")
    with FakeTensorMode():
        val = torch.empty(tuple(reversed(shape)) if strided else shape)
        grad.meta["val"] = val.permute(*reversed(range(len(shape)))) if strided else val
    make = NodeMaker(graph)
    out = rank_major(make, grad, Dim0Layout(shape, world), contiguous=contiguous)
    assert tuple(out.meta["val"].shape) == (world, Dim0Layout(shape, world).piece_numel)
    return [n.target for n in graph.nodes if n.op == "call_function"
            and n.target not in VIEWS]


@pytest.mark.parametrize("shape,world,strided,copies", [
    ((4, 3), 2, False, []),  # contiguous, even: views only
    ((3, 4), 2, False, [aten.constant_pad_nd.default]),  # the pad is the copy
    ((3, 4), 2, True, [aten.constant_pad_nd.default]),  # strided 2-D: viewable, padded
    ((4, 3), 2, True, [aten.clone.default]),  # strided, even: one copy to lay it out
    ((3, 2, 2), 2, True, [aten.clone.default, aten.constant_pad_nd.default]),  # 3-D strided
])
def test_rank_major_copies_only_what_the_layout_needs(shape, world, strided, copies):
    contiguous = not strided
    assert _rank_major_ops(shape, world, strided, contiguous) == copies


# (case, mode, accum, mesh, precision) of ``accum_parity``: at world 4 odd_params' 0-D
# scale, [1] shift, [2, 5, 3] mix and [5, 6] proj leave whole ranks holding only padding.
WORLD4_JOBS = [
    ("odd_params", "lowered", "sync", "1d", "fp32"),
    ("odd_params", "compiled", "sync", "1d", "fp32"),
    ("mlp_odd", "lowered", "no_sync", "1d", "fp32"),
]


@pytest.fixture(scope="module")
def world4():
    from accum_parity import run_jobs
    from dist_utils import run_ranks

    return run_ranks(run_jobs, 4, WORLD4_JOBS)


@pytest.mark.parametrize("job", WORLD4_JOBS, ids=["-".join(j[:3]) for j in WORLD4_JOBS])
def test_world4_matches_single_process(world4, job):
    from accum_parity import train_reference
    from parity import assert_matches

    reference = train_reference(job[0], 4)
    for rank_results in world4:
        assert_matches(rank_results[job], reference)
