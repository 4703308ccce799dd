"""Refuse what would silently corrupt a sharded model; keep what PyTorch changes in sync.

Installed by :func:`graphshard.shard` through :func:`after_shard`:

- **Replacing a parameter** (``model.fc.weight = nn.Parameter(...)``, ``del``,
  ``register_parameter``) raises: ``nn.Module.__setattr__`` would put the full tensor where
  the shard lives, and the next read would gather it as if it were a shard. A DTensor
  Parameter laid out like the one it replaces (same mesh, placements, shape, dtype) is
  taken, and the record follows it: ``load_state_dict(assign=True)`` and torch's
  ``set_model_state_dict`` on a meta model assign such parameters.
- **An optimizer on the pre-shard parameters** raises at its first ``step()``: the
  parameters ``shard()`` replaced are marked, and a global optimizer step pre-hook refuses
  them (they would never receive a gradient: training would silently do nothing).
- **``.to()`` / ``.double()`` / ``.cuda()`` / ``to_empty()``** are supported: PyTorch
  converts the shards (the padding comes along); when it makes new ``Parameter`` objects
  (``torch.__future__.set_overwrite_module_params_on_conversion(True)``, or conversions
  between incompatible tensor types) the sharding record is re-pointed to them and tied
  parameters stay tied.
- **``model.load_state_dict(sd)``** takes what ``model.state_dict()`` gives (DTensors, at
  any world size once DCP has resharded them); a plain tensor for a parameter raises, naming
  ``set_model_state_dict(..., StateDictOptions(full_state_dict=True))`` (DTensor's own error
  would not say what to call).
- **``copy.deepcopy``** of a sharded model or module raises, saying to copy before
  ``shard()`` or to load the weights into a second sharded model (as FSDP2 refuses it; the
  bare error was "cannot pickle ProcessGroup").
- The plan fingerprint and the parameters' values are compared across ranks
  (:mod:`graphshard.safety.fingerprint`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from graphshard.errors import ShardedModelError
from graphshard.safety.data_assignment import record_wrapper, refuse_data_assignments
from graphshard.safety.fingerprint import check_shard_plan, check_shard_values
from graphshard.safety.param_hooks import carry_grad_hooks, reinstall_grad_hooks

__all__ = [
    "collect_originals", "after_shard", "on_new_storage", "refuse_copies",
    "refuse_unsharded_parameters",
    "ShardedModelError",
]


def collect_originals(module: nn.Module) -> list[tuple[nn.Parameter, str]]:
    """Every parameter of ``module`` with its first name, before :func:`shard` replaces it."""
    return [(p, name) for name, p in module.named_parameters()]


def after_shard(module: nn.Module, state: Any, originals: list[tuple[nn.Parameter, str]]):
    """Install the guards on a freshly sharded ``module`` and compare plans across ranks."""
    for param, name in originals:
        param._graphshard_replaced = name
    for entry in state.params:
        record_wrapper(entry)
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        if not sub.__dict__.get("_graphshard_specs") or "_graphshard_prefix" in sub.__dict__:
            continue
        sub.__dict__["_graphshard_prefix"] = f"{mod_name}." if mod_name else ""
        _guard_class(type(sub))
    module.register_load_state_dict_pre_hook(_PlainTensorRefusal(state, type(module).__name__))
    _watch_optimizers()
    _first_in_dict(module, _COPY_REFUSAL_ATTR, _CopyRefusal(type(module).__name__))
    _STATES.append(weakref.ref(state))
    check_shard_plan(state)
    check_shard_values(state, originals, [(b, n) for n, b in module.named_buffers()])


# --------------------------------------------------------------------------- parameter writes


def _refuse_replace(module: nn.Module, name: str, action: str) -> None:
    fqn = module.__dict__.get("_graphshard_prefix", "") + name
    raise ShardedModelError(
        f"Cannot {action} parameter {fqn!r} of a sharded model: after graphshard.shard() "
        "each rank holds only its shard of it, and a new tensor there would be taken for a "
        "shard (gathered and trained silently wrong). Replace parameters before calling "
        "graphshard.shard() (torch.nn.utils.parametrize.register_parametrization, "
        "weight_norm, spectral_norm and torch.nn.utils.prune replace the parameter: apply "
        "them before shard()); "
        "to change the values of a sharded parameter, use "
        "torch.distributed.checkpoint.state_dict.set_model_state_dict(model, "
        f"{{{fqn!r}: new_full_tensor}}, options=StateDictOptions(full_state_dict=True, "
        "strict=False))."
    )


def _guard_class(cls: type) -> None:
    """Give a per-instance sharded class guarded ``__setattr__``, ``__delattr__``,
    ``register_parameter`` and ``_apply`` (once)."""
    if cls.__dict__.get("_graphshard_guarded"):
        return

    def __setattr__(self, name: str, value: Any) -> None:
        specs = self.__dict__.get("_graphshard_specs") or {}
        if name in specs:
            others = self.__dict__["_graphshard_root_state"].params
            if not _same_layout(self._parameters[name], value) or any(
                e.param is value for e in others if e is not specs[name][0]
            ):  # another shard of this model (tying after shard()) is refused too
                _refuse_replace(self, name, "assign to")
            _follow(self, name, specs[name][0], self._parameters[name], value)
            return
        super(cls, self).__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name in (self.__dict__.get("_graphshard_specs") or ()):
            _refuse_replace(self, name, "delete")
        super(cls, self).__delattr__(name)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        specs = self.__dict__.get("_graphshard_specs") or {}
        if name in specs:
            _refuse_replace(self, name, "re-register")
        # one of its shards under a new name (torch.nn.utils.prune's weight_orig), refused
        # before the caller goes on to delete the old name
        for pname, (entry, _) in specs.items():
            if param is not None and entry.param is param:
                _refuse_replace(self, pname, f"re-register (as {name!r})")
        super(cls, self).register_parameter(name, param)

    def _apply(self, fn, recurse: bool = True):
        if _shares_memory(fn):
            _refuse_share_memory(self)
        specs = self.__dict__.get("_graphshard_specs") or {}
        entries = {pname: entry for pname, (entry, _) in specs.items()}
        before = {pname: self._parameters[pname] for pname in entries}
        out = super(cls, self)._apply(fn, recurse)
        for pname, old in before.items():
            new = self._parameters[pname]
            if new is not old:
                _follow(self, pname, entries[pname], old, new)
            else:  # a swap keeps the Parameter object, and autograd drops its hooks
                reinstall_grad_hooks(new)
            _new_storage(entries[pname])
        return out

    cls.__setattr__ = __setattr__
    cls.__delattr__ = __delattr__
    cls.register_parameter = register_parameter
    cls._apply = _apply
    refuse_copies(cls)
    cls._graphshard_guarded = True


def refuse_copies(cls: type) -> None:
    """Make ``copy.deepcopy``, ``pickle`` and ``torch.save`` of instances of ``cls`` (a class
    of sharded modules only) raise with what to do instead."""
    cls.__deepcopy__ = _refuse_deepcopy
    cls.__reduce_ex__ = _refuse_pickle


def _refuse_deepcopy(module: nn.Module, memo: dict | None = None, name: str = "") -> None:
    """``copy.deepcopy`` of a sharded module, or of the model (through its root's hook): the
    parameters are shards of a process group and graphshard's state for the model is bound
    to them, so a copy could not be both independent and sharded the same way."""
    raise ShardedModelError(
        f"copy.deepcopy of a sharded model or module ({name or type(module).__name__}) is not "
        "supported: its parameters are shards bound to a process group and to graphshard's "
        "state for the model. Copy the model before sharding it (twin = "
        "copy.deepcopy(model), or an EMA's ema = torch.optim.swa_utils.AveragedModel(model), "
        "then graphshard.shard() each: the model and ema.module), or shard a freshly built "
        "model and load this one's weights into it: set_model_state_dict(twin, "
        "get_model_state_dict(model)) from torch.distributed.checkpoint.state_dict."
    )


def _refuse_pickle(module: nn.Module, protocol: int = 2, name: str = "") -> None:
    """``torch.save(model)`` (pickling the module, not its state dict): the per-instance
    classes, the hooks and the process group it is bound to cannot be pickled, and torch's
    own error names one of graphshard's hooks; this one says what to save instead."""
    raise ShardedModelError(
        f"torch.save or pickle of a sharded model or module ({name or type(module).__name__}) "
        "is not "
        "supported: it is bound to its process group and graphshard's state for the model. "
        "Save its state instead: torch.distributed.checkpoint.save(get_model_state_dict(model), "
        "...) for sharded checkpoints, or a full state dict (get_model_state_dict(model, "
        "options=StateDictOptions(full_state_dict=True, cpu_offload=True))) saved with "
        "torch.save on rank 0; rebuild the model, shard() it and load the state into it."
    )


# What ``nn.Module.share_memory`` applies to every tensor (torch 2.11 to 2.14): a lambda of
# that method, so the module whose ``_apply`` receives it (the model's root or a submodule,
# reached by the recursion) can tell.
_SHARE_MEMORY = "Module.share_memory.<locals>.<lambda>"


def _shares_memory(fn: Any) -> bool:
    return getattr(fn, "__qualname__", None) == _SHARE_MEMORY


def _refuse_share_memory(module: nn.Module) -> None:
    """``share_memory()`` reaching a sharded module: refused before any parameter is touched,
    since ``Tensor.share_memory_()`` of a DTensor crashes the process."""
    raise ShardedModelError(
        f"share_memory() of a sharded model or module ({type(module).__name__}) is not "
        "supported: torch's DTensor crashes the process (a segmentation fault) in "
        "Tensor.share_memory_() (torch 2.11 to 2.14), and its parameters are shards that "
        "belong to their ranks anyway. To hand the weights to other processes, share a plain "
        "copy: load a full state dict (get_model_state_dict(model, options=StateDictOptions("
        "full_state_dict=True)) from torch.distributed.checkpoint.state_dict) into an "
        "unsharded model and call share_memory() on that."
    )


def _same_layout(old: nn.Parameter, new: Any) -> bool:
    """Whether ``new`` can stand in for the sharded ``old``: a DTensor Parameter of the same
    mesh, placements, shape and dtype (what ``load_state_dict(assign=True)`` and torch's
    ``set_model_state_dict`` on a meta model put there)."""
    return (
        isinstance(new, nn.Parameter)
        and isinstance(new, DTensor)
        and isinstance(old, DTensor)
        and new.device_mesh == old.device_mesh
        and tuple(new.placements) == tuple(old.placements)
        and new.shape == old.shape
        and new.dtype == old.dtype
    )


# Called with a parameter's record whenever its parameter may hold new storage (a swap, a
# replacement): what is built on that storage follows (graphshard.api.local_inputs).
_STORAGE_LISTENERS: list[Callable[[Any], None]] = []


def on_new_storage(listener: Callable[[Any], None]) -> None:
    """Call ``listener(record)`` from now on whenever a sharded parameter may have been given
    new storage by ``.to()``, ``to_empty()`` or an accepted replacement (once per listener)."""
    if listener not in _STORAGE_LISTENERS:
        _STORAGE_LISTENERS.append(listener)


def _new_storage(entry: Any) -> None:
    record_wrapper(entry)
    for listener in _STORAGE_LISTENERS:
        listener(entry)


def _follow(module: nn.Module, pname: str, entry: Any, old: nn.Parameter, new: nn.Parameter):
    """Re-point the sharding record from ``old`` to ``new``, keeping tied parameters tied."""
    if entry.param is old:  # the first owner to change: the record follows
        carry_grad_hooks(old, new)
        entry.param = new
        _new_storage(entry)
    module._parameters[pname] = entry.param  # a tied owner shares that one Parameter


# --------------------------------------------------------------------------- load_state_dict


class _PlainTensorRefusal:
    """The root's ``load_state_dict`` pre-hook (:func:`_refuse_plain_tensors` on its model's
    state). It is the first thing holding that state which ``copy.deepcopy`` of the root
    reaches, so it refuses the copy with the message that says what to do instead."""

    def __init__(self, state: Any, root_class: str) -> None:
        self.state = state
        self.root_class = root_class

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        _refuse_plain_tensors(self.state, module, state_dict, prefix)

    def __deepcopy__(self, memo: dict) -> None:
        _refuse_deepcopy(self, memo, self.root_class)


_COPY_REFUSAL_ATTR = "_graphshard_copy_refusal"


class _CopyRefusal:
    """First in the root's instance dict: what ``pickle`` (``torch.save(model)``) and
    ``copy.deepcopy`` reach first in a root whose class is its own (one without sharded
    parameters of its own, such as a Hugging Face ``...ForCausalLM``), so that they refuse
    with what to do instead of failing on one of graphshard's hooks."""

    def __init__(self, root_class: str) -> None:
        self.root_class = root_class

    def __reduce_ex__(self, protocol: int) -> None:
        _refuse_pickle(self, protocol, self.root_class)

    def __deepcopy__(self, memo: dict) -> None:
        _refuse_deepcopy(self, memo, self.root_class)


def _first_in_dict(module: nn.Module, name: str, value: Any) -> None:
    """Set ``module.name = value`` as the first entry of its instance dict (the order in
    which pickle and deepcopy visit it)."""
    entries = dict(module.__dict__)
    module.__dict__.clear()
    module.__dict__[name] = value
    module.__dict__.update(entries)


def _refuse_plain_tensors(state: Any, module, state_dict, prefix, *args: Any) -> None:
    for entry in state.params:
        if len(entry.full_shape) == 0:  # replicated: a plain 0-D value is the full value
            continue  # (torch's broadcast_from_rank0 hands scalars over as plain tensors)
        for name in entry.names:
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                raise ShardedModelError(
                    f"load_state_dict() got a plain tensor {tuple(value.shape)} for {name!r}, "
                    "whose parameter is a DTensor sharded across ranks. Load full tensors "
                    "with torch.distributed.checkpoint.state_dict.set_model_state_dict(model, "
                    "sd, options=StateDictOptions(full_state_dict=True)) (add "
                    "broadcast_from_rank0=True when only rank 0 holds them); sharded ones "
                    "come from model.state_dict() or torch.distributed.checkpoint."
                )


# --------------------------------------------------------------------------- optimizers


_STATES: list[weakref.ref] = []  # the sharding records of every sharded model


def _stepped_by(optimizer: torch.optim.Optimizer) -> tuple[list[weakref.ref], list[weakref.ref]]:
    """Weak references to the sharding records whose parameters ``optimizer`` holds, and to
    the records of those parameters themselves."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    _STATES[:] = [ref for ref in _STATES if ref() is not None]
    states, entries = [], []
    for ref in _STATES:
        mine = [weakref.ref(e) for e in ref().params if id(e.param) in held]
        if mine:
            states.append(ref)
            entries.extend(mine)
    return states, entries


def _count_step(optimizer: torch.optim.Optimizer) -> None:
    """One more optimizer step on each model whose parameters ``optimizer`` holds (none if
    one of those parameters was assigned new data: :mod:`graphshard.safety.data_assignment`)."""
    entries = [ref() for ref in optimizer.__dict__["_graphshard_entries"]]
    refuse_data_assignments([e for e in entries if e is not None])
    for ref in optimizer.__dict__["_graphshard_states"]:
        state = ref()
        if state is not None:
            state.optimizer_steps += 1


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The global optimizer step pre-hook: an optimizer that holds no sharded parameter (as
    of its parameter count when last checked) passes here, in a form Dynamo traces without a
    graph break; any other goes to :func:`_check_sharded_optimizer`."""
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if (optimizer.__dict__.get("_graphshard_checked") == count
            and not optimizer.__dict__["_graphshard_states"]):
        return None
    _check_sharded_optimizer(optimizer, count)
    return None


# Run as Python even inside a compiled ``optimizer.step`` (torch's ``torch.compile(opt.step)``
# recipe; one graph break before the step): traced, Dynamo wrote the weak references of
# ``_STATES`` back as their referents, and the next step raised "'ShardState' object is not
# callable"; and its counts and checks must happen at every step, not once at tracing.
@torch._dynamo.disable
def _check_sharded_optimizer(optimizer: torch.optim.Optimizer, count: int) -> None:
    if optimizer.__dict__.get("_graphshard_checked") == count:
        _count_step(optimizer)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = getattr(p, "_graphshard_replaced", None)
            if name is not None:
                raise ShardedModelError(
                    f"This {type(optimizer).__name__} holds parameter {name!r} from before "
                    "graphshard.shard(), which replaced it with the local shard: stepping it "
                    "would train nothing. Build the optimizer after sharding: "
                    "model = graphshard.shard(model); "
                    f"opt = torch.optim.{type(optimizer).__name__}(model.parameters(), ...)."
                )
    states, entries = _stepped_by(optimizer)
    optimizer.__dict__["_graphshard_checked"] = count
    optimizer.__dict__["_graphshard_states"] = states
    optimizer.__dict__["_graphshard_entries"] = entries
    _count_step(optimizer)


_HOOKS: list[Any] = []  # torch's handle of the step pre-hook, once installed


def _watch_optimizers() -> None:
    """Install the step pre-hook (once per process) when the first model is sharded: a
    process that imports graphshard and shards nothing keeps torch's optimizer steps as
    they were (a compiled one included)."""
    if not _HOOKS:
        _HOOKS.append(register_optimizer_step_pre_hook(_check_optimizer))


def refuse_unsharded_parameters(example_inputs: Any, world_size: int) -> None:
    """Refuse a graph that trains plain (unsharded) parameters on more than one rank.

    graphshard synchronises gradients only of the parameters ``shard()`` made: a model
    compiled with the graphshard backend but never sharded (or sharded only in part) would
    train every rank on its own gradients, and the ranks' weights would drift apart with no
    error. At world 1 there is nothing to synchronise, and the plain model compiles.
    Frozen parameters (``requires_grad=False``) need no synchronisation and pass.
    """
    if world_size <= 1:
        return
    plain = [x for x in example_inputs if isinstance(x, nn.Parameter)
             and not isinstance(x, DTensor) and x.requires_grad]
    if plain:
        shapes = ", ".join(str(tuple(p.shape)) for p in plain[:4])
        raise ShardedModelError(
            f"torch.compile(backend='graphshard') got {len(plain)} trainable parameter(s) that "
            f"are not sharded (shapes {shapes}{', ...' if len(plain) > 4 else ''}) on "
            f"{world_size} ranks: their gradients would never be synchronised, and the ranks' "
            "weights would drift apart. Call graphshard.shard(model) on the root module "
            "before torch.compile (shard() once, on the root: it shards every parameter), "
            "after any change to its modules (a layer replaced after shard() stays plain), "
            "or freeze those parameters (requires_grad_(False))."
        )
