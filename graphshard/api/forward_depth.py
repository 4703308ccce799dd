"""The count of a sharded model's running forwards, which decides whether a read gathers.

A sharded parameter read as an attribute is the full parameter inside a forward of the model
and the sharded DTensor outside it (:mod:`graphshard.api.param_reads`). ``ShardState.
forward_depth`` counts the forwards now running. It goes up and back down:

- around the root's forward, in a forward pre-hook and an ``always_call`` forward hook that
  :func:`track_forwards` registers when the model is sharded (so hooks a user registered
  before ``shard()`` run outside, as with FSDP2's root);
- around the forward of every other module that holds parameters, in its class's
  ``forward`` (:func:`counted_forward`), so that a submodule called on its own
  (``model.layers[0](x)``, the output layer in a generation loop) gathers too.

Not a hook pair on every submodule: before each call of a compiled step Dynamo checks its
guards, and it guards each hook of each module (the hook's code, its key, ``always_call``,
about 14 guards a module). torch 2.11 skips a module's guards while its dicts are unchanged,
but any later compile in the process turns that skipping off for good
(``docs/torch-versions.md``), and then the hooks were half of graphshard's guards. A
class's ``forward`` is one function Dynamo already guards, and a module without hooks
takes ``nn.Module``'s fast call path eagerly. While Dynamo traces, the class's ``forward``
counts nothing: every read gathers then anyway, and a change of state inside a
``torch.utils.checkpoint`` or compile-region body is refused by torch 2.11's Dynamo and
keeps torch 2.13's from reusing the body.

A module whose ``forward`` is an instance attribute (its class's is never called) is
counted by hooks, as the root is.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo.side_effects
from torch import nn

from graphshard.api import eager_reshard
from graphshard.api.bucket_gathers import end_forward
from graphshard.api.eager_gathers import release
from graphshard.api.eager_roots import run_eagerly_as_root
from graphshard.api.hop_side_effects import unchecked_change_keeping_no_tensor
from graphshard.errors import GraphshardError
from graphshard.records import ShardState
from graphshard.safety.data_assignment import refuse_data_assignments
from graphshard.safety.mutation import end_eager_reads, mutation_error, updated_read
from graphshard.safety.plain_params import refuse_plain_parameters, watch_registrations
from graphshard.safety.rank_agreement import check_same_forward

__all__ = ["COMPILE_REGION_MARK", "DEFERS_SIDE_EFFECT_CHECKS", "DEPTH_HOOK_ATTR",
           "OWN_FORWARD_ATTR", "counted_call", "counted_forward",
           "counts_in_class", "forward_in_place_of", "is_graphshard_hook", "mark_forward_hook",
           "track_forwards"]

# On graphshard's hooks that count running forwards (which decides whether a read gathers).
DEPTH_HOOK_ATTR = "_graphshard_counts_forward_depth"
# On a module counted by its class: the ``forward`` its class had before (a function in the
# instance's dict, which torch 2.11's dict tags cover; an attribute of the class read through
# the module would be guarded at every step).
OWN_FORWARD_ATTR = "_graphshard_own_forward"
# The attribute by which ``torch.compiler.nested_compile_region`` marks the function it wraps.
COMPILE_REGION_MARK = "__marked_compile_region_fn__"
# On every module holding parameters: the state of the model it belongs to.
_STATE = "_graphshard_root_state"
_HOOK_ATTR = "_graphshard_forward_hook"

# torch 2.13's Dynamo defers its checks of side effects in a higher-order op's body (and
# accepts a change undone before the body exits); 2.11's does not.
DEFERS_SIDE_EFFECT_CHECKS = hasattr(torch._dynamo.side_effects.SideEffects,
                                    "defer_side_effect_checks")


def mark_forward_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a forward (pre-)hook that graphshard installs: a registered method runs it too."""
    setattr(hook, _HOOK_ATTR, True)
    return hook


def is_graphshard_hook(hook: Any) -> bool:
    """Whether ``hook`` is one :func:`mark_forward_hook` marked."""
    return getattr(hook, _HOOK_ATTR, False)


def _leave(state: ShardState, unwinding: bool) -> None:
    """After a counted call returns: let go of the gathered copies its reads shared; after
    the outermost forward, check that every rank read what this one did (or, when an error
    unwinds it, only forget the reads)."""
    if state.forward_depth == 0 and state.buckets_gathered:
        end_forward(state, completed=not unwinding)  # copies and gathers no read took
    if not torch.compiler.is_compiling() and state.eager_gathered_at:
        try:
            release(state, unwinding)  # the copies the call that returned shared
        except BaseException:
            if state.forward_depth == 0:  # the forward is over: the next one starts afresh
                state.eager_reads = []
            raise
    if state.forward_depth == 0 and state.eager_reads:
        if unwinding:
            state.eager_reads = []
            return
        check_same_forward(state, end_eager_reads(state))


def counted_call(state: ShardState, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
                 ) -> Any:
    """``fn(*args, **kwargs)`` counted as a forward of the model whose state is ``state``
    (eagerly; call it outside tracing)."""
    resharding = state.forward_depth == 0 and eager_reshard.begin(state)
    state.forward_depth += 1
    try:
        output = fn(*args, **kwargs)
    except BaseException as error:
        state.forward_depth -= 1
        if resharding:
            eager_reshard.end(state)
        updated = (updated_read(state) if isinstance(error, Exception)
                   and not isinstance(error, GraphshardError) else None)
        _leave(state, unwinding=True)
        if updated is not None:  # autograd refused an update of a gathered copy (a view)
            raise mutation_error(updated, "update") from error
        raise
    state.forward_depth -= 1
    if resharding:
        eager_reshard.end(state)
    _leave(state, unwinding=False)
    return output


def counted_forward(self: nn.Module, /, *args: Any, **kwargs: Any) -> Any:
    """The ``forward`` of a module counted by its class: its own, counted eagerly."""
    forward = self._graphshard_own_forward
    if torch.compiler.is_compiling():
        return forward(self, *args, **kwargs)
    return counted_call(self._graphshard_root_state, forward, self, *args, **kwargs)


def forward_in_place_of(generic: Callable[..., Any], own: Callable[..., Any]
                        ) -> Callable[..., Any]:
    """A copy of ``generic`` (a ``forward`` that calls a module's own one) to put in a class in
    place of ``own``: its name, docstring and signature read as ``own``'s (``inspect.
    signature`` follows ``__wrapped__``; Hugging Face reads ``forward``'s parameters), its
    code stays ``generic``'s."""
    forward = types.FunctionType(generic.__code__, generic.__globals__, "forward",
                                 generic.__defaults__, generic.__closure__)
    forward.__kwdefaults__ = generic.__kwdefaults__
    functools.update_wrapper(forward, own)
    # ``own``'s attributes come along, but not a ``nested_compile_region`` mark: ``generic``
    # is not the region, it calls ``own``, which stays marked (or not) on its own.
    forward.__dict__.pop(COMPILE_REGION_MARK, None)
    return forward


@functools.cache
def _counting(own: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`counted_forward` in place of ``own`` (one function per ``own``: identical blocks
    keep identical classes' attributes)."""
    return forward_in_place_of(counted_forward, own)


@functools.cache
def _counted_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``forward`` counts (shared by every instance of ``cls``)."""
    return type(cls.__name__, (cls,), {"forward": _counting(cls.forward),
                                       "__module__": cls.__module__})


def counts_in_class(module: nn.Module) -> bool:
    """Whether ``module``'s forwards are counted by its class (not by hooks)."""
    return OWN_FORWARD_ATTR in module.__dict__


def _count_in_class(module: nn.Module, state: ShardState) -> None:
    cls = type(module)
    module.__dict__[OWN_FORWARD_ATTR] = cls.forward
    module.__dict__[_STATE] = state
    if "_graphshard_original_class" in cls.__dict__:  # already a class of this module alone
        cls.forward = _counting(cls.forward)
    else:
        module.__class__ = _counted_class(cls)


def _add_forward_depth(state: ShardState, step: int) -> None:
    state.forward_depth += step


def _count_forward(state: ShardState, step: int) -> None:
    """Change the count from a hook. Hooks count while Dynamo traces too, also inside a
    ``torch.utils.checkpoint`` body; Dynamo from torch 2.13 defers its check of such a body's
    side effects and accepts one undone before the body exits, torch 2.11's refuses any
    mutation of an outside object there ("HOP: Unsafe side effect"), so there the change goes
    through the hatch that allows it."""
    if DEFERS_SIDE_EFFECT_CHECKS:
        state.forward_depth += step
    else:
        unchecked_change_keeping_no_tensor(_add_forward_depth, state, step)


def _store_compiled_call(state: ShardState, compiled: bool) -> None:
    state.compiled_call = compiled


def _mark_compiled_call(state: ShardState, compiled: bool) -> None:
    """Record whether the root's forward now running was called through ``torch.compile``
    (its pre-hook traced: Dynamo replays the store at every compiled call), for the warning
    of an eager read inside one (:mod:`graphshard.api.eager_roots`); the root's forward hook
    clears it. A store, never a read, so that no guard reads it; through the hatch where
    :func:`_count_forward` uses it, for the same reason."""
    if DEFERS_SIDE_EFFECT_CHECKS:
        state.compiled_call = compiled
    else:
        unchecked_change_keeping_no_tensor(_store_compiled_call, state, compiled)


def _enter_forward(state: ShardState) -> Callable[..., None]:
    @mark_forward_hook
    def hook(module: nn.Module, args: Any) -> None:
        _count_forward(state, 1)

    setattr(hook, DEPTH_HOOK_ATTR, True)
    return hook


def _enter_root_forward(state: ShardState) -> Callable[..., None]:
    """The root's pre-hook: eagerly, parameters added since ``shard()`` and parameters
    assigned new data are refused first."""
    watch_registrations()

    @mark_forward_hook
    def hook(module: nn.Module, args: Any) -> None:
        refuse_plain_parameters(module, state)
        refuse_data_assignments(state.params)
        _mark_compiled_call(state, torch.compiler.is_compiling())
        if not torch.compiler.is_compiling() and state.forward_depth == 0:
            state.root_resharding = eager_reshard.begin(state)
        _count_forward(state, 1)

    setattr(hook, DEPTH_HOOK_ATTR, True)
    return hook


def _exit_forward(state: ShardState) -> Callable[..., None]:
    @mark_forward_hook
    @run_eagerly_as_root  # checks the eager reads of a forward Dynamo left to run eagerly
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        _count_forward(state, -1)
        if state.forward_depth == 0:
            _mark_compiled_call(state, False)
            if not torch.compiler.is_compiling() and state.root_resharding:
                state.root_resharding = False
                eager_reshard.end(state)
        _leave(state, unwinding=sys.exc_info()[1] is not None)

    setattr(hook, DEPTH_HOOK_ATTR, True)
    return hook


def track_forwards(module: nn.Module, state: ShardState) -> None:
    """Count running forwards of ``module`` (the root: hooks) and of every submodule holding
    parameters that has a ``forward`` (its class, or hooks where ``forward`` is an instance
    attribute)."""
    enter, leave = _enter_forward(state), _exit_forward(state)
    for sub in module.modules():
        if sub is not module and (next(sub.parameters(), None) is None
                                  or type(sub).forward is nn.Module.forward):
            continue  # nothing to count: no parameters, or never called (a ModuleList)
        if sub is module or "forward" in sub.__dict__:
            sub.register_forward_pre_hook(_enter_root_forward(state) if sub is module else enter)
            sub.register_forward_hook(leave, always_call=True)  # an error unwinds the count
        else:
            _count_in_class(sub, state)
