"""Inline the block regions that torch's ``invoke_subgraph`` cannot run: those that take a
float.

Dynamo makes a block's Python float attribute (an attention's ``scaling``) dynamic when it
takes a compile for a recompile of the same code: a second model of the same class with
another width (a student compiled beside its teacher). The float then enters the region: the
body takes it as a 0-D tensor and calls ``.item()``, and some calls pass the float itself.
``invoke_subgraph`` accepts tensors, ints and SymInts only, in the forward and in the
backward (which receives the float the forward saved), so AOTAutograd fails on the region,
or its backward does at run time. torch's own ``nested_compile_region`` fails the same way;
Dynamo then runs the frame eagerly. Inlined, such a block's body is traced in the step graph
like any code, as with ``compile_blocks_once=False``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from graphshard.passes.errors import GraphLoweringError
from graphshard.passes.fx_util import traced_value
from graphshard.passes.plan import Plan
from graphshard.passes.regions import region_body, region_calls

__all__ = ["inline_unsupported_regions"]


def _operand_ok(operand: Any) -> bool:
    """Whether ``invoke_subgraph`` takes ``operand``: tensors, ints, SymInts, generators and
    ``None``."""
    value = traced_value(operand)
    return value is None or isinstance(value, (torch.Tensor, int, torch.SymInt, torch.Generator))


def _inline(graph: fx.Graph, call: fx.Node) -> None:
    """Copy the body of region call ``call`` into ``graph`` in its place."""
    body = region_body(call)
    owner = graph.owning_module
    names: dict[str, str] = {}
    for name, child in body.named_children():  # bodies of higher-order ops inside the block
        fresh = name
        while hasattr(owner, fresh):
            fresh = f"{fresh}_inlined"
        owner.add_module(fresh, child)
        names[name] = fresh
    placeholders = body.graph.find_nodes(op="placeholder")
    env: dict[fx.Node, Any] = dict(zip(placeholders, call.args[2:], strict=True))
    with graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if _reads_number(node, env):  # ``.item()`` of a float the body took as a tensor
                env[node] = env[node.args[0]]
                continue
            copy = graph.node_copy(node, lambda n: env[n])
            if node.op == "get_attr" and node.target in names:
                copy.target = names[node.target]
            env[node] = copy
    outputs = body.graph.output_node().args[0]
    for user in list(call.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise GraphLoweringError(
                f"cannot inline the block region {call.name}: its output is read by "
                f"{user.format_node()}, not by an index; compile the model with "
                "shard(..., compile_blocks_once=False)")
        user.replace_all_uses_with(env[outputs[user.args[1]]])
        graph.erase_node(user)
    body_attr = call.args[0]
    graph.erase_node(call)
    if not body_attr.users:
        graph.erase_node(body_attr)
        if not any(n.op == "get_attr" and n.target == body_attr.target for n in graph.nodes):
            owner.delete_submodule(body_attr.target)  # no call of that body is left


def _reads_number(node: fx.Node, env: dict[fx.Node, Any]) -> bool:
    """Whether ``node`` is ``.item()`` of a body input that the call passes as a number.

    Dynamo traces a dynamic float as a 0-D tensor and ``.item()``: a region body takes the
    tensor, while some calls pass the float itself (which is why they cannot run)."""
    if node.op != "call_method" or node.target != "item":
        return False
    source = node.args[0]
    if not isinstance(source, fx.Node) or source.op != "placeholder":
        return False
    return not isinstance(traced_value(env[source]), torch.Tensor)


def _takes_a_float(call: fx.Node) -> bool:
    """Whether region call ``call`` passes a float or runs a body that reads one."""
    if not all(_operand_ok(op) for op in call.args[2:]):
        return True
    return any(n.op == "call_method" and n.target == "item" and n.args[0].op == "placeholder"
               for n in region_body(call).graph.nodes)


def inline_unsupported_regions(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Inline every region call (also inside other higher-order ops' bodies) that takes a
    float, which ``invoke_subgraph`` refuses (module docstring)."""
    for module in list(gm.modules()):
        if not isinstance(module, fx.GraphModule):
            continue
        calls = [call for call in region_calls(module) if _takes_a_float(call)]
        for call in calls:
            _inline(module.graph, call)
        if calls:
            module.recompile()
    return gm
