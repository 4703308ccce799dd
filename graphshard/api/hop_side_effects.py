"""Changes of outside state that graphshard makes while Dynamo traces a higher-order op's body.

graphshard changes a little Python state while Dynamo traces a forward: the count of running
forwards (torch 2.11, from hooks) and, around each block region, the gathered parameters that
the block's attribute reads return (:mod:`graphshard.api.block_regions`). Inside a
``torch.utils.checkpoint`` body Dynamo refuses any change to an outside object ("HOP: Unsafe
side effect"), so these go through Dynamo's hatch, :data:`unchecked_side_effect`.

The hatch also marks the body as one whose tensors may have escaped into outside objects, and
Dynamo then returns *every* intermediate of the body as an output, so that a later read finds
them. That is needed for a change that keeps a tensor made in the body, and not for
graphshard's: each stores no tensor, or takes it back before the body exits. The extra
outputs did harm: Dynamo's pruning of unused ones (``dce_hop_extra_outputs``) misses a block
region shared by several checkpoint bodies, so a region with a side effect of its own (a
Hugging Face Mamba's mixer sets the active kernels on a global) kept every intermediate as
an output. One made under ``vmap`` (Mamba's ``associative_scan``) cannot be an output, and
``invoke_subgraph``'s schema trace failed ("Either your tensor may have escaped from inside
a function being vmapped"; torch 2.11 to 2.14.1).

:func:`changes_keep_no_tensor` lets a caller put the mark back once its changes are undone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch._dynamo.utils

__all__ = ["changes_keep_no_tensor", "tensors_may_escape", "unchecked_change_keeping_no_tensor",
           "unchecked_side_effect"]


def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)


# Dynamo refuses a change to an outside object inside a higher-order op's body ("HOP: Unsafe
# side effect"), e.g. a block called inside a ``torch.utils.checkpoint`` body. This hatch lets
# Dynamo accept it (eagerly it is a plain call).
unchecked_side_effect = getattr(
    torch._dynamo.utils, "_disable_side_effect_safety_checks_for_current_subtracer", _call)


def _current_tracer() -> Any:
    from torch._dynamo.symbolic_convert import InstructionTranslator

    return InstructionTranslator.current_tx().output.current_tracer


# The tracer's mark that the hatch sets (torch 2.11 to 2.14).
_MARK = "traced_with_externally_visible_side_effects"


@torch.compiler.assume_constant_result
def tensors_may_escape() -> bool:
    """Whether Dynamo takes the body it is tracing now for one whose tensors may have escaped
    (it will return every intermediate). Called while Dynamo traces; True where its internals
    differ, so that :func:`changes_keep_no_tensor` then leaves the mark alone."""
    try:
        return bool(getattr(_current_tracer(), _MARK))
    except (AttributeError, AssertionError, ImportError):
        return True


@torch.compiler.assume_constant_result
def changes_keep_no_tensor(marked_before: bool) -> bool:
    """Put the mark of the body Dynamo is tracing back to ``marked_before`` (what
    :func:`tensors_may_escape` said before changes that, by now, keep no tensor made in the
    body). A body marked before stays marked. Called while Dynamo traces; returns whether the
    mark was put back."""
    if marked_before:
        return False
    try:
        tracer = _current_tracer()
        if not hasattr(tracer, _MARK):
            return False
        setattr(tracer, _MARK, False)
    except (AttributeError, AssertionError, ImportError):
        return False
    return True


def unchecked_change_keeping_no_tensor(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, a change of outside state that keeps no tensor (a count, a flag),
    through Dynamo's hatch while it traces, without marking the body's tensors as escaped."""
    if not torch.compiler.is_compiling():
        return fn(*args)
    marked_before = tensors_may_escape()
    result = unchecked_side_effect(fn, *args)
    changes_keep_no_tensor(marked_before)
    return result
