"""Small helpers for building FX nodes whose ``meta["val"]`` stays valid."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode

from graphshard.passes.errors import GraphLoweringError
from graphshard.passes.host_copy import TO_HOST

__all__ = [
    "LOWERED", "DEVICE_COPY", "NodeMaker", "copy_provenance", "copy_to_device", "copy_to_host",
    "fake_value", "traced_value",
    "graph_order", "replace_and_erase", "outputs_of", "waits_of", "wait_of", "completed",
    "is_view",
]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
prims = torch.ops.prims


_PROVENANCE = ("stack_trace", "nn_module_stack")
# ``node.meta[LOWERED]``: ``{"side": "unshard" | "reduce_grad", "bucket": int}`` on every node
# a lowering pass made, so graphshard's own data movement can be told from the model's
# (``graphshard.passes.traffic``).
LOWERED = "graphshard_lowered"
# The op of every host-to-device copy a pass inserts (CPU offload): ``prims.device_put``.
# Inductor lowers it (to its device-copy IR node); it has no lowering of its own for
# ``aten._to_copy``, which AOTAutograd decomposes away before any pass runs, so a
# ``_to_copy`` made by a pass fails in Inductor ("both a fallback and a decomp").
DEVICE_COPY = prims.device_put.default


class NodeMaker:
    """Appends ``call_function`` nodes at the graph's current insert point, with fake ``val``s.

    The value is computed by running the op on the inputs' ``meta["val"]`` under the graph's
    own fake mode, so shapes, dtypes and strides are exactly what the op produces. An op that
    fails on them raises :class:`GraphLoweringError` naming the node (the passes only make
    ops whose fake values they need). A graph without fake placeholders (no fake mode) gets
    nodes without ``val``.
    """

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
        self.fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
        self.source: fx.Node | None = None
        self.lowered: dict | None = None

    @contextlib.contextmanager
    def lowering(self, side: str, bucket: int) -> Iterator[None]:
        """Nodes made inside are tagged ``meta[LOWERED] = {"side": side, "bucket": bucket}``:
        they are graphshard's data movement for that bucket, not the model's compute."""
        outer, self.lowered = self.lowered, {"side": side, "bucket": bucket}
        try:
            yield
        finally:
            self.lowered = outer

    @contextlib.contextmanager
    def provenance(self, source: fx.Node) -> Iterator[None]:
        """Nodes made inside take ``source``'s user-code provenance (``stack_trace``,
        ``nn_module_stack``): dumps and profiler traces then point at the line of the model
        that read the parameter, not at graphshard."""
        outer, self.source = self.source, source
        try:
            yield
        finally:
            self.source = outer

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        """Insert ``target(*args, **kwargs)`` and fill in its ``meta["val"]``."""
        node = self.graph.call_function(target, args, kwargs)
        if self.lowered is not None:
            node.meta[LOWERED] = dict(self.lowered)
        if self.source is not None:
            copy_provenance(self.source, node)
        if self.fake_mode is not None:
            try:
                node.meta["val"] = fake_value(node, self.fake_mode)
            except Exception as e:  # re-raised: a node without its val misprices every pass
                raise GraphLoweringError(
                    f"cannot compute the fake value of {node.format_node()} "
                    f"({type(e).__name__}: {e}); this is a graphshard bug, please report it"
                ) from e
        return node


def copy_provenance(source: fx.Node, node: fx.Node) -> None:
    """Give ``node`` the user-code provenance of ``source`` (``stack_trace``,
    ``nn_module_stack``) where it has none of its own."""
    for key in _PROVENANCE:
        if key in source.meta:
            node.meta.setdefault(key, source.meta[key])


def traced_value(value: Any) -> Any:
    """``value``, or where it is a graph node the value it was traced with: Dynamo's
    ``example_value`` or AOTAutograd's ``val``."""
    if isinstance(value, fx.Node):
        return value.meta.get("example_value", value.meta.get("val"))
    return value


def fake_value(node: fx.Node, fake_mode: Any) -> Any:
    """What ``node``'s op returns on its inputs' ``meta["val"]``, run under ``fake_mode``."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    with fake_mode:
        return node.target(*args, **kwargs)


def fill_missing_values(gm: fx.GraphModule) -> int:
    """Give ``meta["val"]`` to the ``call_function`` nodes AOTAutograd left without one
    (the partitioner's ``run_and_save_rng_state`` around an op with randomness that a
    checkpoint recomputes, and the ``getitem`` of its result), by running each on its inputs'
    values under the graph's fake mode; how many got one. Nodes whose inputs have no value,
    or whose op fails on fake values, are left as they are."""
    fake_mode = NodeMaker(gm.graph).fake_mode
    if fake_mode is None:
        return 0
    filled = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or "val" in node.meta:
            continue
        if not all("val" in i.meta for i in node.all_input_nodes):
            continue
        try:
            node.meta["val"] = fake_value(node, fake_mode)
        except Exception:  # left without one: the runner's invariant check names the node
            continue
        filled += 1
    return filled


def copy_to_device(make: NodeMaker, node: fx.Node, device: str, bucket: int) -> fx.Node:
    """The host ``node`` copied to ``device``, non-blocking (from pinned memory it overlaps
    compute), by an op Inductor lowers; tagged ``meta["graphshard_copy"]``."""
    copy = make(DEVICE_COPY, node, torch.device(device), True)
    copy.meta["graphshard_copy"] = {"direction": "h2d", "bucket": bucket}
    return copy


def copy_to_host(make: NodeMaker, node: fx.Node, bucket: int) -> fx.Node:
    """The device ``node`` copied into pinned host memory, blocking
    (:mod:`graphshard.passes.host_copy`); tagged ``meta["graphshard_copy"]``."""
    copy = make(TO_HOST, node)
    copy.meta["graphshard_copy"] = {"direction": "d2h", "bucket": bucket}
    return copy


# Ops whose result shares its first argument's storage although their schema says nothing.
_UNANNOTATED_VIEWS = frozenset({aten._unsafe_view.default})


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` is an ATen op returning a view of its first argument: its schema's
    one return aliases that argument and writes nothing (``view``, ``permute``, ``expand``,
    ``slice``...), or ``_unsafe_view``."""
    if node.op != "call_function":
        return False
    if node.target in _UNANNOTATED_VIEWS:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or len(schema.returns) != 1 or not schema.arguments:
        return False
    returned, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return (returned is not None and not returned.is_write and first is not None
            and returned.before_set == first.before_set)


def graph_order(graph: fx.Graph) -> dict[fx.Node, int]:
    """Position of every node in ``graph``."""
    return {node: i for i, node in enumerate(graph.nodes)}


def replace_and_erase(old: fx.Node, new: fx.Node) -> None:
    """Point every user of ``old`` at ``new`` and drop ``old``."""
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)


def collectives(graph: fx.Graph, kind: str) -> list[fx.Node]:
    """The lowered collectives of ``kind`` ("unshard" or "reduce_grad"), in graph order."""
    return [n for n in graph.nodes if n.meta.get("graphshard", {}).get("kind") == kind]


def outputs_of(collective: fx.Node) -> list[fx.Node]:
    """The tensors ``collective`` produces: itself, or for a coalesced collective (which
    returns a list) its ``getitem`` users in output order."""
    if not isinstance(collective.meta.get("val"), (list, tuple)):
        return [collective]
    items = [u for u in collective.users if u.target is operator.getitem]
    return sorted(items, key=lambda item: item.args[1])


def waits_of(collective: fx.Node) -> list[list[fx.Node]]:
    """For each output of ``collective``, the ``wait_tensor`` nodes that read it."""
    return [[u for u in out.users if u.target is c10d.wait_tensor.default]
            for out in outputs_of(collective)]


def wait_of(collective: fx.Node, last: bool = True) -> fx.Node:
    """The ``wait_tensor`` that completes ``collective``. Of a coalesced one, the last of its
    outputs' waits in graph order (past it, every output is complete), or with ``last=False``
    the first (before it, none is waited for)."""
    waits = waits_of(collective)
    if not waits or any(len(w) != 1 for w in waits):
        counts = [len(w) for w in waits]
        raise GraphLoweringError(
            f"collective {collective.name} has {counts[0] if len(counts) == 1 else counts} "
            "wait_tensor users, expected one (per output): a pass copied or dropped a wait"
        )
    position = graph_order(collective.graph)
    return (max if last else min)((w[0] for w in waits), key=position.__getitem__)


def ancestors_after(node: fx.Node, position: dict[fx.Node, int], start: int) -> list[fx.Node]:
    """``node`` and the ancestors it needs that sit at or after ``start``, in graph order."""
    found: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in found or current.op == "placeholder" or position[current] < start:
            continue
        found.add(current)
        stack.extend(current.all_input_nodes)
    return sorted(found, key=position.__getitem__)


def descendants(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node that depends on it, in graph order (the output node excluded)."""
    return _downstream([node])


def completed(collective: fx.Node) -> list[fx.Node]:
    """The waits of ``collective`` (one per output) and every node that depends on them, in
    graph order: what may run only once the collective has finished."""
    return _downstream([wait for waits in waits_of(collective) for wait in waits])


def _downstream(starts: list[fx.Node]) -> list[fx.Node]:
    """``starts`` and every node that depends on one of them, in graph order (the output
    node excluded)."""
    if not starts:
        return []
    found: set[fx.Node] = set()
    stack = list(starts)
    while stack:
        current = stack.pop()
        if current in found or current.op == "output":
            continue
        found.add(current)
        stack.extend(current.users)
    position = graph_order(starts[0].graph)
    return sorted(found, key=position.__getitem__)


def move_before(nodes: list[fx.Node], anchor: fx.Node) -> None:
    """Move ``nodes`` (in their order) to sit just before ``anchor`` (or, if ``anchor`` is one
    of them, before the first node after it that is not)."""
    moving = set(nodes)
    while anchor in moving:
        anchor = anchor.next
    for node in nodes:
        anchor.prepend(node)
