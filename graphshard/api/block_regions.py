"""Each distinct block of the model compiled once, with the step's schedule kept.

graphshard compiles the whole training step as one graph, which is what lets it bucket and
prefetch every gather across block boundaries, but Inductor's work then grows with depth:
every one of 80 identical layers is lowered, scheduled and code-generated on its own.

Here each block of the main ``ModuleList`` / ``Sequential`` / ``ModuleDict`` (the one
:func:`graphshard.shard` buckets by) runs, under ``torch.compile``, as a call to one
``torch.compiler.nested_compile_region``:

- the block's parameters are read *outside* the region, through the usual ``unshard``
  markers, and passed in as its first operands; inside, each attribute read returns the
  operand (:data:`REGION_PARAMS_ATTR`). The step graph so keeps every marker, and the
  passes bucket, prefetch and reshard exactly as before (block k+1's gather under block k);
- the region's body is pure compute. Dynamo traces one block of each kind and stamps it out
  for the others (torch 2.13; 2.11 traces each call, and so does 2.13 for a block that
  returns a tensor it was given as it is, as T5's do), and identical bodies become one
  ``invoke_subgraph`` subgraph, which AOTAutograd partitions and Inductor
  compiles once per distinct block (another shape, dtype or module gets its own);
- the backend partitions each region's joint graph with
  :func:`graphshard.passes.regions.partition_region`, and the joint pass
  ``rewire_region_passthrough`` reads the parameters the region saves as its operands, so
  resharding stays true: the backward gathers them again rather than keeping them.

Eagerly, and for blocks this cannot serve (a lone layer, a block holding buffers such as
BatchNorm's running statistics, tensor-parallel parameters, an instance-level ``forward``),
the block runs as it always did, inlined in the step graph. ``graphshard.shard(...,
compile_blocks_once=False)`` turns it off.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import torch
from torch import nn

from graphshard._torch_version import installed_torch_version
from graphshard.api.bucket_storage import place as storage_place
from graphshard.api.bucket_storage import register_storage_slots
from graphshard.api.forward_depth import (
    COMPILE_REGION_MARK,
    DEPTH_HOOK_ATTR,
    OWN_FORWARD_ATTR,
    forward_in_place_of,
    mark_forward_hook,
)
from graphshard.api.hop_side_effects import (
    changes_keep_no_tensor,
    tensors_may_escape,
    unchecked_side_effect,
)
from graphshard.api.local_inputs import LOCAL_INDEX_ATTR, trains
from graphshard.passes.markers import UNSHARD, GradSync
from graphshard.records import ROOT_STATES
from graphshard.safety.guards import refuse_copies
from graphshard.safety.region_compare import region_compare_tolerates_unused_inputs_in_this_process
from graphshard.safety.region_donation import regions_donate_no_inputs_in_this_process
from graphshard.safety.region_offsets import region_offsets_counted_once_in_this_process

__all__ = ["REGION_PARAMS_ATTR", "BlockInlinedWarning", "install_block_regions", "region_forward"]

# On a module inside a block while its region is traced: parameter name -> gathered tensor.
REGION_PARAMS_ATTR = "_graphshard_region_params"
# On a served block: its class's own ``forward`` (a function in the instance's dict, which
# Dynamo's tags cover, where an attribute of the class read through it would be guarded at
# every step).
_BLOCK_FORWARD = "_graphshard_block_forward"
# More than any model has blocks: Dynamo raises when a region's reuse entries exceed this.
_MAX_REUSE_ENTRIES = 1 << 20


def _block_body(block: nn.Module, n_params: int, n_args: int, *operands: Any) -> Any:
    """What a region runs: the block's own forward (its attribute reads return the first
    ``n_params`` operands). The operands are flat, with the keyword arguments' names among
    them as strings, so Dynamo fingerprints them without tracing a pytree flatten at every
    block."""
    args = operands[n_params:n_params + n_args]
    keywords = operands[n_params + n_args:]
    half = len(keywords) // 2
    kwargs = dict(zip(keywords[:half], keywords[half:], strict=True))
    return _operands_taken_out(block._graphshard_block_forward(block, *args, **kwargs),
                               operands)


# Where an operand taken out of a region's output stood when it was the whole output (else
# its position in the output tuple).
_WHOLE_OUTPUT = -1
# The last item of a region's output whose operands were taken out: (output, taken, this).
_TAKEN_OUT = "graphshard: operands taken out of a region's output"


def _operands_taken_out(out: Any, operands: tuple) -> Any:
    """``out``, or where it returns one of ``operands`` as it is: ``(out without them,
    where they stood, _TAKEN_OUT)``.

    ``invoke_subgraph`` may not return one of its inputs (input-to-output aliasing): a block
    that hands on a tensor it was given, as each of T5's blocks returns the position bias the
    first one computed, broke the step graph at every block (the step then ran in pieces,
    nothing overlapped across them). Such an output, the whole output or an item of a plain
    tuple, leaves the region as None and :func:`_operands_put_back` returns the operand
    itself outside, as the block does eagerly. Dynamo stamps out only a body whose output is
    tensors: such a block is traced at each call (its identical bodies still become one
    subgraph, compiled once); every other block's output is left as it is."""
    if isinstance(out, torch.Tensor):
        index = _operand_index(out, operands)
        return out if index is None else (None, ((_WHOLE_OUTPUT, index),), _TAKEN_OUT)
    if type(out) is not tuple:
        return out
    taken = []
    for position, item in enumerate(out):
        index = _operand_index(item, operands)
        if index is not None:
            taken.append((position, index))
    if not taken:
        return out
    positions = dict(taken)
    masked = tuple(None if i in positions else item for i, item in enumerate(out))
    return masked, tuple(taken), _TAKEN_OUT


def _operand_index(item: Any, operands: tuple) -> int | None:
    """The index of the operand ``item`` is, if it is a tensor among ``operands``."""
    if isinstance(item, torch.Tensor):
        for index, operand in enumerate(operands):
            if item is operand:
                return index
    return None


def _operands_put_back(out: Any, operands: tuple) -> Any:
    """The block's output as it returned it: each operand :func:`_operands_taken_out` took out
    back in its place."""
    if not (type(out) is tuple and len(out) == 3 and isinstance(out[2], str)
            and out[2] == _TAKEN_OUT):
        return out
    masked, taken, _ = out
    positions = dict(taken)
    if _WHOLE_OUTPUT in positions:
        return operands[positions[_WHOLE_OUTPUT]]
    return tuple(operands[positions[i]] if i in positions else item
                 for i, item in enumerate(masked))


# [the region], filled at install: traced code reads a list, never calls the cached factory
_REGION: list[Any] = []


@functools.cache
def _region() -> Any:
    """The compile region every block runs in (made when blocks are installed, outside
    tracing: Dynamo only calls it). Identical bodies share one subgraph; others get theirs."""
    extra = {}
    if "max_reuse_entries" in inspect.signature(torch.compiler.nested_compile_region).parameters:
        extra["max_reuse_entries"] = _MAX_REUSE_ENTRIES
    return torch.compiler.nested_compile_region(_block_body, **extra)


def _set_region_params(owners: list[nn.Module], gathered: list[dict]) -> None:
    for module, params in zip(owners, gathered, strict=True):
        object.__setattr__(module, REGION_PARAMS_ATTR, params)


def _clear_region_params(owners: list[nn.Module]) -> None:
    for module in owners:  # back to the value it always holds outside a region
        object.__setattr__(module, REGION_PARAMS_ATTR, None)


# What gathering a block's parameters reads, fixed by ``shard()``: its model's index into
# ``ROOT_STATES`` and, per submodule holding sharded parameters, (path from the block,
# ((parameter name, its ``unshard`` arguments as a plain tuple, its record's index for
# ``local_inputs.trains``, its place in its bucket's buffer: ``bucket_storage.place``, its
# bucket's index), ...)). A served block holds the index of its entry.
_Reads = tuple[int, tuple[tuple[tuple[str, ...],
                                tuple[tuple[str, tuple, int, int, int], ...]], ...]]
_BLOCK_READS: list[_Reads] = []
_READS_ATTR = "_graphshard_block_reads"
# On a served block: bucket index -> the bucket's flat buffer (or None), for every bucket its
# parameters are in (``bucket_storage``). The block's reads take the buffer from here, one
# place per bucket: read from each submodule's own dict, the one buffer would reach Dynamo
# through several sources, and torch 2.14 marks a tensor guarded through several sources
# (an aliasing guard) as not skippable, and with it the block.
_STORAGES_ATTR = "_graphshard_block_storages"


def _param_layout(block: nn.Module) -> tuple[tuple[tuple[str, ...], dict, dict], ...]:
    return tuple((tuple(path.split(".")) if path else (), specs, sub.__dict__[LOCAL_INDEX_ATTR])
                 for path, sub in block.named_modules()
                 if (specs := sub.__dict__.get("_graphshard_specs")))


def _register_reads(state_index: int, layout: tuple) -> int:
    reads = (state_index, tuple((path, tuple((name, tuple(spec), local[name],
                                              storage_place(entry), entry.bucket)
                                             for name, (entry, spec) in specs.items()))
                                for path, specs, local in layout))
    _BLOCK_READS.append(reads)
    return len(_BLOCK_READS) - 1


@torch.compiler.assume_constant_result
def _block_reads(index: int) -> _Reads:
    """A block's entry of ``_BLOCK_READS``: Dynamo takes it as a constant behind one guard
    (on the index), instead of tracing and guarding a walk over every submodule and, per
    parameter, its arguments and its bookkeeping (several guards per parameter, built at
    every compile and evaluated at every step)."""
    return _BLOCK_READS[index]


def _gather_block_params(block: nn.Module) -> tuple[list[nn.Module], list[torch.Tensor]]:
    """Read every parameter of ``block`` (an ``unshard`` marker each, in the step graph) and
    leave the results where the attribute reads inside the region find them. With nothing
    to fold in (the model never used ``no_sync``, gradients synced), each read is what the
    sharded attribute would return, without its per-parameter lookups; otherwise it goes
    through the attribute, which routes the gradient. (One loop, no helper calls: Dynamo
    traces this for every block.)"""
    state_index, owner_reads = _block_reads(block._graphshard_block_reads)
    storages = block._graphshard_block_storages
    state = ROOT_STATES[state_index]
    plain = state.sync == GradSync.FULL and not state.folds_held_back
    owners, gathered, flat = [], [], []
    for path, reads in owner_reads:
        sub = block
        for name in path:
            sub = getattr(sub, name)
        params = {}
        for name, spec, local, place, bucket in reads:
            if plain:
                stored = None
                if trains(local):  # a plain tensor in place of the DTensor (api.local_inputs)
                    shard = sub._graphshard_locals[name]
                    stored = storages[bucket]  # api.bucket_storage, or None
                else:
                    shard = sub._parameters[name].to_local()
                if shard.is_meta:  # the attribute raises the error that says what to do
                    full = getattr(sub, name)
                elif stored is not None:
                    full = UNSHARD(shard, *spec, GradSync.FULL, storage=stored,
                                   storage_index=place)
                elif shard.requires_grad:
                    full = UNSHARD(shard, *spec, GradSync.FULL)
                else:
                    full = UNSHARD(shard, *spec)
            else:
                full = getattr(sub, name)
            params[name] = full
            flat.append(full)
        owners.append(sub)
        gathered.append(params)
    unchecked_side_effect(_set_region_params, owners, gathered)
    return owners, flat


class BlockInlinedWarning(UserWarning):
    """A block that ``compile_blocks_once`` would compile once was compiled inline instead,
    because of an argument it was called with (the message names it and what to change)."""


# Operands a region may take: values that its body cannot change from inside. A tuple
# qualifies when everything in it does.
_VALUE_TYPES = (torch.Tensor, bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                torch.memory_format, torch.layout, type(None), type(Ellipsis))


def _is_value(operand: Any) -> bool:
    if isinstance(operand, tuple):
        for item in operand:
            if not _is_value(item):
                return False
        return True
    return isinstance(operand, _VALUE_TYPES)


def _object_operand(args: tuple, kwargs: dict) -> tuple[str, str] | None:
    """The first argument of a block call that is not a value (a list, a dict, any other
    object), as (which argument, its type's name); None when all are values.

    A region's body may change such an object (a Hugging Face ``DynamicCache`` stores each
    layer's keys and values in it), and torch's ``invoke_subgraph`` cannot replay every such
    change in the step graph: a tensor stored there that aliases one of the region's inputs
    or outputs ends the compile with an internal Dynamo error (``RuntimeError: An
    intermediate tensor ... aliases an input or output``; every torch from 2.11 to 2.14,
    e.g. Mistral's sliding-window cache layers storing ``tensor.to(device)``). A block called
    with one therefore runs inline, as with ``compile_blocks_once=False``."""
    for position, operand in enumerate(args):
        if not _is_value(operand):
            return f"argument {position + 1}", type(operand).__name__
    for name, operand in kwargs.items():
        if not _is_value(operand):
            return f"keyword argument {name!r}", type(operand).__name__
    return None


def _object_reason(where: str, type_name: str) -> str:
    return (f"their {where} is a {type_name}, an object the block's body could change, which "
            f"torch's compile regions cannot always replay. To compile each kind of block "
            f"once, call the blocks with tensors and plain values only (for a Hugging Face "
            f"model in training, pass use_cache=False, or set model.config.use_cache = False, "
            f"so that no cache object reaches them)")


_CHECKPOINT_REASON = (
    "they run inside torch.utils.checkpoint under dynamic shapes, where torch 2.14's reuse of "
    "one block's compile region for the next fails (InternalTorchDynamoError: KeyError: s0; "
    "docs/torch-versions.md). To compile each kind of block once there, pad batches to one "
    "length or pass dynamic=False to torch.compile")


@torch.compiler.assume_constant_result
def _in_checkpoint_under_dynamic_shapes() -> bool:
    """Whether Dynamo is now tracing the body of a ``torch.utils.checkpoint`` in a compile
    with symbolic sizes, on torch 2.14 or newer. There Dynamo's reuse of an identical block's
    region looks up a length symbol it had replaced by an equal one (the attention mask's:
    a Hugging Face Llama under ``gradient_checkpointing_enable()``, at the recompile for a
    second length), which reading the operands' sizes (:func:`_bind_sizes`) cannot bind, and
    the compile fails (``InternalTorchDynamoError: KeyError: s0``; 2.13 compiles it). Such a
    block runs inline. Called by Dynamo while it traces; False where its internals differ."""
    if installed_torch_version() < (2, 14):
        return False
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        output = InstructionTranslator.current_tx().output
        tracer = output.current_tracer
        inside = False
        while tracer.parent is not None:
            inside = inside or "checkpoint" in str(getattr(tracer, "description", ""))
            tracer = tracer.parent
        return inside and bool(output.shape_env.var_to_val)
    except (AttributeError, AssertionError, ImportError):
        return False


@torch.compiler.assume_constant_result
def _compiled_by_plain_inductor() -> bool:
    """Whether Dynamo is now tracing for Inductor itself (``torch.compile(model)``, or
    ``backend="inductor"``) rather than for graphshard's backend, which runs Inductor after
    its passes. Inductor does not know that a region's saved output may share its operand's
    storage (a block under ``h = h + block(h)`` saves a view of ``h``), writes the sum into
    that storage, and the backward reads the sum (torch 2.11 to 2.14; graphshard's backend
    rewires such outputs, ``passes/regions.py``, ``tests/test_region_aliases.py``). Alone it
    gave a tiny Llama's embedding a gradient 1459 off one process's, a small MLP's first
    layer of each block gradients at cosine 0.95 (aot_eager is exact). So there the blocks
    run inline, which trains exactly. Called by Dynamo while it traces; False where its
    internals differ."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        backend = InstructionTranslator.current_tx().output.compiler_fn
    except (AttributeError, AssertionError, ImportError):
        return False
    for _ in range(8):  # Dynamo's wrappers, torch.compile's, then the backend itself
        if backend is None:
            return False
        if (type(backend).__name__ == "_TorchCompileInductorWrapper"
                or getattr(backend, "__name__", None) == "compile_fx"):
            return True
        backend = (getattr(backend, "_torchdynamo_orig_backend", None)
                   or getattr(backend, "compiler_fn", None))
    return False


@torch.compiler.assume_constant_result
def _note_plain_inductor(block_class: str) -> bool:
    """Warn, once per block class in a process, that the sharded model is compiled by
    Inductor itself. Called by Dynamo while it traces, with constants."""
    _warn_once(("plain inductor", block_class),
               "graphshard: the sharded model is compiled by Inductor itself (torch.compile("
               "model) without backend='graphshard'): each parameter is gathered and its "
               "gradient reduced on its own inside the graph, with no bucketing, prefetch or "
               f"overlap, and the {block_class} blocks run inline, each compiled on its own "
               "(Inductor lowers graphshard's block regions wrongly outside its backend). "
               "Compile with torch.compile(model, backend='graphshard').")
    return True


def _inline_reason(args: tuple, kwargs: dict) -> str | None:
    """Why a block call must run inline rather than as its region, or None."""
    held = _object_operand(args, kwargs)
    if held is not None:
        return _object_reason(*held)
    if _in_checkpoint_under_dynamic_shapes():
        return _CHECKPOINT_REASON
    return None


_INLINED_NOTED: set[tuple[str, str]] = set()


def _warn_once(key: tuple[str, str], message: str) -> None:
    """A :class:`BlockInlinedWarning`, once per ``key`` in a process."""
    if key not in _INLINED_NOTED:
        _INLINED_NOTED.add(key)
        warnings.warn(message, BlockInlinedWarning, stacklevel=3)


@torch.compiler.assume_constant_result
def _note_inlined(block_class: str, reason: str) -> bool:
    """Warn, once per (block class, reason) in a process, that a block runs inline
    (:func:`_inline_reason`). Called by Dynamo while it traces, with constants."""
    _warn_once((block_class, reason),
               f"graphshard: {block_class} blocks are compiled inline, each on its own, not "
               f"once per kind (compile_blocks_once): {reason}. The step is the same; only "
               f"its compile time grows with depth.")
    return True


def _bind_sizes(operands: Any) -> None:
    """Read the sizes of every tensor in ``operands`` (tuples included) where the call is
    traced. Under dynamic shapes this binds their symbols in the tracer now tracing: inside
    a ``torch.utils.checkpoint`` body, Dynamo's reuse of an identical block's traced region
    looks its size symbols up in that body's tracer, where nothing had bound them, and the
    compile failed with ``InternalTorchDynamoError: KeyError: s0`` (torch 2.13 and 2.14,
    plain ``nested_compile_region`` too). Static sizes trace to nothing."""
    for operand in operands:
        if isinstance(operand, torch.Tensor):
            operand.size()
        elif isinstance(operand, tuple):
            _bind_sizes(operand)


def region_forward(self: nn.Module, /, *args: Any, **kwargs: Any) -> Any:
    """A block's ``forward``: as a compile region while Dynamo traces, else as written (and
    inline where the region could not serve the call: :func:`_inline_reason`)."""
    forward = self._graphshard_block_forward
    if not torch.compiler.is_compiling():
        return forward(self, *args, **kwargs)
    if _compiled_by_plain_inductor():
        _note_plain_inductor(type(self).__name__)
        return forward(self, *args, **kwargs)
    reason = _inline_reason(args, kwargs)
    if reason is not None:
        _note_inlined(type(self).__name__, reason)
        return forward(self, *args, **kwargs)
    _bind_sizes(args)
    _bind_sizes(tuple(kwargs.values()))
    marked_before = tensors_may_escape()
    owners, flat = _gather_block_params(self)
    operands = (*flat, *args, *kwargs, *kwargs.values())
    try:
        return _operands_put_back(_REGION[0](self, len(flat), len(args), *operands), operands)
    finally:
        unchecked_side_effect(_clear_region_params, owners)
        # the gathered parameters were stored, and are taken back: no tensor escaped the
        # body this may run in (a checkpoint's), which must not return every intermediate
        # (graphshard.api.hop_side_effects)
        changes_keep_no_tensor(marked_before)


@functools.cache
def _region_class(cls: type) -> type:
    region_class = type(cls.__name__, (cls,),
                        {"forward": forward_in_place_of(region_forward, cls.forward)})
    refuse_copies(region_class)  # a block of a sharded model, like its sharded modules
    return region_class


def _unmarked(forward: Any) -> Any:
    """``forward`` without the user's own ``torch.compiler.nested_compile_region`` marks.

    A block class whose ``forward`` the user already made a compile region asks for what
    graphshard's region does (the block compiled once); left marked, it would be a region
    inside graphshard's, which Dynamo cannot trace ("Freevar has no source": the inner
    region reads the block's parameters, which inside graphshard's region are its operands).
    The same holds for any module inside the block (:func:`_unmark_inside`)."""
    while hasattr(forward, COMPILE_REGION_MARK):
        forward = getattr(forward, COMPILE_REGION_MARK)
    return forward


@functools.cache
def _unmarked_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``forward`` is its own without the compile-region mark."""
    return type(cls.__name__, (cls,), {"forward": _unmarked(cls.forward),
                                       "__module__": cls.__module__})


def _unmark_inside(block: nn.Module) -> None:
    """Take the user's ``nested_compile_region`` marks off the modules inside ``block``
    (an attention or MLP class marked to be compiled once): inside graphshard's region, whose
    body is compiled once per distinct block anyway, they run inline. Where the mark sits:
    the module's own ``forward`` kept for graphshard's counting class
    (:mod:`graphshard.api.forward_depth`), or the class (then this instance gets a subclass
    without it; the class itself, and its instances outside the blocks, keep it). torch
    marks functions, not bound methods, so an instance's own ``forward`` carries none."""
    for sub in block.modules():
        own = sub.__dict__.get(OWN_FORWARD_ATTR)
        if own is not None:
            sub.__dict__[OWN_FORWARD_ATTR] = _unmarked(own)
        elif sub is not block and hasattr(type(sub).forward, COMPILE_REGION_MARK):
            sub.__class__ = _unmarked_class(type(sub))


def _holds_persistent_buffers(block: nn.Module) -> bool:
    """Whether ``block`` holds a persistent buffer: model state that training may update
    (BatchNorm's running statistics), which a region cannot (``invoke_subgraph`` takes no
    in-place update of its inputs in training). Non-persistent buffers are caches computed
    at init and only read (torchtitan's rotary tables, one per attention): a region takes
    them as operands."""
    return any(name not in sub._non_persistent_buffers_set
               for sub in block.modules() for name, buf in sub._buffers.items()
               if buf is not None)


def _servable(block: nn.Module) -> bool:
    """Whether ``block`` can run as a region: a composite module (a lone layer gains
    nothing), without persistent buffers (:func:`_holds_persistent_buffers`), tensor-parallel
    parameters or an instance-level ``forward``."""
    if "forward" in block.__dict__ or next(block.children(), None) is None:
        return False
    if _holds_persistent_buffers(block):
        return False
    for sub in block.modules():
        for entry, _ in (sub.__dict__.get("_graphshard_specs") or {}).values():
            if entry.tp is not None:  # tensor-parallel parameters are DTensors inside
                return False
    return True


def _graph_breaks_fall_back() -> None:
    """Let a graph break inside a region fall back the way one inside a ``checkpoint`` body
    does (Dynamo splits the block's code into graphs), instead of Dynamo's hard error for
    ``nested_compile_region`` ("doesn't work unless it is captured completely"): a block that
    graph-breaks then trains as it would inlined. This is Dynamo's own switch for the
    higher-order op, and it holds for the whole process: a user's own region with a graph
    break then falls back too, instead of raising."""
    # (defined here on torch 2.11, re-exported here from its own module on 2.13)
    from torch._dynamo.variables.higher_order_ops import InvokeSubgraphHigherOrderVariable

    InvokeSubgraphHigherOrderVariable._ALLOW_FALLBACK_TO_EAGER = True


_EAGER_ONLY_ATTR = "_graphshard_eager_only"


def _eager_only(hook: Any) -> Any:
    """``hook``, skipped while Dynamo traces (where it folds to ``return None``); one wrapper
    per hook, kept on the hook, so that every block calls the same function."""
    wrapper = getattr(hook, _EAGER_ONLY_ATTR, None)
    if wrapper is None:

        @mark_forward_hook  # a registered forward method still runs it
        def wrapper(*args: Any) -> Any:
            if torch.compiler.is_compiling():
                return None
            return hook(*args)

        setattr(hook, _EAGER_ONLY_ATTR, wrapper)
    return wrapper


# The keys graphshard's depth hooks get on a block's submodules (a user's hooks keep their
# handles' keys, which are positive).
_PRE_HOOK_KEY, _POST_HOOK_KEY = -1, -2


def _rekey_depth_hooks(hooks: dict, key: int, always_called: dict | None = None) -> None:
    """Swap graphshard's depth hook in ``hooks`` (a module's hook dict, in run order) for its
    eager-only wrapper under ``key``."""
    entries = list(hooks.items())
    hooks.clear()
    for old, hook in entries:
        if getattr(hook, DEPTH_HOOK_ATTR, False):
            if always_called is not None and always_called.pop(old, False):
                always_called[key] = True
            old, hook = key, _eager_only(hook)
        hooks[old] = hook


def _count_depth_eagerly_inside(block: nn.Module) -> None:
    """Let Dynamo trace an identical block once and stamp it out for the others.

    Inside a region every parameter read returns its operand, so the forward-depth count of
    the block's submodules is not needed while compiling, and its state change would make the
    body ineligible for Dynamo's reuse (a body with side effects is traced again at every
    call). Most submodules count in their class's ``forward``, which counts nothing while
    Dynamo traces (:mod:`graphshard.api.forward_depth`); one whose ``forward`` is an
    instance attribute counts with hooks. Those are skipped under tracing (eagerly nothing
    changes), and they sit under the same keys in every block: Dynamo guards a hook's key,
    and a handle's key differs from block to block."""
    for sub in block.modules():
        if sub is not block:
            _rekey_depth_hooks(sub._forward_pre_hooks, _PRE_HOOK_KEY)
            _rekey_depth_hooks(sub._forward_hooks, _POST_HOOK_KEY,
                               sub._forward_hooks_always_called)


def install_block_regions(blocks: list[nn.Module] | None, state_index: int
                          ) -> list[nn.Module]:
    """Make each block of ``blocks`` (the main ModuleList/Sequential/ModuleDict's children)
    of the model whose state is ``ROOT_STATES[state_index]`` run as a compile region under
    ``torch.compile``; returns the blocks that will."""
    if blocks is None or not hasattr(torch.compiler, "nested_compile_region"):
        return []
    _graph_breaks_fall_back()
    regions_donate_no_inputs_in_this_process()  # whichever backend compiles the regions
    region_offsets_counted_once_in_this_process()
    region_compare_tolerates_unused_inputs_in_this_process()
    _REGION[:] = [_region()]
    served: list[nn.Module] = []
    for block in blocks:
        if any(block is done for done in served):
            continue  # one block object at several depths: made a region once
        layout = _param_layout(block)
        if layout and _servable(block):
            _unmark_inside(block)
            block.__dict__[_BLOCK_FORWARD] = _unmarked(type(block).forward)
            block.__class__ = _region_class(type(block))
            block.__dict__[_READS_ATTR] = _register_reads(state_index, layout)
            storages = block.__dict__[_STORAGES_ATTR] = {}
            for _, specs, _ in layout:
                for entry, _ in specs.values():
                    register_storage_slots(entry, storages, entry.bucket)
            _count_depth_eagerly_inside(block)
            served.append(block)
    return served
