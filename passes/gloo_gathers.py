"""Issue the all-gathers of gloo groups as gloo's single-tensor all-gather.

``_c10d_functional.all_gather_into_tensor`` (and its coalesced form) runs on a process group's
``allgather_into_tensor_coalesced``, which on gloo corrupts the heap when another collective
of the same group is in flight (torch 2.11 to 2.14.1; docs/torch-versions.md). The schedule
this compiler builds does exactly that: the next bucket's gather is issued while the current
bucket's gather or reduce-scatter is in flight. So, on the gathers whose group the backend
recorded as gloo (``node.meta["group_backend"]``), each functional all-gather becomes
``graphshard::all_gather_single``: the same arguments, result and ``wait_tensor``, issued as
the collective gloo runs safely. A coalesced gather becomes one such gather per input, issued
together where it was. Other backends' graphs are left as they are.

The new gather sends a copy of its input unless the input is a graph input or a view of one:
Inductor keeps a functional collective's input alive until its wait, but not a custom op's,
and may reuse an intermediate buffer (a bucket's concatenated shards) while gloo still reads
it. Runs after every other pass, which know only the functional op.
"""

from __future__ import annotations

import operator

from torch import fx

from graphshard.passes.errors import GraphLoweringError
from graphshard.passes.fx_util import NodeMaker, aten, c10d
from graphshard.passes.markers import ALL_GATHER_SINGLE
from graphshard.passes.plan import Plan

__all__ = ["FUNCTIONAL_GATHERS", "gloo_gathers"]

# The all-gathers that run on gloo's coalesced collective: those this pass replaces.
FUNCTIONAL_GATHERS = (c10d.all_gather_into_tensor.default,
                      c10d.all_gather_into_tensor_coalesced.default)
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.alias.default)


def gloo_gathers(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Replace each functional all-gather of a gloo group with ``all_gather_single``."""
    make = NodeMaker(gm.graph)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in FUNCTIONAL_GATHERS:
            continue
        if node.meta.get("group_backend") != "gloo":
            continue
        if node.target is c10d.all_gather_into_tensor.default:
            with gm.graph.inserting_before(node):
                single = _single(make, node, node.args[0])
            node.replace_all_uses_with(single)
        else:
            _split_coalesced(gm.graph, make, node)
        gm.graph.erase_node(node)
    return gm


def _single(make: NodeMaker, gather: fx.Node, piece: fx.Node) -> fx.Node:
    """``all_gather_single`` of ``piece`` over ``gather``'s group, with its metadata."""
    _, group_size, group_name = gather.args
    new = make(ALL_GATHER_SINGLE, piece, group_size, group_name,
               copy_input=not _reads_graph_input(piece))
    for key, value in gather.meta.items():
        if key != "val":
            new.meta.setdefault(key, value)
    return new


def _split_coalesced(graph: fx.Graph, make: NodeMaker, gather: fx.Node) -> None:
    """One ``all_gather_single`` per input of a coalesced gather, issued where it was; each
    ``getitem`` of its result reads its own gather."""
    with graph.inserting_before(gather):
        singles = [_single(make, gather, piece) for piece in gather.args[0]]
    for user in list(gather.users):
        if user.target is not operator.getitem:
            raise GraphLoweringError(  # the lowering reads a coalesced gather by index only
                f"{user.format_node()} reads coalesced all-gather {gather.name} as a whole; "
                "this is a graphshard bug, please report it with the graph dump")
        user.replace_all_uses_with(singles[user.args[1]])
        graph.erase_node(user)


def _reads_graph_input(node: fx.Node) -> bool:
    """True when ``node`` is a graph input or a chain of views of one (storage that the
    compiled graph does not reuse)."""
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node.op == "placeholder"
