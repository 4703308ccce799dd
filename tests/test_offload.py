"""CPU offload (``graphshard.CPUOffload``): where the copies sit in the lowered graphs.

Graph-level, one process with a fake process group and fake tensors (structure only). The
accelerator is ``fakeaccel``, a PrivateUse1 device registered from Python in a spawned
process (see ``offload_graphs.py`` for why not fake ``cuda``: this CPU-only torch cannot run
autograd on it); the lowering passes alone are also checked on fake ``cuda`` tensors, which
need no autograd. The CPU-only error runs on a real one-rank gloo group.
"""

from __future__ import annotations

import multiprocessing
import re
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import offload_graphs
import pytest
import torch
from graph_utils import fake_process_group
from torch import fx, nn
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode

import graphshard
from graphshard.api.offload import host_standing_in_for_device
from graphshard.passes import Plan, lower_reduce_grad, lower_unshard
from graphshard.passes.layout import Dim0Layout
from graphshard.passes.markers import REDUCE_GRAD, UNSHARD

ACCEL = offload_graphs.ACCEL
# a matmul, or a block region's call (torch 2.11 keeps a region called once; 2.13 inlines it)
COMPUTE = {"aten.mm.default", "aten.addmm.default", "invoke_subgraph"}
GATHER = "_c10d_functional.all_gather_into_tensor.default"
WAIT = "_c10d_functional.wait_tensor.default"
DEVICE_PUT = "prims.device_put.default"
TO_HOST = "graphshard.to_host.default"
TO_DEVICE = "graphshard.to_device.default"
WAIT_COPY = "graphshard.wait_copy.default"


class Traced(dict):
    """Results by configuration; reading one whose tracing raised fails with its traceback."""

    def __getitem__(self, name: str) -> dict[str, Any]:
        result = super().__getitem__(name)
        if "error" in result:
            pytest.fail(f"tracing configuration {name!r} raised:\n{result['error']}")
        return result


@pytest.fixture(scope="module")
def traced() -> Traced:
    """Every configuration of ``offload_graphs.CONFIGS``, traced in one spawned process."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return Traced(pool.submit(offload_graphs.trace_all).result())


# --------------------------------------------------------------------------- graph reading


def graph(result: dict[str, Any], stage: str, index: int = -1) -> list[dict[str, Any]]:
    """The node records of ``stage`` of the ``index``-th compiled graph that has one."""
    return [stages[stage] for stages in result["graphs"] if stage in stages][index]


def by_name(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in records}


def position(records: list[dict[str, Any]]) -> dict[str, int]:
    return {r["name"]: i for i, r in enumerate(records)}


def ancestors(records: list[dict[str, Any]], name: str) -> set[str]:
    """``name``'s inputs, their inputs, and so on."""
    nodes, found, stack = by_name(records), set(), list(by_name(records)[name]["inputs"])
    while stack:
        current = stack.pop()
        if current not in found:
            found.add(current)
            stack.extend(nodes[current]["inputs"])
    return found


def users(records: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in records if name in r["inputs"]]


def copies(records: list[dict[str, Any]], direction: str) -> list[dict[str, Any]]:
    return [r for r in records if (r["copy"] or {}).get("direction") == direction]


def device_copies(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every copy between devices, tagged or not: ``prims.device_put`` (the op Inductor
    lowers), or an ``aten._to_copy`` naming a device (which Inductor would refuse)."""
    return [r for r in records if r["target"] in (DEVICE_PUT, TO_HOST)
            or (r["target"] == "aten._to_copy.default" and "device" in r["kwargs"])]


def non_blocking(copy: dict[str, Any]) -> bool:
    """Whether a ``prims.device_put(x, device, non_blocking)`` record copies asynchronously."""
    assert copy["target"] == DEVICE_PUT, copy
    return copy["args"][2] == "True"


def collectives(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == kind]


def wait_of(records: list[dict[str, Any]], collective: dict[str, Any]) -> dict[str, Any]:
    (wait,) = [u for u in users(records, collective["name"]) if u["target"] == WAIT]
    return wait


def feeding(records: list[dict[str, Any]], gather: dict[str, Any]) -> list[dict[str, Any]]:
    """The host-to-device copies whose data the all-gather ``gather`` sends."""
    up = ancestors(records, gather["name"])
    return [c for c in copies(records, "h2d") if c["name"] in up]


# --------------------------------------------------------------------------- where data lives


def test_shards_gradients_and_optimizer_inputs_live_on_the_host(traced):
    result = traced["offload"]
    assert result["param_devices"] == ["cpu"]  # the DTensors' local tensors
    assert result["param_mesh"] == ["cpu"]  # a host copy of the mesh (same groups)
    assert result["state_mesh"] == ACCEL  # compute and collectives on the accelerator
    assert result["eager_output"] == result["compiled_output"] == ACCEL
    assert result["eager_grads"] == result["compiled_grads"] == ["cpu"]
    assert result["optimizer_state"] == ["cpu"]  # AdamW's moments, made from the shards
    assert result["fingerprint"]["shard option offload"] == "CPUOffload(pin_memory=True)"
    assert result["fingerprint"]["shard option compute_device"] == repr(ACCEL)


def test_without_offload_everything_stays_on_the_accelerator(traced):
    result = traced["plain"]
    assert result["param_devices"] == result["param_mesh"] == [ACCEL]
    assert result["eager_grads"] == result["compiled_grads"] == [ACCEL]
    assert result["optimizer_state"] == [ACCEL]
    assert result["fingerprint"]["shard option offload"] == "None"
    for stage in ("fw", "bw"):
        records = graph(result, stage)
        assert collectives(records, "unshard"), stage
        assert device_copies(records) == [], stage
        assert not any(r["copy"] for r in records), stage


@pytest.mark.parametrize("recipe", ["host", "meta"])
def test_fsdp2_offload_recipes_put_buffers_on_the_device_with_no_manual_moves(traced, recipe):
    """Built on the CPU then sharded, or built on meta, sharded, ``to_empty(device="cpu")``:
    the rotary tables (buffers) go to the mesh's device, the shards and gradients stay on
    the host, and the compiled step traces (Dynamo refuses a mix of devices in one op)."""
    result = traced[f"llama_{recipe}"]
    assert result["buffers"] == [ACCEL]
    if recipe == "host":
        assert result["buffers_after_shard"] == [ACCEL]
    assert result["shards"] == result["eager_grads"] == result["compiled_grads"] == ["cpu"]
    assert result["loss"] == ACCEL
    assert result["h2d_copies"] > 0


# --------------------------------------------------------------------------- host to device


def test_gradient_copies_run_two_buckets_at_once_however_many_copies_a_bucket_has():
    """At world 1 each parameter's gradient is a copy of its own: the bound is two buckets,
    not two copies. A bucket's first copy retires every copy of the bucket two before it
    (the others retire nothing), and the last copy waits with the copies still running."""
    from graphshard.passes import grad_copy_stream
    from graphshard.passes.host_copy import TO_HOST as to_host

    graph_ = fx.Graph()
    sources, copies_ = [], []
    for k, bucket in enumerate((0, 0, 1, 1, 2, 2, 3)):
        source = graph_.placeholder(f"g{k}")
        copy = graph_.call_function(to_host, (source,))
        copy.meta["graphshard_copy"] = {"direction": "d2h", "bucket": bucket}
        sources.append(source)
        copies_.append(copy)
    graph_.output(tuple(copies_))
    gm = grad_copy_stream(fx.GraphModule(nn.Module(), graph_), Plan(grad_copy_stream=True))
    c, g = copies_, sources
    assert [x.kwargs.get("retire") for x in c[:-1]] == [
        None, None, None, None, [c[0], g[0], c[1], g[1]], None]
    assert all(x.kwargs["wait"] is False for x in c[:-1])
    assert c[-1].kwargs == {"wait": True, "issued": [c[2], c[3], c[4], c[5], g[2], g[3], g[4],
                                                     g[5]]}
    inputs = [torch.full((2,), float(k)) for k in range(7)]
    assert all(torch.equal(o, i) for o, i in zip(gm(*inputs), inputs, strict=True))


@pytest.mark.parametrize("stage", ["fw", "bw", "inference"])
def test_each_gather_sends_its_own_shards_copied_to_the_device_before_it(traced, stage):
    records = graph(traced["offload"], stage)
    order, nodes = position(records), by_name(records)
    gathers = collectives(records, "unshard")
    assert gathers
    fed = []
    for gather in gathers:
        mine = feeding(records, gather)
        # one non-blocking copy per shard the gather sends, all tagged with its bucket
        assert len(mine) == len(gather["params"]), gather["name"]
        assert {c["copy"]["bucket"] for c in mine} == {gather["bucket"]}
        for c in mine:
            assert order[c["name"]] < order[gather["name"]]
            assert c["device"] == ACCEL and non_blocking(c)
            (source,) = c["inputs"]
            assert nodes[source]["target"] == "placeholder"  # the host shard itself
            assert nodes[source]["device"] == "cpu"
        assert gather["device"] == ACCEL
        fed += mine
    # every copy feeds a gather, and nothing else moves data between devices
    assert sorted(c["name"] for c in fed) == sorted(c["name"] for c in device_copies(records)
                                                    if c["device"] == ACCEL)


@pytest.mark.parametrize("stage", ["fw", "bw"])
def test_prefetch_issues_the_next_buckets_copies_and_gather_before_this_buckets_compute(
    traced, stage
):
    records = graph(traced["offload"], stage)
    order = position(records)
    gathers = collectives(records, "unshard")
    assert len(gathers) >= 3
    first_compute = min(order[r["name"]] for r in records if r["target"] in COMPUTE)
    assert all(order[c["name"]] < first_compute for c in feeding(records, gathers[0]))
    for current, following in zip(gathers, gathers[1:], strict=False):
        wait = wait_of(records, current)
        # this bucket's compute: the first matmul that reads its gathered parameters
        compute = min(order[r["name"]] for r in records
                      if r["target"] in COMPUTE and wait["name"] in ancestors(records, r["name"]))
        assert order[following["name"]] < compute, (current["name"], following["name"])
        for c in feeding(records, following):
            assert order[wait["name"]] < order[c["name"]] < compute  # issued with the gather


@pytest.mark.parametrize("stage", ["fw", "bw"])
def test_offload_adds_copies_and_leaves_the_collective_schedule_alone(traced, stage):
    def schedule(records):
        return [(r["kind"], r["bucket"]) for r in records if r["kind"]]

    plain, offloaded = graph(traced["plain"], stage), graph(traced["offload"], stage)
    assert schedule(offloaded) == schedule(plain)
    assert copies(offloaded, "h2d") and not copies(plain, "h2d")


def test_bytes_copied_to_the_device_per_step_are_the_shard_bytes_of_each_gathered_bucket(traced):
    result = traced["offload"]
    shard_bytes, buckets = result["shard_bytes"], result["buckets"]
    per_step = 0
    for stage in ("fw", "bw"):
        records = graph(result, stage)
        for gather in collectives(records, "unshard"):
            sent = sum(c["nbytes"] for c in feeding(records, gather))
            assert sent == sum(shard_bytes[name] for name in gather["params"]), gather["name"]
            per_step += sent
        assert sum(c["nbytes"] for c in copies(records, "h2d")) == sum(
            sum(shard_bytes[n] for n in g["params"]) for g in collectives(records, "unshard"))
    # forward: every bucket once (whole buckets); backward: only what it gathers again
    fw_gathers = collectives(graph(result, "fw"), "unshard")
    assert sorted(g["bucket"] for g in fw_gathers) == sorted(set(buckets.values()))
    fw_bytes = sum(c["nbytes"] for c in copies(graph(result, "fw"), "h2d"))
    assert fw_bytes == sum(shard_bytes.values())
    bw_regathered = [n for g in collectives(graph(result, "bw"), "unshard") for n in g["params"]]
    assert per_step == fw_bytes + sum(shard_bytes[n] for n in bw_regathered)
    assert 0 < len(bw_regathered) < len(shard_bytes)  # the head and biases are not re-sent


def test_keeping_the_gathered_parameters_sends_each_shard_to_the_device_once_a_step(traced):
    """With ``reshard_after_forward=False`` the backward uses the forward's gathered
    parameters: the shards cross the bus once a step (the forward's copies), not again for
    the backward's gathers (``docs/cpu-offload.md``: the bus bounds an offloaded step)."""
    kept, resharded = traced["kept"], traced["offload"]
    fw_bytes = sum(c["nbytes"] for c in copies(graph(kept, "fw"), "h2d"))
    assert fw_bytes == sum(kept["shard_bytes"].values())
    assert not copies(graph(kept, "bw"), "h2d")
    assert copies(graph(resharded, "bw"), "h2d")  # the default sends them again
    assert copies(graph(kept, "bw"), "d2h")  # the gradients still go to the host


def test_auto_reshard_under_offload_counts_no_device_state_and_prices_the_bus(traced):
    """``reshard_after_forward="auto"`` under CPU offload: the shards, their gradients and
    the optimizer state live on the host, so the device budget does not hold them; and a
    bucket gathered again in backward crosses the bus again, which freeing it costs."""
    plain, offloaded = traced["auto"]["plain"], traced["auto"]["offloaded"]
    assert plain["state_bytes"] > 0 and offloaded["state_bytes"] == 0
    assert all(offloaded["keep"].values())  # no budget: everything kept
    for bucket, added in plain["added_s"].items():
        assert offloaded["added_s"][bucket] > added  # the shards' copy from the host
    # a budget that holds the offloaded step's device memory, and not the state besides it:
    # every bucket still kept (before, the host state counted against the device budget)
    assert offloaded["keep_all_peak"] < plain["keep_all_peak"]
    budgeted = traced["auto"]["budgeted"]
    assert budgeted["fits"] and all(budgeted["keep"].values())


def test_mixed_precision_copies_the_fp32_shard_then_casts_on_the_device(traced):
    records = graph(traced["bf16"], "fw")
    nodes = by_name(records)
    for gather in collectives(records, "unshard"):
        assert gather["dtype"] == "bfloat16"
        for c in feeding(records, gather):
            assert c["dtype"] == "float32"
            (cast,) = users(records, c["name"])
            assert cast["target"] == "prims.convert_element_type.default"
            assert cast["dtype"] == "bfloat16" and cast["device"] == ACCEL
            assert nodes[c["inputs"][0]]["device"] == "cpu"


# --------------------------------------------------------------------------- device to host


@pytest.mark.parametrize("config", ["offload", "hsdp", "bf16"])
def test_reduced_gradients_are_copied_to_the_host_right_after_the_reduction(traced, config):
    records = graph(traced[config], "bw")
    nodes, order = by_name(records), position(records)
    reduces = collectives(records, "reduce_grad")
    host = copies(records, "d2h")
    assert len(host) == len(reduces) == 4
    for reduce in reduces:
        (copy,) = [c for c in host if c["copy"]["bucket"] == reduce["bucket"]]
        last = wait_of(records, reduce)  # the reduce-scatter's wait ...
        if config == "hsdp":  # ... or, on HSDP, the wait of the all-reduce across replicas
            (across,) = users(records, last["name"])
            assert across["kind"] == "replica_reduce"
            last = wait_of(records, across)
        (source,) = copy["inputs"]
        if config == "bf16":  # cast back to the shard's dtype on the device, then copied
            assert nodes[source]["target"] == "prims.convert_element_type.default"
            assert nodes[source]["inputs"] == [last["name"]] and copy["dtype"] == "float32"
        else:
            assert source == last["name"]
        assert copy["device"] == "cpu" and copy["target"] == TO_HOST  # pinned, blocking
        assert copy["nbytes"] == nodes[source]["nbytes"]  # the bucket's reduced pieces
        assert order[last["name"]] < order[copy["name"]]
        # the shards' gradients are views of the host copy
        assert users(records, copy["name"])
        assert all(u["device"] == "cpu" for u in users(records, copy["name"]))
    output = records[-1]
    grads = [nodes[n] for n in output["inputs"] if nodes[n]["device"] is not None]
    assert grads and all(g["device"] == "cpu" for g in grads)


def test_gradients_on_a_copy_stream_two_at_once_and_one_host_wait(traced):
    """``backend(grad_copy_stream=True)``: every copy but the graph's last is left running
    (nothing but views of it before the output), at most two at once: each retires the copy
    two before it (the compute stream waits for it there) and keeps that copy's device source
    alive until then, so that Inductor reuses no source's memory while the copy stream reads
    it. The last waits on the host, with the copies still running as operands, so that no
    scheduler moves it before them, and their sources. The default waits at each."""
    default = copies(graph(traced["offload"], "bw"), "d2h")
    assert len(default) == 4 and all(c["kwargs"] == {} for c in default)
    records = graph(traced["copy_stream"], "bw")
    order, nodes = position(records), by_name(records)
    *early, last = copies(records, "d2h")
    assert len(early) == 3
    assert all(c["kwargs"]["wait"] == "False" for c in early)
    for k, copy in enumerate(early):
        if k < 2:
            assert "retire" not in copy["kwargs"] and copy["inputs"] == copy["inputs"][:1]
        else:  # the copy two before, and its source
            retired = early[k - 2]
            assert copy["inputs"][1:] == [retired["name"], retired["inputs"][0]]
            assert order[retired["name"]] < order[copy["name"]]
    assert last["kwargs"]["wait"] == "True"
    # its operands: the copies still running (order) and their device sources (lifetime)
    still_running = early[-2:]
    sources = [c["inputs"][0] for c in still_running]
    assert last["inputs"][1:] == [c["name"] for c in still_running] + sources
    assert all(nodes[name]["device"] == ACCEL for name in sources)
    assert all(order[c["name"]] < order[last["name"]] for c in early)
    for copy in early:  # read by nothing but views on their way to the output
        pending = users(records, copy["name"])
        while pending:
            user = pending.pop()
            if user["target"] != "output" and (user["copy"] or {}).get("direction") != "d2h":
                assert user["target"].split(".")[1] in ("slice", "view", "as_strided"), user
                pending += users(records, user["name"])
    assert [c["copy"]["bucket"] for c in (*early, last)] == [c["copy"]["bucket"] for c in default]
    assert nodes[last["name"]]["device"] == "cpu"


def test_a_copy_the_graph_reads_still_waits():
    """A copy whose result the graph computes with (a sum on the host) must have finished
    first: it waits, and lists the copies issued before it."""
    from torch import fx

    from graphshard.passes import Plan, grad_copy_stream
    from graphshard.passes.host_copy import TO_HOST as to_host

    graph_ = fx.Graph()
    a, b, c = (graph_.placeholder(name) for name in "abc")
    copies_ = []
    for k, x in enumerate((a, b, c)):
        copy = graph_.call_function(to_host, (x,))
        copy.meta["graphshard_copy"] = {"direction": "d2h", "bucket": k}
        copies_.append(copy)
    viewed = graph_.call_function(torch.ops.aten.view.default, (copies_[0], [-1]))
    summed = graph_.call_function(torch.ops.aten.sum.default, (copies_[1],))
    graph_.output((viewed, summed, copies_[2]))
    gm = grad_copy_stream(fx.GraphModule(nn.Module(), graph_), Plan(grad_copy_stream=True))
    first, read, last = copies_
    assert first.kwargs == {"wait": False}
    assert read.kwargs == {"wait": True, "issued": [first, a]}
    assert last.kwargs == {"wait": True, "issued": []}  # the read's wait finished the first
    inputs = [torch.arange(4.0), torch.ones(3), torch.zeros(2)]
    out = gm(*inputs)  # on the CPU every copy is synchronous
    assert torch.equal(out[0], inputs[0]) and torch.equal(out[2], inputs[2])
    assert out[1].item() == 3.0
    assert grad_copy_stream(gm, Plan()).graph is gm.graph  # off: nothing changes


@pytest.mark.parametrize("stage", ["fw", "bw", "inference"])
@pytest.mark.parametrize("config,baseline", [
    ("shard_stream", "offload"), ("mixed_streams", "mixed"),
], ids=["fsdp", "hsdp_bf16_no_sync_both_streams"])
def test_shards_go_to_the_device_on_a_copy_stream_one_bucket_ahead(traced, stage, config,
                                                                    baseline):
    """``backend(shard_copy_stream=True)``: each host-to-device copy is issued on the copy
    stream (``graphshard::to_device``) and waited for (``graphshard::wait_copy``) where the
    default copies, before anything reads it; a bucket's copies are issued before the first
    wait of the bucket used before it, and not before the one used two buckets before."""
    default = copies(graph(traced[baseline], stage), "h2d")
    assert default and all(c["target"] == DEVICE_PUT for c in default)
    records = graph(traced[config], stage)
    order, nodes = position(records), by_name(records)
    starts = copies(records, "h2d")
    assert [r for r in records if r["target"] == DEVICE_PUT] == []
    assert all(c["target"] == TO_DEVICE for c in starts)
    # the same copies: buckets, sources, bytes and the device
    assert sorted((c["copy"]["bucket"], c["nbytes"]) for c in starts) == sorted(
        (c["copy"]["bucket"], c["nbytes"]) for c in default)
    assert all(c["device"] == ACCEL and nodes[c["inputs"][0]]["device"] == "cpu" for c in starts)
    first_wait: dict[int, int] = {}
    for start in starts:
        waits = [u for u in users(records, start["name"]) if u["target"] == WAIT_COPY]
        assert len(waits) == 1, start["name"]
        readers = [u for u in users(records, start["name"]) if u["target"] != WAIT_COPY]
        assert readers and all(order[waits[0]["name"]] < order[u["name"]] for u in readers)
        bucket = start["copy"]["bucket"]
        first_wait[bucket] = min(first_wait.get(bucket, len(records)), order[waits[0]["name"]])
    in_use = sorted(first_wait, key=first_wait.get)
    assert len(in_use) >= 3
    for k, bucket in enumerate(in_use):
        for start in (c for c in starts if c["copy"]["bucket"] == bucket):
            if k >= 1:  # issued while the bucket before computes
                assert order[start["name"]] < first_wait[in_use[k - 1]], start["name"]
            if k >= 2:  # no more than one bucket ahead
                assert order[start["name"]] > first_wait[in_use[k - 2]], start["name"]


@pytest.mark.parametrize("config,baseline", [
    ("copy_stream", "offload"), ("shard_stream", "offload"), ("mixed_streams", "mixed"),
], ids=["gradients", "shards", "hsdp_bf16_no_sync_both_streams"])
def test_the_copy_streams_move_the_bytes_the_default_moves(traced, config, baseline):
    """The step's data movement (``graphshard.passes.traffic``, the bench's "copies MB"
    column) with the copies on copy streams is the default's: a ``wait_copy`` moves nothing
    (it returns no value: the bench's accounting raised on it on the H200), and the copies
    and sources a gradient copy only orders itself after or keeps alive are not read."""
    default, streams = traced[baseline]["traffic"], traced[config]["traffic"]
    assert isinstance(default, dict) and default["offload"] > 0, default
    assert streams == default


def test_both_copy_streams_are_on_by_default(traced):
    """Offloaded and nothing named, the step's graphs are the ones both copy streams make
    (measured on an H200: 0.84x FSDP2's offload step, docs/cpu-offload.md)."""
    default, both = traced["default"]["graphs"], traced["both_streams"]["graphs"]
    assert default == both
    targets = {r["target"] for stages in default for records in stages.values()
               for r in records}
    assert TO_DEVICE in targets and WAIT_COPY in targets


def test_a_shard_copy_made_in_the_graph_is_issued_after_its_source():
    """``shard_copy_stream`` never issues a copy before its host input exists, and an
    unrelated device copy (not a shard's) is left alone."""
    from graphshard.passes import shard_copy_stream
    from graphshard.passes.device_copy import TO_DEVICE as to_device
    from graphshard.passes.device_copy import WAIT_COPY as wait_copy

    device_put = torch.ops.prims.device_put.default
    graph_ = fx.Graph()
    a, b = graph_.placeholder("a"), graph_.placeholder("b")
    outputs = []
    for k, source in enumerate((a, b)):
        if k == 1:  # made inside the graph, after bucket 0's use
            source = graph_.call_function(torch.ops.aten.mul.Tensor, (source, 2.0))
        copy = graph_.call_function(device_put, (source, torch.device("cpu"), True))
        copy.meta["graphshard_copy"] = {"direction": "h2d", "bucket": k}
        outputs.append(graph_.call_function(torch.ops.aten.sin.default, (copy,)))
    other = graph_.call_function(device_put, (a, torch.device("cpu"), True))
    graph_.output((*outputs, other))
    gm = shard_copy_stream(fx.GraphModule(nn.Module(), graph_), Plan(shard_copy_stream=True))
    nodes = list(gm.graph.nodes)
    starts = [n for n in nodes if n.target is to_device]
    waits = [n for n in nodes if n.target is wait_copy]
    assert len(starts) == 2 and len(waits) == 2 and nodes.count(other) == 1
    assert nodes.index(starts[0]) == 2  # bucket 0: before the graph's first node
    mul = next(n for n in nodes if n.target is torch.ops.aten.mul.Tensor)
    assert nodes.index(starts[1]) == nodes.index(mul) + 1  # bucket 1: right after its source
    inputs = [torch.arange(3.0), torch.ones(3)]
    out = gm(*inputs)
    assert torch.equal(out[0], inputs[0].sin()) and torch.equal(out[1], (2 * inputs[1]).sin())
    assert shard_copy_stream(gm, Plan()).graph is gm.graph  # off: nothing changes


def test_no_sync_accumulates_on_the_device_and_the_synced_step_copies_once(traced):
    result = traced["no_sync"]
    assert result["accumulators"] == [ACCEL]
    held_back = graph(result, "bw", index=0)  # the no_sync graph: no reduction, no copy back
    assert collectives(held_back, "reduce_grad") == [] and copies(held_back, "d2h") == []
    assert copies(held_back, "h2d")  # it still gathers from the host
    synced = graph(result, "bw", index=-1)
    assert len(copies(synced, "d2h")) == len(collectives(synced, "reduce_grad")) == 4
    assert result["compiled_grads"] == ["cpu"]


# --------------------------------------------------------------------------- eager kernels


def test_eager_kernels_copy_to_the_device_then_cast_and_gather_and_back_after_reducing(traced):
    kernels = traced["kernels"]
    assert kernels["unshard"]["calls"] == [
        f"_to_copy(device={ACCEL}:0, dtype=torch.float32, non_blocking=True)",
        "_to_copy(device=None, dtype=torch.bfloat16, non_blocking=False)",
        "all_gather_into_tensor",
    ]
    assert kernels["unshard"]["device"] == ACCEL and kernels["unshard"]["shape"] == [5, 8]
    assert kernels["reduce_grad"]["calls"] == [
        "reduce_scatter_tensor",
        f"to_host({ACCEL} -> pinned host)",
    ]
    assert kernels["reduce_grad"]["device"] == "cpu"
    assert kernels["reduce_grad"]["shape"] == [3, 8]  # rank 0's rows of [5, 8]


# --------------------------------------------------------------------------- fake cuda


def test_lowering_copies_to_and_from_cuda_with_valid_values():
    """The passes alone, on fake ``cuda`` tensors (no autograd, so no CUDA build needed)."""
    with fake_process_group(2) as group, FakeTensorMode():
        layout = Dim0Layout([5, 8], 2)
        g = fx.Graph()
        shard = g.placeholder("shard")
        shard.meta["val"] = torch.empty(3, 8)
        args = (shard, [5, 8], 0, False, True, "w", 2, group.group_name, None, None, "", 1,
                "cuda")
        full = g.call_function(UNSHARD, args)
        full.meta["val"] = UNSHARD(shard.meta["val"], *args[1:])
        g.output((full,))
        fw = lower_unshard(fx.GraphModule(nn.Module(), g), Plan())

        g = fx.Graph()
        grad = g.placeholder("grad")
        grad.meta["val"] = torch.empty(5, 8, device="cuda")
        args = (grad, 0, "w", 2, group.group_name, None, torch.float32, "", 1, True, None,
                None, 3, "cpu")
        reduced = g.call_function(REDUCE_GRAD, args)
        reduced.meta["val"] = REDUCE_GRAD(grad.meta["val"], *args[1:])
        g.output((reduced,))
        bw = lower_reduce_grad(fx.GraphModule(nn.Module(), g), Plan())

    (h2d,) = [n for n in fw.graph.nodes if n.meta.get("graphshard_copy")]
    assert h2d.target is torch.ops.prims.device_put.default  # an op Inductor lowers
    assert h2d.args == (shard, torch.device("cuda"), True) and not h2d.kwargs
    assert h2d.meta["val"].device.type == "cuda" and h2d.meta["val"].shape == (3, 8)
    (gather,) = [n for n in fw.graph.nodes if n.meta.get("graphshard")]
    assert gather.meta["val"].device.type == "cuda"
    assert gather.meta["val"].numel() == 2 * layout.piece_numel
    (d2h,) = [n for n in bw.graph.nodes if n.meta.get("graphshard_copy")]
    assert d2h.meta["graphshard_copy"] == {"direction": "d2h", "bucket": 0}
    assert d2h.target is torch.ops.graphshard.to_host.default
    assert d2h.args[0].target is torch.ops._c10d_functional.wait_tensor.default
    assert d2h.meta["val"].device.type == "cpu"
    (out,) = bw.graph.find_nodes(op="output")[0].args[0]
    assert out.meta["val"].device.type == "cpu" and tuple(out.meta["val"].shape) == (3, 8)


# --------------------------------------------------------------------------- errors


def _message_names_the_fix(error: pytest.ExceptionInfo) -> None:
    text = str(error.value)
    assert "on 'cpu'" in text and "nothing to offload" in text
    assert "Drop offload=" in text and "accelerator mesh" in text
    assert "init_device_mesh('cuda'" in text


def test_offload_on_a_cpu_only_run_says_why_and_what_to_change(one_rank):
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError) as error:
        graphshard.shard(model, offload=graphshard.CPUOffload())  # mesh from the CPU params
    _message_names_the_fix(error)
    assert not graphshard.api.sharding.is_sharded(model)  # refused before anything changed
    assert type(model) is nn.Linear and not hasattr(model.weight, "device_mesh")
    graphshard.shard(model)  # the fix: without offload= it shards
    assert model.weight.shape == (4, 4)


def test_offload_on_an_explicit_cpu_mesh_is_refused(one_rank):
    from torch.distributed.device_mesh import init_device_mesh

    with pytest.raises(ValueError) as error:
        graphshard.shard(nn.Linear(4, 4), init_device_mesh("cpu", (1,)),
                         offload=graphshard.CPUOffload(pin_memory=False))
    _message_names_the_fix(error)


def test_the_host_stands_in_for_the_device_only_within_its_context(one_rank):
    """``host_standing_in_for_device`` lets a CPU mesh offload (the check of offload's graphs
    on a CPU-only machine) inside it, and nowhere after it, an exception included."""
    from graphshard.api.sharding import shard_state

    with host_standing_in_for_device():
        model = graphshard.shard(nn.Linear(4, 4), offload=graphshard.CPUOffload(pin_memory=False))
    assert shard_state(model).compute_device == "cpu" and shard_state(model).offload
    with pytest.raises(KeyError), host_standing_in_for_device():
        raise KeyError("inside")
    with pytest.raises(ValueError) as error:
        graphshard.shard(nn.Linear(4, 4), offload=graphshard.CPUOffload(pin_memory=False))
    _message_names_the_fix(error)


def test_offload_takes_a_cpu_offload_policy():
    with fake_process_group(2):
        with pytest.raises(TypeError, match="offload must be a graphshard.CPUOffload"):
            graphshard.shard(nn.Linear(4, 4), offload=True)
    with pytest.raises(TypeError, match="pin_memory must be True or False"):
        graphshard.CPUOffload(pin_memory="yes")


# --------------------------------------------------------------------------- through Inductor


def _waits_before_reads(module: str) -> int:
    """How many ``wait_copy`` calls Inductor's code for a graph makes; each must come before
    every mention of its buffer after that buffer is made, metadata checks aside (the wait
    is declared to write it, so no scheduler may put a reader first)."""
    lines = module.splitlines()
    waits = 0
    for i, line in enumerate(lines):
        found = re.search(r"graphshard\.wait_copy\.default\((buf\d+)\)", line)
        if found is None:
            continue
        waits += 1
        name = re.compile(rf"\b{found.group(1)}\b")
        made = max(j for j in range(i) if re.match(rf"\s*{found.group(1)} = ", lines[j]))
        for earlier in lines[made + 1 : i]:
            text = earlier.strip()
            assert not name.search(text) or text.startswith(("#", "assert_")), (
                f"{found.group(1)} read before its wait_copy: {text}")
    return waits


def _train_compiled(model: nn.Module, backend, steps: int = 3) -> list[float]:
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = compiled(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("param_dtype,backend_options", [
    (None, {"grad_copy_stream": False, "shard_copy_stream": False}),
    (torch.bfloat16, {"grad_copy_stream": False, "shard_copy_stream": False}),
    (None, {"grad_copy_stream": True, "shard_copy_stream": False}),
    (torch.bfloat16, {}),  # both copy streams, by default
], ids=["fp32", "bf16", "grad_copy_stream", "both_streams_by_default"])
def test_offload_graphs_compile_through_inductor_and_train_like_no_offload(
    one_rank, param_dtype, backend_options
):
    """Inductor lowers every copy the passes insert (it has no lowering of its own for
    ``aten._to_copy``, which it expects AOTAutograd to have decomposed), and the offloaded
    step computes what the plain one does."""
    from graphshard.api.sharding import shard_state

    torch._dynamo.reset()
    mp = None if param_dtype is None else graphshard.MixedPrecision(param_dtype=param_dtype)
    torch.manual_seed(0)
    plain = offload_graphs.ThreeBlock()
    offloaded = offload_graphs.ThreeBlock()
    offloaded.load_state_dict(plain.state_dict())
    graphshard.shard(plain, mixed_precision=mp)
    plain_losses = _train_compiled(plain, graphshard.backend())
    with host_standing_in_for_device():  # the host stands in for the accelerator
        graphshard.shard(offloaded, mixed_precision=mp,
                         offload=graphshard.CPUOffload(pin_memory=False))
    assert shard_state(offloaded).compute_device == "cpu"
    backend = graphshard.backend(**backend_options)
    offload_losses, code = run_and_get_code(_train_compiled, offloaded, backend)
    if backend_options.get("shard_copy_stream", True):
        assert sum(_waits_before_reads(module) for module in code) >= 8
    stages = backend.graphs[-1]
    directions = Counter(n.meta["graphshard_copy"]["direction"] for stage in ("fw", "bw")
                         for n in stages[stage].graph.nodes if n.meta.get("graphshard_copy"))
    assert directions["h2d"] >= 4 and directions["d2h"] >= 4  # Inductor compiled the copies
    waits = [n.kwargs.get("wait", True) for n in stages["bw"].graph.nodes
             if n.meta.get("graphshard_copy", {}).get("direction") == "d2h"]
    running = backend_options.get("grad_copy_stream", True)
    assert waits.count(False) == (len(waits) - 1 if running else 0)
    assert offload_losses == plain_losses
    for (name, a), b in zip(plain.state_dict().items(), offloaded.state_dict().values(),
                            strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
