"""Shared record types: what a sharding is, per parameter and per model.

A leaf module: it imports nothing else of graphshard (type names only under
``TYPE_CHECKING``), so every room of the package (api, compiler, state, safety, tools) can
read a sharded model's record without importing the code that built it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from graphshard.api.mixed_precision import MixedPrecision
    from graphshard.api.offload import CPUOffload
    from graphshard.api.tensor_parallel import TPLayout

__all__ = ["ROOT_STATES", "STATE_ATTR", "ShardedParam", "ShardState"]

STATE_ATTR = "_graphshard_state"  # the attribute of a sharded root that holds its ShardState


@dataclass
class ShardedParam:
    """What one sharded parameter is: its names, full shape, bucket and the Parameter."""

    names: list[str]
    full_shape: torch.Size  # what the dp gather rebuilds: under TP, this rank's TP piece
    bucket: int
    pinned: bool  # chosen by the user's ``buckets=[...]``: strategies keep it
    param: nn.Parameter  # a DTensor: the full shape, this rank's rows as local tensor
    # Leaves that collect gradients held back by no_sync: the full gradient (GradSync.NONE)
    # or the reduce-scattered padded piece (GradSync.PARTIAL). Their ``.grad`` is pending.
    unreduced: torch.Tensor | None = None
    partial: torch.Tensor | None = None
    # (full, partial) held-back gradients the next read folds in: armed before each forward
    # (graphshard.api.grad_sync), taken by the first read of the forward (so a parameter read in
    # two graphs or twice eagerly adds them once); ``folding`` until its backward has run.
    armed: tuple[torch.Tensor | None, torch.Tensor | None] | None = None
    folding: bool = False
    tp: TPLayout | None = None  # under tensor parallelism: how to re-wrap the gathered piece
    # A plain tensor over the local shard's storage, autograd-linked to ``param``: what
    # compiled graphs read for a trainable parameter (graphshard.api.local_inputs).
    local: torch.Tensor | None = None
    # Where the owning modules hold ``local`` for traced reads: (the module's dict of plain
    # tensors, the parameter's name there). Kept equal to ``local`` by
    # ``graphshard.api.local_inputs``, the one place that sets it.
    local_slots: list[tuple[dict, str]] = field(default_factory=list, repr=False, compare=False)
    # Its bucket's flat, padded buffer and the records laid out in it
    # (graphshard.api.bucket_storage.BucketStorage), or None; and where the owning modules
    # (and served blocks) hold that buffer (or None) for traced reads, kept equal by that
    # module: (dict, key) pairs.
    storage_group: Any = field(default=None, repr=False, compare=False)
    storage_slots: list[tuple[dict, Any]] = field(default_factory=list, repr=False,
                                                  compare=False)
    # The storage id of ``param``'s DTensor wrapper when sharded, or after the last swap
    # graphshard followed: ``param.data = ...`` changes it (graphshard.safety.data_assignment).
    wrapper_id: int = 0


@dataclass
class ShardState:
    """Per-root record of a sharding: the group and every sharded parameter."""

    group: dist.ProcessGroup  # the shard group: parameters are split across its ranks
    world_size: int  # ranks in the shard group
    rank: int  # this rank's index in the shard group
    # True, False, "auto" or k (groups of k ranks); per module: module name -> one of those
    reshard_after_forward: bool | int | str | dict
    mesh: DeviceMesh  # 1-D (shard) or 2-D (replicate, shard): where the DTensors live
    sync: int  # where this micro-batch's gradients go (a GradSync value)
    params: list[ShardedParam] = field(default_factory=list)
    bucket_names: list[str] = field(default_factory=list)
    # each bucket's reshard_after_forward (True, False, "auto" or k), by index
    reshard_of_bucket: list = field(default_factory=list)
    replica_group: dist.ProcessGroup | None = None  # HSDP: gradients are all-reduced over it
    replica_size: int = 1
    mixed_precision: MixedPrecision | None = None
    folds_held_back: bool = False  # no_sync's hooks are installed (on its first use)
    # autograd graph tasks (backwards) seen by graphshard.api.grad_sync: the last that
    # reduced a gradient (and was checked for held-back gradients left unreduced), the last
    # that held one back, and the last whose end runs that check
    unread_check_task: int = -1
    held_back_task: int = -1
    unread_queued_task: int = -1
    forward_depth: int = 0  # module forwards of this model now running (attribute reads gather)
    # whether the running root forward was called through torch.compile (api.forward_depth)
    compiled_call: bool = False
    # eager reads in the running forward, checked for in-place updates of the gathered copy
    # (graphshard.safety.mutation): (reference to the copy, its version, parameter name),
    # the last one a strong reference, the others weak
    eager_reads: list = field(default_factory=list)
    # eager gathers shared by a module call's reads (graphshard.api.eager_gathers):
    # (name, grad mode, inference mode) -> (gathered copy, its version), and the keys
    # gathered at each depth of counted calls
    eager_gathered: dict = field(default_factory=dict)
    eager_gathered_at: dict = field(default_factory=dict)
    # gathered copies graphshard.unshard(model) holds for reads without gradients
    # (graphshard.api.held_gathers): parameter name -> eager_gathers.HeldCopy
    held_gathered: dict = field(default_factory=dict)
    # one eager all-gather per bucket (graphshard.api.bucket_gathers): bucket -> [(record,
    # UnshardSpec)]; the buckets gathered in the running forward; and the copies their reads
    # have not taken yet, id(record) -> (copy, the local shard gathered, version counters)
    bucket_members: dict = field(default_factory=dict)
    buckets_gathered: set = field(default_factory=set)
    bucket_stash: dict = field(default_factory=dict)
    # gathers issued a bucket ahead: bucket -> bucket_gathers._PendingGather; the buckets the
    # running forward gathered whole, in order, as (bucket, how its members travel); and
    # what the last complete forward gathered after each bucket
    bucket_prefetched: dict = field(default_factory=dict)
    bucket_order_now: list = field(default_factory=list)
    bucket_next: dict = field(default_factory=dict)
    # the relay from the running forward's last bucket read that trains to the next one,
    # which finishes the next one's reduction in its backward, and that read's token
    # (graphshard.api.bucket_reads)
    bucket_relay: Any = None
    # reshard_after_forward=True eagerly (graphshard.api.eager_reshard): while an eager forward
    # runs, its gathered copies by storage (else None); handles alive per (forward, record);
    # copies gathered again for the backward; whether their clearing is queued
    reshard_copies: dict | None = None
    resharded_live: dict = field(default_factory=dict)
    regathered: dict = field(default_factory=dict)
    regathered_clear_queued: bool = False
    regather_pending: dict = field(default_factory=dict)  # issued a bucket ahead in a backward
    root_resharding: bool = False  # the running root forward put those hooks in place
    reshard_kept: list = field(default_factory=list)  # the handles of the bucket saved last
    # reshard_after_forward=k eagerly: per (forward, record) with handles alive, this rank's
    # piece over its group of k, which the backward gathers over that group
    group_pieces: dict = field(default_factory=dict)
    # optimizer steps taken over this model's parameters (graphshard.safety.guards counts
    # them): every rank must step alike, and the checks that are free compare it
    optimizer_steps: int = 0
    offload: CPUOffload | None = None  # shards, gradients, optimizer state on the host
    compute_device: str = ""  # with offload: the device type shards are gathered on
    # shard(gradient_divide_factor=...): what the ranks' summed gradients are divided by
    # (None: by their number, the average)
    gradient_divide_factor: float | None = None

    @property
    def group_name(self) -> str:
        """The name the functional collectives use for ``group``."""
        return self.group.group_name


# Every sharded root's ShardState by an index (``graphshard.api.sharding`` registers it and
# drops it once the root is collected). Traced code reaches a model's state only here, never
# through a module's own attribute: under many names the one state would make Dynamo check at
# every step, in Python, that they are still one object (an aliasing guard per module). (A
# dict, not a list: Dynamo guards only the key a step reads, where it would guard a list's
# length and recompile whenever another model is sharded.)
ROOT_STATES: dict[int, ShardState] = {}
