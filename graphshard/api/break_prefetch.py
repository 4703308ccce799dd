"""Across a graph break, the end of one forward graph gathers what the next one starts with
(``Plan.break_prefetch``).

A graph break splits a forward into compiled graphs with eager code between them. Each graph
gathers only what it reads, so the next graph's first gathers (its leading gathers, before it
first computes with a parameter) had nothing to run under: the break exposed them. With
``break_prefetch`` they are ``graphshard::take_prefetched`` nodes, as with
``step_prefetch`` (:mod:`graphshard.passes.step_prefetch`), and every forward graph the
backend compiles runs through :func:`run_forward`:

1. after a graph's forward returns, the graph that followed it last time (learnt in step 2)
   has its leading gathers issued, async, rebuilt from the shards as they are now
   (:func:`graphshard.api.step_prefetch.issue_lead`, with the shards' version counters);
   they run while the eager code between the graphs does;
2. the next graph's ``take_prefetched`` takes them when this rank's shards are unchanged
   since (the same tensors at the same versions: no collective, no host synchronisation),
   and records which graph it leads, so that step 1 knows it from then on.

Inside one forward nothing may update a shard (graphshard refuses an update of a parameter
there), so a changed shard raises on that rank instead of taking stale values. (The graph
that follows the last one of a forward is the next forward's first: prefetched when two
training forwards run with no backward or optimizer step between them, where an update of
the parameters raises the same way.) A gather is
issued only for the graph that followed last time; if another follows (data-dependent
control flow), the gather is left, and dropped with the others at the start of the backward
(a hook on the first output that needs a gradient) or of an optimizer step: so a prefetched
buffer never crosses a backward or an update of the parameters. The first
forward issues nothing (nothing learnt yet); every rank learns the same order, since every
rank runs the same graphs. Forwards without gradients (evaluation under ``no_grad``) are
left alone: their graphs bind no gather, and they neither learn nor issue.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from graphshard.api import step_prefetch

__all__ = ["run_forward", "pending", "drop_pending"]

_TOKENS = itertools.count()
# the forward graph that finished last, while no backward or step came after it
_LAST: list[int | None] = [None]
_NEXT: dict[int, tuple[int, str]] = {}  # graph token -> (id(state), lead) of the graph after
_HOOK: list[Any] = []  # the optimizer step pre-hook, once a wrapped forward ran


def run_forward(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` (the forward of one Dynamo graph) as a callable that learns which graph
    comes after it and, once known, gathers that graph's leading buckets as it returns."""
    token = next(_TOKENS)
    boxed = getattr(compiled, "_boxed_call", False)

    def forward(*args: Any) -> Any:
        if not torch.is_grad_enabled():  # an evaluation forward: its graphs bind nothing
            return compiled(*args)
        if not _HOOK:
            _HOOK.append(register_optimizer_step_pre_hook(lambda *_: drop_pending()))
        before = _LAST[0]
        step_prefetch.last_break_lead = None
        outputs = compiled(*args)
        led = step_prefetch.last_break_lead
        if before is not None and led is not None:
            _NEXT[before] = led  # this graph's leading gathers follow graph ``before``
        _LAST[0] = token
        _drop_at_backward(outputs)
        follows = _NEXT.get(token)
        if follows is not None:
            step_prefetch.issue_lead(*follows)
        return outputs

    if boxed:
        forward._boxed_call = True  # type: ignore[attr-defined]
    return forward


def _drop_at_backward(outputs: Any) -> None:
    """Drop what is pending when the backward of these outputs starts."""
    values = outputs if isinstance(outputs, Sequence) else (outputs,)
    for value in values:
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            value.grad_fn.register_prehook(lambda *_: drop_pending())
            return


def pending() -> int:
    """Gathers issued at the end of a forward graph and not yet taken by the next one."""
    return step_prefetch.versioned_pending()


def drop_pending() -> None:
    """Forget the graph that finished last and drop the gathers issued for the one after it
    (waited for first): at a backward's or an optimizer step's start."""
    _LAST[0] = None
    step_prefetch.drop_versioned()
