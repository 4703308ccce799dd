"""Sizes that a block region returns, read outside it from values the graph computes itself.

Under dynamic shapes a partitioned region returns the sizes its backward needs (``2*s0``) as
``SymInt`` outputs. AOTAutograd's partitioner treats equal sizes as one value, so an op
outside the region may end up reading its size from such an output: the loss's backward
expanding to ``[2*s0, vocab]`` read the size of a block's recomputed region (a block under
Hugging Face's gradient checkpointing). Inductor takes a region's ``SymInt`` output as a
buffer, not as an expression, and refused the lowering (``LoweringException: cannot extract
sympy expressions from ShapeAsConstantBuffer``).

:func:`sizes_outside_regions` gives such readers the same size from the graph's own values:
the size input with the same expression, or that expression computed from the size inputs.
Region calls keep reading it (they take ``SymInt`` operands).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import sympy
import torch
from torch import fx

from graphshard.passes.fx_util import NodeMaker
from graphshard.passes.regions import is_region_call

if TYPE_CHECKING:
    from graphshard.passes.plan import Plan

__all__ = ["sizes_outside_regions"]


def _expr(node: fx.Node) -> Any:
    val = node.meta.get("val")
    return val.node.expr if isinstance(val, torch.SymInt) else None


def _is_region_size(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node) and is_region_call(node.args[0])
            and _expr(node) is not None)


def _build(expr: Any, known: dict[Any, fx.Node], make: NodeMaker) -> fx.Node | int | None:
    """A node (or int) for ``expr`` from the sizes in ``known``, made with ``make``: sums and
    products of known sizes and integers. None when a symbol is not known."""
    if expr in known:
        return known[expr]
    if isinstance(expr, sympy.Integer):
        return int(expr)
    if isinstance(expr, (sympy.Add, sympy.Mul)):
        op = operator.add if isinstance(expr, sympy.Add) else operator.mul
        terms = [_build(term, known, make) for term in expr.args]
        if any(term is None for term in terms):
            return None
        value = terms[0]
        for term in terms[1:]:
            value = make(op, value, term)
        if isinstance(value, fx.Node):
            known[expr] = value
        return value
    return None


def sizes_outside_regions(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Point every reader of a region's ``SymInt`` output that is not itself a region call
    at the same size computed outside regions (module docstring); a size that cannot be
    computed from the graph's own size values is left as it is."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    known: dict[Any, fx.Node] = {}  # expression -> the size input that holds it
    for node in placeholders:
        if (expr := _expr(node)) is not None:
            known.setdefault(expr, node)
    make = NodeMaker(gm.graph)
    # sizes are made right after the inputs (before every reader), in the order made
    anchor = next(node for node in gm.graph.nodes if node.op != "placeholder")
    for node in list(gm.graph.nodes):
        if not _is_region_size(node):
            continue
        readers = [u for u in node.users if not is_region_call(u) and u.op != "output"]
        if not readers:
            continue
        with gm.graph.inserting_before(anchor):
            same = _build(_expr(node), known, make)
        if same is None:
            continue
        for reader in readers:
            reader.replace_input_with(node, same)
    return gm
