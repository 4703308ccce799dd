"""Warn when a graph break splits a sharded model's step, and say what the split costs.

A graph break cuts the step into separately compiled graphs. The passes schedule collectives
within one graph only, so at each cut the next graph's first all-gather has no compute before
it to hide under (exposed in forward), and the reduce-scatter of its first bucket is waited
before that graph's backward returns (exposed in backward); a bucket read on both sides of the
cut is gathered once per graph. Dynamo breaks silently by default, so the backend names the
break (Dynamo's reason and the user's source line) and prices it with the cost model.

Dynamo compiles the graph that ends in the break first (``gm.compile_subgraph_reason`` says
why it ended), then the graph after it: the break is remembered until the next graph that
gathers something is compiled, whose collectives are the cost.

A break inside a block that runs as a compile region (:mod:`graphshard.api.block_regions`)
shows first as a break at graphshard's region call, where Dynamo falls back; the block's own
code then compiles in graphs of its own, which gather nothing (the block's parameters came
gathered) and end with the block's return. Such a break stays remembered across them, and
takes the reason and line of the block's own break.
"""

from __future__ import annotations

import math
import traceback
import warnings
from dataclasses import dataclass, field

from torch import fx

from graphshard.api.block_regions import region_forward
from graphshard.passes.cost_model import (
    HardwareProfile,
    all_gather_time,
    reduce_scatter_time,
    tensor_bytes,
)
from graphshard.passes.fx_util import collectives
from graphshard.passes.markers import is_reduce_grad, marker_args

__all__ = ["GraphBreakWarning", "BreakCost", "break_cost", "GraphBreakTracker"]


class GraphBreakWarning(UserWarning):
    """A graph break split a sharded model's step into several graphs (costs overlap)."""


@dataclass
class BreakCost:
    """Communication a graph break exposes per training step (predicted by the cost model)."""

    gather_bytes: int = 0  # the first all-gather after the break (forward)
    gather_s: float = 0.0
    reduce_bytes: int = 0  # the reduce-scatter waited before that graph's backward returns
    reduce_s: float = 0.0
    regathered: list[str] = field(default_factory=list)  # read on both sides: gathered twice
    regathered_bytes: int = 0  # unsharded bytes of one extra gather of those parameters

    @property
    def exposed_s(self) -> float:
        """Predicted extra exposed communication per step, seconds."""
        return self.gather_s + self.reduce_s


@dataclass
class _Break:
    reason: str
    where: str
    gathered: dict[str, int]  # parameter name -> unsharded bytes, before the break
    frame: traceback.FrameSummary | None = None  # the user's line that broke the graph
    # Dynamo fell back at a block region's call (:mod:`graphshard.api.block_regions`): the
    # break is inside the block, whose code is then compiled apart, frame by frame
    in_region: bool = False
    named_by_body: bool = False  # the block's own break replaced the region call's reason


def _at_region_call(frame: traceback.FrameSummary | None) -> bool:
    code = region_forward.__code__
    return frame is not None and frame.filename == code.co_filename and frame.name == code.co_name


def _first_line(reason: str) -> str:
    lines = [ln.strip() for ln in reason.strip().splitlines() if ln.strip()]
    text = lines[0] if lines else "unknown reason"
    explanation = next((ln for ln in lines if ln.startswith("Explanation:")), None)
    return f"{text}: {explanation[len('Explanation:'):].strip()}" if explanation else text


def _where(reason) -> str:
    stack = getattr(reason, "user_stack", None) or []
    if not stack:
        return "an unknown location"
    frame = stack[-1]
    code = f": {frame.line.strip()}" if getattr(frame, "line", None) else ""
    return f"{frame.filename}:{frame.lineno} in {frame.name}{code}"


def _gathers(gm: fx.GraphModule) -> list[fx.Node]:
    return collectives(gm.graph, "unshard")


def _param_bytes(gather: fx.Node) -> dict[str, int]:
    """Unsharded bytes per parameter of one lowered all-gather (shared evenly if unknown; a
    coalesced all-gather's value holds each parameter's own)."""
    names = gather.meta["graphshard"]["params"]
    val = gather.meta["val"]
    if isinstance(val, (list, tuple)):
        return {name: tensor_bytes(v) for name, v in zip(names, val, strict=True)}
    total = tensor_bytes(val)
    return {name: total // max(1, len(names)) for name in names}


def _world(gather: fx.Node) -> int:
    return int(gather.args[1])


def _first_reduce_bytes(joint: fx.GraphModule | None, world: int) -> int:
    """Bytes entering the reduce-scatter of the last bucket the backward reduces."""
    if joint is None:
        return 0
    by_bucket: dict[int, int] = {}
    order: list[int] = []
    for node in joint.graph.nodes:
        if is_reduce_grad(node) and "val" in node.meta:
            bucket = marker_args(node).bucket
            val = node.meta["val"]
            if bucket not in by_bucket:
                order.append(bucket)
            by_bucket[bucket] = by_bucket.get(bucket, 0) + (
                math.prod(val.shape) * world * val.element_size()
            )
    return by_bucket[order[-1]] if order else 0


def break_cost(
    before: dict[str, int], stages: dict[str, fx.GraphModule], profile: HardwareProfile
) -> BreakCost:
    """What a break costs, given the bytes per parameter gathered before it and the graphs
    (``GraphshardBackend.graphs`` entry) compiled after it."""
    forward = stages.get("fw", stages.get("inference"))
    cost = BreakCost()
    gathers = _gathers(forward) if forward is not None else []
    if not gathers:
        return cost
    world = _world(gathers[0])
    cost.gather_bytes = tensor_bytes(gathers[0].meta["val"])  # a coalesced one's: a list
    cost.gather_s = all_gather_time(cost.gather_bytes, world, profile)
    cost.reduce_bytes = _first_reduce_bytes(stages.get("joint"), world)
    if cost.reduce_bytes:
        cost.reduce_s = reduce_scatter_time(cost.reduce_bytes, world, profile)
    for gather in gathers:
        for name, nbytes in _param_bytes(gather).items():
            if name in before:
                cost.regathered.append(name)
                cost.regathered_bytes += nbytes
    return cost


def _message(brk: _Break, cost: BreakCost, profile: HardwareProfile,
             break_prefetch: bool = False) -> str:
    ahead = " unless break_prefetch, which issues it at the end of the graph before, took it"
    parts = [
        f"forward: +1 exposed all-gather ({cost.gather_bytes:,} bytes, "
        f"{cost.gather_s * 1e3:.3f} ms{ahead if break_prefetch else ''})"
    ]
    if cost.reduce_bytes:
        parts.append(
            f"backward: +1 exposed reduce-scatter ({cost.reduce_bytes:,} bytes, "
            f"{cost.reduce_s * 1e3:.3f} ms)"
        )
    if cost.regathered:
        shown = ", ".join(cost.regathered[:4]) + (" ..." if len(cost.regathered) > 4 else "")
        parts.append(
            f"{len(cost.regathered)} parameter(s) read on both sides are gathered once more "
            f"per graph ({cost.regathered_bytes:,} more bytes per gather: {shown})"
        )
    inside = (" (inside a block compiled as a region: each such block's gathers then run in "
              "graphs of their own)") if brk.in_region else ""
    return (
        f"graphshard: a graph break at {brk.where}{inside} splits the sharded step into "
        f"separate graphs; collectives cannot be overlapped across it. Dynamo's reason: "
        f"{brk.reason}. "
        f"Cost per step ({profile.name} profile): " + "; ".join(parts) + ". Predicted extra "
        f"exposed communication: {cost.exposed_s * 1e3:.3f} ms per step. Remove the break "
        "(the reason says how, or see torch._dynamo.explain / TORCH_LOGS=graph_breaks) or move "
        "it before the first or after the last parameter use"
        + ("." if break_prefetch else ", or pass graphshard.backend(break_prefetch=True) to "
           "gather the forward's first buckets after the break at the end of the graph "
           "before it.")
    )


class GraphBreakTracker:
    """Remembers the break that ended the last compiled graph and warns for the next one."""

    def __init__(self) -> None:
        self.pending: _Break | None = None

    def reads_forward(self, gm: fx.GraphModule) -> bool:
        """Whether :meth:`graph_compiled` needs ``gm``'s forward graph: a break precedes it
        or ends it."""
        reason = getattr(gm, "compile_subgraph_reason", None)
        return self.pending is not None or bool(getattr(reason, "graph_break", False))

    def graph_compiled(
        self, gm: fx.GraphModule, stages: dict[str, fx.GraphModule], profile: HardwareProfile,
        break_prefetch: bool = False,
    ) -> BreakCost | None:
        """Called once per compiled Dynamo graph (``gm``) after its forward is compiled.

        Warns with :class:`GraphBreakWarning` if a break precedes this graph and this graph
        gathers parameters; returns the cost it warned about, else None.
        """
        forward = stages.get("fw", stages.get("inference"))
        gathered: dict[str, int] = {}
        for gather in _gathers(forward) if forward is not None else []:
            gathered.update(_param_bytes(gather))
        cost = None
        if self.pending is not None and gathered:
            cost = break_cost(self.pending.gathered, stages, profile)
            message = _message(self.pending, cost, profile, break_prefetch)
            frame = self.pending.frame
            if frame is not None and frame.lineno is not None:  # attributed to the user's line
                warnings.warn_explicit(message, GraphBreakWarning, frame.filename, frame.lineno)
            else:
                warnings.warn(message, GraphBreakWarning, stacklevel=2)
            self.pending = None
        elif self.pending is not None:
            self.pending.gathered.update(gathered)  # nothing gathered yet: wait for the next
        reason = getattr(gm, "compile_subgraph_reason", None)
        breaks = reason is not None and getattr(reason, "graph_break", False)
        stack = getattr(reason, "user_stack", None) or [None]
        if self.pending is not None and self.pending.in_region and not gathered:
            # A graph of the block's own code, compiled after the region call fell back: its
            # break is the one to name; its frame's return is the block's, not the step's.
            if breaks and not self.pending.named_by_body and not _at_region_call(stack[-1]):
                self.pending.reason, self.pending.where = _first_line(reason.reason), _where(reason)
                self.pending.frame, self.pending.named_by_body = stack[-1], True
            return cost
        if not breaks:
            self.pending = None  # the frame returned: a break before it cost nothing more
        elif gathered:
            self.pending = _Break(_first_line(reason.reason), _where(reason), gathered, stack[-1],
                                  in_region=_at_region_call(stack[-1]))
        return cost


TRACKER = GraphBreakTracker()
