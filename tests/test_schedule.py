"""Scheduling passes: prefetch order, gathers in flight, memory cap, overlap, Inductor order."""

from __future__ import annotations

import pytest
import torch
from graph_utils import (
    MATMULS,
    BlockStack,
    c10d,
    calls,
    derived_before_matmul,
    fake_process_group,
)
from torch import fx
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

import graphshard


def graphs(**options) -> dict[str, fx.GraphModule]:
    """Graphs of a 4-block step; every bucket is regathered in backward (schedule, not policy)."""
    backend = graphshard.backend(inductor=False, reshard_last_bucket=True, **options)
    model = graphshard.shard(BlockStack(4, 16, 32))
    torch.compile(model, backend=backend)(torch.randn(8, 16)).sum().backward()
    (stages,) = backend.graphs
    return stages


def bucket_matmuls(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """For each all-gather in order, the matmuls that read a parameter it gathered."""
    result = []
    for gather in calls(gm, c10d.all_gather_into_tensor.default):
        values = derived_before_matmul(gather)
        result.append([n for n in gm.graph.nodes if n.target in MATMULS and set(n.args) & values])
    return result


def position(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def wait(node: fx.Node) -> fx.Node:
    (w,) = [u for u in node.users if u.target is c10d.wait_tensor.default]
    return w


def max_in_flight(gm: fx.GraphModule) -> int:
    """Most gathered buckets alive at once: from the gather's issue to its bucket's last matmul."""
    pos = position(gm)
    gathers = calls(gm, c10d.all_gather_into_tensor.default)
    spans = [(pos[g], pos[mms[-1]]) for g, mms in zip(gathers, bucket_matmuls(gm), strict=True)]
    return max(sum(start <= i <= end for start, end in spans) for i in range(len(pos)))


@pytest.fixture
def world2():
    with fake_process_group(2):
        torch.manual_seed(0)
        yield


@pytest.mark.parametrize("stage", ["fw", "bw"])
def test_depth1_next_gather_overlaps_current_bucket(world2, stage):
    gm = graphs(prefetch_depth=1)[stage]
    pos = position(gm)
    gathers = calls(gm, c10d.all_gather_into_tensor.default)
    matmuls = bucket_matmuls(gm)
    assert len(gathers) == 4
    for k in range(len(gathers) - 1):
        first_mm = matmuls[k][0]
        assert pos[gathers[k + 1]] < pos[first_mm] < pos[wait(gathers[k + 1])]
    assert max_in_flight(gm) == 2


@pytest.mark.parametrize("stage", ["fw", "bw"])
def test_depth0_issues_no_gather_before_previous_compute(world2, stage):
    gm = graphs(prefetch_depth=0)[stage]
    pos = position(gm)
    gathers = calls(gm, c10d.all_gather_into_tensor.default)
    matmuls = bucket_matmuls(gm)
    for k in range(1, len(gathers)):
        assert pos[gathers[k]] > pos[matmuls[k - 1][-1]]
    assert max_in_flight(gm) == 1


def test_depth2_keeps_at_most_three_gathers_in_flight(world2):
    gm = graphs(prefetch_depth=2)["fw"]
    assert max_in_flight(gm) == 3
    pos = position(gm)
    gathers = calls(gm, c10d.all_gather_into_tensor.default)
    assert pos[gathers[2]] < pos[bucket_matmuls(gm)[0][0]]


def test_memory_cap_limits_prefetch(world2):
    fw = graphs(prefetch_depth=2)["fw"]
    one_bucket = calls(fw, c10d.all_gather_into_tensor.default)[0].meta["val"].nbytes
    torch._dynamo.reset()
    capped = graphs(prefetch_depth=2, max_unsharded_bytes=2 * one_bucket)["fw"]
    assert max_in_flight(capped) == 2
    torch._dynamo.reset()
    tight = graphs(prefetch_depth=2, max_unsharded_bytes=one_bucket)["fw"]
    assert max_in_flight(tight) == 1


def test_reduce_scatter_overlaps_next_bucket_backward(world2):
    bw = graphs()["bw"]
    pos = position(bw)
    reduces = calls(bw, c10d.reduce_scatter_tensor.default)
    matmuls = [n for n in bw.graph.nodes if n.target in MATMULS]
    assert len(reduces) == 4
    for reduce in reduces[:-1]:
        between = [m for m in matmuls if pos[reduce] < pos[m] < pos[wait(reduce)]]
        assert between, f"nothing overlaps {reduce.name}"
    # one reduction in flight: each wait comes before the next reduce-scatter is issued
    for a, b in zip(reduces, reduces[1:], strict=False):
        assert pos[wait(a)] < pos[b]


def test_schedule_is_deterministic(world2):
    first = graphs()["bw"].code
    torch._dynamo.reset()
    assert graphs()["bw"].code == first


def test_inductor_code_keeps_the_order(world2):
    model = graphshard.shard(BlockStack(4, 16, 32))
    compiled = torch.compile(model, backend=graphshard.backend(reshard_last_bucket=True))
    _, (fw, bw) = run_and_get_code(lambda: compiled(torch.randn(8, 16)).sum().backward())
    ag, wait_ = "all_gather_into_tensor.default(", "wait_tensor.default("
    # compute: a matmul, or the call of a block region (its body holds the matmuls)
    mm = r"extern_kernels\.|# subgraph: partitioned_"
    # The two gathers issued before any compute may come from the optimizer step.
    lead = r"(all_gather_into_tensor|take_prefetched)\.default\("
    check = FileCheck().check_regex(lead).check(wait_).check_regex(lead).check_regex(mm)
    check = check.check(wait_)
    for _ in range(2):  # bucket k+1 is issued before bucket k's first matmul, waited after it
        check = check.check(ag).check_regex(mm).check(wait_)
    check.run(fw)
    check = FileCheck().check(ag).check(wait_).check(ag).check_regex(mm)
    check = check.check("reduce_scatter_tensor").check(wait_).check(ag).check_regex(mm)
    check.check(wait_).check("reduce_scatter_tensor").run(bw)


def test_cap_below_one_bucket_warns(world2):
    with pytest.warns(UserWarning, match="more than max_unsharded_bytes=100 on its own"):
        graphs(max_unsharded_bytes=100)
