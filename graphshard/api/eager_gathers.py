"""Eagerly, one gather per parameter per module call: :func:`read_once`, :func:`release`.

An eager read of a sharded parameter inside a forward all-gathers it, and ranks pair their
collectives by the order they issue them. Code that reads one parameter a number of times
that depends on the data issues a different number of gathers on each rank: Hugging Face's
loop over the experts a batch was routed to (``experts_implementation="eager"``) reads the
stacked ``gate_up_proj`` once per expert hit, so one rank's extra gather paired with
another's next collective, and gloo aborted the process (``Received data size doesn't match
expected size``), where FSDP2, which gathers a module's parameters once on entry, trains.

So a parameter read again while the module call that first read it is still running gets the
same gathered tensor, as the compiled step's reads of one parameter share one gather.
Autograd then sums the reads' gradients before the one reduce-scatter. The gathered tensor is
held until that call returns (the call counted by :mod:`graphshard.api.forward_depth`, at the
depth of the read), not to the end of the forward: a forward under ``torch.no_grad()`` frees
each module's parameters after it, as before. A read under another grad mode, or under
``torch.inference_mode()``, gathers its own copy (a copy without autograd history must not
serve a read that trains). When a call returns, its copies are checked for in-place updates
(:mod:`graphshard.safety.mutation`) before they are let go.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from graphshard.records import ShardState
from graphshard.safety.mutation import check_unchanged

__all__ = ["read_once", "release"]


def read_once(state: ShardState, name: str, gather: Callable[[], torch.Tensor]
              ) -> tuple[torch.Tensor, bool]:
    """The gathered parameter ``name`` for a read at ``state.forward_depth``: the copy an
    enclosing call still holds, or ``gather()``'s, held until the current call returns.
    Also whether it was gathered now."""
    key = (name, torch.is_grad_enabled(), torch.is_inference_mode_enabled())
    held = state.eager_gathered.get(key)
    if held is not None:
        return held[0], False
    full = gather()
    state.eager_gathered[key] = (full, None if full.is_inference() else full._version)
    state.eager_gathered_at.setdefault(state.forward_depth, []).append(key)
    return full, True


def release(state: ShardState, unwinding: bool) -> None:
    """After a counted call returns (``state.forward_depth`` is already the caller's): let go
    of the copies gathered at deeper depths, raising if one was updated in place (unless an
    error is unwinding the call)."""
    depth = state.forward_depth
    released = [(key, state.eager_gathered.pop(key))
                for level in [level for level in state.eager_gathered_at if level > depth]
                for key in state.eager_gathered_at.pop(level)]
    if not unwinding:  # every copy is let go first: a refusal leaves none for the next forward
        for key, (full, version) in released:
            check_unchanged(full, version, key[0])
