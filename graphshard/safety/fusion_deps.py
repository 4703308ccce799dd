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

:func:`fusion_keeps_ordering_deps_in_this_process` re-adds them after the recompute, as 2.12
does, on the releases in :data:`BROKEN_RELEASES`, for every Inductor compile of the process,
once. :func:`fusion_keeps_ordering_deps` also tags Inductor's FX-graph cache keys within
graphshard's compiles, which do not cover the patch.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

from graphshard._torch_version import installed_torch_version
from graphshard.safety.cache_tags import cache_keys_tagged

__all__ = ["BROKEN_RELEASES", "CACHE_TAG", "fusion_keeps_ordering_deps",
           "fusion_keeps_ordering_deps_in_this_process"]

# (major, minor) releases whose SchedulerNode.recompute_size_and_body drops the dependencies
# described above.
BROKEN_RELEASES = frozenset({(2, 11)})

# Added to torch.compiler.config.cache_key_tag while graphshard compiles on those releases:
# entries compiled without the dependencies are never hits.
CACHE_TAG = "graphshard:fusion-keeps-ordering-deps"

_lock = threading.Lock()
_applied = False


def fusion_keeps_ordering_deps_in_this_process() -> None:
    """From now on, on a torch release in :data:`BROKEN_RELEASES`, a node whose sizes and
    body Inductor recomputes keeps its hand-added (``StarDep`` / ``WeakDep``) dependencies.
    Elsewhere nothing changes. Idempotent."""
    global _applied
    if installed_torch_version() not in BROKEN_RELEASES:
        return
    with _lock:
        if _applied:
            return
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

        recompute_size_and_body.torch_recompute = original  # type: ignore[attr-defined]
        SchedulerNode.recompute_size_and_body = recompute_size_and_body
        _applied = True


@contextlib.contextmanager
def fusion_keeps_ordering_deps() -> Iterator[None]:
    """Recomputed nodes keep their ordering dependencies (for good:
    :func:`fusion_keeps_ordering_deps_in_this_process`) and, within, on a release in
    :data:`BROKEN_RELEASES`, Inductor's FX-graph cache keys tagged with :data:`CACHE_TAG`."""
    fusion_keeps_ordering_deps_in_this_process()
    if installed_torch_version() not in BROKEN_RELEASES:
        yield
        return
    with cache_keys_tagged(CACHE_TAG):
        yield
