"""Keep Dynamo's comparison of two block regions from failing on a body that holds an
``autograd.Function`` (a torch bug, worked around).

Dynamo compares each new compile region's traced body with those it already holds, to
install identical bodies once (``are_same_graph_modules``). A body that calls an
``autograd.Function`` (Hugging Face BLOOM's ``GeLUFunction``, which its ``BloomGelu`` runs
in training) holds the function's backward as a graph whose unused inputs are placeholders
without an ``example_value``; the comparison reads that value and the compile ends with
``InternalTorchDynamoError: KeyError: example_value``. Seen on torch 2.11.0, where Dynamo
traces every block and compares each body with the ones before; on 2.13.0 the same model
compiles.

:func:`region_compare_tolerates_unused_inputs_in_this_process` makes such a comparison say
"not the same": Dynamo then installs the second body as a body of its own, which is what it
does for any two bodies that differ. The step compiles one more body and trains the same.
"""

from __future__ import annotations

import functools
from typing import Any

from graphshard.safety.torch_patch import TorchPatch

__all__ = ["REGION_COMPARE_TOLERATES_UNUSED_INPUTS",
           "region_compare_tolerates_unused_inputs_in_this_process"]

def _tolerate_unused_inputs() -> None:
    """Make Dynamo's ``are_same_graph_modules`` answer False where it would raise
    ``KeyError('example_value')``; nothing on a torch without it."""
    from torch._dynamo.variables import higher_order_ops

    original = getattr(higher_order_ops, "are_same_graph_modules", None)
    if original is None:
        return

    @functools.wraps(original)
    def are_same_graph_modules(*args: Any, **kwargs: Any) -> bool:
        try:
            return original(*args, **kwargs)
        except KeyError as error:
            if error.args != ("example_value",):
                raise
            return False

    are_same_graph_modules.torch_compare = original  # type: ignore[attr-defined]
    higher_order_ops.are_same_graph_modules = are_same_graph_modules


# Dynamo's comparison, not Inductor's lowering: no cache key to tag.
REGION_COMPARE_TOLERATES_UNUSED_INPUTS = TorchPatch(_tolerate_unused_inputs)


def region_compare_tolerates_unused_inputs_in_this_process() -> None:
    """From now on, Dynamo's comparison of two region bodies answers "not the same" where
    it would fail on a placeholder without an example value. Idempotent; nothing happens
    on a torch without the comparison."""
    REGION_COMPARE_TOLERATES_UNUSED_INPUTS.apply_in_this_process()
