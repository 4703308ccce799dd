"""Connect each marker straight to its parameter and its gradient: fold no-op views.

A sharded parameter is a DTensor read through ``to_local()``. AOTAutograd traces that as a
view of the same shape between the local tensor (the graph input) and the ``unshard``
marker, and in backward as another between the ``reduce_grad`` marker and the gradient
returned for the parameter. They move no data, but they hide from the passes that two
markers read one parameter (lowering gives each distinct input its own slot in the gathered
buffer) and they put a user of each gradient before the bucket's last gradient (lowering
reduces a bucket as one collective). Folding them gives the graph the shape the passes
expect: marker inputs are parameters, marker outputs are gradients.
"""

from __future__ import annotations

import torch
from torch import fx

from graphshard.passes.markers import is_reduce_grad, is_unshard
from graphshard.passes.plan import Plan

__all__ = ["fold_views", "is_noop_view"]

_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.alias.default,
          torch.ops.aten._unsafe_view.default}


def is_noop_view(node: fx.Node) -> bool:
    """A view that returns its input's shape and dtype unchanged."""
    if node.op != "call_function" or node.target not in _VIEWS:
        return False
    base = node.args[0]
    out, into = node.meta.get("val"), getattr(base, "meta", {}).get("val")
    return (isinstance(out, torch.Tensor) and isinstance(into, torch.Tensor)
            and out.shape == into.shape and out.dtype == into.dtype)


def fold_views(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Markers read the view's base instead of a no-op view; a no-op view of a gradient is
    replaced by the gradient. Views left unused are dropped."""
    for node in list(gm.graph.nodes):
        if is_unshard(node):
            source = node.args[0]
            while isinstance(source, fx.Node) and is_noop_view(source):
                source = source.args[0]
            if source is not node.args[0]:
                view = node.args[0]
                node.update_arg(0, source)
                _erase_unused_views(gm.graph, view)
        elif is_reduce_grad(node):
            views = [user for user in node.users if is_noop_view(user)]
            while views:
                view = views.pop()
                views.extend(user for user in view.users if is_noop_view(user))
                view.replace_all_uses_with(node)
                gm.graph.erase_node(view)
    return gm


def _erase_unused_views(graph: fx.Graph, view: fx.Node) -> None:
    while isinstance(view, fx.Node) and is_noop_view(view) and not view.users:
        base = view.args[0]
        graph.erase_node(view)
        view = base
