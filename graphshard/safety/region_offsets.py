"""Keep a block region's output that is a view at a storage offset from being read at twice
the offset (a torch bug, worked around).

Inductor lowers a region call (``invoke_subgraph``: each block compiled once) into one
``MultiOutput`` per result of the body. A result may be a view into a buffer of the body:
the gradient of an operand that the block concatenated (``torch.cat([h, skip], dim=1)``,
as every U-Net's up block does with its skip connections) is a slice of the
concatenation's gradient. torch gives the ``MultiOutput`` the view's layout *with its
storage offset*, and then binds it to the view tensor itself, whose data pointer already
points past that offset; every kernel of the step that reads it adds the offset again.
The step so reads the gradient from the wrong place (and past the end of the buffer:
garbage gradients, ``NaN``, heap corruption at exit). Seen on torch 2.11, 2.13 and 2.14.1
(``InvokeSubgraph.create`` is the same in all three), whenever a region stays a call: a
block whose body other blocks share, and on 2.11 every block (2.13 inlines a body used
once).

The workaround gives such an output the layout a graph input gets (offset 0, read from
the tensor's own data pointer; every ``reinterpret_tensor`` of it is relative to it), and
keeps Inductor from reusing the storage of any output that is a view into the body's
buffers (a reuse would write over the other views of the same buffer).
:func:`region_offsets_counted_once_in_this_process` applies it to every Inductor compile
of the process, once: where ``shard()`` installs the block regions and whenever
graphshard's backend compiles. :func:`region_offsets_counted_once` also tags Inductor's
FX-graph cache keys within graphshard's compiles, which do not cover the patch.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

from graphshard.safety.torch_patch import TorchPatch

__all__ = ["CACHE_TAG", "REGION_OFFSETS_COUNTED_ONCE", "region_offsets_counted_once",
           "region_offsets_counted_once_in_this_process"]

# Added to torch.compiler.config.cache_key_tag while graphshard compiles: entries compiled
# with the offset counted twice are never hits.
CACHE_TAG = "graphshard:region-offsets-counted-once"

def _is_view(body_output: Any) -> bool:
    """Whether a region body's result (an Inductor IR node) is a view into a buffer of the
    body rather than a buffer of its own."""
    from torch._inductor import ir

    if isinstance(body_output, ir.ReinterpretView):
        return True
    layout = getattr(body_output, "layout", None)
    return isinstance(layout, ir.NonOwningLayout) or getattr(layout, "offset", 0) != 0


def _count_offsets_once(subgraph: Any, outputs: list[Any]) -> None:
    """Give each region output at a storage offset the layout at offset 0 and keep every
    output that is a view out of Inductor's buffer reuse."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    body_outputs = subgraph.graph.graph_outputs
    paired = len(body_outputs) == len(outputs)  # as in torch 2.11 to 2.14.1
    for index, output in enumerate(outputs):
        if not isinstance(output, ir.MultiOutput):
            continue
        if output.layout.offset != 0:
            layout = copy.copy(output.layout)
            layout.offset = 0
            output.layout = layout
        if not paired or _is_view(body_outputs[index]):
            V.graph.never_reuse_buffers.add(output.get_name())


def _count_offsets_once_in_lowering() -> None:
    """Make ``InvokeSubgraph.create`` count each region output's storage offset once."""
    from torch._inductor.ir import InvokeSubgraph

    original = InvokeSubgraph.create.__func__

    def create(cls: Any, subgraph: Any, *operands: Any) -> Any:
        outputs = original(cls, subgraph, *operands)
        _count_offsets_once(subgraph, outputs)
        return outputs

    create.torch_create = original  # type: ignore[attr-defined]  (what tests look for)
    InvokeSubgraph.create = classmethod(create)


REGION_OFFSETS_COUNTED_ONCE = TorchPatch(_count_offsets_once_in_lowering, cache_tag=CACHE_TAG)


def region_offsets_counted_once_in_this_process() -> None:
    """From now on, every Inductor compile of this process reads a region output at a
    storage offset from the view's own data pointer. Idempotent."""
    REGION_OFFSETS_COUNTED_ONCE.apply_in_this_process()


def region_offsets_counted_once() -> contextlib.AbstractContextManager[None]:
    """Region outputs read at their offset once (for good:
    :func:`region_offsets_counted_once_in_this_process`) and, within, Inductor's FX-graph
    cache keys tagged with :data:`CACHE_TAG`."""
    return REGION_OFFSETS_COUNTED_ONCE.applied()
