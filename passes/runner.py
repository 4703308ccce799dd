"""The pass runner: what every pass would otherwise repeat, and the invariants between passes.

A pass only transforms the graph. The runner then lints and recompiles it once, and checks
what must hold after it, so a pass that breaks the graph fails at that pass with its name,
not later inside Inductor or as a hang across ranks:

- no ``unshard`` marker is left once ``lower_unshard`` has run, no ``reduce_grad`` marker
  once ``lower_reduce_grad`` has;
- every collective is waited on exactly once (an unwaited one leaks, a twice-waited one
  is a lowering bug);
- every operation of an AOTAutograd graph carries ``meta["val"]`` (what Inductor, the cost
  model and the dumps read);
- once lowered, graphshard's collectives keep the order the lowering gave them (the plan's
  bucket order): a scheduling pass may move a gather against compute or a reduce-scatter,
  never past another gather (nor a reduce-scatter past another reduce-scatter).

Each pass's wall time is recorded, so ``graphshard plan`` times the passes through the
runner.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import fx

from graphshard.passes.errors import GraphshardError
from graphshard.passes.fx_util import fill_missing_values, waits_of
from graphshard.passes.markers import is_collective_start, is_reduce_grad, is_unshard
from graphshard.passes.plan import Plan

__all__ = ["PassInvariantError", "PassRunner", "check_invariants", "collective_order"]

Pass = Callable[[fx.GraphModule, Plan], fx.GraphModule]
_AOT_STAGES = ("joint", "fw", "bw", "inference")


class PassInvariantError(GraphshardError, RuntimeError):
    """A graph pass left the graph in a state the next stage cannot take: a graphshard bug,
    reported with the pass and the node."""


@dataclass
class PassRunner:
    """Runs a stage's passes in order: lint and invariants after each, and recompiles the
    graph's code once at the end (no pass runs the code; recompiling a graph of an
    80-layer model after each pass cost a second per trace).

    ``after_each(step, name, gm)`` is called with the graph before the first pass (step 0,
    name ``"input"``) and after each pass (the dumps hook in here). ``seconds`` sums the
    wall time of each pass by name, over every graph this runner ran.
    """

    after_each: Callable[[int, str, fx.GraphModule], None] | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    def run(self, stage: str, passes: Sequence[Pass], gm: fx.GraphModule,
            plan: Plan) -> fx.GraphModule:
        """``gm`` after every pass of ``passes``; ``stage`` names the graph (dynamo, joint,
        fw, bw, inference)."""
        if stage in _AOT_STAGES:
            fill_missing_values(gm)  # what AOTAutograd's partitioner left without a value
        if self.after_each is not None:
            self.after_each(0, "input", gm)
        done: list[str] = []
        order = collective_order(gm)
        for step, fn in enumerate(passes, start=1):
            start = time.perf_counter()
            gm = fn(gm, plan)
            gm.graph.lint()
            name = fn.__name__
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            done.append(name)
            check_invariants(stage, gm, done)
            now = collective_order(gm)
            if sorted(now) == sorted(order) and _by_kind(now) != _by_kind(order):
                raise PassInvariantError(
                    f"graphshard pass {name!r} ({stage} graph) reordered graphshard's "
                    f"collectives of one kind among themselves: {order} became {now}. "
                    "Every rank issues them in the order the lowering gave (the plan's "
                    "bucket order); a pass may move one against compute or a collective of "
                    "another kind, not past one of its own kind. This is a bug in "
                    "graphshard; please report it with the graph dump."
                )
            order = now
            if self.after_each is not None:
                self.after_each(step, name, gm)
        if done:
            gm.recompile()
        return gm

    @property
    def total_seconds(self) -> float:
        """Wall time spent in passes (lint and recompile included)."""
        return sum(self.seconds.values())


def check_invariants(stage: str, gm: fx.GraphModule, done: Sequence[str]) -> None:
    """Raise :class:`PassInvariantError` if ``gm`` breaks an invariant after the passes
    ``done`` (names, in order) of ``stage``."""
    last = done[-1] if done else "input"

    def fail(node: fx.Node, what: str) -> None:
        raise PassInvariantError(
            f"graphshard pass {last!r} ({stage} graph) left {node.format_node()}: {what}. "
            "This is a bug in graphshard; please report it with the graph dump "
            "(GRAPHSHARD_DUMP_DIR=...)."
        )

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if "lower_unshard" in done and is_unshard(node):
            fail(node, "an unshard marker after lower_unshard")
        if "lower_reduce_grad" in done and is_reduce_grad(node):
            fail(node, "a reduce_grad marker after lower_reduce_grad")
        if stage in _AOT_STAGES and "val" not in node.meta and not _is_profiler_op(node):
            fail(node, 'no meta["val"]')
        if is_collective_start(node):
            counts = [len(waits) for waits in waits_of(node)]
            if not counts or any(count != 1 for count in counts):
                fail(node, "a collective waited on "
                     f"{counts[0] if len(counts) == 1 else counts} times (must be once per output)")




def _is_profiler_op(node: fx.Node) -> bool:
    """A ``record_function`` range (Dynamo adds them around a region's call under an active
    profiler): it returns a handle, not a tensor, so it has no value to record."""
    return getattr(node.target, "namespace", None) == "profiler"


def _by_kind(order: list[tuple[str, int]]) -> dict[str, list[int]]:
    kinds: dict[str, list[int]] = {}
    for kind, bucket in order:
        kinds.setdefault(kind, []).append(bucket)
    return kinds


def collective_order(gm: fx.GraphModule) -> list[tuple[str, int]]:
    """graphshard's collectives as (kind, bucket), in graph order."""
    order = []
    for node in gm.graph.nodes:
        tag = node.meta.get("graphshard") or {}
        if "kind" in tag and "bucket" in tag:
            order.append((tag["kind"], tag["bucket"]))
    return order
