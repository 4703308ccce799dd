"""Eagerly, one all-gather and one reduce-scatter per bucket: :func:`gather_bucket`,
:func:`take_gathered`.

The compiled step moves a bucket's parameters and gradients in one collective each. Eagerly
each read used to gather its own parameter and reduce its own gradient: an eager step of
llama-small at world 2 issued 79 collectives, FSDP2's 14, and on gloo, where every collective
costs a fixed latency, the eager step (and a generation loop, one forward per token) paid for
the difference.

So the first eager read of a bucket's parameter in a forward gathers every parameter of the
bucket that travels alike (same group, dtype and device once cast, same reduction of the
gradients) in one collective, as FSDP2 gathers a module's parameters on entry. The copies
wait in ``state.bucket_stash`` for their reads, and each read takes its own
(:func:`take_gathered`).

- The reads that train with nothing held back (gradient sync on, no ``no_sync`` gradient to
  fold in, no tensor-parallel re-wrap) take outputs of one autograd node
  (:func:`graphshard.api.bucket_reads.read_bucket`), whose backward reduce-scatters their
  gradients in one collective, finished under the backward of the bucket read before.
- Any other read gets ``unshard``'s autograd for its copy
  (:func:`graphshard.api.eager_kernels.from_gathered`): one reduction each, as before.

Each bucket's gather is issued one bucket ahead, as FSDP2 prefetches the next module's:
a forward that gathers a bucket issues the gather of the bucket the last complete forward
gathered after it (:func:`_prefetch_next`), and waits for it at that bucket's first read.
On a GPU the collective then runs under this bucket's compute (NCCL's stream waits only for
the kernels queued before it was issued); on gloo in a worker thread beside it. A forward
that reads in another order takes what it reads and drops, after waiting for it, what it
does not.

A bucket is gathered whole once per forward. A parameter read again after its copy was let
go gathers with the rest of its module's parameters in the bucket (a module called a second
time), not with the whole bucket (a tied weight read at both ends of the model gathers
alone). What no read took is dropped when the forward ends (:func:`end_forward`).

Ranks issue the same collectives in the same order as long as they read the same buckets in
the same order, which the per-parameter gathers needed too (and the end-of-forward check of
:mod:`graphshard.safety.rank_agreement` compares). A copy is served only while its shard is
the one gathered, unchanged since: a shard written in between is gathered again on its own.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch.distributed.tensor import DTensor

from graphshard.api.bucket_reads import Relay, read_bucket
from graphshard.errors import GraphshardRuntimeError
from graphshard.passes.layout import (
    Dim0Layout,
    eager,
    full_from_gathered,
    gather_piece,
    rows_held,
)
from graphshard.passes.markers import GradSync, UnshardSpec
from graphshard.records import ShardedParam, ShardState
from graphshard.safety.gloo_gather import all_gather

__all__ = ["end_forward", "gather_bucket", "gather_copies", "issue_gather",
           "register_bucket_member", "take_gathered", "travels_as"]

_c10d = torch.ops._c10d_functional


def register_bucket_member(state: ShardState, entry: ShardedParam, spec: UnshardSpec) -> None:
    """At ``shard()``: ``entry`` (read with ``spec``) belongs to its bucket's eager gather."""
    members = state.bucket_members.setdefault(entry.bucket, [])
    if all(known is not entry for known, _ in members):  # a tied parameter: once
        members.append((entry, spec))


def gather_bucket(state: ShardState, entry: ShardedParam,
                  wanted: Collection[int] | None = None,
                  again: Collection[int] = ()) -> None:
    """Before the eager gather of ``entry``'s parameter, unless a copy of it is waiting:
    gather the members of its bucket that travel as ``entry`` does in one collective, into
    ``state.bucket_stash``. The first time in a forward, every such member (or those whose
    ``id`` is in ``wanted``); after that, those in ``again`` (the reading module's own: a
    module called a second time) that have no copy waiting."""
    if state.world_size == 1 or id(entry) in state.bucket_stash:
        return
    whole = wanted is None and entry.bucket not in state.buckets_gathered
    if entry.bucket in state.buckets_gathered:
        wanted = again
    state.buckets_gathered.add(entry.bucket)
    members = state.bucket_members.get(entry.bucket, ())
    key = next((travels_as(e, spec) for e, spec in members if e is entry), None)
    if key is None:
        return
    pending = state.bucket_prefetched.pop(entry.bucket, None) if whole else None
    if pending is not None and pending.key != key:  # the bucket is read another way now
        pending.drop()
        pending = None
    if pending is None:
        reads = [(e, spec) for e, spec in members
                 if (wanted is None or id(e) in wanted) and id(e) not in state.bucket_stash
                 and travels_as(e, spec) == key]
        if len(reads) < 2:  # alone, the per-parameter gather is this one, without the copy out
            return
        pending = issue_gather(reads, key)
    if whole:
        state.bucket_order_now.append((entry.bucket, key))
        _prefetch_next(state, entry.bucket)
    reads, fulls = pending.reads, pending.copies()
    trained = [i for i, (e, _) in enumerate(reads) if _reads_together(state, e)]
    if len(trained) > 1:  # their gradients are reduced together too
        members = [reads[i][0] for i in trained]
        relay = state.bucket_relay  # (the relay, the token of the read that made it)
        taken = relay if relay is not None and relay[0].expects(members) else None
        handed = _relay_to_next(state, entry.bucket) if whole else None
        outputs, token = read_bucket([reads[i][1] for i in trained],
                                     [fulls[i] for i in trained],
                                     [e.param for e in members], taken, handed)
        state.bucket_relay = None if handed is None else (handed, token)
        for i, output in zip(trained, outputs, strict=True):
            fulls[i] = output
    for (e, _), full, (local, versions) in zip(reads, fulls, pending.shards, strict=True):
        state.bucket_stash[id(e)] = (full, local, versions)


def _relay_to_next(state: ShardState, bucket: int) -> Relay | None:
    """The relay from ``bucket``'s reads that train to those of the bucket the last complete
    forward gathered after it, which its backward finishes reducing
    (:mod:`graphshard.api.bucket_reads`); None where no such bucket is known."""
    after = state.bucket_next.get(bucket)
    if after is None:
        return None
    following, key = after
    members = [e for e, spec in state.bucket_members.get(following, ())
               if travels_as(e, spec) == key and _reads_together(state, e)]
    return Relay(members) if len(members) > 1 else None


def _prefetch_next(state: ShardState, bucket: int) -> None:
    """Issue the gather of the bucket the last complete forward gathered after ``bucket``,
    unless this forward has it already (module docstring)."""
    after = state.bucket_next.get(bucket)
    if after is None:
        return
    following, key = after
    if following in state.buckets_gathered or following in state.bucket_prefetched:
        return
    reads = [(e, spec) for e, spec in state.bucket_members.get(following, ())
             if id(e) not in state.bucket_stash and travels_as(e, spec) == key]
    if len(reads) > 1:
        state.bucket_prefetched[following] = issue_gather(reads, key)


class _PendingGather:
    """A bucket's all-gather, issued and not waited for yet: :meth:`copies` waits and cuts
    the members' full copies out; :meth:`drop` waits and lets it go (a collective's output
    is never freed while the collective may still write it)."""

    __slots__ = ("reads", "key", "shards", "layouts", "sent", "gathered", "world")

    def __init__(self, reads: list[tuple[ShardedParam, UnshardSpec]], key: tuple | None,
                 group_pieces: list[torch.Tensor] | None = None) -> None:
        self.reads, self.key = reads, key
        # what was sent: each member's local shard and its version counters then
        self.shards = [(e.param._local_tensor, _versions(e)) for e, _ in reads]
        first = reads[0][1]
        with torch.no_grad(), torch.inference_mode(False):
            if group_pieces is None:
                self.world, group = first.world_size, first.group_name
                self.sent, self.layouts = _pieces(reads)
            else:  # reshard_after_forward=k: the pieces kept, over the group of k
                self.world, group = first.reshard_size, first.reshard_group
                self.sent = torch.cat([piece.reshape(-1) for piece in group_pieces])
                self.layouts = [Dim0Layout(spec.full_shape, self.world) for _, spec in reads]
            self.gathered: torch.Tensor | None = all_gather(self.sent, self.world, group)

    def _wait(self) -> torch.Tensor:
        gathered = self.gathered
        if gathered is None:  # its caller took it from the state once: a second read is a bug
            raise GraphshardRuntimeError(
                "graphshard internal error: a bucket's gather issued ahead was read after it "
                "was waited for; please report this with the model's code")
        with torch.no_grad(), torch.inference_mode(False):
            gathered = _c10d.wait_tensor(gathered)
        self.gathered = self.sent = None  # what was sent may go once the collective is done
        return gathered

    def copies(self) -> list[torch.Tensor]:
        """The members' full copies (without autograd), in ``reads``'s order."""
        with torch.no_grad(), torch.inference_mode(False):
            gathered = self._wait().view(self.world, -1)
            fulls, offset = [], 0
            for layout in self.layouts:
                part = gathered[:, offset:offset + layout.piece_numel]
                offset += layout.piece_numel
                # contiguous: a piece of one element per rank would view as a strided column
                fulls.append(full_from_gathered(eager, part.reshape(-1).contiguous(), layout))
        return fulls

    def drop(self) -> None:
        """Wait for the collective and let its output go."""
        if self.gathered is not None:
            self._wait()


def issue_gather(reads: list[tuple[ShardedParam, UnshardSpec]], key: tuple | None = None,
                 group_pieces: list[torch.Tensor] | None = None) -> _PendingGather:
    """Issue the all-gather of the members in ``reads`` (records and their ``UnshardSpec``,
    all travelling alike, as ``key`` says) in one collective: of their shards over their
    group, or of ``group_pieces`` (each member's piece over its group of
    ``reshard_after_forward=k`` ranks, :mod:`graphshard.api.eager_reshard`) over that group."""
    return _PendingGather(reads, key, group_pieces)


def gather_copies(reads: list[tuple[ShardedParam, UnshardSpec]]) -> list[torch.Tensor]:
    """The full copies of the parameters in ``reads`` (records and their ``UnshardSpec``, all
    travelling alike), gathered in one collective, without autograd."""
    return issue_gather(reads).copies()


def _reads_together(state: ShardState, entry: ShardedParam) -> bool:
    """Whether ``entry``'s read in a forward that records gradients can be one of its
    bucket's reads whose gradients are reduced in one collective: it trains, its gradient is
    synchronised now with nothing held back to fold in (``no_sync``), and it is not
    re-wrapped for tensor parallelism."""
    return (torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
            and state.sync == GradSync.FULL and entry.armed is None and entry.tp is None
            and entry.param.requires_grad)


def take_gathered(state: ShardState, entry: ShardedParam) -> tuple[torch.Tensor, bool] | None:
    """The copy of ``entry``'s parameter its bucket's gather left for this read, and whether
    it carries its autograd already (one of the bucket's reads that train,
    :func:`graphshard.api.bucket_reads.read_bucket`); None when none is left, or its shard
    changed since (then it is gathered on its own)."""
    if not state.bucket_stash:
        return None
    stashed = state.bucket_stash.pop(id(entry), None)
    if stashed is None:
        return None
    full, local, versions = stashed
    if entry.param._local_tensor is not local or _versions(entry) != versions:
        return None
    return full, full.grad_fn is not None


def _versions(entry: ShardedParam) -> tuple[int, int]:
    """The version counters of ``entry``'s DTensor and of its local shard: an in-place update
    through the DTensor counts on the DTensor only, one of the local tensor on it only."""
    param = entry.param
    return param._version, param._local_tensor._version


def end_forward(state: ShardState, completed: bool = True) -> None:
    """When the forward ends: drop the copies no read took and the gathers issued ahead
    that no read waited for; the next forward gathers anew. A forward that ``completed``
    (not one an error unwound) and gathered two buckets or more sets the order the next ones
    prefetch in."""
    state.buckets_gathered.clear()
    state.bucket_stash.clear()
    state.bucket_relay = None  # a relay no read took: nothing to finish
    for pending in state.bucket_prefetched.values():
        pending.drop()
    state.bucket_prefetched.clear()
    order, state.bucket_order_now = state.bucket_order_now, []
    if completed and len(order) > 1:  # (a call of one block teaches nothing)
        state.bucket_next = {bucket: after
                             for (bucket, _), after in zip(order, order[1:], strict=False)}


def travels_as(entry: ShardedParam, spec: UnshardSpec) -> tuple | None:
    """What decides whether two members can share one collective: the group, the dtype and
    device they are gathered in, and how their gradients are reduced. None for a parameter
    without values to gather."""
    param = entry.param
    if not isinstance(param, DTensor):
        return None
    local = param._local_tensor
    if local.is_meta:
        return None
    dtype = spec.param_dtype or local.dtype
    device = spec.compute_device or local.device.type
    return (spec.world_size, spec.group_name, dtype, device, spec.reduce_dtype,
            spec.replica_group, spec.replica_size, spec.divide_factor)


def _pieces(reads: list[tuple[ShardedParam, UnshardSpec]]
            ) -> tuple[torch.Tensor, list[Dim0Layout]]:
    """What this rank sends for the members of ``reads``: their padded pieces, concatenated
    (the bucket's flat buffer itself where it is exactly that), and each member's layout."""
    layouts = [Dim0Layout(spec.full_shape, spec.world_size) for _, spec in reads]
    flat = _stored_flat(reads)
    if flat is None:
        pieces = []
        for (e, spec), layout in zip(reads, layouts, strict=True):
            local = e.param._local_tensor
            if spec.compute_device:  # CPU offload: the host shard -> the device, then cast
                local = local.to(spec.compute_device, non_blocking=True)
            if spec.param_dtype is not None:
                local = local.to(spec.param_dtype)
            pieces.append(gather_piece(eager, local, layout, rows_held(local.shape)))
        flat = torch.cat(pieces)
    return flat, layouts


def _stored_flat(reads: list[tuple[ShardedParam, UnshardSpec]]) -> torch.Tensor | None:
    """The bucket's flat buffer (:mod:`graphshard.api.bucket_storage`) when it is exactly
    the pieces to send, in this order: then nothing is copied in. (Not where it was laid out
    for another number of ranks: ``shard()`` lays a bucket out for its mesh's last dim, and a
    parameter that tensor parallelism left replicated on a (dp, tp) mesh is gathered over
    dp.)"""
    group = reads[0][0].storage_group
    if group is None or group.flat is None or not group.laid_out():
        return None
    if len(group.entries) != len(reads) or any(
            e is not g for (e, _), g in zip(reads, group.entries, strict=True)):
        return None
    if any(spec.param_dtype not in (None, e.param._local_tensor.dtype) or spec.compute_device
           for e, spec in reads):
        return None
    flat = group.flat
    offset, itemsize = flat.data_ptr(), flat.element_size()
    for e, spec in reads:  # each shard at its piece, the pieces as this gather lays them out
        if e.param._local_tensor.data_ptr() != offset:
            return None
        offset += Dim0Layout(spec.full_shape, spec.world_size).piece_numel * itemsize
    return flat if offset == flat.data_ptr() + flat.numel() * itemsize else None
