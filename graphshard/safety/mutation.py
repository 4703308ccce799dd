"""Refuse in-place updates of a gathered parameter inside forward.

Inside forward, ``self.weight`` is the gathered copy of the shards (``unshard``), not the
parameter: an in-place update of it (``with torch.no_grad(): self.w.clamp_(...)``) changes
that copy only, and the shard, which the optimizer and the next step read, never sees it.
Worse, the copy's lifetime differs between the compiled step (reads of one parameter share
one gather for the whole graph) and the eager one (they share one per module call,
:mod:`graphshard.api.eager_gathers`), so a later read would see the update or not depending
on where it is, and the two would disagree with each other and with one process. FSDP2
loses such updates the same way. graphshard raises instead, naming the parameter: compiled,
from the Dynamo graph before any pass runs; eagerly, from the version counters of the
forward's gathered copies, checked at the next gather, when the module call that shares a
copy returns, and when the forward ends. The last copy gathered is held until the next
gather (one parameter's memory), so an update of a copy that is dropped right away is
caught too; the others are held by weak references and freed as usual.
Update the parameter outside forward (``with torch.no_grad(): model.w.clamp_(...)`` on the
sharded DTensor, e.g. after ``optimizer.step()``), or use the clamped value out of place.
"""

from __future__ import annotations

import operator
import weakref

import torch
from torch import fx

from graphshard.errors import ShardedModelError
from graphshard.passes.markers import is_unshard, marker_args

__all__ = [
    "refuse_gathered_parameter_mutation", "note_eager_read", "end_eager_reads", "mutation_error",
    "check_unchanged",
]

# Dynamo-graph ops that return a view of their first argument (an in-place update through
# the view reaches the gathered parameter).
_VIEW_METHODS = frozenset({
    "view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze",
    "narrow", "select", "unflatten", "flatten", "view_as", "expand_as", "as_strided",
    "detach", "__getitem__", "unbind", "split", "chunk",
})
_VIEW_FUNCTIONS = frozenset({
    operator.getitem, torch.t, torch.transpose, torch.permute, torch.reshape, torch.narrow,
    torch.select, torch.unsqueeze, torch.squeeze, torch.flatten, torch.detach,
})


def mutation_error(name: str, op: str, where: str = "") -> ShardedModelError:
    """The error for an in-place ``op`` on the gathered parameter ``name``."""
    return ShardedModelError(
        f"In-place {op} on parameter {name!r} inside forward{where}: inside forward "
        "graphshard hands the module a gathered copy of the shards, and an in-place update "
        "of that copy never reaches the sharded parameter (compiled and eager would also "
        "disagree). Update the parameter outside forward, on the sharded DTensor (e.g. "
        f"`with torch.no_grad(): model.{name}.{op if op.endswith('_') else 'clamp_'}(...)` "
        "after optimizer.step()), or use the result out of place (`w = w.clamp(...)`)."
    )


def _in_place_name(node: fx.Node) -> str | None:
    """The name of the in-place op ``node`` calls on its first argument, or None."""
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
            schema = getattr(target, "_schema", None)
            if schema is not None and schema.is_mutable:
                return schema.name.split("::")[-1]
            return None
        name = getattr(target, "__name__", "")
    else:
        return None
    if name.endswith("_") and not name.startswith("_"):
        return name
    return None


def _is_view(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    return node.op == "call_function" and node.target in _VIEW_FUNCTIONS


def refuse_gathered_parameter_mutation(gm: fx.GraphModule) -> None:
    """Raise :class:`ShardedModelError` if the Dynamo graph ``gm`` updates the result of an
    ``unshard`` marker (a gathered parameter), or a view of it, in place."""
    for node in gm.graph.nodes:
        if not is_unshard(node):
            continue
        stack = [node]
        while stack:
            current = stack.pop()
            for user in current.users:
                if user.args and user.args[0] is current:
                    op = _in_place_name(user)
                    if op is not None:
                        trace = (user.meta.get("stack_trace") or "").strip().splitlines()
                        where = " (" + " ".join(t.strip() for t in trace[-2:]) + ")"
                        where = where if trace else ""
                        raise mutation_error(marker_args(node).name, op, where)
                    if _is_view(user):
                        stack.append(user)


def _check(ref, version: int | None, name: str) -> None:
    gathered = ref()
    if gathered is not None:
        check_unchanged(gathered, version, name)


def check_unchanged(gathered: torch.Tensor, version: int | None, name: str) -> None:
    """Raise if the gathered copy of ``name`` changed since its version was ``version`` (None:
    an inference tensor, not checked)."""
    if version is not None and gathered._version != version:
        raise mutation_error(name, "update")


def note_eager_read(state, full: torch.Tensor, name: str) -> None:
    """Record an eager forward's read of ``name`` (the gathered copy ``full``) in
    ``state.eager_reads``, after checking the previous read's copy. A copy gathered under
    ``torch.inference_mode()`` has no version counter, and nothing trains on it: its read is
    recorded unchecked."""
    reads = state.eager_reads
    if reads:
        last, version, last_name, trained = reads[-1]
        _check(last, version, last_name)
        reads[-1] = (weakref.ref(last()), version, last_name, trained)  # no longer held
    version = None if full.is_inference() else full._version
    reads.append((lambda full=full: full, version, name, full.requires_grad))


def end_eager_reads(state) -> list[tuple[str, bool]]:
    """At the end of an eager forward: raise if a copy it read was updated in place; else
    return ``(parameter name, trained)`` of each read, in order."""
    reads, state.eager_reads = state.eager_reads, []
    for ref, version, name, _ in reads:
        _check(ref, version, name)
    return [(name, trained) for _, _, name, trained in reads]
