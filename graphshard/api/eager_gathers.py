"""Eagerly, one gathered copy per parameter per module call: :func:`read_once`, :func:`release`.

An eager read of a sharded parameter inside a forward gathers it (with the rest of its
bucket: :mod:`graphshard.api.bucket_gathers`), and ranks pair their
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

Under :func:`graphshard.unshard` a read that records no gradient takes the copy held there
(:func:`served_copy`, :class:`HeldCopy`) before any of this.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from graphshard.records import ShardState
from graphshard.safety.mutation import check_unchanged

__all__ = ["HeldCopy", "read_once", "release", "served_copy"]


class HeldCopy:
    """A gathered parameter :func:`graphshard.unshard` holds
    (:mod:`graphshard.api.held_gathers`): the copy and its version counter, the sharded
    parameter it came from, and what tells that the parameter changed since: the version
    counters of the DTensor and of its local shard, and the model's count of optimizer steps.
    An update through the DTensor (``param.mul_()``, ``load_state_dict``) counts on the
    DTensor only, one of the local tensor on it only, and graphshard's fused optimizer step
    (:mod:`graphshard.api.fused_optimizer_ops`, which runs below DTensor's dispatch) on
    neither: an optimizer step over the model makes every held copy stale."""

    __slots__ = ("full", "full_version", "param", "local", "versions")

    def __init__(self, full: torch.Tensor, param: torch.Tensor, optimizer_steps: int) -> None:
        self.full = full
        self.full_version = full._version
        self.param = param
        self.local = param._local_tensor
        self.versions = (param._version, self.local._version, optimizer_steps)

    def is_current(self, param: torch.Tensor, optimizer_steps: int) -> bool:
        """Whether ``param`` (the sharded parameter now) is the one gathered, over the same
        local shard, unchanged since and with no optimizer step taken."""
        local = param._local_tensor
        return (param is self.param and local is self.local
                and (param._version, local._version, optimizer_steps) == self.versions)


def served_copy(state: ShardState, name: str, param: torch.Tensor,
                gather: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, bool] | None:
    """For an eager read of parameter ``name`` (the sharded DTensor ``param``) that records
    no gradient: the copy :func:`graphshard.unshard` holds for it, gathered again by
    ``gather()`` first when the parameter was updated since; and whether it was gathered now.
    None when nothing holds it, or when the read records gradients (a held copy has no
    autograd history)."""
    if not state.held_gathered or torch.is_grad_enabled():
        return None
    held = state.held_gathered.get(name)
    if held is None:
        return None
    if held.is_current(param, state.optimizer_steps):
        return held.full, False
    check_unchanged(held.full, held.full_version, name)  # a write to it would be lost
    with torch.inference_mode(False):  # the copy serves later reads outside inference mode
        full = gather()
    state.held_gathered[name] = HeldCopy(full, param, state.optimizer_steps)
    return full, True


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
