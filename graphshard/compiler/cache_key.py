"""A stable Inductor FX-graph cache key for graphs that hold a ``DeviceMesh``.

DTensor parameters put their ``DeviceMesh`` into the traced graphs as opaque inputs, and
Inductor's FX-graph cache pickles those inputs into its key. ``DeviceMesh.__getstate__``
keeps the mesh's cached ``_hash``, Python's ``hash()`` of a tuple that holds strings, which
is randomised per process (``PYTHONHASHSEED``). So every process computed a new key and the
cache never hit for a graphshard graph: every restart, every rank and every test recompiled
from scratch. While graphshard's backend compiles, meshes pickle without that field; the rest
of the mesh (ranks, layout, device type, dimension names, group names) stays in the key.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["meshes_pickle_without_hash"]


@contextlib.contextmanager
def meshes_pickle_without_hash() -> Iterator[None]:
    """Within the block, pickling a ``DeviceMesh`` leaves out its per-process ``_hash``."""
    original = DeviceMesh.__getstate__

    def getstate(mesh: DeviceMesh) -> dict:
        state = dict(original(mesh))
        state.pop("_hash", None)  # recomputed lazily by __hash__ after unpickling
        return state

    DeviceMesh.__getstate__ = getstate
    try:
        yield
    finally:
        DeviceMesh.__getstate__ = original
