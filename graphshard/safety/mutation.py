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
import os
import weakref
from pathlib import Path

import torch
from torch import fx

from graphshard.errors import ShardedModelError
from graphshard.passes.markers import is_unshard, marker_args

__all__ = [
    "refuse_gathered_parameter_mutation", "note_eager_read", "end_eager_reads", "mutation_error",
    "check_unchanged", "updated_read",
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


# An update made inside a torch function rather than by the model's own code.
_HIDDEN_UPDATE_HINT = (
    " A torch function can make such an update itself: nn.Embedding(max_norm=...) (and "
    "F.embedding(..., max_norm=...)) renormalises the rows it looks up in place. Drop "
    "max_norm and renormalise outside forward (e.g. after optimizer.step(), `with "
    "torch.no_grad(): w = model.<embedding>.weight.to_local(); w.copy_(torch.renorm(w, 2, 0, "
    "max_norm))`, which renormalises every row, not only those looked up), or scale the "
    "looked-up vectors out of place."
)


def mutation_error(name: str, op: str, where: str = "") -> ShardedModelError:
    """The error for an in-place ``op`` on the gathered parameter ``name`` (``op`` is
    ``"update"`` where only the copy's version counter saw it)."""
    return ShardedModelError(
        f"In-place {op} on parameter {name!r} inside forward{where}: inside forward "
        "graphshard hands the module a gathered copy of the shards, and an in-place update "
        "of that copy never reaches the sharded parameter (compiled and eager would also "
        "disagree). Update the parameter outside forward, on the sharded DTensor (e.g. "
        f"`with torch.no_grad(): model.{name}.{op if op.endswith('_') else 'clamp_'}(...)` "
        "after optimizer.step()), or use the result out of place (`w = w.clamp(...)`)."
        + (_HIDDEN_UPDATE_HINT if op == "update" else "")
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


_PACKAGE_DIR = str(Path(__file__).resolve().parents[1]) + os.sep


def _where(node: fx.Node) -> str:
    """`` (File ..., line ...: code)``: the innermost frame of ``node``'s stack trace outside
    graphshard (the user's line), or ``""``."""
    frames: list[list[str]] = []
    for line in (node.meta.get("stack_trace") or "").splitlines():
        text = line.strip()
        if text.startswith("File "):
            frames.append([text])
        elif frames and text and set(text) - set("^~ "):  # code, not the caret line under it
            frames[-1].append(text)
    outside = [f for f in frames if _PACKAGE_DIR not in f[0]] or frames
    return f" ({' '.join(outside[-1])})" if outside else ""


def refuse_gathered_parameter_mutation(gm: fx.GraphModule) -> None:
    """Raise :class:`ShardedModelError` if the Dynamo graph ``gm`` updates the result of an
    ``unshard`` marker (a gathered parameter), or a view of it, in place.

    An in-place call in the graph is found by its name. One made inside a function the graph
    calls as a whole (``F.embedding`` with ``max_norm`` renormalises rows of its weight) shows
    only in the version counter of the gathered copy's example value, which Dynamo's fake
    tracing advanced; such a copy is refused at the first call that read it."""
    for node in gm.graph.nodes:
        if not is_unshard(node):
            continue
        name = marker_args(node).name
        readers: list[fx.Node] = []
        stack = [node]
        while stack:
            current = stack.pop()
            for user in current.users:
                if user.args and user.args[0] is current:
                    op = _in_place_name(user)
                    if op is not None:
                        raise mutation_error(name, op, _where(user))
                    if _is_view(user):
                        stack.append(user)
                        continue
                readers.append(user)
        example = node.meta.get("example_value")
        if (isinstance(example, torch.Tensor) and not example.is_inference()
                and example._version != 0):  # an inference tensor has no version counter
            first = min(readers, key=_graph_order(gm), default=node)
            raise mutation_error(name, "update", _where(first))


def _graph_order(gm: fx.GraphModule):
    position = {node: index for index, node in enumerate(gm.graph.nodes)}
    return position.__getitem__


def _check(ref, version: int | None, name: str) -> None:
    if _changed(ref(), version):
        raise mutation_error(name, "update")


def _changed(gathered: torch.Tensor | None, version: int | None) -> bool:
    """Whether a gathered copy (None: let go) changed since its version was ``version``
    (None: an inference tensor, not checked)."""
    return gathered is not None and version is not None and gathered._version != version


def check_unchanged(gathered: torch.Tensor, version: int | None, name: str) -> None:
    """Raise if the gathered copy of ``name`` changed since its version was ``version`` (None:
    an inference tensor, not checked)."""
    if _changed(gathered, version):
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


def updated_read(state) -> str | None:
    """The name of a parameter whose gathered copy, read in the eager forward now running,
    was updated in place since, or None. Where the copy is a view (the eager gather's output
    is), autograd itself refuses the update with an error that names no parameter; the
    forward that sees it raises :func:`mutation_error` from it instead."""
    return next((name for ref, version, name, _ in state.eager_reads
                 if _changed(ref(), version)), None)
