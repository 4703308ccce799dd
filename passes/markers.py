"""The marker ops: the vocabulary shared by ``graphshard`` and the passes.

A sharded parameter is read through ``graphshard::unshard`` and its gradient leaves through
``graphshard::reduce_grad``. Both carry everything the passes need as plain arguments (full
shape, bucket, reshard policy, group), so a traced graph is self-describing: the passes never
look at a module or a process group. Only the schemas and the fake (shape) implementations
live here; the eager kernels that really communicate are registered by
``graphshard.api.eager_kernels``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import fx

from graphshard.passes.errors import GraphshardValueError
from graphshard.passes.layout import Dim0Layout

__all__ = [
    "UNSHARD",
    "REDUCE_GRAD",
    "TAKE_PREFETCHED",
    "ALL_GATHER_SINGLE",
    "TAKE_GROUP_PIECE",
    "PREFETCH_BY_STEP",
    "PREFETCH_BY_BREAK",
    "is_unshard",
    "is_reduce_grad",
    "is_collective_start",
    "UnshardArgs",
    "UnshardSpec",
    "ReduceGradArgs",
    "marker_args",
    "GradSync",
    "RESHARD_KEEP",
    "RESHARD_FREE",
    "RESHARD_AUTO",
    "reshard_code",
    "reduce_op",
    "replica_divide_factor",
    "reduced_shape",
]

_lib = torch.library.Library("graphshard", "DEF")
# ``sync`` says where the gradient of one micro-batch goes (see ``GradSync``); ``accum`` is the
# leaf that receives it when it is not reduced all the way, ``pending_*`` what earlier
# micro-batches accumulated, folded into this micro-batch's reduction. ``shard`` is the rank's
# local rows (the DTensor parameter's local tensor, unpadded: see ``graphshard.passes.layout``).
# ``reshard``: RESHARD_KEEP (0, ZeRO-2), RESHARD_FREE (1, ZeRO-3) or RESHARD_AUTO (2: the
# ``reshard`` pass chooses per bucket against the plan's memory budget); a bool reads as 0/1.
# ``compute_device`` (CPU offload): the device type the shard is copied to before the gather
# ('' = gathered where it lives). ``divide_factor``: what the ranks' summed gradient is
# divided by (``shard(gradient_divide_factor=...)``; None: their average); the last of the
# per-parameter fields ``shard()`` fixes, so the per-read ones (``sync`` ...) follow it.
# ``storage`` / ``storage_index``: the flat, padded buffer the bucket's shards live in and
# this shard's place there, where ``graphshard.api.bucket_storage`` laid the bucket out (the
# gather may read it as it is). ``reshard_group`` / ``reshard_size`` (``shard(reshard_after_
# forward=k)`` with 1 < k < world_size): what the forward keeps for the backward is this
# rank's piece of the gathered parameter split over its group of ``k`` ranks, gathered again
# over that group alone ('' / 1: the shard, gathered again over ``group_name``; see
# ``graphshard.passes.group_reshard``). Fixed by ``shard()`` too, so they precede ``sync``.
_lib.define(
    "unshard(Tensor shard, SymInt[] full_shape, int bucket, bool pinned, int reshard, "
    "str name, int world_size, str group_name, ScalarType? param_dtype=None, "
    "ScalarType? reduce_dtype=None, str replica_group='', int replica_size=1, "
    "str compute_device='', float? divide_factor=None, str reshard_group='', "
    "int reshard_size=1, int sync=0, Tensor? accum=None, "
    "Tensor? pending_full=None, Tensor? pending_partial=None, Tensor? storage=None, "
    "int storage_index=-1) -> Tensor"
)
_lib.define(
    "reduce_grad(Tensor grad, int bucket, str name, int world_size, str group_name, "
    "ScalarType? reduce_dtype=None, ScalarType? out_dtype=None, str replica_group='', "
    "int replica_size=1, bool all_reduce=True, Tensor? pending_full=None, "
    "Tensor? pending_partial=None, int local_rows=0, str out_device='', "
    "float? divide_factor=None) -> Tensor"
)
# The forward's leading all-gathers, bound to the buffers the previous optimizer step
# gathered (``graphshard.passes.step_prefetch``): ``all_gather_into_tensor(flat, group_size,
# group_name)`` with what the step needs to rebuild ``flat`` from the updated shards (each
# shard's padded piece size; ``flat`` is their pieces, cast to its dtype, concatenated),
# ``key`` (names the gather) and ``lead`` (names the graph's leading gathers together). It
# returns the gathered buffer as the all-gather does (completed by the same ``wait_tensor``);
# its kernel (``graphshard.api.step_prefetch``) takes the prefetched one when every rank's
# ``flat`` still equals what it sent, else gathers anew. The first of a graph's leading
# gathers also gets the others' inputs and keys (``peers``, ``peer_keys``), so the ranks
# agree on all of them at once. ``sources``: who may have issued it, a sum of
# ``PREFETCH_BY_STEP`` (the optimizer step, ``Plan.step_prefetch``) and ``PREFETCH_BY_BREAK``
# (the end of the previous forward graph, ``Plan.break_prefetch``).
_lib.define(
    "take_prefetched(Tensor flat, int group_size, str group_name, *, Tensor[] shards, "
    "int[] piece_numels, str key, str lead, Tensor[] peers, str[] peer_keys, "
    "int sources=1) -> Tensor"
)
# An all-gather on a gloo group (``graphshard.passes.gloo_gathers``): the arguments and result
# of ``_c10d_functional.all_gather_into_tensor``, completed by the same ``wait_tensor``, but
# issued as the group's single-tensor all-gather, which gloo runs safely beside another
# collective in flight (its kernel: ``graphshard.safety.gloo_gather``). ``copy_input``: the
# kernel sends a copy of ``input``, which the collective then owns, for an input the compiled
# graph may overwrite before the wait (any intermediate buffer; not a graph input).
_lib.define(
    "all_gather_single(Tensor input, int group_size, str group_name, *, "
    "bool copy_input=True) -> Tensor"
)
# ``shard(reshard_after_forward=k)``: this rank's padded piece of ``full`` split on dim 0
# over ``group_size`` ranks (its ``Dim0Layout`` piece), a new tensor. The rank's place is
# read from the group when it runs, so the graph is the same on every rank
# (``graphshard.passes.group_reshard``; its kernel: ``graphshard.api.eager_kernels``).
_lib.define("take_group_piece(Tensor full, int group_size, str group_name) -> Tensor")
# ``local_rows``: rows of dim 0 the reading rank holds; a final gradient comes out in that
# local shape, a partial one (``all_reduce=False``) as the padded piece it accumulates in.
# ``out_device`` (CPU offload): the device type the reduced gradient is copied to, the host
# where its shard lives ('' = it stays where it was reduced). ``divide_factor``: as unshard's.


class GradSync:
    """Where one micro-batch's gradient goes (the ``sync`` argument of ``unshard``).

    ``FULL``: reduce-scatter (and all-reduce across replicas) into the shard's ``.grad``,
    folding in whatever earlier micro-batches left pending. ``PARTIAL``: reduce-scatter only,
    accumulating the partial shard gradient for one replica all-reduce later (HSDP).
    ``NONE``: no communication; the full gradient accumulates for one reduction later.
    """

    FULL = 0
    PARTIAL = 1
    NONE = 2

RESHARD_KEEP = 0  # reshard_after_forward=False: kept from forward to backward (ZeRO-2)
RESHARD_FREE = 1  # reshard_after_forward=True: freed, gathered again in backward (ZeRO-3)
RESHARD_AUTO = 2  # reshard_after_forward="auto": chosen per bucket (graphshard.passes.reshard)


def reshard_code(reshard_after_forward: bool | int | str) -> int:
    """The ``reshard`` argument of ``unshard`` for a ``shard(reshard_after_forward=...)``
    (an int ``k`` frees too: what is kept is named by ``reshard_group``)."""
    if reshard_after_forward == "auto":
        return RESHARD_AUTO
    return RESHARD_FREE if reshard_after_forward else RESHARD_KEEP


UNSHARD = torch.ops.graphshard.unshard.default
REDUCE_GRAD = torch.ops.graphshard.reduce_grad.default
PREFETCH_BY_STEP = 1  # take_prefetched's sources: the optimizer step may have issued it
PREFETCH_BY_BREAK = 2  # the end of the forward graph before a graph break may have

TAKE_PREFETCHED = torch.ops.graphshard.take_prefetched.default
ALL_GATHER_SINGLE = torch.ops.graphshard.all_gather_single.default
TAKE_GROUP_PIECE = torch.ops.graphshard.take_group_piece.default


def reduce_op(dtype: torch.dtype, group_size: int,
              divide_factor: float | None = None) -> tuple[str, float]:
    """The collective's reduce op and the factor applied before it, to average a gradient
    of ``dtype`` over ``group_size`` ranks, or with ``divide_factor`` to sum it and divide
    by that instead (``shard(gradient_divide_factor=...)``: multiplied by its inverse first,
    as FSDP2's pre-multiplied sum does; 1.0 is a plain sum).

    fp16 overflows when large gradients are summed: it is divided first, then summed. The
    other dtypes use the collective's own average.
    """
    if divide_factor is not None:
        return "sum", 1.0 / divide_factor
    if dtype == torch.float16:
        return "sum", 1.0 / group_size
    return "avg", 1.0


def replica_divide_factor(divide_factor: float | None) -> float | None:
    """The ``divide_factor`` of HSDP's all-reduce across replicas, after the reduce-scatter
    applied ``divide_factor``: None (an average) stays None; a factor was applied already,
    so the replicas sum (1.0)."""
    return None if divide_factor is None else 1.0


@torch.library.register_fake("graphshard::unshard")
def _unshard_fake(shard, full_shape, *args, **kwargs):
    m = UnshardArgs(shard, full_shape, *args, **kwargs)
    device = m.compute_device or shard.device
    return shard.new_empty(full_shape, dtype=m.param_dtype or shard.dtype, device=device)


@torch.library.register_fake("graphshard::reduce_grad")
def _reduce_grad_fake(grad, bucket, name, world_size, *args, **kwargs):
    m = ReduceGradArgs(grad, bucket, name, world_size, *args, **kwargs)
    return grad.new_empty(
        reduced_shape(m), dtype=m.out_dtype or grad.dtype, device=m.out_device or grad.device
    )


@torch.library.register_fake("graphshard::take_prefetched")
def _take_prefetched_fake(flat, group_size, group_name, **kwargs):
    return flat.new_empty([flat.shape[0] * group_size, *flat.shape[1:]])


@torch.library.register_fake("graphshard::take_group_piece")
def _take_group_piece_fake(full, group_size, group_name):
    return full.new_empty(Dim0Layout(full.shape, group_size).piece_shape)


@torch.library.register_fake("graphshard::all_gather_single")
def _all_gather_single_fake(input, group_size, group_name, **kwargs):
    return input.new_empty([input.shape[0] * group_size, *input.shape[1:]])


def reduced_shape(m: ReduceGradArgs) -> tuple[int, ...]:
    """The shape ``reduce_grad`` returns: the reading rank's local shape for a final
    gradient, the padded piece for a partial one."""
    layout = Dim0Layout(m.grad.shape if isinstance(m.grad, torch.Tensor)
                        else m.grad.meta["val"].shape, m.world_size)
    return layout.local_shape(m.local_rows) if m.all_reduce else layout.piece_shape


def is_unshard(node: fx.Node) -> bool:
    """True for a call of the ``unshard`` marker."""
    return node.op == "call_function" and node.target is UNSHARD


def is_reduce_grad(node: fx.Node) -> bool:
    """True for a call of the ``reduce_grad`` marker."""
    return node.op == "call_function" and node.target is REDUCE_GRAD


def is_collective_start(node: fx.Node) -> bool:
    """True for a node that starts a collective: a functional c10d op other than
    ``wait_tensor``, ``take_prefetched`` (the all-gather the optimizer step may have
    issued already) or ``all_gather_single`` (gloo's all-gather)."""
    if node.op != "call_function":
        return False
    target = node.target
    return target is TAKE_PREFETCHED or target is ALL_GATHER_SINGLE or (
        getattr(target, "namespace", None) == "_c10d_functional"
        and target is not torch.ops._c10d_functional.wait_tensor.default)


class UnshardSpec(NamedTuple):
    """What ``shard()`` fixes per parameter: the ``unshard`` arguments after ``shard`` and
    before the per-read ones (``sync`` ...), in schema order."""

    full_shape: list[int]
    bucket: int
    pinned: bool
    reshard: int  # RESHARD_KEEP, RESHARD_FREE or RESHARD_AUTO
    name: str
    world_size: int
    group_name: str
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    replica_group: str
    replica_size: int
    compute_device: str
    divide_factor: float | None = None  # None: gradients averaged over the ranks
    reshard_group: str = ""  # shard(reshard_after_forward=k): the group of k ranks
    reshard_size: int = 1


class UnshardArgs(NamedTuple):
    """The arguments of an ``unshard`` call, by name."""

    shard: fx.Node
    full_shape: list[int]
    bucket: int
    pinned: bool  # the user chose this bucket: bucketing strategies leave it alone
    reshard: int  # RESHARD_KEEP (0), RESHARD_FREE (1) or RESHARD_AUTO (2)
    name: str
    world_size: int
    group_name: str
    param_dtype: torch.dtype | None = None  # cast to this before the gather
    reduce_dtype: torch.dtype | None = None  # the gradient is reduced in this dtype
    replica_group: str = ""  # HSDP: the group the shard gradients are all-reduced over
    replica_size: int = 1
    compute_device: str = ""  # CPU offload: copy the shard to this device type, then gather
    divide_factor: float | None = None  # the summed gradient's divisor (None: the average)
    reshard_group: str = ""  # kept for the backward: this rank's piece over this group
    reshard_size: int = 1  # ... of this many ranks (1: the shard itself)
    sync: int = GradSync.FULL
    accum: fx.Node | None = None
    pending_full: fx.Node | None = None
    pending_partial: fx.Node | None = None
    storage: fx.Node | None = None  # the bucket's flat buffer, where it is laid out in one
    storage_index: int = -1  # this shard's place among the pieces in ``storage``


class ReduceGradArgs(NamedTuple):
    """The arguments of a ``reduce_grad`` call, by name."""

    grad: fx.Node
    bucket: int
    name: str
    world_size: int
    group_name: str
    reduce_dtype: torch.dtype | None = None
    out_dtype: torch.dtype | None = None  # the shard's dtype, or reduce_dtype for a partial
    replica_group: str = ""
    replica_size: int = 1
    all_reduce: bool = True  # False: a partial (reduce-scattered, not yet all-reduced)
    pending_full: fx.Node | None = None
    pending_partial: fx.Node | None = None
    local_rows: int = 0  # rows of dim 0 the reading rank holds (rank-dependent)
    out_device: str = ""  # CPU offload: copy the reduced gradient to this device type
    divide_factor: float | None = None  # the summed gradient's divisor (None: the average)


def marker_args(node: fx.Node) -> UnshardArgs | ReduceGradArgs:
    """The arguments of a marker node as a named tuple."""
    if is_unshard(node):
        return UnshardArgs(*node.args, **node.kwargs)
    if is_reduce_grad(node):
        return ReduceGradArgs(*node.args, **node.kwargs)
    raise GraphshardValueError(f"{node.format_node()} is not a graphshard marker")
