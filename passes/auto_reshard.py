"""``reshard_after_forward="auto"``: keep or free each bucket, chosen against a memory budget.

Runs inside :func:`graphshard.passes.reshard` on the joint graph, where keep (``MUST_SAVE``,
ZeRO-2 for that bucket) or free (``MUST_RECOMPUTE``, ZeRO-3: gathered again in backward) is
decided. From the joint graph and the plan alone (so every rank decides the same) it builds a
bucket-level model of the step:

- **memory per rank**, along the step (forward segment by segment, then backward in reverse):
  sharded parameters, and for those that train (a frozen one has no ``reduce_grad``) their
  gradients and ``OPTIMIZER_STATES`` optimizer states of the
  shards' size (AdamW's two; the graph does not show the optimizer), all of them padded
  pieces (the same bytes on every rank), none of them under CPU offload (they live on the
  host); the activations the forward saves for backward
  (every forward value the backward reads, minus parameters: the cut that saves everything
  at the boundary, which bounds what the min-cut partitioner saves); gathered buckets, alive
  from their (prefetched) all-gather to their last use, a kept bucket's backward part until
  its last backward use; the backward's re-gathered buckets, prefetched ``d`` ahead; each
  bucket's full gradients from its first gradient until its reduce-scatter has run.
- **time**: forward and backward on one compute and one comm stream, per bucket: forward
  compute from the cost model between buckets' first reads, backward compute twice that,
  all-gathers and reduce-scatters priced by the cost model's ring formulas, gathers issued
  ``d`` buckets ahead as :func:`graphshard.passes.prefetch` issues them. Under CPU offload
  a gather also waits for its shards' copy from the host (the profile's host link): a bucket
  gathered again in backward crosses the bus again, which keeping it saves.

The search: for each prefetch depth from ``plan.prefetch_depth`` down to 0, free buckets in
order of least predicted added time (ties: most bytes saved, then bucket index) until the
predicted peak fits the budget, then keep again any freed bucket that still fits; of the
depths whose schedule fits, the fastest predicted one wins (ties: the deeper prefetch). With
no budget everything is kept at ``plan.prefetch_depth``. When nothing fits, every bucket is
freed at depth 0 (the least memory the model predicts) and a warning says by how much the
budget is exceeded.

Everything here is a prediction: the real peak also holds what the model does not see
(the allocator's fragmentation, Inductor's temporaries, the loss's inputs, communication
buffers of the backend).
"""

from __future__ import annotations

import math
import operator
import warnings
from dataclasses import dataclass, field

import torch
from torch import fx

from graphshard.passes.cost_model import (
    HardwareProfile,
    all_gather_time,
    node_time,
    reduce_scatter_time,
    tensor_bytes,
)
from graphshard.passes.layout import Dim0Layout
from graphshard.passes.markers import RESHARD_AUTO, is_reduce_grad, is_unshard, marker_args
from graphshard.passes.plan import use_all_to_all

__all__ = [
    "OPTIMIZER_STATES",
    "BucketReshard",
    "ReshardChoice",
    "choose_reshard",
    "default_memory_budget",
    "format_bytes",
    "resolve_budget",
]

OPTIMIZER_STATES = 2  # optimizer tensors per parameter element, the shard's size (AdamW)

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
_VIEWS = {
    aten.view.default, aten.slice.Tensor, aten.clone.default, aten.permute.default,
    aten.t.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.alias.default, aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim,
    aten._to_copy.default, aten.detach.default,
}

def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it above 1 (``1.50 GiB``)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def default_memory_budget(device: torch.device | str | None) -> int | None:
    """The budget when none is given: the memory of the CUDA device the parameters are
    gathered on, None elsewhere (the CPU, fake tensors offline: everything fits)."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(torch.cuda.get_device_properties(index).total_memory)


@dataclass(frozen=True)
class BucketReshard:
    """The choice for one bucket (forward order)."""

    bucket: int
    params: tuple[str, ...]
    gathered_bytes: int  # the bucket's all-gathered (unsharded) bytes in forward
    backward_bytes: int  # of which the backward reads: kept, or gathered again
    keep: bool  # True: kept from forward to backward (ZeRO-2); False: freed (ZeRO-3)
    auto: bool = True  # False: fixed by reshard_after_forward=True/False, not chosen
    added_s: float = 0.0  # predicted step time freeing it adds, all else kept


@dataclass(frozen=True)
class ReshardChoice:
    """What ``reshard_after_forward="auto"`` chose for one compiled graph, and why."""

    buckets: tuple[BucketReshard, ...]
    prefetch_depth: int
    budget: int | None  # bytes per rank; None: no budget (everything fits)
    predicted_peak_bytes: int
    predicted_step_s: float
    fits: bool
    state_bytes: int  # sharded parameters + gradients + optimizer state, per rank
    activation_bytes: int  # saved for backward (the boundary cut)
    keep_all_peak_bytes: int  # the predicted peak with every bucket kept
    keep_all_step_s: float
    free_all_peak_bytes: int  # with every bucket freed, at depth 0
    zero3_peak_bytes: int  # what reshard_after_forward=True predicts: all but the last freed
    peaks: dict[int, int] = field(default_factory=dict)  # depth -> peak of its choice

    def keeps(self, bucket: int) -> bool:
        """Whether ``bucket``'s gathered parameters are kept for backward."""
        return next(b.keep for b in self.buckets if b.bucket == bucket)

    @property
    def kept(self) -> list[int]:
        """Buckets kept for backward (forward order); not those the backward never reads."""
        return [b.bucket for b in self.buckets if b.keep and b.backward_bytes]

    @property
    def unread(self) -> list[int]:
        """Buckets the backward never reads (an untied embedding): nothing is kept for it or
        gathered again, whatever the choice."""
        return [b.bucket for b in self.buckets if not b.backward_bytes]

    @property
    def freed(self) -> list[int]:
        """Buckets freed after forward and gathered again in backward."""
        return [b.bucket for b in self.buckets if not b.keep and b.backward_bytes]

    def format(self) -> str:
        """A summary line and a table, one row per bucket."""
        budget = "none (everything fits)" if self.budget is None else format_bytes(self.budget)
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines = [
            f"memory budget {budget}; predicted peak {format_bytes(self.predicted_peak_bytes)} "
            f"({verdict}; state {format_bytes(self.state_bytes)}, activations "
            f"{format_bytes(self.activation_bytes)}), prefetch depth {self.prefetch_depth}, "
            f"predicted step {self.predicted_step_s * 1e3:.3f} ms; keep all: peak "
            f"{format_bytes(self.keep_all_peak_bytes)}, {self.keep_all_step_s * 1e3:.3f} ms; "
            f"free all: peak {format_bytes(self.free_all_peak_bytes)}",
            "| bucket | params | gathered | backward reads | choice | freeing adds ms |",
            "|---|---|---|---|---|---|",
        ]
        for b in self.buckets:
            names = ", ".join(b.params[:2]) + (f", +{len(b.params) - 2}" if len(b.params) > 2
                                               else "")
            choice = ("not read in backward" if not b.backward_bytes
                      else "keep (ZeRO-2)" if b.keep else "free (ZeRO-3)")
            choice += "" if b.auto or not b.backward_bytes else ", fixed"
            lines.append(f"| {b.bucket} | {names} | {format_bytes(b.gathered_bytes)} | "
                         f"{format_bytes(b.backward_bytes)} | {choice} | "
                         f"{b.added_s * 1e3:.3f} |")
        return "\n".join(lines)


@dataclass
class _Bucket:
    index: int
    names: list[str]
    gathered: int  # forward all-gather bytes
    backward: int  # bytes of the parameters the backward reads
    grad: int  # full gradient bytes (reduce dtype)
    reduce_buffers: int  # bytes the reduction allocates (padded send buffer, received pieces)
    first: int  # forward segment of its first read
    last: int  # forward segment of its last read
    bw_lo: int  # backward reads span forward segments [bw_lo, bw_hi]
    bw_hi: int
    auto: bool
    fixed_keep: bool
    host_bytes: int = 0  # CPU offload: shard bytes copied from the host for each gather

    def copied(self, nbytes: int) -> int:
        """Host bytes copied to gather ``nbytes`` of the bucket (the backward's share)."""
        return self.host_bytes * nbytes // self.gathered if self.gathered else 0


@dataclass
class _Step:
    """The bucket-level model of one step."""

    segments: int
    fw_compute: list[float]  # per forward segment
    saved: list[int]  # activation bytes saved per forward segment
    state: int
    buckets: list[_Bucket]  # in forward order (first read)
    world: int
    profile: HardwareProfile

    # positions: forward segment s -> s; the backward of segment s -> two, its compute
    # (``bw``: parameters, activations and gradients in use) then the reductions issued
    # after it (``bw + 1``: gradients copied into the reduction's buffers, the previous
    # reduction waited for)
    def bw(self, s: int) -> int:
        return self.segments + 2 * (self.segments - 1 - s)

    def peak(self, keep: dict[int, bool], depth: int) -> int:
        n = 3 * self.segments
        delta = [0] * (n + 2)

        def alive(start: int, end: int, size: int) -> None:
            if size and end >= start:
                delta[start] += size
                delta[end + 1] -= size

        for s, size in enumerate(self.saved):
            alive(s, self.bw(s), size)
        order = self.buckets
        for k, b in enumerate(order):
            issue = order[k - depth].first if k >= depth else 0
            alive(issue, issue, b.host_bytes)  # offload: the shards' device copy, gathered
            if keep[b.index] and b.backward:
                alive(issue, b.last, b.gathered - b.backward)
                alive(issue, self.bw(b.bw_lo), b.backward)
            else:
                alive(issue, b.last, b.gathered)
        regather = sorted((b for b in order if not keep[b.index] and b.backward),
                          key=lambda b: (-b.bw_hi, b.first))
        for k, b in enumerate(regather):
            issue = self.bw(regather[k - depth].bw_hi) if k >= depth else self.segments
            alive(issue, issue, b.copied(b.backward))
            alive(issue, self.bw(b.bw_lo), b.backward)
        # each bucket's full gradients from the first one computed until they are copied into
        # the reduction's buffer; the buffers until the next reduction is issued (its wait)
        reduces = sorted(order, key=lambda b: (-b.first, b.index))
        for k, b in enumerate(reduces):
            alive(self.bw(b.last), self.bw(b.first) + 1, b.grad)
            until = self.bw(reduces[k + 1].first) + 1 if k + 1 < len(reduces) else n - 1
            alive(self.bw(b.first) + 1, until, b.reduce_buffers)
        peak = live = 0
        for d in delta[:n]:
            live += d
            peak = max(peak, live)
        return self.state + peak

    def time(self, keep: dict[int, bool], depth: int) -> float:
        prof, world = self.profile, self.world
        t = comm = 0.0
        # forward: every bucket gathered, in order of first read, ``depth`` ahead
        order = self.buckets
        ends: list[float] = []
        starts = [b.first for b in order] + [self.segments]

        def issue_upto(k: int, now: float, seq: list, costs: list[float], out: list) -> None:
            nonlocal comm
            while len(out) <= min(k, len(seq) - 1):
                start = max(now, comm)
                comm = start + costs[len(out)]
                out.append(comm)

        def gather_cost(b: _Bucket, nbytes: int) -> float:  # the host copy first (offload)
            return all_gather_time(nbytes, world, prof) + prof.host_copy_time(b.copied(nbytes))

        costs = [gather_cost(b, b.gathered) for b in order]
        t = sum(self.fw_compute[: starts[0]]) if order else sum(self.fw_compute)
        for k in range(len(order)):
            issue_upto(k + depth, t, order, costs, ends)
            t = max(t, ends[k])
            t += sum(self.fw_compute[starts[k]: starts[k + 1]])
        # backward: segments in reverse; re-gathers prefetched ``depth`` ahead; each bucket's
        # reduce-scatter issued once its first segment's backward has run
        regather = sorted((b for b in order if not keep[b.index] and b.backward),
                          key=lambda b: (-b.bw_hi, b.first))
        regather_costs = [gather_cost(b, b.backward) for b in regather]
        waits: dict[int, list[int]] = {}
        for k, b in enumerate(regather):
            waits.setdefault(b.bw_hi, []).append(k)
        reduce_at: dict[int, list[_Bucket]] = {}
        for b in order:
            if b.grad:  # a bucket of frozen parameters reduces nothing
                reduce_at.setdefault(b.first, []).append(b)
        bw_ends: list[float] = []
        if regather:
            issue_upto(depth, t, regather, regather_costs, bw_ends)
        for s in range(self.segments - 1, -1, -1):
            for k in waits.get(s, ()):
                issue_upto(k + depth, t, regather, regather_costs, bw_ends)
                t = max(t, bw_ends[k])
            t += 2 * self.fw_compute[s]
            for b in reduce_at.get(s, ()):
                comm = max(t, comm) + reduce_scatter_time(b.grad, world, prof)
        return max(t, comm)


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes the forward does not need: everything but the ancestors of the forward outputs
    (the joint graph returns the forward's outputs, then one gradient per primal)."""
    primals = [n for n in graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]
    outputs = list(graph.find_nodes(op="output")[0].args[0])
    forward_outs = outputs[: max(0, len(outputs) - len(primals))]
    forward: set[fx.Node] = set()
    stack = [o for o in forward_outs if isinstance(o, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in forward:
            forward.add(node)
            stack.extend(node.all_input_nodes)
    return {n for n in graph.nodes if n not in forward and n.op not in ("placeholder", "output")}


def _derived(marker: fx.Node, backward: set[fx.Node]) -> set[fx.Node]:
    """``marker`` and the forward nodes made from it by views and casts: the parameter."""
    found, stack = {marker}, [marker]
    while stack:
        for user in stack.pop().users:
            if (user not in found and user not in backward and user.op == "call_function"
                    and (user.target in _VIEWS or getattr(user.target, "is_view", False))):
                found.add(user)
                stack.append(user)
    return found


def _model(gm: fx.GraphModule, plan) -> _Step | None:
    graph = gm.graph
    markers = [n for n in graph.nodes if is_unshard(n)]
    if not markers:
        return None
    backward = _backward_nodes(graph)
    segment: dict[fx.Node, int] = {}
    current = 0
    seen_marker = False
    for node in graph.nodes:
        if is_unshard(node):
            current += seen_marker
            seen_marker = True
        segment[node] = current
    segments = current + 1
    params: set[fx.Node] = set()
    per_marker: dict[fx.Node, tuple[set[fx.Node], bool, int]] = {}
    for m in markers:
        derived = _derived(m, backward)
        params |= derived
        users = [u for d in derived for u in d.users]
        needed = any(u in backward for u in users)
        last = max((segment[u] for u in users if u not in backward), default=segment[m])
        per_marker[m] = (derived, needed, last)
    fw_compute = [0.0] * segments
    saved = [0] * segments
    for node in graph.nodes:
        if node.op != "call_function" or node in backward or node in params:
            continue
        if "val" in node.meta:
            fw_compute[segment[node]] += node_time(node, plan.profile)
            if isinstance(node.meta["val"], (tuple, list)):
                # several outputs (a block region's call): the ones the backward reads, which
                # it reads through getitem nodes that belong to no forward output
                saved[segment[node]] += sum(
                    tensor_bytes(u.meta.get("val")) for u in node.users
                    if u in backward and u.target is operator.getitem)
            elif any(u in backward for u in node.users):
                saved[segment[node]] += tensor_bytes(node.meta["val"])

    backends = {n.meta.get("group_backend") for n in graph.nodes if is_reduce_grad(n)}
    all_to_all = use_all_to_all(plan.reduce_scatter_via, next(iter(sorted(
        b for b in backends if b)), None))
    buckets: dict[int, _Bucket] = {}
    state = 0
    counted: set[str] = set()
    trained = {marker_args(n).name for n in graph.nodes if is_reduce_grad(n)}
    world = 1
    for m in markers:
        args = marker_args(m)
        world = args.world_size
        derived, needed, last = per_marker[m]
        first = segment[m]
        b = buckets.get(args.bucket)
        if b is None:
            b = buckets[args.bucket] = _Bucket(
                args.bucket, [], 0, 0, 0, 0, first, last, segments, -1,
                auto=args.reshard == RESHARD_AUTO, fixed_keep=not args.reshard)
        b.first, b.last = min(b.first, first), max(b.last, last)
        if needed:
            b.bw_lo, b.bw_hi = min(b.bw_lo, first), max(b.bw_hi, last)
        if args.name in counted:  # a parameter read under two markers counts once
            continue
        counted.add(args.name)
        b.names.append(args.name)
        val = m.meta["val"]
        full = tensor_bytes(val)
        b.gathered += full
        b.backward += full if needed else 0
        shard_val = args.shard.meta.get("val") if isinstance(args.shard, fx.Node) else None
        shard_dtype = shard_val.dtype if isinstance(shard_val, torch.Tensor) else val.dtype
        reduce_dtype = args.reduce_dtype or val.dtype
        numel = math.prod(int(s) for s in args.full_shape)
        piece = Dim0Layout([int(s) for s in args.full_shape], args.world_size).piece_numel
        trains = args.name in trained  # a frozen parameter: no gradient, no optimizer state
        if trains:
            b.grad += numel * reduce_dtype.itemsize
            padded = piece * args.world_size * reduce_dtype.itemsize  # the interleaved buffer
            # all-to-all: the buffer and the pieces received; reduce-scatter: the buffer and
            # this rank's piece
            b.reduce_buffers += padded + (padded if all_to_all else padded // args.world_size)
        if args.compute_device:  # CPU offload: the shard state is on the host
            b.host_bytes += piece * shard_dtype.itemsize
        else:
            state += piece * shard_dtype.itemsize * (1 + (1 + OPTIMIZER_STATES) * trains)
    for b in buckets.values():
        if b.bw_hi < 0:
            b.bw_lo = b.bw_hi = b.last
    ordered = sorted(buckets.values(), key=lambda b: (b.first, b.index))
    return _Step(segments, fw_compute, saved, state, ordered, world, plan.profile)


def _last_bucket(step: _Step) -> int:
    return max(step.buckets, key=lambda b: (b.last, b.first)).index


def choose_reshard(gm: fx.GraphModule, plan, budget: int | None = None) -> ReshardChoice | None:
    """Choose keep or free per ``auto`` bucket of the joint graph ``gm`` (see the module doc);
    None when the graph has no ``unshard`` marker. ``budget``: bytes per rank (None: no
    budget). Buckets whose markers are not ``auto`` keep their fixed policy (the bucket read
    last in forward is kept unless ``plan.reshard_last_bucket``, as :func:`reshard` does)."""
    step = _model(gm, plan)
    if step is None:
        return None
    last = None if plan.reshard_last_bucket else _last_bucket(step)
    fixed = {b.index: b.fixed_keep or b.index == last for b in step.buckets if not b.auto}
    auto = [b for b in step.buckets if b.auto and b.backward]
    base = {b.index: True for b in step.buckets} | fixed  # a bucket the backward never reads:
    # kept or freed alike (nothing is saved, nothing gathered again); reported as unread

    def evaluate(keep: dict[int, bool], depth: int) -> tuple[float, int]:
        return step.time(keep, depth), step.peak(keep, depth)

    keep_all_time, keep_all_peak = evaluate(base, plan.prefetch_depth)
    added: dict[int, float] = {}
    for b in auto:
        added[b.index] = step.time(base | {b.index: False}, plan.prefetch_depth) - keep_all_time
    candidates = []  # (time, -depth, peak, keep)
    depths = [plan.prefetch_depth] if budget is None else range(plan.prefetch_depth, -1, -1)
    for depth in depths:
        keep = dict(base)
        order = sorted(auto, key=lambda b: (added[b.index], -b.backward, b.index))
        freed = []
        for b in order:
            if budget is None or step.peak(keep, depth) <= budget:
                break
            keep[b.index] = False
            freed.append(b)
        if budget is not None and step.peak(keep, depth) > budget:
            continue
        for b in reversed(freed):  # keep again what still fits, the costliest first
            trial = keep | {b.index: True}
            if step.peak(trial, depth) <= budget:
                keep = trial
        time, peak = evaluate(keep, depth)
        candidates.append((time, -depth, peak, keep))
    all_free = base | {b.index: False for b in auto}
    free_all_peak = step.peak(all_free, 0)
    zero3_peak = step.peak(all_free | {_last_bucket(step): True}, plan.prefetch_depth)
    if candidates:
        time, neg_depth, peak, keep = min(candidates, key=lambda c: c[:3])
        depth, fits = -neg_depth, True
    else:
        keep, depth, fits = all_free, 0, False
        time, peak = evaluate(keep, depth)
        warnings.warn(
            f"graphshard reshard_after_forward='auto': no schedule fits memory_budget="
            f"{format_bytes(budget)} per rank (predicted peak with every bucket freed and no "
            f"prefetch: {format_bytes(peak)}); freeing every bucket. Raise the budget, use "
            "smaller buckets, mixed precision or activation checkpointing.",
            stacklevel=2,
        )
    rows = tuple(
        BucketReshard(b.index, tuple(b.names), b.gathered, b.backward, keep[b.index],
                      b.auto, added.get(b.index, 0.0))
        for b in step.buckets
    )
    return ReshardChoice(
        rows, depth, budget, peak, time, fits, step.state, sum(step.saved), keep_all_peak,
        keep_all_time, free_all_peak, zero3_peak, {-c[1]: c[2] for c in candidates},
    )


def resolve_budget(gm: fx.GraphModule, plan) -> int | None:
    """``plan.memory_budget``, or the default for the device the markers gather on."""
    if plan.memory_budget is not None:
        return plan.memory_budget
    marker = next((n for n in gm.graph.nodes if is_unshard(n)), None)
    val = marker.meta.get("val") if marker is not None else None
    return default_memory_budget(val.device) if isinstance(val, torch.Tensor) else None
