"""``shard()``: replace every parameter of a module by a DTensor sharded on dim 0.

Each parameter becomes an ``nn.Parameter`` wrapping a ``DTensor`` of the full shape, placed
``Shard(0)`` on the shard mesh (``(Replicate(), Shard(0))`` on an HSDP mesh; a 0-D
parameter is replicated); its local tensor is this rank's rows as ``torch.chunk`` lays them
out (``graphshard.passes.layout``). So ``parameters()``, optimizers, ``state_dict()``, DCP and
torch's utilities (``clip_grad_norm_``, ``numel()``, ``nn.init``) see sharded parameters with their
global shapes, and gradients arrive as DTensors with the same placements.

Attribute access (``self.weight``) goes through a per-instance subclass whose
``__getattr__`` returns, as with FSDP2, the sharded DTensor parameter outside the model's
forward (so a module's ``reset_parameters()`` initialises the shards) and
``unshard(param.to_local())`` inside it: eagerly that all-gathers, and under
``torch.compile`` it leaves a marker node that the passes lower into bucketed collectives
(:mod:`graphshard.api.param_reads`). Inside means: in a forward of the sharded root or of any
of its submodules (counted by :mod:`graphshard.api.forward_depth`), in a backward
(activation checkpointing recomputes there), or while Dynamo traces.

A model built on the meta device shards without allocating: each local tensor is a meta
tensor of this rank's rows, and ``to_empty(device=...)`` then allocates only those.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from graphshard.api import eager_kernels, random_init, step_prefetch  # noqa: F401  (kernels)
from graphshard.api.block_regions import install_block_regions
from graphshard.api.bucket_storage import store_buckets
from graphshard.api.forward_depth import track_forwards
from graphshard.api.functional_calls import watch_functional_calls
from graphshard.api.fused_optimizer_ops import run_fused_optimizers_locally
from graphshard.api.grad_norm_ops import run_grad_norm_ops_locally
from graphshard.api.local_inputs import register_locals
from graphshard.api.mixed_precision import MixedPrecision, install_casts
from graphshard.api.offload import (
    CPUOffload,
    buffers_to_device,
    keep_buffers_on_device,
    resolve_offload,
)
from graphshard.api.optimizer_state import keep_scalar_states_replicated
from graphshard.api.optimizer_steps import step_reducing_optimizers
from graphshard.api.param_reads import install_reads, register_state
from graphshard.api.reshard_settings import check_setting, resolve_settings
from graphshard.api.tensor_parallel import refuse_tp_after_shard, tp_mesh_of, tp_parameter
from graphshard.errors import (
    GraphshardNotImplementedError,
    GraphshardRuntimeError,
    GraphshardTypeError,
    GraphshardValueError,
)
from graphshard.passes.layout import Dim0Layout
from graphshard.passes.markers import GradSync, UnshardSpec, reshard_code
from graphshard.records import STATE_ATTR, ShardedParam, ShardState
from graphshard.safety import guards
from graphshard.safety.param_hooks import carry_grad_hooks

__all__ = [
    "shard", "ShardedParam", "ShardState", "shard_state", "is_sharded", "MixedPrecision",
    "placements", "sharded_parameter",
]

random_init.install()  # nn.init on CPU DTensors: the same values at any world size


def shard_state(module: nn.Module) -> ShardState:
    """The sharding record of a module passed to :func:`shard` (unwraps ``torch.compile``)."""
    module = getattr(module, "_orig_mod", module)
    state = getattr(module, STATE_ATTR, None)
    if state is None:
        raise GraphshardValueError(
            f"{type(module).__name__} is not sharded: call graphshard.shard(module) first."
        )
    return state


def is_sharded(module: nn.Module) -> bool:
    """True when ``module`` (or the module it wraps) was passed to :func:`shard`."""
    return hasattr(getattr(module, "_orig_mod", module), STATE_ATTR)


def _resolve_groups(mesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """The shard group and, for a 2-D (replicate, shard) mesh, the replica group."""
    if not dist.is_available() or not dist.is_initialized():
        raise GraphshardRuntimeError(
            "graphshard.shard() needs an initialised process group: call "
            "torch.distributed.init_process_group(...) first (torchrun sets the environment), "
            "or pass a DeviceMesh."
        )
    if mesh is None:
        return dist.group.WORLD, None
    ndim = getattr(mesh, "ndim", None)
    if ndim == 1:
        return mesh.get_group(), None
    if ndim == 2:
        return mesh.get_group(1), mesh.get_group(0)
    raise GraphshardValueError(
        f"graphshard.shard() takes a 1-D DeviceMesh (shard) or a 2-D one (replicate, shard) "
        f"for HSDP, got a mesh with {ndim} dimensions (shape {tuple(getattr(mesh, 'shape', ()))})"
        ". Pass init_device_mesh(device, (world_size,)) or init_device_mesh(device, "
        "(replicas, shards), mesh_dim_names=('replicate', 'shard')), or a slice of your mesh."
    )


def _default_device(group: dist.ProcessGroup) -> torch.device:
    """The device a group's collectives run on: cuda for NCCL, the CPU for gloo (and the
    fake group of offline tracing), else the current accelerator."""
    backend = str(dist.get_backend(group))
    if backend == "nccl":
        return torch.device("cuda")
    if backend in ("gloo", "fake") or torch.accelerator.current_accelerator() is None:
        return torch.device("cpu")
    return torch.accelerator.current_accelerator()


def _block_container(sub: nn.Module) -> bool:
    """A ModuleList or Sequential, or a ModuleDict of modules of one class (torchtitan keeps
    its layers in one, keyed by index; a dict of unlike parts, two towers say, is not a
    list of blocks)."""
    if isinstance(sub, (nn.ModuleList, nn.Sequential)):
        return True
    return isinstance(sub, nn.ModuleDict) and len({type(m) for m in sub.values()}) == 1


def _main_blocks(module: nn.Module) -> list[nn.Module] | None:
    """The model's blocks, in registration order; None if it has none.

    The main list is the block container (:func:`_block_container`) with most parameters
    and at least two children. Other containers of one block class (the encoder's layers
    beside the decoder's, a CNN's stages beside its largest) join it when they hold
    parameters of their own, outside every container already taken: an encoder left out
    was one bucket, gathered whole before its first layer."""
    sized = [(sum(p.numel() for p in sub.parameters()), index, sub)
             for index, sub in enumerate(module.modules())
             if _block_container(sub) and len(sub) >= 2]
    taken: list[tuple[int, nn.Module]] = []
    held: set[int] = set()
    for numel, index, sub in sorted(sized, key=lambda item: (-item[0], item[1])):
        ids = {id(p) for p in sub.parameters()}
        if numel == 0 or ids & held:
            continue  # no parameters, or shares a taken container's (holds or is inside one)
        if taken and len({type(child) for child in _children(sub)}) != 1:
            continue  # beside the main list, only a list of like blocks
        taken.append((index, sub))
        held |= ids
    if not taken:
        return None
    return [child for _, sub in sorted(taken, key=lambda item: item[0])
            for child in _children(sub)]


def _children(container: nn.Module) -> list[nn.Module]:
    return list(container.values() if isinstance(container, nn.ModuleDict) else container)


def _block_groups(blocks: list[nn.Module] | None) -> list[list[nn.Module]]:
    """The default groups: one per block of the main list, except a block whose parameters
    all belong to earlier blocks. A block object listed again (one layer applied at several
    depths, as in a looped or ALBERT-style model) or a block of shared parameters only adds
    no bucket: its parameters are gathered with the first block that holds them. (A block
    without parameters keeps its empty group, as it always has.)"""
    if blocks is None:
        return []
    groups, seen = [], set()
    for child in blocks:
        ids = {id(p) for p in child.parameters()}
        if not ids or ids - seen:
            groups.append([child])
        seen |= ids
    return groups


def _module_groups(module: nn.Module, buckets) -> list[list[nn.Module]]:
    if buckets is None:
        return _block_groups(_main_blocks(module))
    if isinstance(buckets, nn.ModuleDict):  # its modules, as the ModuleList's would be
        buckets = list(buckets.values())
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Iterable) or (
        isinstance(buckets, nn.Module) and not isinstance(buckets, (nn.ModuleList, nn.Sequential))
    ):
        raise GraphshardTypeError(
            f"graphshard.shard() option buckets must be None or a list of groups (a module or "
            f"a list of modules each), got {type(buckets).__name__}; for one group pass "
            f"buckets=[[module, ...]]"
        )
    groups = []
    for group in buckets:
        members = [group] if isinstance(group, nn.Module) else (
            list(group) if isinstance(group, Iterable) and not isinstance(group, str) else [group]
        )
        for m in members:
            if not isinstance(m, nn.Module):
                raise GraphshardTypeError(
                    f"buckets must be a list of modules or lists of modules, got {type(m).__name__}"
                )
        groups.append(members)
    return groups


def _assign_buckets(
    module: nn.Module, groups: Sequence[Sequence[nn.Module]], *, first_wins: bool = False
) -> tuple[dict[int, int], list[str]]:
    """Map id(param) -> bucket index: one bucket per group, then one for the rest. A parameter
    in two groups is an error, or with ``first_wins`` (the default groups, which the user did
    not choose) stays in the first."""
    names_of: dict[int, str] = {}  # a module under several names goes by its first
    for name, sub in module.named_modules(remove_duplicate=False):
        names_of.setdefault(id(sub), name or "<root>")
    bucket_of: dict[int, int] = {}
    bucket_names: list[str] = []
    for index, group in enumerate(groups):
        labels, holds = [], False
        for m in group:
            if id(m) not in names_of:
                raise GraphshardValueError(
                    f"buckets[{index}] holds a {type(m).__name__} that is not a submodule of "
                    f"the module being sharded."
                )
            labels.append(names_of[id(m)])
            for p in m.parameters():
                holds = True
                if bucket_of.setdefault(id(p), index) != index and not first_wins:
                    raise GraphshardValueError(
                        f"A parameter of {names_of[id(m)]} is in buckets[{bucket_of[id(p)]}] and "
                        f"buckets[{index}]: each parameter may belong to one bucket only."
                    )
        if not first_wins and not holds:
            held = " + ".join(labels) if labels else "nothing"
            raise GraphshardValueError(
                f"buckets[{index}] holds no parameters (it names {held}): each group must name "
                f"modules with parameters. Drop it, or name the modules whose parameters it "
                f"should gather together."
            )
        bucket_names.append("+".join(labels))
    rest = len(groups)
    bucket_names.append("<rest>")
    for p in module.parameters():
        bucket_of.setdefault(id(p), rest)
    if first_wins:
        bucket_of, bucket_names = _split_rest_around_blocks(module, bucket_of, bucket_names)
    return _split_by_dtype(module, bucket_of, bucket_names)


def _split_rest_around_blocks(
    module: nn.Module, bucket_of: dict[int, int], names: list[str]
) -> tuple[dict[int, int], list[str]]:
    """The default buckets: the parameters outside the blocks in two buckets, those
    registered before the first block's (an embedding) and those after (a final norm, an
    output head), as torchtitan shards its Llama (the embedding, each block, norm and output
    as their own units). One bucket for both, first read at the start of the forward,
    gathers the head's weights before any compute can hide them, and its reduce-scatter
    waits for the embedding's gradient, the last of the backward, so the head's gradient
    is sent exposed at the end. Apart, the head's gather runs under the blocks' forward and
    its reduce-scatter under their backward. Registration order stands in for the order of
    use, which ``shard()`` cannot see: where it misleads, each bucket is still gathered at
    its first read. Unchanged when the rest lies on one side only."""
    rest = len(names) - 1
    before, after, seen_block = [], [], False
    for p in module.parameters():
        if bucket_of[id(p)] != rest:
            seen_block = True
        else:
            (after if seen_block else before).append(id(p))
    if not before or not after:  # (nothing is "after" without a block before it)
        return bucket_of, names
    out = {key: index + 1 for key, index in bucket_of.items()}  # the blocks follow bucket 0
    out.update(dict.fromkeys(before, 0))
    out.update(dict.fromkeys(after, rest + 1))
    return out, ["<before blocks>", *names[:-1], "<after blocks>"]


def _split_by_dtype(
    module: nn.Module, bucket_of: dict[int, int], names: list[str]
) -> tuple[dict[int, int], list[str]]:
    """One dtype per bucket: a bucket's shards travel in one flat buffer, and concatenating
    pieces of two dtypes would promote one of them (a bf16 weight gathered as fp32)."""
    return _split_by_kind(module, bucket_of, names, lambda p: p.dtype,
                          lambda dtype: str(dtype).removeprefix("torch."))


def _split_by_kind(
    module: nn.Module, bucket_of: dict[int, int], names: list[str],
    kind_of: Callable[[nn.Parameter], Hashable], label: Callable[[Hashable], str],
) -> tuple[dict[int, int], list[str]]:
    """One kind per bucket: a group whose parameters are of several kinds (``kind_of``)
    becomes one bucket per kind, in first-seen order, named with ``[label(kind)]`` appended;
    bucket indices stay in group order and ``<rest>`` stays last. A bucket of one kind keeps
    its name."""
    kinds: dict[int, list[Hashable]] = {}
    for p in module.parameters():
        seen = kinds.setdefault(bucket_of[id(p)], [])
        if kind_of(p) not in seen:
            seen.append(kind_of(p))
    new_index: dict[tuple[int, Hashable], int] = {}
    new_names: list[str] = []
    for old, name in enumerate(names):
        found = kinds.get(old) or [None]
        for kind in found:
            new_index[(old, kind)] = len(new_names)
            new_names.append(name + (f"[{label(kind)}]" if len(found) > 1 else ""))
    return ({id(p): new_index[(bucket_of[id(p)], kind_of(p))] for p in module.parameters()},
            new_names)


def placements(mesh: DeviceMesh, full_shape: Sequence[int]) -> tuple:
    """Where a parameter of ``full_shape`` lives on ``mesh``: ``Shard(0)`` along the last
    (shard) dimension, replicated along the others; a 0-D parameter is replicated."""
    inner = Shard(0) if len(full_shape) else Replicate()
    return (*([Replicate()] * (mesh.ndim - 1)), inner)


def sharded_parameter(
    full: torch.Tensor, mesh: DeviceMesh, rank: int, offload: CPUOffload | None = None
) -> nn.Parameter:
    """``full`` as a Parameter wrapping a DTensor whose local tensor is ``rank``'s rows: a
    contiguous copy where ``full`` lives (as FSDP2 stores shards: a transposed parameter's
    rows are copied into row-major order), or with ``offload`` a host copy (pinned if asked;
    a meta ``full`` stays meta until ``to_empty``)."""
    layout = Dim0Layout(full.shape, mesh.size(mesh.ndim - 1))
    local = layout.local(full.detach(), rank)
    if offload is None or local.is_meta:
        local = local.clone(memory_format=torch.contiguous_format)
    else:
        local = local.to("cpu", copy=True).contiguous()
        if offload.pin_memory and not is_fake(local):  # a fake tensor has no memory to pin
            local = local.pin_memory()
    dtensor = DTensor.from_local(
        local, mesh, placements(mesh, full.shape), run_check=False, shape=full.shape,
        stride=torch.empty(full.shape, device="meta").stride(),
    )  # fmt: skip
    return nn.Parameter(dtensor, requires_grad=full.requires_grad)


def _check_shard_options(module: object, mesh: object, reshard_after_forward: object) -> None:
    """The types of :func:`shard`'s arguments, before anything is changed."""
    if not isinstance(module, nn.Module):
        raise GraphshardTypeError(
            f"graphshard.shard() takes an nn.Module, got {type(module).__name__}"
        )
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise GraphshardTypeError(
            f"graphshard.shard() option mesh must be a DeviceMesh (1-D, or 2-D (replicate, "
            f"shard) for HSDP) or None for the default process group, got {mesh!r} "
            f"({type(mesh).__name__})"
        )
    if not isinstance(reshard_after_forward, Mapping):
        check_setting(reshard_after_forward)


def _check_divide_factor(factor: object) -> None:
    """``gradient_divide_factor`` is None or a positive, finite real number."""
    if factor is None:
        return
    number = isinstance(factor, (int, float)) and not isinstance(factor, bool)
    if not number or not math.isfinite(factor) or factor <= 0:
        raise GraphshardValueError(
            f"graphshard.shard() option gradient_divide_factor must be None (average the "
            f"gradients over the ranks) or a positive number to divide their sum by (1.0: "
            f"sum them, for a loss already divided by a global count); got {factor!r} "
            f"({type(factor).__name__})"
        )


def _refuse_complex_parameters(module: nn.Module) -> None:
    """Complex parameters cannot travel: gloo's all-to-all (the reduce-scatter on gloo) and
    the flat bucket buffers are real-valued. Refused before anything is replaced."""
    bad = [(n, p.dtype) for n, p in module.named_parameters() if p.is_complex()]
    if bad:
        listed = ", ".join(f"'{n}' ({str(d).removeprefix('torch.')})" for n, d in bad)
        raise GraphshardNotImplementedError(
            f"graphshard.shard() does not shard complex parameters: {listed}. Its collectives "
            f"move real-valued buffers (gloo's all-to-all refuses complex ones). Store the "
            f"parameter as its real view instead, nn.Parameter(torch.view_as_real(w)) (shape "
            f"(..., 2)), and use torch.view_as_complex(self.w) in forward; it then shards, "
            f"trains and checkpoints like any real parameter."
        )


def _refuse_sparse_gradients(module: nn.Module) -> None:
    """``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)`` make sparse
    gradients, which neither a reduce-scatter nor a DTensor shard can hold. Refused before
    anything is replaced, instead of failing inside the compiled backward."""
    bad = [name for name, sub in module.named_modules()
           if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse]
    if bad:
        listed = ", ".join(f"'{n}'" for n in bad)
        raise GraphshardNotImplementedError(
            f"graphshard.shard() does not shard embeddings with sparse gradients: {listed} "
            f"(sparse=True). Their gradients are sparse tensors, which the reduce-scatter "
            f"and the sharded gradients cannot hold. Build them with sparse=False (the "
            f"default): the gradient is then dense and sharded like every other, and "
            f"optimizers made for sparse gradients (SparseAdam) are not needed."
        )


def _refuse_sharded_submodules(module: nn.Module) -> None:
    """Refuse sharding a model whose submodule was sharded by an earlier call (FSDP2's one
    ``fully_shard`` per block; otherwise met as a tensor-parallel DTensor model), or a
    submodule of a sharded model, naming ``buckets=`` instead."""
    inner = [
        (name, sub) for name, sub in module.named_modules() if name and is_sharded(sub)
    ]
    if not inner:
        if any("_graphshard_root_state" in sub.__dict__ for sub in module.modules()):
            raise GraphshardRuntimeError(
                f"This {type(module).__name__} is part of a model already sharded by "
                f"graphshard.shard(): graphshard shards a model once, on its root. To gather this "
                f"submodule as a group of its own, build the model again and pass it as a bucket: "
                f"graphshard.shard(model, buckets=[model.<this submodule>, ...])."
            )
        return
    names = ", ".join(f"{name} ({type(sub).__name__})" for name, sub in inner)
    first = inner[0][0]
    attr = "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in first.split("."))
    raise GraphshardRuntimeError(
        f"Submodule(s) {names} of this {type(module).__name__} were already sharded by an "
        f"earlier graphshard.shard() call. graphshard shards a model once, on its root: the "
        f"groups FSDP2 makes with one fully_shard() per block are buckets here. Build the "
        f"model again (the sharded submodule's parameters were replaced) and call "
        f"graphshard.shard(model, buckets=[model{attr}, ...]) once; with buckets=None each "
        f"block of the main ModuleList is a bucket already."
    )


def shard(
    module: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    buckets: Sequence[nn.Module | Sequence[nn.Module]] | None = None,
    reshard_after_forward: bool | int | Literal["auto"]
    | Mapping[nn.Module | str, bool | int | Literal["auto"]] = True,
    mixed_precision: MixedPrecision | None = None,
    offload: CPUOffload | None = None,
    compile_blocks_once: bool = True,
    gradient_divide_factor: float | None = None,
) -> nn.Module:
    """Shard every parameter of ``module`` in place across the ranks of ``mesh``.

    Args:
        module: any ``nn.Module`` with the same initial parameters on every rank, or one
            built under ``torch.device("meta")``: then nothing is allocated, and
            ``module.to_empty(device=...)`` allocates each rank's rows only, to be
            initialised (``reset_parameters()``, ``nn.init`` on the DTensors) or loaded
            (``dcp.load``, ``set_model_state_dict``).
        mesh: a 1-D ``DeviceMesh`` to shard across, a 2-D one ``(replicate, shard)`` for
            HSDP (parameters sharded along the second dimension, gradients also averaged
            across the first), or None to shard across the default process group. For a
            model made tensor parallel first (``parallelize_module`` on ``mesh["tp"]``),
            the data-parallel sub-mesh of the same mesh: ``mesh["dp"]``, or
            ``mesh["replicate", "shard"]`` for HSDP x TP; each TP piece is then sharded
            across it (:mod:`graphshard.api.tensor_parallel`).
        buckets: None for one bucket per block of the model's main ModuleList/Sequential
            (or ModuleDict, as torchtitan's models hold their layers) and of other lists of
            like blocks beside it (an encoder's layers),
            and for the other parameters one bucket of those registered before the blocks
            (an embedding) and one of those after them (a final norm, an output head); or a
            list of module groups (a module or a list of modules, which
            need not be neighbours), each gathered as one bucket; what no group holds goes to
            a last bucket.
        reshard_after_forward: free unsharded parameters after forward and gather them again
            in backward (ZeRO-3, default); False keeps them for backward (ZeRO-2);
            ``"auto"``: the compiler chooses per bucket, keeping what fits the backend's
            ``memory_budget`` (default: the GPU's memory; on the CPU everything is kept) and
            freeing the rest, fastest predicted schedule first
            (:mod:`graphshard.passes.auto_reshard`); an int ``k`` dividing the ranks
            (FSDP2's): each rank keeps ``1/k`` of each freed parameter and the backward
            gathers it again within its group of ``k`` consecutive ranks, a node's GPUs
            where ``k`` is their count (``1`` is ``False``, the rank count ``True``).
            Uncompiled (eager), ``"auto"`` runs as ``True``; an int keeps its pieces and
            gathers over the groups eagerly too. A dict sets it per module, as FSDP2's
            ``fully_shard`` calls do: ``{model.layers[-1]: False, "output": 8}`` maps
            submodules (or their names, ``""`` for the root) to one of the settings above; a
            parameter takes its innermost key's, ``True`` where no key holds it, and a
            bucket asked two settings becomes two buckets
            (:mod:`graphshard.api.reshard_settings`).
        mixed_precision: gather and compute in ``param_dtype``, reduce gradients in
            ``reduce_dtype``; the shards (and so the optimizer state) keep their dtype.
        offload: ``CPUOffload()`` keeps the shards (pinned by default), gradients and
            optimizer state in host memory, like FSDP2's ``CPUOffloadPolicy``: each
            bucket's shards are copied to the mesh's device before its all-gather, and
            reduced gradients are copied back, so the optimizer steps on the host. Needs an
            accelerator mesh (ValueError on a CPU one: nothing to offload). The buffers go
            to the mesh's device (also after a later ``to_empty(device="cpu")``).
        compile_blocks_once: under ``torch.compile``, run each block of the main
            ModuleList/Sequential/ModuleDict as a compile region, so that identical blocks are
            partitioned and compiled by Inductor once, while their gathers stay in the step
            graph, bucketed and prefetched across blocks (:mod:`graphshard.api.block_regions`).
            False compiles every block on its own, as part of the one step graph.
        gradient_divide_factor: None (the default) averages each gradient over the ranks
            (over all of them on an HSDP mesh), as the mean of per-rank mean losses needs. A
            number ``f`` sums the ranks' gradients and divides the sum by ``f`` instead (each
            rank's gradient is multiplied by ``1 / f`` before the reduction), as FSDP2's
            ``set_gradient_divide_factor(f)``: ``1.0`` for a loss each rank already divided
            by the global count (torchtitan divides its summed loss by the tokens of every
            rank and turns FSDP's division off this way).

    Returns:
        ``module`` itself, whose ``parameters()`` are now DTensors sharded on dim 0.
        Each local shard is stored contiguous (a transposed parameter's rows are copied
        into row-major order), as FSDP2 stores them.

    Raises:
        GraphshardTypeError: an argument of the wrong type (``reshard_after_forward="no"``,
            a mesh that is not a ``DeviceMesh``, ``buckets`` that is not a list of groups).
        GraphshardValueError: an int ``reshard_after_forward`` that does not divide the
            ranks; a per-module key that is not a submodule, holds no parameters or is given
            two settings.
        GraphshardRuntimeError: ``module`` (or a submodule of it, or a model it is part of)
            was sharded already: shard once, on the root, and name groups with ``buckets=``.
        GraphshardNotImplementedError: a complex parameter (store its
            ``torch.view_as_real`` form instead).
        PlanMismatchError: the ranks differ in the model (shapes, dtypes), the buckets or
            the options, or in the values of a parameter or buffer (seed identically, or
            init on the meta device after ``shard()``); raised on every rank.

    Methods other than ``forward`` that compute with the parameters (``model.encode(x)``)
    must be registered with :func:`graphshard.register_forward_method`.
    """
    if is_sharded(module):
        raise GraphshardRuntimeError(
            f"{type(module).__name__} is already sharded: call graphshard.shard() once per "
            "model, on the root module."
        )
    _check_shard_options(module, mesh, reshard_after_forward)
    if not isinstance(compile_blocks_once, bool):
        raise GraphshardTypeError(
            f"graphshard.shard() option compile_blocks_once must be True or False, got "
            f"{compile_blocks_once!r} ({type(compile_blocks_once).__name__})"
        )
    _check_divide_factor(gradient_divide_factor)
    _refuse_sharded_submodules(module)
    _refuse_complex_parameters(module)
    _refuse_sparse_gradients(module)
    tp_mesh = tp_mesh_of(module, mesh)  # None without tensor parallelism; checks the order
    if tp_mesh is not None and offload is not None:
        raise GraphshardNotImplementedError(
            "graphshard.shard(offload=CPUOffload()) with tensor-parallel parameters is not "
            "supported; shard without offload, or offload without tensor parallelism."
        )
    group, replica_group = _resolve_groups(mesh)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    # each parameter's setting (one for all, or per module) and for an int k its group
    reshards = resolve_settings(module, reshard_after_forward, group)
    replica_size = 1 if replica_group is None else dist.get_world_size(replica_group)
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        hint = ""
        if type(mixed_precision).__name__ == "MixedPrecisionPolicy":  # FSDP2's, same fields
            fields_ = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
            same = ", ".join(f"{f}={getattr(mixed_precision, f, None)!r}" for f in fields_)
            hint = f": FSDP2's policy; graphshard's takes the same fields: MixedPrecision({same})"
        elif isinstance(mixed_precision, torch.dtype):
            hint = f": for one dtype, MixedPrecision(param_dtype={mixed_precision})"
        raise GraphshardTypeError(
            f"mixed_precision must be a graphshard.MixedPrecision, got "
            f"{type(mixed_precision).__name__}{hint}"
        )
    policy = mixed_precision or MixedPrecision()
    originals = guards.collect_originals(module)  # marked once replaced (graphshard.safety.guards)
    bucket_of, bucket_names = _assign_buckets(module, _module_groups(module, buckets),
                                              first_wins=buckets is None)
    # one setting per bucket: a group asked to reshard in two ways becomes two buckets
    bucket_of, bucket_names = _split_by_kind(module, bucket_of, bucket_names,
                                             reshards.kind, reshards.label)
    if mesh is None:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        if device.type == "meta":  # the device to_empty will allocate on: the group's
            device = _default_device(group)
        with unset_fake_temporarily():  # the mesh holds real rank ids, also when tracing
            mesh = DeviceMesh.from_group(group, device.type)
    compute_device, host = resolve_offload(mesh, offload)  # "", None without offload
    state = ShardState(
        group, world_size, rank, reshards.model_setting, mesh, GradSync.FULL,
        bucket_names=bucket_names, reshard_of_bucket=reshards.of_buckets(bucket_of),
        replica_group=replica_group, replica_size=replica_size, mixed_precision=mixed_precision,
        offload=offload, compute_device=compute_device,
        gradient_divide_factor=(None if gradient_divide_factor is None
                                else float(gradient_divide_factor)),
    )  # fmt: skip

    by_param: dict[int, ShardedParam] = {}
    owners: dict[int, tuple[nn.Module, list[str]]] = {}
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        for pname, p in list(sub._parameters.items()):
            if p is None:
                continue
            fqn = f"{mod_name}.{pname}" if mod_name else pname
            entry = by_param.get(id(p))
            if entry is None:
                bucket = bucket_of[id(p)]
                pinned = buckets is not None and not bucket_names[bucket].startswith("<rest>")
                if tp_mesh is not None:  # tensor parallel: shard each TP piece over dp
                    param, tp = tp_parameter(p, mesh, placements(mesh, p.shape), rank,
                                             tp_mesh)
                    piece = p.to_local().shape if isinstance(p, DTensor) else p.shape
                    entry = ShardedParam([fqn], piece, bucket, pinned, param)
                    entry.tp = tp
                else:
                    param = sharded_parameter(p, host or mesh, rank, offload)
                    entry = ShardedParam([fqn], p.shape, bucket, pinned, param)
                carry_grad_hooks(p, param)  # the user's gradient hooks stay on it
                by_param[id(p)] = entry
                state.params.append(entry)
            elif fqn not in entry.names:
                entry.names.append(fqn)
            owners.setdefault(id(sub), (sub, []))[1].append(pname)

    store_buckets(state)  # each bucket's shards in one flat buffer (api.bucket_storage)
    state_index = register_state(module, state)
    # what compiled graphs read in place of each DTensor parameter (api.local_inputs)
    local_index = dict(zip(map(id, state.params), register_locals(state.params), strict=True))
    # a fused optimizer's step on these shards runs on their local tensors, without dispatch
    run_fused_optimizers_locally(module, (entry.param for entry in state.params))
    step_reducing_optimizers()  # and Adafactor's and Rprop's (api.optimizer_steps)
    keep_scalar_states_replicated()  # a 0-D parameter's loaded state (api.optimizer_state)
    # and clip_grad_norm_'s list ops on their gradients (api.grad_norm_ops)
    run_grad_norm_ops_locally(module, {id(e.param.device_mesh): e.param.device_mesh
                                       for e in state.params
                                       if isinstance(e.param, DTensor)}.values())
    for sub, pnames in owners.values():
        if getattr(sub, "_graphshard_specs", None) is not None:
            continue
        specs = {}
        for pname in dict.fromkeys(pnames):
            original = sub._parameters[pname]
            entry = by_param[id(original)]
            sub._parameters[pname] = entry.param
            setting, reshard_group = reshards.of_param(original)
            spec = UnshardSpec(
                full_shape=list(entry.full_shape),
                bucket=entry.bucket,
                pinned=entry.pinned,
                reshard=reshard_code(setting),
                name=entry.names[0],
                world_size=world_size,
                group_name=state.group_name,
                param_dtype=policy.param_dtype,
                reduce_dtype=policy.gradient_dtype,
                replica_group="" if replica_group is None else replica_group.group_name,
                replica_size=replica_size,
                compute_device=compute_device,
                divide_factor=state.gradient_divide_factor,
                reshard_group="" if reshard_group is None else reshard_group.group_name,
                reshard_size=1 if reshard_group is None else reshard_group.size(),
            )
            specs[pname] = (entry, spec)
        install_reads(sub, specs, state, state_index,
                      {pname: local_index[id(entry)] for pname, (entry, _) in specs.items()})
    if mixed_precision is not None:
        install_casts(module, mixed_precision)
    # Buffers are read by the compute: on the mesh's device, as FSDP2 puts them, also when
    # the model was built on the host (the offload recipe) or is to_empty'd there later.
    buffers_to_device(module, mesh.device_type)
    if offload is not None:
        keep_buffers_on_device(module, mesh.device_type)
    track_forwards(module, state)
    if compile_blocks_once:
        install_block_regions(_main_blocks(module), state_index)
    step_prefetch.track(state)  # the optimizer step may gather the forward's first buckets
    setattr(module, STATE_ATTR, state)
    refuse_tp_after_shard()
    guards.after_shard(module, state, originals)  # write guards, cross-rank plan check
    watch_functional_calls()  # torch.func.functional_call runs such a model eagerly
    return module
