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


def _offload_graph() -> torch.fx.GraphModule:
    """Two buckets of one 4 MiB host shard each, copied to the device (the default: on the
    compute stream) and multiplied in, one after the other."""
    from torch import fx

    from graphshard.passes.fx_util import DEVICE_COPY

    graph = fx.Graph()
    meta = torch.empty(1024, 1024, device="meta")
    x = graph.placeholder("x")
    x.meta["val"] = meta
    shards = []
    for k in range(2):
        shard = graph.placeholder(f"shard{k}")
        shard.meta["val"] = meta
        shards.append(shard)
    y = x
    for k, shard in enumerate(shards):
        copy = graph.call_function(DEVICE_COPY, (shard, torch.device("cpu"), True))
        copy.meta.update(val=meta, graphshard_copy={"direction": "h2d", "bucket": k})
        y = graph.call_function(torch.ops.aten.mm.default, (y, copy))
        y.meta["val"] = meta
    graph.output(y)
    return fx.GraphModule(torch.nn.Module(), graph)


def test_offload_copies_hold_the_compute_stream_unless_on_a_copy_stream():
    """A 4 MiB copy takes 1 ms over the host link and a matmul 1 ms: on the compute stream
    (the default) the two copies and two matmuls run in series (4 ms); with
    ``shard_copy_stream`` the second copy crosses the bus under the first matmul, and only
    the first is waited for (3 ms, 1 ms of it stalled on the copy)."""
    from graphshard.passes import Plan, shard_copy_stream

    mib = 2**20
    profile = HardwareProfile("offload-test", alpha_s=1e-6, bandwidth_Bps=1e9,
                              peak_flops=2 * 1024**3 / 1e-3, mem_bandwidth_Bps=1e15,
                              host_link_Bps=4 * mib / 1e-3)
    default = simulate(_offload_graph(), profile)
    assert default.total_time == pytest.approx(4e-3)
    assert default.copy_time == pytest.approx(2e-3) and default.exposed_copy == 0
    assert [e.lane for e in default.events if e.kind == "h2d"] == ["compute", "compute"]
    streams = simulate(shard_copy_stream(_offload_graph(), Plan(shard_copy_stream=True)),
                       profile)
    assert streams.total_time == pytest.approx(3e-3)
    assert streams.exposed_copy == pytest.approx(1e-3)
    copies = [e for e in streams.events if e.kind == "h2d"]
    assert [(e.lane, e.start, e.end) for e in copies] == [
        ("h2d", 0.0, pytest.approx(1e-3)), ("h2d", pytest.approx(1e-3), pytest.approx(2e-3))]


def test_the_copy_streams_get_lanes_of_their_own_in_the_trace_and_picture(tmp_path):
    from graphshard.analysis.timeline import render_png, to_chrome_trace
    from graphshard.passes import Plan, shard_copy_stream

    profile = HardwareProfile("offload-test", alpha_s=1e-6, bandwidth_Bps=1e9,
                              peak_flops=1e12, mem_bandwidth_Bps=1e12, host_link_Bps=1e9)
    gm = shard_copy_stream(_offload_graph(), Plan(shard_copy_stream=True))
    timeline = simulate(gm, profile)
    trace = to_chrome_trace(timeline)
    lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "thread_name"}
    assert set(lanes.values()) == {"compute", "comm", "exposed", "h2d"}
    copies = [e for e in trace["traceEvents"] if e.get("cat") == "h2d"]
    assert len(copies) == 2 and all(lanes[e["tid"]] == "h2d" for e in copies)
    assert trace["otherData"]["copy_time_s"] == pytest.approx(timeline.copy_time)
    assert render_png(timeline, tmp_path / "offload.png").stat().st_size > 0
    default = to_chrome_trace(simulate(_offload_graph(), profile))
    assert "h2d" not in {e["args"]["name"] for e in default["traceEvents"]
                         if e["name"] == "thread_name"}
