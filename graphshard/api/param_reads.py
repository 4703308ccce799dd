"""How a sharded module's parameters are read: :func:`install_reads`.

:func:`graphshard.shard` gives every module that holds sharded parameters a per-instance
class whose ``__getattr__`` answers for them: outside a forward the sharded DTensor
parameter (so ``reset_parameters()`` initialises the shards, as with FSDP2), inside one the
full parameter through the ``unshard`` marker (eagerly that all-gathers; under
``torch.compile`` it leaves the marker the passes lower into bucketed collectives), and
inside a block's compile region the operand gathered outside it
(:mod:`graphshard.api.block_regions`).

What the traced read touches is chosen for Dynamo's guards, which run before every call of
the compiled step. torch 2.11's Dynamo skips a module's guards whole while no dict under it
has changed since the last call, but only a module whose reads are all dicts, functions and
immutable values reached through its ``__dict__`` and its class's own dicts
(``docs/torch-versions.md``). So the module holds what the trace reads as plain attributes of
its instance dict: the names of its sharded parameters (a dict, the same in every block of
one kind: torch 2.12's Dynamo reads the values of a dict tested with ``in`` and guards them,
and a value that differs between two blocks keeps it from reusing one block's trace for the
other), dicts of indices into constant tables (:func:`_fixed_spec`, the root state's index),
a dict of its parameters' plain tensors (``ShardedParam.local``, kept equal
by :func:`graphshard.api.local_inputs.set_local`), a dict of their buckets' flat buffers
(:mod:`graphshard.api.bucket_storage`) and two flags; the records themselves are
read only where gradients are held back (``no_sync``) or tensor parallelism re-wraps.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from graphshard.api.block_regions import REGION_PARAMS_ATTR
from graphshard.api.bucket_gathers import gather_bucket, register_bucket_member, take_gathered
from graphshard.api.bucket_storage import STORAGES_ATTR, place, register_storage_slots
from graphshard.api.eager_gathers import read_once, served_copy
from graphshard.api.eager_kernels import from_gathered
from graphshard.api.eager_reshard import register_copy
from graphshard.api.eager_roots import note_eager_read_under_compile, run_eagerly_as_root
from graphshard.api.functional_calls import exporting, refuse_export
from graphshard.api.local_inputs import (
    LOCAL_INDEX_ATTR,
    LOCALS_ATTR,
    register_module_mates,
    set_local,
    trains,
)
from graphshard.passes.markers import UNSHARD, GradSync, UnshardSpec
from graphshard.records import ROOT_STATES, ShardedParam, ShardState
from graphshard.safety import guards
from graphshard.safety.mutation import note_eager_read

__all__ = ["install_reads", "gathered_param", "read_param", "reads_gather", "register_state"]


def install_reads(module: nn.Module, specs: dict[str, tuple[ShardedParam, UnshardSpec]],
                  state: ShardState, state_index: int, local_index: dict[str, int]) -> None:
    """Make ``module``'s parameters named in ``specs`` (name -> (record, unshard arguments))
    read as sharded parameters of the model whose state is ``state`` (``ROOT_STATES``'s
    ``state_index``); ``local_index``: each name's index for
    :func:`graphshard.api.local_inputs.trains`."""
    attrs = module.__dict__
    attrs["_graphshard_specs"] = specs
    attrs[_SPEC_INDEX_ATTR] = {pname: _register_spec(spec, place(entry))
                               for pname, (entry, spec) in specs.items()}
    attrs[_SHARDED_NAMES_ATTR] = dict.fromkeys(specs, True)
    attrs[LOCAL_INDEX_ATTR] = local_index
    register_module_mates(local_index.values())
    locals_ = attrs[LOCALS_ATTR] = {}
    storages = attrs[STORAGES_ATTR] = {}
    for pname, (entry, _) in specs.items():
        entry.local_slots.append((locals_, pname))
        set_local(entry, entry.local)
        register_storage_slots(entry, storages, pname)
        register_bucket_member(state, entry, specs[pname][1])
    attrs[_HOLDS_TP_ATTR] = any(entry.tp is not None for entry, _ in specs.values())
    attrs[REGION_PARAMS_ATTR] = None  # set only while a block's region is traced
    attrs["_graphshard_root_state"] = state
    attrs[_STATE_INDEX_ATTR] = state_index
    module.__class__ = _sharded_class(type(module))


def read_param(
    shard: torch.Tensor, entry: ShardedParam, spec: UnshardSpec, sync: int,
    unshard: Callable[..., torch.Tensor] = UNSHARD,
) -> torch.Tensor:
    """The parameter inside the forward: the full tensor through the ``unshard`` marker, or
    under tensor parallelism the dp-gathered TP piece as the TP DTensor. ``unshard``: the
    marker, or eagerly one whose gather already ran (``eager_kernels.from_gathered``)."""
    full = _read_param(shard, entry, spec, sync, unshard)
    return full if entry.tp is None else entry.tp.wrap(full)


def _read_param(
    shard: torch.Tensor, entry: ShardedParam, spec: UnshardSpec, sync: int,
    unshard: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """The full parameter through ``unshard``, routed by the gradient-sync mode."""
    if shard.is_meta:
        raise guards.ShardedModelError(
            f"Parameter {entry.names[0]!r} is still on the meta device: a model built under "
            "torch.device('meta') and sharded has no values yet. Call "
            "model.to_empty(device=...) and then initialise it (model.init_weights() or each "
            "module's reset_parameters()) or load it (dcp.load(model.state_dict(), ...) or "
            "set_model_state_dict(..., StateDictOptions(full_state_dict=True, "
            "broadcast_from_rank0=True))) before running it."
        )
    if not shard.requires_grad or not torch.is_grad_enabled():
        # a read that records no gradient (under ``torch.no_grad()``; while Dynamo traces,
        # the local is a plain input that requires grad either way) must not take no_sync's
        # held-back gradient: no backward of it would fold that in
        return unshard(shard, *spec)
    if sync in (GradSync.NONE, GradSync.PARTIAL):
        # The held-back gradient goes to no_sync's accumulator, none to the shard: eagerly the
        # shard is left out of the graph, so that its gradient hooks (the user's) are not
        # called with None. (A compiled backward hands it no gradient either.)
        held = entry.unreduced if sync == GradSync.NONE else entry.partial
        return unshard(shard if torch.compiler.is_compiling() else shard.detach(), *spec,
                       sync, held)
    armed = entry.armed
    if armed is None:
        return unshard(shard, *spec, sync)
    entry.armed = None  # this read folds the held-back gradient in; later reads must not
    entry.folding = True
    return unshard(shard, *spec, sync, None, *armed)


def reads_gather(state: ShardState) -> bool:
    """Whether an attribute read now means "the full parameter" (inside a forward of the
    sharded model, in a backward, or while Dynamo traces) rather than "the sharded one"."""
    return (
        torch.compiler.is_compiling()
        or state.forward_depth > 0
        or torch._C._current_graph_task_id() != -1
    )


# Every UnshardSpec shard() made, as the plain tuple Dynamo takes; a sharded module holds its
# parameters' indices here (``_graphshard_spec_index``: parameter name -> index).
_SPECS: list[tuple] = []
_SPEC_INDEX_ATTR = "_graphshard_spec_index"
# A sharded module's names of sharded parameters: what an attribute read tests (the same in
# every block of a kind, where the indices differ; see :func:`_sharded_getattr`). A dict, not
# a frozenset: torch 2.11 skips a module's guards through dicts, not through a frozenset
# (``python -m bench.guard_check`` on 2.11: 0.15-0.55 ms a step with a dict, 0.43-1.0 with one).
_SHARDED_NAMES_ATTR = "_graphshard_sharded_names"


_PLACES: list[int] = []  # by the same index: the parameter's place in its bucket's buffer


def _register_spec(spec: UnshardSpec, storage_place: int) -> int:
    _SPECS.append(tuple(spec))
    _PLACES.append(storage_place)
    return len(_SPECS) - 1


@torch.compiler.assume_constant_result
def _fixed_place(index: int) -> int:
    """A parameter's place in its bucket's buffer (``graphshard.api.bucket_storage.place``):
    a constant of the trace, not a guard."""
    return _PLACES[index]


@torch.compiler.assume_constant_result
def _fixed_spec(index: int) -> tuple:
    """The ``unshard`` arguments ``shard()`` fixed for a parameter. They never change after
    ``shard()``, so Dynamo takes them as a constant behind one guard (on the index) instead
    of guarding each of their fields on every parameter (some thirty guards per parameter,
    evaluated at every step). (An index, not the module: torch 2.11's Dynamo takes only
    constants as the arguments of such a function, and a plain tuple as its result.)"""
    return _SPECS[index]


# A sharded module holds its root's index into ``ROOT_STATES`` (``_graphshard_state_index``).
_STATE_INDEX_ATTR = "_graphshard_state_index"
_STATE_INDICES = itertools.count()


def register_state(root: nn.Module, state: ShardState) -> int:
    """Enter ``root``'s ``state`` in ``ROOT_STATES`` (until ``root`` is collected); its index."""
    index = next(_STATE_INDICES)
    ROOT_STATES[index] = state
    weakref.finalize(root, ROOT_STATES.pop, index, None)
    return index


def gathered_param(module: nn.Module, pname: str, state: ShardState | None = None
                   ) -> torch.Tensor:
    """The full parameter ``pname`` of the sharded ``module``, through its ``unshard``
    marker: what reading the attribute means inside a forward, a backward or while Dynamo
    traces. ``state``: its model's (default: looked up by the module's index, the one
    source Dynamo should see). Dynamo traces this once per parameter, so it is kept short,
    and in the common case it reads only what keeps the module's guards skippable
    (:func:`_sharded_class`): plain attribute reads of the module's dicts of indices and
    plain tensors (``module.__dict__`` itself would be guarded as an attribute)."""
    spec = _fixed_spec(module._graphshard_spec_index[pname])
    if state is None:  # while Dynamo traces: a trainable parameter is read as its plain local
        state = ROOT_STATES[module._graphshard_state_index]
        if trains(module._graphshard_local_index[pname]):
            shard = module._graphshard_locals[pname]
            if (state.sync == GradSync.FULL and not state.folds_held_back
                    and not module._graphshard_holds_tp and not shard.is_meta):
                stored = module._graphshard_storages[pname]  # the bucket's buffer, or None
                if stored is not None:
                    return UNSHARD(shard, *spec, GradSync.FULL, storage=stored,
                                   storage_index=_fixed_place(module._graphshard_spec_index[pname]))
                return UNSHARD(shard, *spec, GradSync.FULL)  # nothing to fold in or re-wrap
            return read_param(shard, module._graphshard_specs[pname][0], spec, state.sync)
    entry = module._graphshard_specs[pname][0]
    shard = module._parameters[pname].to_local()
    if not torch.compiler.is_compiling():  # eagerly: the copy its bucket's gather left, if any
        taken = take_gathered(state, entry)
        if taken is not None:
            full, with_autograd = taken
            if with_autograd:  # read with its bucket's (api.bucket_reads.read_bucket)
                return full if torch.is_grad_enabled() else full.detach()
            return read_param(shard, entry, spec, state.sync,
                              functools.partial(from_gathered, full))
    return read_param(shard, entry, spec, state.sync)


# On a sharded module: whether any of its parameters is tensor-parallel (read re-wrapped).
# Traced code reads this and the other attributes :func:`install_reads` sets as attributes,
# by name (``module._graphshard_holds_tp``), never through ``module.__dict__``.
_HOLDS_TP_ATTR = "_graphshard_holds_tp"
_PREFIX = "_graphshard_"  # graphshard's own attributes: never a parameter's name


def _sharded_read(self: nn.Module, name: str) -> Any:
    """The sharded parameter ``name`` of ``self`` outside a forward, the gathered one inside
    it (module docstring)."""
    region = self._graphshard_region_params
    if region is not None:  # inside a block's compile region: gathered outside it
        return region[name]
    if torch.compiler.is_compiling():
        if exporting():
            refuse_export()
        return gathered_param(self, name)
    state = self._graphshard_root_state
    if not reads_gather(state):
        return self._parameters[name]
    entry = self._graphshard_specs[name][0]
    given = self._parameters[name]
    if given is not entry.param:  # torch.func.functional_call's tensor (api.functional_calls)
        return given.full_tensor() if isinstance(given, DTensor) else given
    if state.forward_depth == 0:  # in a backward, outside any forward
        return gathered_param(self, name, state)
    param_name = entry.names[0]

    def gather() -> torch.Tensor:  # with the rest of its bucket, the first time in a forward
        gather_bucket(state, entry, again={id(e) for e, _ in self._graphshard_specs.values()})
        return gathered_param(self, name, state)

    served = served_copy(state, param_name, given, gather)  # graphshard.unshard
    full, gathered = served if served is not None else read_once(state, param_name, gather)
    if gathered:
        register_copy(state, full, entry, self._graphshard_specs[name][1])
        note_eager_read(state, full, param_name)
        if state.compiled_call:
            note_eager_read_under_compile(_class_name(self), param_name)
    return full


def _class_name(module: nn.Module) -> str:
    """The name of ``module``'s class as the user wrote it (not graphshard's subclass)."""
    return getattr(type(module), "_graphshard_original_class", type(module)).__name__


# Names the lookup below leaves to nn.Module at once: its tables (missing only while a module
# is being built or copied) and graphshard's own attributes (never sharded parameters).
_MODULE_TABLES = ("_parameters", "_buffers", "_modules")


@run_eagerly_as_root  # code running eagerly under torch.compile reads eagerly (api.eager_roots)
def _sharded_getattr(self: nn.Module, name: str) -> Any:
    """``__getattr__`` of a sharded module whose class has nn.Module's: the sharded
    parameters (:func:`_sharded_read`), then nn.Module's own lookup (parameters, buffers,
    submodules) written as plain attribute reads. Called by name, nn.Module's ``__getattr__``
    reads ``self.__dict__``, which Dynamo guards as an attribute of the module, and a
    closure, or an attribute of the class, would be guarded through the module too: either
    keeps Dynamo from skipping the module's guards (:func:`_sharded_class`)."""
    if name in _MODULE_TABLES or name.startswith(_PREFIX):
        return nn.Module.__getattr__(self, name)
    if name in self._graphshard_sharded_names:
        return _sharded_read(self, name)
    parameters = self._parameters
    if name in parameters:
        return parameters[name]
    buffers = self._buffers
    if name in buffers:
        return buffers[name]
    modules = self._modules
    if name in modules:
        return modules[name]
    return nn.Module.__getattr__(self, name)  # raises its AttributeError


def _sharded_class(cls: type) -> type:
    """The per-instance class of a module holding sharded parameters: its ``__getattr__``
    answers for them (:func:`_sharded_read`) and leaves every other name to the class's own.

    Not a property per parameter: torch's Dynamo skips a module's guards at every step while
    its dicts are unchanged only when every attribute of its class it read is a function or
    an immutable value, and a property is neither (torch 2.11: 1.6-2.2 ms a step of guards
    on llama-1b, against 0.1 for the plain model; ``docs/torch-versions.md``)."""
    own = cls.__getattr__
    if own is nn.Module.__getattr__:
        getattr_ = _sharded_getattr
    else:  # a class with a __getattr__ of its own (its modules' guards are then not skipped)

        @run_eagerly_as_root
        def getattr_(self: nn.Module, name: str) -> Any:
            if name.startswith(_PREFIX) or name not in self._graphshard_sharded_names:
                return own(self, name)
            return _sharded_read(self, name)

    attrs = {"__getattr__": getattr_, "_graphshard_original_class": cls}
    return type(f"Sharded{cls.__name__}", (cls,), attrs)
