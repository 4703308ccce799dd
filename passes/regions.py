"""Blocks compiled once (``invoke_subgraph`` regions): their partitioner and the joint pass
that keeps resharding working across them.

graphshard calls each structurally identical block of a model through one
``torch.compiler.nested_compile_region`` (:mod:`graphshard.api.block_regions`). The block's
gathered parameters are the region's first ``n_params`` operands, so the ``unshard`` markers
stay in the step graph (bucketed and prefetched across blocks as before) and the region's
body is pure compute, traced by AOTAutograd and compiled by Inductor once per distinct block.

Two things keep ZeRO-3's free-after-forward true across a region:

- :func:`partition_region`: AOTAutograd partitions each region's joint graph on its own. Left
  alone, the min-cut partitioner saves tensors derived from the parameters only (a weight's
  transpose) as region outputs, and the step graph would keep those alive from forward to
  backward. Tagging them ``MUST_RECOMPUTE`` makes the region save its parameter operands
  themselves;
- :func:`rewire_region_passthrough`: a region "output" that is one of its own operands
  passed through becomes that operand in the step graph. The backward then reads the
  ``unshard`` marker's result directly, and the step's partitioner gathers it again (the
  marker is ``MUST_RECOMPUTE``) instead of saving it.

These two passes also keep the gradients right: Inductor takes every region output for a
buffer of its own, so an output that aliases an operand (a saved view of the input:
``rewire_region_passthrough``) or another output (an activation's result returned as output
and as saved tensor: :func:`read_shared_region_outputs_once`) is read in the step graph as
that operand or output, where Inductor sees the alias and does not write over it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from graphshard.passes.errors import GraphLoweringError
from graphshard.passes.fx_util import NodeMaker, is_view, traced_value
from graphshard.passes.markers import is_unshard

if TYPE_CHECKING:
    from graphshard.passes.plan import Plan

__all__ = [
    "REGION_AC_GRAPH_ID",
    "is_region_call",
    "joint_primal_signature",
    "parameters_first_in_regions",
    "partition_region",
    "region_body",
    "region_calls",
    "region_parameter_counts",
    "read_shared_region_outputs_once",
    "rewire_region_passthrough",
]

# Above any activation-checkpoint region id inside a block: the tagged nodes never merge with
# the user's own checkpointed regions.
REGION_AC_GRAPH_ID = 1 << 30


def is_region_call(node: fx.Node) -> bool:
    """Whether ``node`` calls a block region (``invoke_subgraph``)."""
    hop = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    return node.op == "call_function" and hop is not None and node.target is hop


def region_calls(gm: fx.GraphModule) -> Iterator[fx.Node]:
    """The ``invoke_subgraph`` calls of ``gm`` (one per block call)."""
    return (node for node in gm.graph.nodes if is_region_call(node))


def region_body(node: fx.Node) -> fx.GraphModule:
    """The graph an ``invoke_subgraph`` call runs."""
    owner = node.graph.owning_module
    return getattr(owner, node.args[0].target)


def _nested_region_calls(gm: fx.GraphModule) -> Iterator[fx.Node]:
    """Region calls inside the graphs of other higher-order ops (a block called in a
    ``torch.utils.checkpoint`` body), however deep."""
    for module in gm.modules():
        if module is not gm and isinstance(module, fx.GraphModule):
            yield from region_calls(module)


def parameters_first_in_regions(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Make each region's gathered parameters its first inputs, in the Dynamo graph.

    Dynamo lifts a region's inputs in the order the body first uses them (the block's input
    before its first norm weight), and AOTAutograd keeps that order; the region's partitioner
    (:func:`partition_region`) tells parameters from activations by position, so the
    parameter operands (the ``unshard`` markers' results) are moved to the front, in the body
    and at every call of it alike, also at calls inside another higher-order op's body
    (which pass the same operands through that body's inputs)."""
    orders: dict[int, list[int]] = {}
    for node in list(region_calls(gm)):
        operands = list(node.args[2:])
        is_param = [isinstance(o, fx.Node) and is_unshard(o) for o in operands]
        order = [i for i, p in enumerate(is_param) if p] + \
            [i for i, p in enumerate(is_param) if not p]
        body = region_body(node)
        if id(body) not in orders:
            orders[id(body)] = order
            if order != sorted(order):
                _permute_placeholders(body, order)
        elif orders[id(body)] != order:
            raise GraphLoweringError(
                f"{node.name}: calls of the compile region {node.args[0].target} pass their "
                "gathered parameters at different positions; the region's body cannot serve "
                "both. This is a bug in graphshard; compile with graphshard.shard(..., "
                "compile_blocks_once=False) and please report it."
            )
        node.args = (*node.args[:2], *(operands[i] for i in order))
    for node in list(_nested_region_calls(gm)):
        order = orders.get(id(region_body(node)))
        if order is not None:  # a body the step graph also calls (else left as traced)
            operands = list(node.args[2:])
            node.args = (*node.args[:2], *(operands[i] for i in order))
            node.graph.owning_module.recompile()
    return gm


def _permute_placeholders(body: fx.GraphModule, order: list[int]) -> None:
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    previous = None
    for index in order:
        node = placeholders[index]
        if previous is None:
            if node is not placeholders[0]:
                placeholders[0].prepend(node)
        else:
            previous.append(node)  # moves ``node`` right after ``previous``
        previous = node
    body.recompile()


def _signature(vals: list[Any]) -> tuple:
    return tuple((tuple(str(d) for d in v.shape), str(v.dtype)) if isinstance(v, torch.Tensor)
                 else (type(v).__name__,) for v in vals)


def region_parameter_counts(gm: fx.GraphModule) -> dict[tuple, int]:
    """For each region of the Dynamo graph ``gm`` (after
    :func:`parameters_first_in_regions`): the shapes and dtypes of its inputs -> how many of
    them, first, are gathered parameters. AOTAutograd hands the backend's partitioner each
    region's joint graph alone; this is how the partitioner recognises one (its primals have
    these shapes) and knows which of its inputs are parameters."""
    counts: dict[tuple, int] = {}
    for node in region_calls(gm):
        operands = node.args[2:]
        n_params = sum(1 for o in operands if isinstance(o, fx.Node) and is_unshard(o))
        key = _signature([traced_value(o) for o in operands])
        if counts.setdefault(key, n_params) != n_params:
            raise GraphLoweringError(
                f"{node.name}: two compile regions take inputs of the same shapes with "
                f"{counts[key]} and {n_params} gathered parameters; graphshard cannot tell "
                "their joint graphs apart. Compile with graphshard.shard(..., "
                "compile_blocks_once=False)."
            )
    return counts


def joint_primal_signature(joint: fx.GraphModule) -> tuple:
    """The shapes and dtypes of a joint graph's primal inputs (see
    :func:`region_parameter_counts`)."""
    return _signature([n.meta.get("val") for n in joint.graph.nodes
                       if n.op == "placeholder" and n.name.startswith("primals")])


def partition_region(joint: fx.GraphModule, joint_inputs: Any, *, n_params: int,
                     **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Partition a block region's joint graph, recomputing in its backward everything that
    depends only on its first ``n_params`` inputs (the gathered parameters), so that the
    region saves those inputs themselves rather than tensors derived from them.

    Random ops that the backward recomputes (a checkpointed block's attention on CUDA:
    ``_scaled_dot_product_cudnn_attention`` is a seeded op) replay the forward's generator
    state. torch's graph-safe way of doing that on CUDA adds generator placeholders to the
    region's forward and backward that the step graph's ``invoke_subgraph`` calls never
    pass (only a top-level graph's runtime feeds them), so the region takes torch's other
    way: the forward returns the state it ran with and the backward reads it, as on the
    CPU."""
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    params_only = set(placeholders[:n_params])
    for node in joint.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        inputs = node.all_input_nodes
        if inputs and all(i in params_only for i in inputs):
            params_only.add(node)
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = REGION_AC_GRAPH_ID
    with functorch_config.patch(graphsafe_rng_functionalization=False):
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def _view_chain(out: Any) -> tuple[fx.Node, list[fx.Node]] | None:
    """(root, the view nodes from it to ``out``, in order): ``root`` is the first node that
    is not a view (a region body's placeholder, or a value it computes) and ``out`` is it or
    a chain of views of it; None when ``out`` is not a node."""
    chain: list[fx.Node] = []
    while isinstance(out, fx.Node) and is_view(out) and isinstance(out.args[0], fx.Node):
        chain.append(out)
        out = out.args[0]
    return (out, chain[::-1]) if isinstance(out, fx.Node) else None


def _is_symbolic_scalar(node: fx.Node) -> bool:
    """Whether ``node`` computes a size rather than a tensor: ``sym_size`` of an input or
    arithmetic on sizes (under dynamic shapes a view's sizes are such nodes of the body)."""
    val = node.meta.get("val")
    return node.op == "call_function" and isinstance(
        val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _size_nodes(args: Any, operand_of: dict[fx.Node, Any]) -> list[fx.Node] | None:
    """The body's size computations that ``args`` read, inputs first (to be made again in
    the step graph); None when ``args`` read a body value that is neither an operand nor a
    size computed from operands."""
    needed: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(node: fx.Node) -> bool:
        if node in operand_of or node in seen:
            return True
        if not _is_symbolic_scalar(node) or not all(visit(i) for i in node.all_input_nodes):
            return False
        seen.add(node)
        needed.append(node)
        return True

    inputs: list[fx.Node] = []
    fx.node.map_arg(args, inputs.append)
    return needed if all(visit(i) for i in inputs) else None


def _operand_read(make: NodeMaker, call: fx.Node, out: Any,
                  operand_of: dict[fx.Node, Any]) -> fx.Node | None:
    """What the step graph reads in place of region output ``out`` of ``call``: the operand
    it passes through, or the same views of that operand, made right after ``call`` (with
    the sizes they take, which under dynamic shapes the body computes from its size
    operands, computed again there). None when ``out`` is not a tensor operand or views of
    one; :class:`GraphLoweringError` when it is but the views read other body values."""
    found = _view_chain(out)
    if found is None or not isinstance(operand_of.get(found[0]), fx.Node):
        return None
    source, chain = found
    sizes = _size_nodes(_view_args(chain), operand_of)
    if sizes is None:
        raise GraphLoweringError(
            f"{call.name}: the compile region {call.args[0].target} returns a view of its "
            f"operand {source.name} that graphshard cannot take in the step graph "
            f"({' -> '.join(view.format_node() for view in chain)}); left as a region "
            "output, Inductor may overwrite the operand under it and the gradients would be "
            "wrong. This is a bug in graphshard; compile with graphshard.shard(..., "
            "compile_blocks_once=False) and please report it."
        )
    return _views_in_step(make, call, operand_of[source], chain, sizes, operand_of)


def _view_args(chain: list[fx.Node]) -> list[tuple[Any, dict]]:
    return [(view.args[1:], view.kwargs) for view in chain]


def _views_in_step(make: NodeMaker, after: fx.Node, base: fx.Node, chain: list[fx.Node],
                   sizes: list[fx.Node], operand_of: dict[fx.Node, Any]) -> fx.Node:
    """The views of ``chain`` (body nodes) taken of ``base`` in the step graph, right after
    ``after``, with the body's size computations ``sizes`` made again from the operands."""
    step_of = dict(operand_of)
    with after.graph.inserting_before(after.next):
        for node in sizes:
            step_of[node] = make(node.target, *fx.node.map_arg(node.args, step_of.__getitem__),
                                 **fx.node.map_arg(node.kwargs, step_of.__getitem__))
        value = base
        for view, (args, kwargs) in zip(chain, _view_args(chain), strict=True):
            value = make(view.target, value, *fx.node.map_arg(args, step_of.__getitem__),
                         **fx.node.map_arg(kwargs, step_of.__getitem__))
    return value


def _body_and_operands(call: fx.Node) -> tuple[fx.GraphModule, dict[fx.Node, Any]]:
    """Region ``call``'s body, and each of its placeholders -> the step graph's operand."""
    body = region_body(call)
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    return body, dict(zip(placeholders, call.args[2:], strict=True))


def _output_reads(call: fx.Node) -> list[fx.Node]:
    """The step graph's ``getitem`` reads of region ``call``'s outputs."""
    return [user for user in call.users
            if user.op == "call_function" and user.target is operator.getitem]


def read_shared_region_outputs_once(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Read region outputs that share storage in the body (one value returned twice, or views
    of one value) as one output, and views of it taken in the step graph.

    A block whose last op saves its result for the backward (``tanh``, ``sigmoid``) returns
    that result twice: as its output and as a saved tensor. Inductor takes the two for
    separate buffers: in ``h = h + block(h)`` it wrote the sum into the output's, and the
    backward read the sum as the saved result (every gradient of the block and below wrong;
    torch 2.11 to 2.14, also without graphshard). Read as one node, the buffer is live until
    the backward and is not written over. Where one shared output is not a view of another
    (two views of a value the body does not return), the body returns a copy for each but
    one. Runs after :func:`rewire_region_passthrough`, which takes care of outputs that alias
    an operand."""
    changed = False
    make = NodeMaker(gm.graph)
    for call in list(region_calls(gm)):
        body, operand_of = _body_and_operands(call)
        reads: dict[int, list[fx.Node]] = {}
        for user in _output_reads(call):
            reads.setdefault(user.args[1], []).append(user)
        changed |= _read_once_per_value(make, call, body, reads, operand_of)
    if changed:
        gm.graph.eliminate_dead_code()
    return gm


def _read_once_per_value(make: NodeMaker, call: fx.Node, body: fx.GraphModule,
                         reads: dict[int, list[fx.Node]], operand_of: dict[fx.Node, Any]
                         ) -> bool:
    """:func:`read_shared_region_outputs_once` for one call; ``reads``: output index -> its
    ``getitem`` nodes."""
    outputs = body.graph.output_node().args[0]
    groups: dict[fx.Node, list[tuple[int, list[fx.Node]]]] = {}
    for index in reads:
        found = _view_chain(outputs[index])
        if found is not None and found[0] not in operand_of:
            groups.setdefault(found[0], []).append((index, found[1]))
    changed = False
    for members in groups.values():
        if len(members) < 2:
            continue
        members.sort(key=lambda member: len(member[1]))
        first, first_chain = members[0]
        base = reads[first][0]
        call.append(base)  # right after the call: before every read of the others
        for index, chain in members[1:]:
            rest = chain[len(first_chain):]
            sizes = _size_nodes(_view_args(rest), operand_of)
            if chain[:len(first_chain)] == first_chain and sizes is not None:
                value = _views_in_step(make, base, base, rest, sizes, operand_of)
                for user in reads.pop(index):
                    user.replace_all_uses_with(value)
            else:
                _return_a_copy(body, index)
            changed = True
    return changed


def _return_a_copy(body: fx.GraphModule, index: int) -> None:
    """Make region ``body`` return a copy of its output ``index`` (for every call of it)."""
    output = body.graph.output_node()
    outputs = list(output.args[0])
    with body.graph.inserting_before(output):
        outputs[index] = NodeMaker(body.graph)(torch.ops.aten.clone.default, outputs[index])
    output.args = (type(output.args[0])(outputs),)
    body.recompile()


def rewire_region_passthrough(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Read a region's operand where the step graph reads it back as a region output.

    A partitioned region saves a parameter operand for its backward by returning it; the
    step graph would then save that output (a new tensor to its partitioner) from forward to
    backward. Reading the operand instead lets the partitioner recompute it (the ``unshard``
    marker's reshard policy).

    A region output that is a *view* of an operand (a block saving ``x.view(-1, d)`` of its
    input for a weight's gradient) is read as that view, taken of the operand in the step
    graph. Inductor does not know that a region's output shares an operand's storage: in the
    forward of ``h = h + block(h)`` it wrote the sum into ``h``'s buffer, which the region
    had saved, and the backward computed the block's first weight gradient from the sum
    (torch 2.11 to 2.14, also without graphshard). In the step graph the view is an alias
    Inductor sees. Under dynamic shapes the view's sizes are the body's arithmetic on its
    size operands (``[s0*s1, d]``), which the step graph computes again; a view that reads
    any other body value is refused rather than left to alias."""
    changed = False
    make = NodeMaker(gm.graph)
    for node in list(region_calls(gm)):
        body, operand_of = _body_and_operands(node)
        outputs = body.graph.output_node().args[0]
        for user in _output_reads(node):
            value = _operand_read(make, node, outputs[user.args[1]], operand_of)
            if value is not None:
                user.replace_all_uses_with(value)
                changed = True
    if changed:
        gm.graph.eliminate_dead_code()
    return gm
