"""Hand block regions their conjugate and negative views as plain tensors.

A model with complex rotary tables (Llama 4's ``freqs_cis``, multiplied into the queries and
keys) has a backward that multiplies by the table's conjugate. AOTAutograd computes that
``aten._conj`` once, outside the blocks, and passes the view (a tensor with the conjugate
bit set, not a copy) to every block region's backward. ``invoke_subgraph`` has no kernel for
the conjugate (or negative) dispatch key, so Inductor fails on the call ("could not find
kernel for HigherOrderOperator invoke_subgraph at dispatch key DispatchKey.Conjugate"), as
torch's own ``nested_compile_region`` does on the same model. Each such operand is cloned
before the calls that take it (a clone resolves the bit: the same values, materialized),
once per view, so the blocks stay compiled once.
"""

from __future__ import annotations

import torch
from torch import fx

from graphshard.passes.fx_util import NodeMaker, graph_order
from graphshard.passes.plan import Plan
from graphshard.passes.regions import region_calls

__all__ = ["resolve_region_operand_views"]

aten = torch.ops.aten


def _lazy_view(operand: object) -> bool:
    """Whether ``operand`` is a node whose value carries the conjugate or negative bit."""
    value = operand.meta.get("val") if isinstance(operand, fx.Node) else None
    return isinstance(value, torch.Tensor) and (value.is_conj() or value.is_neg())


def resolve_region_operand_views(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Every region operand with the conjugate or negative bit is replaced, in the region
    calls, by one clone of it made just before the first call that takes it."""
    del plan  # the rewrite is the same for every plan
    make = NodeMaker(gm.graph)
    position = graph_order(gm.graph)
    resolved: dict[fx.Node, fx.Node] = {}
    for call in list(region_calls(gm)):
        operands = call.args[2:]
        views = {a for a in operands if _lazy_view(a) and a not in resolved}
        for view in sorted(views, key=position.__getitem__):
            with gm.graph.inserting_before(call), make.provenance(view):
                resolved[view] = make(aten.clone.default, view)
        if any(isinstance(a, fx.Node) and a in resolved for a in operands):
            call.args = (*call.args[:2], *(
                resolved.get(a, a) if isinstance(a, fx.Node) else a for a in operands))
    return gm
