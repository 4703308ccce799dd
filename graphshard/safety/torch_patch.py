"""A fix of torch that graphshard carries, applied once per process.

Each workaround of a torch bug that patches torch's code (region_donation.py,
region_offsets.py, region_compare.py, fusion_deps.py, masked_vec.py) is a :class:`TorchPatch`:
the function that patches torch, the releases it is for (every release where not said), and,
for a patch of Inductor, the tag that graphshard's compiles add to Inductor's FX-graph cache
keys while it applies. Those keys cover Inductor's config and the graph, not a patch of its
code, so without the tag an entry compiled before the fix would still be loaded. On a release
the patch is not for, nothing is patched or tagged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from graphshard._torch_version import installed_torch_version
from graphshard.safety.cache_tags import cache_keys_tagged

__all__ = ["TorchPatch"]


class TorchPatch:
    """The fix ``apply`` of a torch bug, for ``releases`` (``(major, minor)`` pairs; None:
    every release), with ``cache_tag`` on graphshard's compiles where it applies (None: the
    patch does not change what Inductor compiles)."""

    def __init__(self, apply: Callable[[], None], *, cache_tag: str | None = None,
                 releases: frozenset[tuple[int, int]] | None = None) -> None:
        self.releases = releases
        self.cache_tag = cache_tag
        self._apply = apply
        self._lock = threading.Lock()
        self._applied = False

    def needed(self) -> bool:
        """Whether the torch this process imported is one the patch is for."""
        return self.releases is None or installed_torch_version() in self.releases

    def apply_in_this_process(self) -> None:
        """Patch torch for the rest of the process, where needed. Idempotent."""
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
        if self.cache_tag is None or not self.needed():
            yield
            return
        with cache_keys_tagged(self.cache_tag):
            yield
