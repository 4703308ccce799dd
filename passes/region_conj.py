"""Hand block regions their conjugate and negative views as plain tensors.

torch's ``invoke_subgraph`` (a compile region) has no kernel for the conjugate or negative
dispatch key, so a region call given a lazily conjugated view (or the negated view that
``z.conj().imag`` is) fails ("could not find kernel for HigherOrderOperator invoke_subgraph at
dispatch key DispatchKey.Conjugate"), as torch's own ``nested_compile_region`` does:

- in the Dynamo graph, where the model passes such a view to its blocks;
- in the backward, where AOTAutograd makes one: a model with complex rotary tables
  (Hugging Face's Llama 4 multiplies its queries and keys by ``freqs_cis``) has a backward
  that multiplies by the tables' conjugate, computed once outside the blocks as
  ``aten._conj`` and passed to every block region.

Each such operand is cloned before the first call that takes it (a clone resolves the bit:
the same values, materialized), once per view, so the blocks stay compiled once. The pass
runs on Dynamo's graph (``torch.clone``, ``example_value``) and on AOTAutograd's
(``aten.clone``, ``val``).
"""

from __future__ import annotations

import torch
from torch import fx

from graphshard.passes.fx_util import NodeMaker, copy_provenance, graph_order, traced_value
from graphshard.passes.plan import Plan
from graphshard.passes.regions import region_calls

__all__ = ["resolve_region_operand_views"]

aten = torch.ops.aten


def _lazy_view(operand: object) -> bool:
    """Whether ``operand`` is a node whose value carries the conjugate or negative bit."""
    value = traced_value(operand) if isinstance(operand, fx.Node) else None
    return isinstance(value, torch.Tensor) and (value.is_conj() or value.is_neg())


def _clone_in_dynamo_graph(graph: fx.Graph, view: fx.Node) -> fx.Node:
    """``torch.clone(view)`` with its ``example_value``, as Dynamo records a call."""
    clone = graph.call_function(torch.clone, (view,))
    example = view.meta["example_value"]
    mode = getattr(example, "fake_mode", None)  # its own (the tracing context's may differ)
    with mode if mode is not None else torch.no_grad():
        clone.meta["example_value"] = torch.clone(example)
    copy_provenance(view, clone)
    return clone


def _resolve_in(gm: fx.GraphModule) -> bool:
    """The rewrite on one graph module's own graph; whether it changed anything."""
    graph = gm.graph
    make = NodeMaker(graph)
    position = graph_order(graph)
    resolved: dict[fx.Node, fx.Node] = {}
    for call in list(region_calls(gm)):
        operands = call.args[2:]
        views = {a for a in operands if _lazy_view(a) and a not in resolved}
        for view in sorted(views, key=position.__getitem__):
            with graph.inserting_before(call):
                if "example_value" in view.meta:
                    resolved[view] = _clone_in_dynamo_graph(graph, view)
                else:
                    with make.provenance(view):
                        resolved[view] = make(aten.clone.default, view)
        if any(isinstance(a, fx.Node) and a in resolved for a in operands):
            call.args = (*call.args[:2], *(
                resolved.get(a, a) if isinstance(a, fx.Node) else a for a in operands))
    return bool(resolved)


def resolve_region_operand_views(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Every region operand with the conjugate or negative bit is replaced, in the region
    calls, by one clone of it made just before the first call that takes it; also inside
    the bodies of other higher-order ops (a checkpoint's)."""
    del plan  # the rewrite is the same for every plan
    for module in list(gm.modules()):
        if isinstance(module, fx.GraphModule) and module is not gm and _resolve_in(module):
            module.recompile()
    _resolve_in(gm)  # the runner recompiles the root
    return gm
