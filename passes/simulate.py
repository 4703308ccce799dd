"""Replay a scheduled graph on one compute stream and one comm stream, using the cost model.

It answers the questions the scheduling passes are about without a cluster: how much
communication is hidden behind compute, how much stalls the step (exposed communication),
and how many unsharded bytes are alive at once. Nodes run in graph order; a collective is
issued on the comm stream when compute reaches it (and the stream is free), and
``wait_tensor`` stalls compute until that collective has finished.

CPU offload's copies between host and device take the profile's host link. A copy on the
compute stream (the default) holds it. One on a copy stream (``shard_copy_stream``,
``grad_copy_stream``) runs on an ``h2d`` or ``d2h`` lane from the moment compute reaches
it, and compute stalls where it waits for one (``wait_copy``, a gradient copy's
``retire``, a copy the host waits for).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from graphshard.passes.cost_model import (
    HardwareProfile,
    collective_kind,
    node_flops,
    node_time,
    tensor_bytes,
)
from graphshard.passes.device_copy import TO_DEVICE, WAIT_COPY
from graphshard.passes.fx_util import DEVICE_COPY
from graphshard.passes.host_copy import TO_HOST

__all__ = ["Event", "Timeline", "simulate", "peak_unsharded_bytes", "gathered_nodes"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# Ops through which the lowered passes rebuild parameters from a gathered buffer: the buffer
# stays alive as long as anything derived through them is still used.
_REBUILD_OPS = {
    operator.getitem,  # an output of a coalesced all-gather
    c10d.wait_tensor.default,
    aten.view.default,
    aten.slice.Tensor,
    aten.clone.default,
    aten.permute.default,
    aten.t.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.alias.default,
}


@dataclass
class Event:
    """One interval on a lane; ``kind`` is unshard/reduce_grad/<collective>/compute/exposed."""

    name: str
    lane: str  # "compute", "comm", or a copy stream's "h2d" / "d2h"
    start: float
    end: float
    bucket: int | None = None
    kind: str = "compute"
    ops: int = 1  # nodes merged into this event
    flops: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """The simulated step: its events and the totals the scheduling passes care about."""

    events: list[Event] = field(default_factory=list)
    total_time: float = 0.0
    compute_time: float = 0.0
    comm_time: float = 0.0
    exposed_comm: float = 0.0
    copy_time: float = 0.0  # CPU offload's copies over the host link
    exposed_copy: float = 0.0  # compute stalled on copies of a copy stream
    peak_unsharded_bytes: int = 0
    profile: str = ""


class _ComputeRun:
    """Consecutive compute nodes, merged into one event so that timelines stay readable."""

    def __init__(self) -> None:
        self.nodes: list[fx.Node] = []
        self.start = self.end = 0.0
        self.flops = 0

    def add(self, node: fx.Node, start: float, end: float) -> None:
        if not self.nodes:
            self.start = start
        self.nodes.append(node)
        self.end = end
        self.flops += node_flops(node)

    def flush(self, events: list[Event]) -> None:
        if self.nodes:
            first, n = self.nodes[0].name, len(self.nodes)
            name = first if n == 1 else f"{first} (+{n - 1} ops)"
            events.append(
                Event(name, "compute", self.start, self.end, None, "compute", n, self.flops)
            )
        self.nodes = []
        self.flops = 0


def _label(node: fx.Node) -> tuple[str, int | None]:
    tag = node.meta.get("graphshard") or {}
    return tag.get("kind") or collective_kind(node) or "comm", tag.get("bucket")


def _waited_collective(node: fx.Node, ends: dict[fx.Node, float]) -> fx.Node | None:
    if node.op != "call_function" or node.target is not c10d.wait_tensor.default:
        return None
    src = node.args[0]
    if src.op == "call_function" and src.target is operator.getitem:
        src = src.args[0]  # an output of a coalesced collective
    return src if src in ends else None


def _copy_direction(node: fx.Node) -> str | None:
    """"h2d" or "d2h" for a copy between host and device, else None."""
    if node.target in (DEVICE_COPY, TO_DEVICE):
        return "h2d"
    return "d2h" if node.target is TO_HOST else None


def _on_copy_stream(node: fx.Node) -> bool:
    """Whether a host-device copy runs on a copy stream (not on the compute stream)."""
    if node.target is TO_DEVICE:
        return True
    return node.target is TO_HOST and (
        not node.kwargs.get("wait", True) or node.kwargs.get("issued") is not None)


class _Copies:
    """The copy-stream lanes: when each is free, when each copy ends."""

    def __init__(self, timeline: Timeline, profile: HardwareProfile) -> None:
        self.timeline, self.profile = timeline, profile
        self.free = {"h2d": 0.0, "d2h": 0.0}
        self.ends: dict[fx.Node, float] = {}

    def stall(self, compute_t: float, until: float, name: str, bucket: int | None) -> float:
        """Compute waits until ``until``; the stall is recorded as exposed copy time."""
        if until <= compute_t:
            return compute_t
        self.timeline.events.append(
            Event(f"wait {name}", "compute", compute_t, until, bucket, "exposed"))
        self.timeline.exposed_copy += until - compute_t
        return until

    def run(self, node: fx.Node, lane: str, compute_t: float) -> float:
        """Run copy ``node``; return when compute may go on."""
        dur = self.profile.host_copy_time(tensor_bytes(node.meta.get("val")))
        bucket = (node.meta.get("graphshard_copy") or {}).get("bucket")
        self.timeline.copy_time += dur
        if not _on_copy_stream(node):  # it holds the compute stream
            self.timeline.events.append(
                Event(node.name, "compute", compute_t, compute_t + dur, bucket, lane))
            return compute_t + dur
        for retired in node.kwargs.get("retire") or ():
            if retired in self.ends:
                compute_t = self.stall(compute_t, self.ends[retired], retired.name, bucket)
        start = max(compute_t, self.free[lane])
        self.free[lane] = self.ends[node] = start + dur
        self.timeline.events.append(Event(node.name, lane, start, start + dur, bucket, lane))
        if node.target is TO_HOST and node.kwargs.get("wait", True):  # the host waits
            compute_t = self.stall(compute_t, start + dur, node.name, bucket)
        return compute_t


def simulate(
    gm_or_graph: fx.GraphModule | fx.Graph,
    profile: HardwareProfile,
    *,
    world_size: int | None = None,
) -> Timeline:
    """Simulate one execution of the graph on ``profile``.

    ``world_size`` is needed only to cost ``all_reduce`` nodes.
    """
    graph = gm_or_graph.graph if isinstance(gm_or_graph, fx.GraphModule) else gm_or_graph
    tl = Timeline(profile=profile.name)
    compute_t = comm_free = 0.0
    ends: dict[fx.Node, float] = {}
    run = _ComputeRun()
    copies = _Copies(tl, profile)
    for node in graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        lane = _copy_direction(node)
        if lane is not None or node.target is WAIT_COPY:
            run.flush(tl.events)
            if lane is not None:
                compute_t = copies.run(node, lane, compute_t)
            elif node.args[0] in copies.ends:
                source = node.args[0]
                bucket = (source.meta.get("graphshard_copy") or {}).get("bucket")
                compute_t = copies.stall(compute_t, copies.ends[source], source.name, bucket)
            continue
        if collective_kind(node) is not None:
            run.flush(tl.events)
            dur = node_time(node, profile, world_size=world_size)
            start = max(compute_t, comm_free)
            comm_free = ends[node] = start + dur
            kind, bucket = _label(node)
            tl.events.append(Event(node.name, "comm", start, comm_free, bucket, kind))
            tl.comm_time += dur
            continue
        src = _waited_collective(node, ends)
        if src is not None:
            run.flush(tl.events)
            if ends[src] > compute_t:
                _, bucket = _label(src)
                tl.events.append(
                    Event(f"wait {src.name}", "compute", compute_t, ends[src], bucket, "exposed")
                )
                tl.exposed_comm += ends[src] - compute_t
                compute_t = ends[src]
            continue
        dur = node_time(node, profile, world_size=world_size)
        if dur > 0:
            run.add(node, compute_t, compute_t + dur)
            compute_t += dur
            tl.compute_time += dur
    run.flush(tl.events)
    tl.total_time = max(compute_t, comm_free, *copies.free.values())
    tl.peak_unsharded_bytes = peak_unsharded_bytes(graph)
    return tl


def gathered_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The all-gathers of ``graph`` and every node derived from them by rebuild ops alone:
    the values that are unsharded parameters."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if collective_kind(node) == "all_gather" or (
            node.op == "call_function"
            and node.target in _REBUILD_OPS
            and any(a in found for a in node.all_input_nodes)
        ):
            found.add(node)
    return found


def peak_unsharded_bytes(graph: fx.Graph) -> int:
    """Most all-gathered bytes alive at one graph position.

    A gathered buffer is alive from its all-gather until the last use of anything derived
    from it through the rebuild ops (wait, views, slices, clones). A coalesced all-gather's
    outputs are separate buffers: each lives until the last use of what is derived from it
    alone, so a parameter read early in its bucket is not counted for the whole bucket.
    """
    nodes = list(graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    delta = [0] * (len(nodes) + 1)
    for node in nodes:
        if collective_kind(node) != "all_gather":
            continue
        for roots, size in _gathered_buffers(node):
            delta[order[node]] += size
            delta[_last_use(roots, order) + 1] -= size
    peak = live = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak


def _gathered_buffers(gather: fx.Node) -> list[tuple[list[fx.Node], int]]:
    """The buffers an all-gather fills, each as (the nodes its uses derive from, its bytes):
    the gather itself, or for a coalesced one each output's ``getitem`` nodes. A coalesced
    gather read other than by index counts whole from the gather, as do outputs nothing
    reads."""
    outputs = gather.meta.get("val")
    if not isinstance(outputs, (list, tuple)):
        return [([gather], tensor_bytes(outputs))]
    readers: dict[int, list[fx.Node]] = {}
    for user in gather.users:
        if user.op != "call_function" or user.target is not operator.getitem:
            return [([gather], tensor_bytes(outputs))]
        readers.setdefault(user.args[1], []).append(user)
    buffers = [(nodes, tensor_bytes(outputs[i])) for i, nodes in readers.items()]
    unread = sum(tensor_bytes(value) for i, value in enumerate(outputs) if i not in readers)
    return buffers + ([([gather], unread)] if unread else [])


def _last_use(roots: list[fx.Node], order: dict[fx.Node, int]) -> int:
    """The graph position of the last use of ``roots`` or of anything derived from them
    through the rebuild ops."""
    derived, stack = set(roots), list(roots)
    last = max(order[root] for root in roots)
    while stack:
        for user in stack.pop().users:
            last = max(last, order[user])
            if user.op == "call_function" and user.target in _REBUILD_OPS and user not in derived:
                derived.add(user)
                stack.append(user)
    return last
