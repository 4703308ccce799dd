"""The two-stream simulator: overlap, exposed communication and live unsharded bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from graphshard.passes.cost_model import (
    HardwareProfile,
    all_gather_time,
    all_reduce_time,
    node_time,
)
from graphshard.passes.simulate import simulate

c10d = torch.ops._c10d_functional

# Slow compute, fast links: a 128^3 matmul (4.2 ms) dwarfs any gather here (microseconds).
PROF = HardwareProfile(
    "test", alpha_s=1e-6, bandwidth_Bps=1e9, peak_flops=1e9, mem_bandwidth_Bps=1e12
)


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def _trace(fn, *shapes):
    return make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))


def _gather(x, group):
    return c10d.all_gather_into_tensor(x, 2, group)


def _only(gm, target):
    (node,) = [n for n in gm.graph.nodes if n.target is target]
    return node


def test_gather_hidden_behind_matmul(group):
    def fn(x, a, b):
        y = _gather(x, group)
        z = a @ b
        return c10d.wait_tensor(y) + 1, z

    gm = _trace(fn, (256,), (128, 128), (128, 128))
    tl = simulate(gm, PROF)
    comm = all_gather_time(2 * 256 * 4, 2, PROF)
    assert tl.exposed_comm == 0.0
    assert tl.comm_time == pytest.approx(comm)
    assert tl.compute_time > comm
    assert tl.total_time == pytest.approx(tl.compute_time)
    assert not [e for e in tl.events if e.kind == "exposed"]


def test_wait_right_after_issue_exposes_all_of_it(group):
    def fn(x, a, b):
        y = c10d.wait_tensor(_gather(x, group))
        return y + 1, a @ b

    gm = _trace(fn, (256,), (128, 128), (128, 128))
    tl = simulate(gm, PROF)
    comm = all_gather_time(2 * 256 * 4, 2, PROF)
    assert tl.exposed_comm == pytest.approx(comm)
    assert tl.total_time == pytest.approx(comm + tl.compute_time)
    (stall,) = [e for e in tl.events if e.kind == "exposed"]
    assert stall.lane == "compute" and stall.duration == pytest.approx(comm)


def test_exact_totals_with_merged_compute(group):
    def fn(x, a, b):
        y = _gather(x, group)
        z = ((a @ b).relu() @ b + 2).sin()
        return c10d.wait_tensor(y).view(-1), z

    gm = _trace(fn, (256,), (128, 128), (128, 128))
    tl = simulate(gm, PROF)
    expected = sum(
        node_time(n, PROF)
        for n in gm.graph.nodes
        if n.target is not c10d.all_gather_into_tensor.default
    )
    compute = [e for e in tl.events if e.kind == "compute"]
    assert tl.compute_time == pytest.approx(expected)
    assert sum(e.duration for e in compute) == pytest.approx(expected)
    # mm, relu, mm, add and sin run without a collective in between: one event.
    assert len(compute) == 1 and compute[0].ops == 5 and compute[0].flops == 2 * 2 * 128**3


def test_bucket_labels_and_serial_comm_stream(group):
    def fn(x, w):
        y = _gather(x, group)
        s = c10d.reduce_scatter_tensor(w, "avg", 2, group)
        return c10d.wait_tensor(y), c10d.wait_tensor(s)

    gm = _trace(fn, (256,), (512,))
    ag = _only(gm, c10d.all_gather_into_tensor.default)
    rs = _only(gm, c10d.reduce_scatter_tensor.default)
    ag.meta["graphshard"] = {"kind": "unshard", "bucket": 3}
    rs.meta["graphshard"] = {"kind": "reduce_grad", "bucket": 7}
    tl = simulate(gm, PROF)
    first, second = [e for e in tl.events if e.lane == "comm"]
    assert (first.kind, first.bucket, second.kind, second.bucket) == (
        "unshard",
        3,
        "reduce_grad",
        7,
    )
    # Both are issued at t=0 but share one stream: the reduce-scatter starts after the gather.
    assert second.start == pytest.approx(first.end)
    assert tl.exposed_comm == pytest.approx(second.end)


def test_all_reduce_needs_world_size(group):
    def fn(x):
        return c10d.wait_tensor(c10d.all_reduce(x, "sum", group))

    gm = _trace(fn, (1024,))
    with pytest.raises(ValueError, match="world_size"):
        simulate(gm, PROF)
    tl = simulate(gm, PROF, world_size=2)
    assert tl.comm_time == pytest.approx(all_reduce_time(4096, 2, PROF))


def test_peak_unsharded_one_gather(group):
    def fn(x, a):
        full = c10d.wait_tensor(_gather(x, group)).view(32, 16)
        return a @ full.t()

    gm = _trace(fn, (256,), (8, 16))
    assert simulate(gm, PROF).peak_unsharded_bytes == 2 * 256 * 4


def test_peak_unsharded_two_overlapping_gathers(group):
    def fn(x1, x2, a):
        y1, y2 = _gather(x1, group), _gather(x2, group)
        w1 = c10d.wait_tensor(y1).view(16, 16)
        w2 = c10d.wait_tensor(y2).view(16, 32)
        return a @ w1 @ w2

    gm = _trace(fn, (128,), (256,), (4, 16))
    assert simulate(gm, PROF).peak_unsharded_bytes == 2 * 128 * 4 + 2 * 256 * 4


def test_peak_unsharded_gathers_that_do_not_overlap(group):
    def fn(x1, x2, a):
        h = a @ c10d.wait_tensor(_gather(x1, group)).view(16, 16)
        return h @ c10d.wait_tensor(_gather(x2, group)).view(16, 32)

    gm = _trace(fn, (128,), (256,), (4, 16))
    # The first buffer's last use (the first matmul) comes before the second gather.
    assert simulate(gm, PROF).peak_unsharded_bytes == 2 * 256 * 4


def test_peak_unsharded_frees_each_output_of_a_coalesced_gather_at_its_own_last_use(group):
    def fn(x1, x2, x3, a):
        w1, w2 = c10d.all_gather_into_tensor_coalesced([x1, x2], 2, group)
        h = a @ c10d.wait_tensor(w1).view(16, 16)  # the last use of the first output
        y3 = _gather(x3, group)  # issued while only the second output is still needed
        h = h @ c10d.wait_tensor(w2).view(16, 32)
        return h @ c10d.wait_tensor(y3).view(32, 32)

    gm = _trace(fn, (128,), (256,), (512,), (4, 16))
    # the second output and the third gather; counting the coalesced gather whole until its
    # last output's last use would add the first output's 2 * 128 * 4 bytes
    assert simulate(gm, PROF).peak_unsharded_bytes == 2 * 256 * 4 + 2 * 512 * 4
