"""Inductor's joint-graph passes on the graphs graphshard partitions itself.

``torch.compile``'s Inductor backend rewrites every joint graph before its partition function
cuts it into forward and backward, and every inference graph before it compiles it: its
joint-graph passes (pattern rewrites for kernels that fuse, constant folding, no-op removal).
graphshard hands AOTAutograd a partition function of its own, since its passes run between
tracing and partitioning, and so must run those passes itself. Without them the graphs
Inductor compiles are not the plain model's: a loss's backward materialises a zero tensor of
(tokens x vocabulary) and scatters into it, where Inductor computes it pointwise, and
attention written out as softmax(q k^T / sqrt(d)) v stays unfused, where Inductor calls fused
scaled-dot-product attention.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from torch import fx

from graphshard.passes.fx_util import fake_value

__all__ = ["inductor_joint_passes"]


def inductor_joint_passes(graph: fx.GraphModule, inputs: Sequence[Any], *,
                          partitioned: bool = True) -> fx.GraphModule:
    """Inductor's joint-graph passes on ``graph``, as Inductor's own partition function runs
    them on a joint before it partitions it (a block region's joint included; the regions
    inside ``graph`` are partitioned on their own), or, ``partitioned=False``, as its forward
    compiler runs them on an inference graph, regions included. They run in the graph's fake
    mode (patterns trace their replacements in it); a node they make without a fake value
    gets one, so that graphshard's passes after them see every node's ``meta["val"]``."""
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import (
        _recursive_joint_graph_passes,
        get_cuda_device_context,
        get_inputs_devices,
    )
    from torch._inductor.virtualized import V

    fake_mode = detect_fake_mode(inputs)
    with (V.set_fake_mode(fake_mode) if fake_mode is not None else contextlib.nullcontext(),
          get_cuda_device_context(graph)):
        device = next(iter(get_inputs_devices(inputs, graph)), None)
        graph = _recursive_joint_graph_passes(graph, skip_invoke_subgraph=partitioned,
                                              input_device=device)
    if fake_mode is not None:
        _fill_fake_values(graph, fake_mode)
    return graph


def _fill_fake_values(graph: fx.GraphModule, fake_mode: Any) -> None:
    """``meta["val"]`` for the ``call_function`` nodes the passes made without one (constant
    folding's ``empty_strided`` for a value computed from meta tensors, for example): the op
    run on its inputs' values. Left out where that fails; graphshard's pass runner then names
    the node."""
    for node in graph.graph.nodes:
        if node.op != "call_function" or "val" in node.meta:
            continue
        try:
            node.meta["val"] = fake_value(node, fake_mode)
        except Exception:  # noqa: BLE001  (the runner's invariant reports the node)
            continue
