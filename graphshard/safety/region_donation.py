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

The workaround does what the upstream fix does: region bodies donate nothing (the step
graph keeps its donations). :func:`regions_donate_no_inputs_in_this_process` applies it to
every Inductor compile of the process, once: where ``shard()`` installs the block regions
and whenever graphshard's backend compiles. (Plain Inductor, ``torch.compile(model)``, runs
a sharded model's blocks inline: :func:`graphshard.api.block_regions.region_forward`.)
Within graphshard's compiles, :func:`regions_donate_no_inputs` also tags Inductor's FX-graph
cache keys: they do not cover donation, so without the tag a body compiled before the
workaround would still be loaded from the cache. (Plain Inductor's keys are left alone: a
tag there would change the keys of everything else the process compiles.)
"""

from __future__ import annotations

import contextlib
from typing import Any

from graphshard.safety.torch_patch import TorchPatch

__all__ = ["CACHE_TAG", "REGIONS_DONATE_NO_INPUTS", "regions_donate_no_inputs",
           "regions_donate_no_inputs_in_this_process"]

# Added to torch.compiler.config.cache_key_tag while graphshard compiles: entries compiled
# with region bodies that donate are never hits.
CACHE_TAG = "graphshard:regions-donate-no-inputs"

def _donate_no_inputs() -> None:
    """Make every region body's lowering forget the step's donated input positions."""
    from torch._inductor.graph import SubgraphLowering

    original = SubgraphLowering.__init__

    def init(self: Any, parent: Any, *args: Any, **kwargs: Any) -> None:
        original(self, parent, *args, **kwargs)
        self.bw_donated_idxs = None  # the step's positions mean nothing among the body's

    init.torch_init = original  # type: ignore[attr-defined]  (what tests look for)
    SubgraphLowering.__init__ = init


REGIONS_DONATE_NO_INPUTS = TorchPatch(_donate_no_inputs, cache_tag=CACHE_TAG)


def regions_donate_no_inputs_in_this_process() -> None:
    """From now on, every Inductor compile of this process lowers region bodies without
    donated inputs (the upstream fix, strictly more conservative than torch's lowering).
    Idempotent."""
    REGIONS_DONATE_NO_INPUTS.apply_in_this_process()


def regions_donate_no_inputs() -> contextlib.AbstractContextManager[None]:
    """Region bodies lowered without donated inputs (for good:
    :func:`regions_donate_no_inputs_in_this_process`) and, within, Inductor's FX-graph cache
    keys tagged with :data:`CACHE_TAG`."""
    return REGIONS_DONATE_NO_INPUTS.applied()
