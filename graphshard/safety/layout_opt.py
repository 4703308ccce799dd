"""Turn off Inductor's layout optimization on the torch release whose backward it breaks.

Inductor's layout optimization stores the activations of a graph with enough convolutions
channels-last. On torch 2.13 it drops a gradient there: in the backward of Hugging Face
diffusers' ``UNet2DConditionModel`` (two levels of ``DownBlock2D`` / ``UpBlock2D``), the
upsampler's gradient (``F.interpolate(..., mode="nearest")``, lowered to an accumulating
``index_put`` into fresh zeros) is written into a buffer that no later kernel reads, and
everything before the upsampler trains on a wrong gradient, silently. Plain
``torch.compile(model)`` does the same; ``aot_eager`` and ``layout_optimization=False`` are
exact, and torch 2.11.0 and 2.14.1 are exact with it on (checked on the CPU).

:func:`layout_optimization_off_where_broken` wraps graphshard's Inductor compiles: on torch
2.13 it turns the optimization off (a speed feature of convolution nets; graphs without
convolutions never use it), elsewhere it changes nothing. Inductor's FX-graph cache keys
cover its config, so nothing compiled with the optimization on is loaded under it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from graphshard._torch_version import installed_torch_version

__all__ = ["BROKEN_RELEASES", "layout_optimization_off_where_broken"]

# (major, minor) releases whose layout optimization drops the gradient described above.
BROKEN_RELEASES = frozenset({(2, 13)})


@contextlib.contextmanager
def layout_optimization_off_where_broken() -> Iterator[None]:
    """Within: ``torch._inductor.config.layout_optimization`` is False on a torch release
    in :data:`BROKEN_RELEASES`; on any other release the config is left as it is."""
    if installed_torch_version() not in BROKEN_RELEASES:
        yield
        return
    from torch._inductor import config

    with config.patch(layout_optimization=False):
        yield
