"""The bytes graphshard's own kernels move in a step, and the least they could move.

Beside the collectives (the wire, priced by ``cost_model``), sharding costs memory traffic
on each rank: shards are cast and copied into the gather buffer, the gathered buffer is cut
into parameters, gradients are copied into the reduce-scatter buffer. This module measures
it on the lowered graphs, per category:

- ``copy_in``: shards into the all-gather buffer; ``cast``: a cast kernel of its own (one
  fused into the copy-in costs nothing extra); ``padding``: zeros written to even out the
  pieces; ``copy_out``: a plain copy of gathered data into a per-parameter tensor;
  ``interleave``: the copy that reorders a bucket's rank-major gathered data into one
  parameter; ``offload``: CPU-offload copies between host and device;
- ``grad_copy_in``: gradients into the reduce-scatter buffer; ``grad_padding``;
  ``grad_cast``: the cast of reduced gradients back to the shard's dtype, or a cast kernel
  of its own; ``grad_other``: anything else after the reduction (held-back partials added).

Accounting (what Inductor would do; ``fused=False`` instead counts every op as a kernel,
as the graph runs with ``inductor=False``):

- Graphshard's nodes are those the lowering made (``meta[LOWERED]``). Views move nothing,
  nor do the ops Inductor removes before it schedules (a clone to the same strides, a cast
  to the same dtype, a pad by nothing: its post-grad ``remove_noop_ops``); collectives and
  waits are the wire, not counted here.
- An op is fused into its consumer when it has exactly one (looking through views) and that
  consumer is pointwise: a pointwise op, ``cat``, ``constant_pad_nd``, a same-device copy,
  or a reduction of the model's compute. A fused op writes nothing; an op that feeds a
  collective, an extern kernel (a matmul), the graph's output or several consumers is a
  kernel that writes its output once. An op fused into the model's compute is not
  graphshard's kernel and counts nothing.
- A kernel reads each input it does not fuse once, as much of it as the view it reads
  through holds (a column slice reads the column, an expanded scalar one element). A
  producer of the model's compute counts as one read of its result.
- The padding zeros a kernel writes count as ``padding``, not as its own category.

The minimum, per bucket: the copy-in reads every shard (gradient) once and writes the buffer
once, nothing at all when the buffer can be the one shard itself (same dtype, contiguous,
nothing to pad) or the bucket's storage (``graphshard.passes.bucket_storage``); every cast
is fused into the copy-in; padding writes its zeros once; each parameter of a
multi-parameter bucket gathered over several ranks is materialised once (its
real rows read and written by one interleave), any other parameter is a view of the
gathered buffer. A coalesced collective (``all_gather_via`` / ``reduce_scatter_via=
"coalesced"``) takes one buffer per parameter, each its own minimum: nothing for a shard or
gradient that goes in as it is, and no interleave (each output is one parameter).
What the semantics ask beyond that (a cast at world 1, the cast of reduced
gradients back, offload copies, held-back gradients added, the sum after an all-to-all
reduce-scatter) counts at what it moves.
Figures are per rank, for the rank whose graphs these are (padding differs by rank).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import fx

from graphshard.passes.device_copy import TO_DEVICE, WAIT_COPY
from graphshard.passes.fx_util import DEVICE_COPY, LOWERED
from graphshard.passes.host_copy import TO_HOST
from graphshard.passes.markers import is_collective_start

__all__ = ["CATEGORIES", "Traffic", "traffic", "step_traffic", "format_traffic"]

STEP_STAGES = ("fw", "bw", "inference")

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional

CATEGORIES = (
    "copy_in", "cast", "padding", "copy_out", "interleave", "offload",
    "grad_copy_in", "grad_cast", "grad_padding", "grad_reduce", "grad_other",
)

VIEWS = {
    aten.view.default, aten._unsafe_view.default, aten.slice.Tensor, aten.permute.default,
    aten.t.default, aten.transpose.int, aten.expand.default, aten.alias.default,
    aten.squeeze.dim, aten.squeeze.default, aten.unsqueeze.default, aten.select.int,
    aten.as_strided.default,
}
_CASTS = {prims.convert_element_type.default}
_NO_READ = {aten.new_zeros.default, aten.zeros.default, aten.full.default,
            aten.scalar_tensor.default, aten.empty.memory_format}
_LAYOUT = {aten.cat.default, aten.constant_pad_nd.default}
_NOOPS = {aten.clone.default, aten.alias.default, prims.convert_element_type.default,
          aten.constant_pad_nd.default, aten.cat.default}


@dataclass(frozen=True)
class Traffic:
    """Bytes moved and the minimum, per category (:data:`CATEGORIES`); ``kernels``: how
    many kernels graphshard's nodes make."""

    moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    minimum: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    kernels: int = 0

    @property
    def total(self) -> int:
        return sum(self.moved.values())

    @property
    def total_minimum(self) -> int:
        return sum(self.minimum.values())

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic({k: self.moved[k] + other.moved[k] for k in CATEGORIES},
                       {k: self.minimum[k] + other.minimum[k] for k in CATEGORIES},
                       self.kernels + other.kernels)


def traffic(graphs: fx.GraphModule | Iterable[fx.GraphModule], *, fused: bool = True) -> Traffic:
    """What graphshard's kernels move in ``graphs`` (one lowered graph or several, e.g. a
    step's forward and backward), and the minimum; see the module doc for the accounting."""
    if isinstance(graphs, fx.GraphModule):
        graphs = [graphs]
    total = Traffic()
    for gm in graphs:
        total = total + _graph_traffic(gm.graph, fused)
    return total


def step_traffic(graphs: Iterable[dict[str, fx.GraphModule]], *, fused: bool = True) -> Traffic:
    """:func:`traffic` of one step: every compiled graph's forward, backward (and inference)
    graph, as ``GraphshardBackend.graphs`` holds them (one dict of stage -> graph each)."""
    return traffic([stages[s] for stages in graphs for s in STEP_STAGES if s in stages],
                   fused=fused)


def format_traffic(t: Traffic) -> str:
    """A text table: bytes moved, the minimum and the excess per category, then the total."""
    lines = [f"{'category':<14}{'moved':>14}{'minimum':>14}{'excess':>14}"]
    for key in CATEGORIES:
        moved, least = t.moved[key], t.minimum[key]
        if moved or least:
            lines.append(f"{key:<14}{moved:>14,}{least:>14,}{moved - least:>14,}")
    lines.append(f"{'total':<14}{t.total:>14,}{t.total_minimum:>14,}"
                 f"{t.total - t.total_minimum:>14,}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- helpers


def _tag(node: fx.Node) -> dict | None:
    return node.meta.get(LOWERED) if node.op == "call_function" else None


def _is_wire(node: fx.Node) -> bool:
    """A collective, one of a coalesced collective's outputs, or a wait (for a collective,
    or for a copy issued on a copy stream: ``shard_copy_stream``'s, which returns nothing)."""
    return is_collective_start(node) or node.target in (c10d.wait_tensor.default, WAIT_COPY) or (
        node.target is operator.getitem and is_collective_start(node.args[0]))


def _is_device_copy(node: fx.Node) -> bool:
    return node.target in (DEVICE_COPY, TO_DEVICE, TO_HOST)


def _val(node: fx.Node) -> torch.Tensor:
    return node.meta["val"]


def _bytes(node: fx.Node, numel: int | None = None) -> int:
    val = _val(node)
    return (val.numel() if numel is None else numel) * val.element_size()


def _same_meta(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and va.shape == vb.shape and va.dtype == vb.dtype and va.device == vb.device
            and va.stride() == vb.stride())


def _noop(node: fx.Node) -> bool:
    """An op Inductor drops before it schedules anything (its post-grad ``remove_noop_ops``):
    a copy or cast to identical metadata, a pad by nothing, a cat of one tensor."""
    if node.op != "call_function" or node.target not in _NOOPS:
        return False
    source = node.args[0][0] if node.target is aten.cat.default else node.args[0]
    if node.target is aten.cat.default and len(node.args[0]) != 1:
        return False
    if node.target is aten.constant_pad_nd.default and any(node.args[1]):
        return False
    return isinstance(source, fx.Node) and _same_meta(node, source)


def _source(node: fx.Node) -> fx.Node:
    return node.args[0][0] if node.target is aten.cat.default else node.args[0]


def _pointwise(node: fx.Node) -> bool:
    """Inductor computes this op's inputs inside its own kernel (they need not be written)."""
    if node.op != "call_function" or _is_wire(node) or _is_device_copy(node):
        return False
    if node.target in _LAYOUT or node.target is aten._to_copy.default:
        return True
    tags = getattr(node.target, "tags", ())
    if torch.Tag.pointwise in tags:
        return True
    return _tag(node) is None and torch.Tag.reduction in tags


class _Account:
    """One graph's kernels, fused or op by op."""

    def __init__(self, fused: bool) -> None:
        self.fused = fused

    def free(self, node: fx.Node) -> bool:
        """Moves no data: a view, or (fused) an op Inductor removes."""
        return node.op == "call_function" and (
            node.target in VIEWS or (self.fused and _noop(node)))

    def base(self, node: fx.Node) -> tuple[fx.Node, int]:
        """Back through free ops to the data ``node`` shows, and the fewest elements on the
        way (what a reader of ``node`` reads of it)."""
        least = _val(node).numel()
        while self.free(node):
            node = node.args[0] if node.target in VIEWS else _source(node)
            least = min(least, _val(node).numel())
        return node, least

    def is_data(self, node: fx.Node) -> bool:
        """A graphshard op that moves data."""
        return _tag(node) is not None and not self.free(node) and not _is_wire(node)

    def consumers(self, node: fx.Node) -> list[fx.Node]:
        """The nodes that read ``node``'s data, through free ops (the output node too)."""
        found, stack, seen = [], list(node.users), set()
        while stack:
            user = stack.pop()
            if user in seen:
                continue
            seen.add(user)
            if self.free(user):
                stack.extend(user.users)
            else:
                found.append(user)
        return found

    def fused_away(self, node: fx.Node) -> bool:
        """``node`` runs inside its one consumer's kernel (a pointwise one)."""
        if not self.fused or _is_device_copy(node):
            return False
        consumers = self.consumers(node)
        return len(consumers) == 1 and _pointwise(consumers[0])

    def kernel(self, root: fx.Node) -> tuple[list[tuple[fx.Node, fx.Node, int]], list[fx.Node]]:
        """The kernel that writes ``root``: what it reads (base, the node read through,
        bytes) and the graphshard ops it runs (``root`` and those fused into it)."""
        reads: dict[tuple[fx.Node, int], tuple[fx.Node, fx.Node, int]] = {}
        members, stack = [], [root]
        while stack:
            node = stack.pop()
            members.append(node)
            if node.target in _NO_READ:
                continue
            # a device copy reads its source alone: the copies it orders itself after and
            # the sources it keeps alive (``grad_copy_stream``'s operands) it does not read
            inputs = [node.args[0]] if _is_device_copy(node) else node.all_input_nodes
            for arg in inputs:
                if not isinstance(arg.meta.get("val"), torch.Tensor):
                    continue  # a size, not data
                base, least = self.base(arg)
                if self.is_data(base) and base is not root and self.fused_away(base):
                    stack.append(base)
                else:
                    reads[(base, least)] = (base, arg, _bytes(base, least))
        return list(reads.values()), members

    def category(self, root: fx.Node, side: str, phase: str, reads, members) -> str:
        """The copy that writes the collective's buffer is the copy-in (whatever is fused into
        it); a cast kernel of its own is a cast; after the gather, a copy from a strided
        column is the interleave; after an all-to-all reduce-scatter, the kernel that sums
        the received pieces is the reduction."""
        if _is_device_copy(root):
            return "offload"
        if side != "unshard" and phase == "post" and any(
                n.target is aten.sum.dim_IntList for n in members):
            return "grad_reduce"
        cast = root.target in _CASTS
        feeds = phase == "pre" and any(_is_wire(c) for c in self.consumers(root))
        if side == "unshard":
            if phase == "pre":
                return "cast" if cast and not feeds else "copy_in"
            if cast:
                return "cast"
            strided = any(not _val(view).is_contiguous() for _, view, _ in reads)
            return "interleave" if strided and phase == "post" else "copy_out"
        if phase == "pre":
            return "grad_cast" if cast and not feeds else "grad_copy_in"
        return "grad_cast" if cast else "grad_other"

    def leaves(self, start: fx.Node, members: set[fx.Node]) -> list[fx.Node]:
        """What a bucket's buffer is built from: back from ``start`` through the bucket's own
        ops to other nodes (offload copies included: they count on their own)."""
        found: list[fx.Node] = []
        stack, seen = [start], set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node not in members or _is_device_copy(node):
                found.append(node)
            elif node.target not in _NO_READ:
                stack.extend(node.all_input_nodes)
        return found

    def graph(self, graph: fx.Graph) -> Traffic:
        groups: dict[tuple[str, int], list[fx.Node]] = {}
        for node in graph.nodes:
            tag = _tag(node)
            if tag is not None:
                groups.setdefault((tag["side"], tag["bucket"]), []).append(node)
        moved = dict.fromkeys(CATEGORIES, 0)
        minimum = dict.fromkeys(CATEGORIES, 0)
        kernels = 0
        for (side, _), nodes in groups.items():
            collective = next((n for n in nodes if is_collective_start(n)
                               and n.target is not c10d.all_reduce.default), None)
            before = _ancestors(collective, set(nodes)) if collective is not None else set()
            for _, category, size, pad in self.kernels(side, nodes, collective, before):
                moved[category] += size
                moved["padding" if side == "unshard" else "grad_padding"] += pad
                kernels += 1
            for category, size in self.bucket_minimum(side, nodes, collective, before):
                minimum[category] += size
        return Traffic(moved, minimum, kernels)

    def kernels(self, side, nodes, collective, before):
        """One bucket's side, kernel by kernel: (phase, category, bytes, padding bytes)."""
        for node in nodes:
            if not self.is_data(node) or self.fused_away(node):
                continue
            reads, inside = self.kernel(node)
            phase = "local" if collective is None else ("pre" if node in before else "post")
            pad = _padding(inside)
            yield (phase, self.category(node, side, phase, reads, inside),
                   sum(b for _, _, b in reads) + _bytes(node) - pad, pad)

    def bucket_minimum(self, side, nodes, collective, before):
        """(category, bytes) of the least one bucket's side must move (see the module doc)."""
        for phase, category, size, _ in self.kernels(side, nodes, collective, before):
            if category in ("offload", "grad_reduce", "grad_other") or (
                category in ("cast", "grad_cast") and phase != "pre"
            ):
                yield category, size  # what the semantics ask for
        if collective is None:
            return
        members = set(nodes)
        # a coalesced all-gather takes one buffer per parameter, each its own minimum
        coalesced = isinstance(collective.args[0], (list, tuple))
        buffers = list(collective.args[0]) if coalesced else [collective.args[0]]
        pad = _padding([n for n in before if self.is_data(n)])
        yield ("padding" if side == "unshard" else "grad_padding"), pad
        world = collective.args[1] if side == "unshard" else collective.args[2]
        if isinstance(world, (list, tuple)):  # an all-to-all reduce-scatter: its split sizes
            world = len(world)
        copied = 0
        leaves_of = [self.leaves(buffer, members) for buffer in buffers]
        # gathered from the bucket's storage as it lies (graphshard.passes.bucket_storage)
        stored = side == "unshard" and not coalesced and buffers[0] not in members
        for buffer, leaves in zip(buffers, leaves_of, strict=True):
            whole = world == 1 or stored or (
                len(leaves) == 1 and _val(leaves[0]).dtype == _val(buffer).dtype
                and _val(leaves[0]).numel() == _val(buffer).numel()
                and _val(leaves[0]).is_contiguous())
            if not whole:
                copied += sum(_bytes(leaf) for leaf in leaves) + _bytes(buffer)
            elif world == 1:  # no buffer is needed, only the casts (the shard is the parameter)
                itemsize = _val(buffer).element_size()
                yield ("cast" if side == "unshard" else "grad_cast"), sum(
                    _bytes(leaf) + _val(leaf).numel() * itemsize for leaf in leaves
                    if _val(leaf).dtype != _val(buffer).dtype)
        if copied:
            yield ("copy_in" if side == "unshard" else "grad_copy_in"), copied - pad
        params = len(collective.meta.get("graphshard", {}).get("params", ())) if stored \
            else len(leaves_of[0])
        if side == "unshard" and world > 1 and not coalesced and params > 1:
            outputs = {n for n in nodes if n not in before and n is not collective
                       and any(u not in members for u in n.users)}
            yield "interleave", sum(2 * _bytes(n) for n in outputs
                                    if not self.fused_into_compute(n))

    def fused_into_compute(self, node: fx.Node) -> bool:
        """A parameter Inductor reads from the gathered buffer inside its one (pointwise)
        consumer: it need not be materialised."""
        consumers = self.consumers(node)
        return self.fused and len(consumers) == 1 and _pointwise(consumers[0])


def _graph_traffic(graph: fx.Graph, fused: bool) -> Traffic:
    return _Account(fused).graph(graph)


def _padding(members: list[fx.Node]) -> int:
    """Bytes of zeros the padding ops among ``members`` write."""
    return sum(_bytes(n) - _bytes(n.args[0]) for n in members
               if n.target is aten.constant_pad_nd.default)


def _ancestors(node: fx.Node, members: set[fx.Node]) -> set[fx.Node]:
    found, stack = set(), [node]
    while stack:
        current = stack.pop()
        for arg in current.all_input_nodes:
            if arg in members and arg not in found:
                found.add(arg)
                stack.append(arg)
    return found
