"""A fix of torch's Inductor for the torch releases that need it, applied once per process.

Each fix that graphshard carries for a torch bug (fusion_deps.py, masked_vec.py) is a
:class:`ReleasePatch`: which releases it is for, the function that patches torch, and the tag
that graphshard's compiles add to Inductor's FX-graph cache keys while it applies, since those
keys cover Inductor's config and the graph, not a patch of its code (an entry compiled before
the fix would otherwise still be loaded). On any other release nothing is patched or tagged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from graphshard._torch_version import installed_torch_version
from graphshard.safety.cache_tags import cache_keys_tagged

__all__ = ["ReleasePatch"]


class ReleasePatch:
    """The fix ``apply`` of a torch bug found on ``releases`` (``(major, minor)`` pairs)."""

    def __init__(self, releases: frozenset[tuple[int, int]], cache_tag: str,
                 apply: Callable[[], None]) -> None:
        self.releases = releases
        self.cache_tag = cache_tag
        self._apply = apply
        self._lock = threading.Lock()
        self._applied = False

    def needed(self) -> bool:
        """Whether the torch this process imported is one of :attr:`releases`."""
        return installed_torch_version() in self.releases

    def apply_in_this_process(self) -> None:
        """Patch torch for every later Inductor compile of the process, where needed.
        Idempotent."""
        if not self.needed():
            return
        with self._lock:
            if not self._applied:
                self._apply()
                self._applied = True

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Within: torch patched (for good) and Inductor's FX-graph cache keys tagged with
        :attr:`cache_tag`, where needed; elsewhere nothing changes."""
        self.apply_in_this_process()
        if not self.needed():
            yield
            return
        with cache_keys_tagged(self.cache_tag):
            yield
