"""Keep a block region's backward from writing into its inputs (a torch bug, worked around).

AOTAutograd marks some inputs of a step's backward as *donated*: saved tensors that nothing
reads after the backward, whose buffers Inductor may then reuse for the backward's own
results. The marks are positions among the step backward's inputs. Inductor lowers each
region body (an ``invoke_subgraph`` body: each block compiled once) with a
``SubgraphLowering`` that inherits the same positions and applies them to the body's own
inputs, which are numbered differently (pytorch/pytorch#192840, fixed upstream by #193960;
torch 2.11, 2.13 and 2.14.1 all have it). A body may then put one of its results in the
buffer of an input the step still holds. Seen here, with a coalesced reduce-scatter: the
second block's backward returned the incoming gradient's buffer as the gradient of its own
input, the step reused that same buffer for the first block's gathered parameters, and the
first block's and the embedding's gradients came out wrong.

While graphshard's backend runs Inductor, :func:`regions_donate_no_inputs` makes region
bodies donate nothing, as the upstream fix does (the step graph keeps its donations). It
also tags Inductor's FX-graph cache keys: they do not cover donation, so without the tag a
body compiled before the fix would still be loaded from the cache. A model whose blocks
graphshard made into regions may also be compiled with plain Inductor
(``torch.compile(model)``); :func:`regions_donate_no_inputs_in_this_process`, called where
the regions are installed, lowers every region body of the process that way (without the
cache tag, which would change the keys of everything else the process compiles).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["CACHE_TAG", "regions_donate_no_inputs", "regions_donate_no_inputs_in_this_process"]

# Added to torch.compiler.config.cache_key_tag while graphshard compiles: entries compiled
# with region bodies that donate are never hits.
CACHE_TAG = "graphshard:regions-donate-no-inputs"

_lock = threading.Lock()
_depth = 0  # holders of the patch: open contexts, plus one for the whole process once set
_process_wide = False
_original_init: Any = None


def _install() -> None:
    global _original_init
    from torch._inductor.graph import SubgraphLowering

    _original_init = original = SubgraphLowering.__init__

    def init(self: Any, parent: Any, *args: Any, **kwargs: Any) -> None:
        original(self, parent, *args, **kwargs)
        self.bw_donated_idxs = None  # the step's positions mean nothing among the body's

    init.donates_no_inputs = True  # type: ignore[attr-defined]  (what tests look for)
    SubgraphLowering.__init__ = init


def _uninstall() -> None:
    from torch._inductor.graph import SubgraphLowering

    SubgraphLowering.__init__ = _original_init


def regions_donate_no_inputs_in_this_process() -> None:
    """From now on, every Inductor compile of this process lowers region bodies without
    donated inputs (the upstream fix, strictly more conservative than torch's lowering).
    Idempotent; :func:`regions_donate_no_inputs` nests inside it."""
    global _depth, _process_wide
    with _lock:
        if _process_wide:
            return
        if _depth == 0:
            _install()
        _depth += 1
        _process_wide = True


@contextlib.contextmanager
def regions_donate_no_inputs() -> Iterator[None]:
    """Within: Inductor lowers region bodies without donated inputs, under FX-graph cache
    keys tagged with :data:`CACHE_TAG`. Nests, and holds across threads."""
    import torch.compiler.config as compiler_config

    global _depth
    with _lock:
        if _depth == 0:
            _install()
        _depth += 1
    tag = compiler_config.cache_key_tag
    if CACHE_TAG not in tag:
        tag = f"{tag}|{CACHE_TAG}" if tag else CACHE_TAG
    try:
        with compiler_config.patch(cache_key_tag=tag):
            yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _uninstall()
