"""Keep the ordering dependencies of a kernel that Inductor's CPU backend re-lays out for a
fusion (a torch 2.11 bug, worked around).

Inductor's scheduler adds dependencies that the loop body does not show: a node that writes
into another buffer in place (``copy_`` into a view of fresh zeros: how a pooling to one
pixel passes its gradient back) must run after the node that creates that buffer; the
dependency is a ``StarDep`` on it, added by hand. When the CPU backend fuses two nodes whose
loops differ (outer-loop fusion, a split loop) it recomputes the node's sizes and body
(``SchedulerNode.recompute_size_and_body``), and on torch 2.11 that rebuilds the node's reads
from the body alone: the hand-added dependencies are gone. The zero fill may then run after
the copy it should precede, and the gradient written into the buffer is lost. Seen on
torchvision's ConvNeXt head (a channel layer norm after ``AdaptiveAvgPool2d(1)``): plain
``torch.compile`` raised ``UnboundLocalError`` from the generated code, graphshard's step
trained every parameter before the head on a zero gradient, silently. torch 2.12 re-adds the
dependencies there; 2.13 and 2.14.1 too.

:data:`FUSION_KEEPS_ORDERING_DEPS` re-adds them after the recompute, as 2.12 does, on torch
2.11; graphshard's backend applies it (a
:class:`~graphshard.safety.torch_patch.TorchPatch`).
"""

from __future__ import annotations

import functools
from typing import Any

from graphshard.safety.torch_patch import TorchPatch

__all__ = ["FUSION_KEEPS_ORDERING_DEPS"]


def _keep_ordering_deps() -> None:
    """Make ``SchedulerNode.recompute_size_and_body`` re-add the node's ``StarDep`` and
    ``WeakDep`` reads after rebuilding the others from the body."""
    from torch._inductor.dependencies import StarDep, WeakDep
    from torch._inductor.scheduler import SchedulerNode
    from torch.utils._ordered_set import OrderedSet

    original = SchedulerNode.recompute_size_and_body

    @functools.wraps(original)
    def recompute_size_and_body(self: Any, *args: Any, **kwargs: Any) -> None:
        ordering_deps = OrderedSet(dep for dep in self.read_writes.reads
                                   if isinstance(dep, (StarDep, WeakDep)))
        original(self, *args, **kwargs)
        if ordering_deps:
            self.set_read_writes(self.read_writes.with_read(ordering_deps)
                                 .rename(self.mutation_renames))

    recompute_size_and_body.torch_original = original  # type: ignore[attr-defined]
    SchedulerNode.recompute_size_and_body = recompute_size_and_body


FUSION_KEEPS_ORDERING_DEPS = TorchPatch(_keep_ordering_deps, releases=frozenset({(2, 11)}),
                                        cache_tag="graphshard:fusion-keeps-ordering-deps")
