"""Unit tests of single graph passes on small graphs built by hand.

Each graph is built node by node: fake placeholders, then ops whose ``meta["val"]`` the ops
themselves compute (``NodeMaker``), the markers with their real argument specs. One pass runs
through the ``PassRunner`` (lint, recompile and invariants after it), and the test asserts what
the pass's rule changes: targets, order, shapes, byte sizes, counts. The lowered collectives
are also run in this process, ranks one after the other with the collective done by hand, to
check that the bytes they move rebuild the right tensors.
"""

from __future__ import annotations

import pytest
import torch
from graph_utils import c10d, calls, fake_process_group, schedule_string
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import CheckpointPolicy

from graphshard.passes import (
    Plan,
    assign_buckets,
    dedupe_unshard,
    fold_views,
    keep_group_pieces,
    lower_reduce_grad,
    lower_unshard,
    merge_reduce_grad,
    overlap_reduce,
    prefetch,
    read_forward_gathers,
    reshard,
)
from graphshard.passes.errors import GraphLoweringError
from graphshard.passes.fx_util import NodeMaker
from graphshard.passes.layout import Dim0Layout
from graphshard.passes.markers import (
    REDUCE_GRAD,
    TAKE_GROUP_PIECE,
    UNSHARD,
    ReduceGradArgs,
    UnshardSpec,
    marker_args,
)
from graphshard.passes.runner import PassRunner

aten = torch.ops.aten
prims = torch.ops.prims
AG = c10d.all_gather_into_tensor.default
RS = c10d.reduce_scatter_tensor.default
AR = c10d.all_reduce.default
A2A = c10d.all_to_all_single.default
WAIT = c10d.wait_tensor.default
WORLD = 2


@pytest.fixture(scope="module")
def group():
    """The name of a fake process group of two ranks (what ``shard()`` writes in markers)."""
    with fake_process_group(WORLD) as pg:
        yield pg.group_name


class Builder:
    """A graph under construction: fake inputs first, then ops with their fake values."""

    def __init__(self, group: str) -> None:
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()
        self.group = group
        self._make: NodeMaker | None = None

    def input(self, name: str, *shape: int, dtype: torch.dtype = torch.float32) -> fx.Node:
        assert self._make is None, "inputs come first"
        node = self.graph.placeholder(name)
        node.meta["val"] = self.mode.from_tensor(torch.empty(shape, dtype=dtype))
        return node

    def __call__(self, target, *args, **kwargs) -> fx.Node:
        if self._make is None:
            self._make = NodeMaker(self.graph)
        return self._make(target, *args, **kwargs)

    def unshard(self, shard: fx.Node, full_shape, bucket: int, name: str, **spec) -> fx.Node:
        fields = dict(full_shape=list(full_shape), bucket=bucket, pinned=False, reshard=True,
                      name=name, world_size=WORLD, group_name=self.group, param_dtype=None,
                      reduce_dtype=None, replica_group="", replica_size=1, compute_device="")
        return self(UNSHARD, shard, *UnshardSpec(**{**fields, **spec}))

    def reduce_grad(self, grad: fx.Node, bucket: int, name: str, local_rows: int,
                    **kwargs) -> fx.Node:
        args = ReduceGradArgs(grad, bucket, name, WORLD, self.group, local_rows=local_rows,
                              **kwargs)
        return self(REDUCE_GRAD, *args)

    def gather(self, shard: fx.Node, bucket: int) -> fx.Node:
        """A lowered bucket: its all-gather (tagged as ``lower_unshard`` tags it) and wait."""
        gathered = self(AG, shard, WORLD, self.group)
        gathered.meta["graphshard"] = {"kind": "unshard", "bucket": bucket, "params": []}
        return self(WAIT, gathered)

    def module(self, *outputs: fx.Node) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        return fx.GraphModule(torch.nn.Module(), self.graph)


def run(stage: str, fn, gm: fx.GraphModule, **plan) -> fx.GraphModule:
    """``gm`` after the one pass ``fn``, through the runner (invariants checked)."""
    return PassRunner().run(stage, [fn], gm, Plan(**plan))


def targets(gm: fx.GraphModule) -> list:
    """The targets of the graph's call_function nodes, in order."""
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def outputs(gm: fx.GraphModule) -> tuple:
    return gm.graph.find_nodes(op="output")[0].args[0]


def shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def nbytes(node: fx.Node) -> int:
    val = node.meta["val"]
    return val.numel() * val.element_size()


class _Comm(fx.Interpreter):
    """Runs one rank's lowered graph; each all-gather or reduce-scatter returns what
    ``results`` holds for it (zeros on the first run) and records what the rank sent."""

    def __init__(self, gm: fx.GraphModule, rank: int, results: dict | None) -> None:
        super().__init__(gm)
        self.rank, self.results, self.sent = rank, results, {}

    def run_node(self, n: fx.Node):
        if n.op == "call_function" and n.target in (AG, RS, A2A):
            key = (n.target, n.meta["graphshard"]["bucket"])
            self.sent[key] = (self.env[n.args[0]].clone(), n.args[1])
            if self.results is None:
                return torch.zeros(n.meta["val"].shape, dtype=n.meta["val"].dtype)
            return self.results[key][self.rank]
        if n.op == "call_function" and n.target is WAIT:
            return self.env[n.args[0]]
        return super().run_node(n)


def run_ranks(graphs: list[fx.GraphModule], inputs: list[list[torch.Tensor]]) -> list:
    """Each rank's outputs, its gathers and reduce-scatters done in this process."""
    first = [_Comm(gm, r, None) for r, gm in enumerate(graphs)]
    for interp, args in zip(first, inputs, strict=True):
        interp.run(*args)
    results = {}
    for key in first[0].sent:
        sent = [interp.sent[key][0] for interp in first]
        if key[0] is AG:
            results[key] = [torch.cat(sent)] * WORLD
        elif key[0] is A2A:  # rank r receives every rank's r-th piece, in rank order
            results[key] = [torch.cat([s.chunk(WORLD)[r] for s in sent]) for r in range(WORLD)]
        else:
            op = first[0].sent[key][1]  # "avg", or "sum" of pre-scaled fp16
            total = torch.stack(sent).mean(0) if op == "avg" else torch.stack(sent).sum(0)
            results[key] = list(total.chunk(WORLD))
    return [_Comm(gm, r, results).run(*args)
            for r, (gm, args) in enumerate(zip(graphs, inputs, strict=True))]


# --------------------------------------------------------------------------- dedupe_unshard


def _dynamo_reads(group: str, params: list[str], to_local: bool = True) -> fx.GraphModule:
    """A Dynamo-stage graph reading the DTensor parameters ``params`` (by name; a name twice
    is a second read) each through its own ``to_local()`` and marker, and summing them."""
    graph = fx.Graph()
    inputs = {name: graph.placeholder(name) for name in dict.fromkeys(params)}
    total = None
    for name in params:
        shard = graph.call_method("to_local", (inputs[name],)) if to_local else inputs[name]
        spec = UnshardSpec([4, 8], 0, False, True, name, WORLD, group, None, None, "", 1, "")
        read = graph.call_function(UNSHARD, (shard, *spec))
        total = read if total is None else graph.call_function(torch.add, (total, read))
    graph.output((total,))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_dedupe_points_a_second_read_at_the_first_marker(group):
    """Two reads of one parameter: one marker and one ``to_local`` are left, used twice."""
    gm = run("dynamo", dedupe_unshard, _dynamo_reads(group, ["w", "w"]))
    (marker,) = calls(gm, UNSHARD)
    to_locals = [n for n in gm.graph.nodes if n.op == "call_method"]
    assert len(to_locals) == 1 and marker.args[0] is to_locals[0]
    (add,) = calls(gm, torch.add)
    assert add.args == (marker, marker)


def test_dedupe_merges_reads_of_a_plain_input(group):
    """A marker reading the graph input directly (no ``to_local``) is merged all the same."""
    gm = run("dynamo", dedupe_unshard, _dynamo_reads(group, ["w", "w", "w"], to_local=False))
    (marker,) = calls(gm, UNSHARD)
    assert marker.args[0].op == "placeholder"
    assert [a is marker for add in calls(gm, torch.add) for a in add.args].count(True) == 3


def test_dedupe_never_points_a_read_that_trains_at_one_without_gradients(group):
    """Reads of ``w`` traced under no_grad, with grad, no_grad, grad (Dynamo's example value
    says which): the first read that trains keeps its own marker (pointed at the no-grad one,
    the parameter got no gradient at all), and every later read shares it."""
    gm = _dynamo_reads(group, ["w"] * 4)
    for marker, trains in zip(calls(gm, UNSHARD), [False, True, False, True], strict=True):
        marker.meta["example_value"] = torch.empty(4, 8, requires_grad=trains)
    gm = run("dynamo", dedupe_unshard, gm)
    first, training = calls(gm, UNSHARD)
    assert not first.meta["example_value"].requires_grad
    assert training.meta["example_value"].requires_grad
    reads = [calls(gm, torch.add)[0].args[0]] + [add.args[1] for add in calls(gm, torch.add)]
    assert reads == [first, training, training, training]


def test_dedupe_keeps_one_marker_per_distinct_parameter(group):
    """Different parameters are not merged, even with the same shape and bucket."""
    gm = run("dynamo", dedupe_unshard, _dynamo_reads(group, ["w", "v", "w"]))
    assert [marker_args(n).name for n in calls(gm, UNSHARD)] == ["w", "v"]
    assert len([n for n in gm.graph.nodes if n.op == "call_method"]) == 2


# --------------------------------------------------------------------------------- fold_views


def test_fold_views_marker_reads_its_parameter_through_a_view_chain(group):
    """``alias`` then a same-shape ``view`` between input and marker: both folded away."""
    b = Builder(group)
    x, w = b.input("x", 4, 8), b.input("w", 3, 8)
    v = b(aten.view.default, b(aten.alias.default, w), [3, 8])
    u = b.unshard(v, [5, 8], 0, "w")
    gm = run("joint", fold_views, b.module(b(aten.mm.default, x, b(aten.t.default, u))))
    (marker,) = calls(gm, UNSHARD)
    assert marker.args[0] is w
    assert targets(gm) == [UNSHARD, aten.t.default, aten.mm.default]


def test_fold_views_keeps_a_reshaping_view_and_one_still_used(group):
    """A view that changes the shape is no no-op; a no-op view another node reads stays."""
    b = Builder(group)
    w, v = b.input("w", 3, 8), b.input("v", 3, 8)
    flat = b(aten.view.default, w, [24])
    uw = b.unshard(flat, [5, 8], 0, "w")
    same = b(aten.view.default, v, [3, 8])
    uv = b.unshard(same, [5, 8], 0, "v")
    gm = run("joint", fold_views, b.module(uw, uv, b(aten.relu.default, same)))
    uw, uv = calls(gm, UNSHARD)
    assert uw.args[0] is flat and uv.args[0] is v
    assert len(calls(gm, aten.view.default)) == 2  # neither view dropped


def test_fold_views_gradient_view_chain_is_replaced_by_the_marker(group):
    """No-op views of a ``reduce_grad`` result: the gradient returned is the marker's."""
    b = Builder(group)
    g = b.input("g", 5, 8)
    r = b.reduce_grad(g, 0, "w", local_rows=3)
    chain = b(aten.alias.default, b(aten.view.default, r, [3, 8]))
    reshaped = b(aten.view.default, r, [24])  # not a no-op: kept
    gm = run("joint", fold_views, b.module(chain, reshaped))
    (marker,) = calls(gm, REDUCE_GRAD)
    assert outputs(gm)[0] is marker
    assert targets(gm) == [REDUCE_GRAD, aten.view.default]
    assert outputs(gm)[1].args == (marker, [24])


# -------------------------------------------------------------------------- merge_reduce_grad


def _summed_reads(group: str, n: int, **first_kwargs) -> fx.GraphModule:
    """``n`` ``reduce_grad`` of parameter ``w`` (one per read), their results summed."""
    b = Builder(group)
    grads = [b.input(f"g{i}", 5, 8) for i in range(n)]
    pending = b.input("pending", 5, 8) if first_kwargs else None
    kwargs = {k: pending for k in first_kwargs}
    reads = [b.reduce_grad(g, 0, "w", local_rows=3, **(kwargs if i == 0 else {}))
             for i, g in enumerate(grads)]
    total = reads[0]
    for read in reads[1:]:
        total = b(aten.add.Tensor, total, read)
    return b.module(total)


def test_merge_reduce_grad_reduces_the_summed_gradients_once(group):
    """Two reductions of ``w`` summed: one reduction of ``g0 + g1``, which is returned."""
    gm = run("joint", merge_reduce_grad, _summed_reads(group, 2))
    (marker,) = calls(gm, REDUCE_GRAD)
    (add,) = calls(gm, aten.add.Tensor)
    assert [a.name for a in add.args] == ["g0", "g1"]
    assert marker.args[0] is add and marker_args(marker).local_rows == 3
    assert outputs(gm) == (marker,) and shape(marker) == (3, 8)
    assert targets(gm) == [aten.add.Tensor, REDUCE_GRAD]


def test_merge_reduce_grad_folds_a_tree_of_three_and_keeps_pending(group):
    """Three reads: the full gradients are summed in order; ``no_sync``'s pending gradient,
    carried by the first read only, is kept on the merged reduction."""
    gm = run("joint", merge_reduce_grad, _summed_reads(group, 3, pending_full=True))
    (marker,) = calls(gm, REDUCE_GRAD)
    args = marker_args(marker)
    assert args.pending_full is not None and args.pending_full.name == "pending"
    outer = args.grad
    assert outer.target is aten.add.Tensor and outer.args[1].name == "g2"
    assert outer.args[0].target is aten.add.Tensor
    assert [a.name for a in outer.args[0].args] == ["g0", "g1"]
    assert outputs(gm) == (marker,)


def test_merge_reduce_grad_leaves_reductions_used_apart(group):
    """Reductions of one parameter whose results are not only summed are left as they are,
    and so are reductions of different parameters summed together."""
    b = Builder(group)
    g0, g1, g2 = b.input("g0", 5, 8), b.input("g1", 5, 8), b.input("g2", 5, 8)
    r0, r1 = b.reduce_grad(g0, 0, "w", 3), b.reduce_grad(g1, 0, "w", 3)
    other = b(aten.add.Tensor, b.reduce_grad(g2, 0, "v", 3), r1)  # w's read and v's summed
    gm = b.module(r0, other)
    before = targets(gm)
    gm = run("joint", merge_reduce_grad, gm)
    assert targets(gm) == before and len(calls(gm, REDUCE_GRAD)) == 3


# ---------------------------------------------------------------------------- assign_buckets


def _joint_params(group: str, bf16: bool = False, pinned: str = "") -> fx.GraphModule:
    """Four parameters read in order a [5, 8], b [5], c [8, 8], d [8] (160, 20, 256 and 32
    bytes in fp32), all in bucket 0 (``pinned`` in bucket 5, pinned), each with its
    gradient's ``reduce_grad`` in the same bucket."""
    b = Builder(group)
    shapes = {"a": [5, 8], "b": [5], "c": [8, 8], "d": [8]}
    shards = {n: b.input(n, (s[0] + 1) // 2, *s[1:]) for n, s in shapes.items()}
    grads = {n: b.input(f"grad_{n}", *s) for n, s in shapes.items()}
    dtype = torch.bfloat16 if bf16 else None
    out = []
    for name, full in shapes.items():
        bucket = 5 if name == pinned else 0
        out.append(b.unshard(shards[name], full, bucket, name, param_dtype=dtype,
                             pinned=name == pinned))
    for name, full in shapes.items():
        out.append(b.reduce_grad(grads[name], 5 if name == pinned else 0, name,
                                 (full[0] + 1) // 2))
    return b.module(*out)


def buckets(gm: fx.GraphModule, marker) -> dict[str, int]:
    return {marker_args(n).name: marker_args(n).bucket for n in calls(gm, marker)}


def test_block_bucketing_leaves_the_buckets(group):
    """``block``: the buckets ``shard()`` chose are kept."""
    gm = run("joint", assign_buckets, _joint_params(group), bucketing="block", bucket_bytes=1)
    assert set(buckets(gm, UNSHARD).values()) == {0}


def test_size_bucketing_packs_in_read_order_and_moves_the_gradients_along(group):
    """``size``: consecutive parameters while the bucket stays within ``bucket_bytes`` (one
    larger than the cap is a bucket alone); each gradient follows its parameter."""
    gm = run("joint", assign_buckets, _joint_params(group), bucketing="size", bucket_bytes=180)
    assert buckets(gm, UNSHARD) == {"a": 0, "b": 0, "c": 1, "d": 2}
    assert buckets(gm, REDUCE_GRAD) == buckets(gm, UNSHARD)


def test_size_bucketing_counts_the_gathered_dtype(group):
    """With ``param_dtype=bf16`` a parameter weighs half: c and d now share a bucket."""
    gm = run("joint", assign_buckets, _joint_params(group, bf16=True), bucketing="size",
             bucket_bytes=180)
    assert buckets(gm, UNSHARD) == {"a": 0, "b": 0, "c": 1, "d": 1}


def test_size_bucketing_keeps_pinned_buckets_and_numbers_the_rest_after(group):
    """A pinned bucket is kept; the others are packed from the next free index."""
    gm = run("joint", assign_buckets, _joint_params(group, pinned="a"), bucketing="size",
             bucket_bytes=180)
    assert buckets(gm, UNSHARD) == {"a": 5, "b": 6, "c": 7, "d": 8}
    assert buckets(gm, REDUCE_GRAD) == buckets(gm, UNSHARD)


def test_auto_bucketing_merges_without_compute_and_splits_under_a_cap(group):
    """``auto``: with no compute to hide a gather, one bucket pays the latency once; a cap
    that two neighbouring parameters exceed together gives one parameter per bucket."""
    gm = run("joint", assign_buckets, _joint_params(group), bucketing="auto")
    assert set(buckets(gm, UNSHARD).values()) == {0}
    gm = run("joint", assign_buckets, _joint_params(group), bucketing="auto",
             max_unsharded_bytes=300)
    assert buckets(gm, UNSHARD) == {"a": 0, "b": 1, "c": 2, "d": 3}
    assert buckets(gm, REDUCE_GRAD) == buckets(gm, UNSHARD)


# ----------------------------------------------------------------------------------- reshard


def _three_buckets(group: str, reshard_flags=(True, True, True)) -> fx.GraphModule:
    b = Builder(group)
    x = b.input("x", 4, 8)
    shards = [b.input(f"w{k}", 4, 8) for k in range(3)]
    h = x
    for k, (shard, flag) in enumerate(zip(shards, reshard_flags, strict=True)):
        h = b(aten.mm.default, h, b.unshard(shard, [8, 8], k, f"w{k}", reshard=flag))
    return b.module(h)


def policies(gm: fx.GraphModule) -> list:
    return [n.meta["recompute"] for n in calls(gm, UNSHARD)]


def test_reshard_recomputes_all_but_the_last_read_bucket(group):
    """``reshard=True``: gathered again in backward (MUST_RECOMPUTE), except the bucket read
    last in forward, which backward needs first (MUST_SAVE)."""
    gm = run("joint", reshard, _three_buckets(group))
    save, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE
    assert policies(gm) == [again, again, save]
    gm = run("joint", reshard, _three_buckets(group), reshard_last_bucket=True)
    assert policies(gm) == [again, again, again]


def test_reshard_false_keeps_the_parameter(group):
    """``reshard=False`` (ZeRO-2) is saved for backward whatever the plan."""
    gm = run("joint", reshard, _three_buckets(group, (False, True, True)),
             reshard_last_bucket=True)
    save, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE
    assert policies(gm) == [save, again, again]


def test_reshard_puts_markers_above_every_checkpoint_region(group):
    """Markers get an ``ac_graph_id`` above every region's (1 when there is none)."""
    gm = run("joint", reshard, _three_buckets(group))
    assert {n.meta["ac_graph_id"] for n in calls(gm, UNSHARD)} == {1}
    gm = _three_buckets(group)
    for i, mm in enumerate(calls(gm, aten.mm.default)):
        mm.meta["ac_graph_id"] = 2 + i
    gm = run("joint", reshard, gm)
    assert {n.meta["ac_graph_id"] for n in calls(gm, UNSHARD)} == {5}


# ---------------------------------------------------- keep_group_pieces, read_forward_gathers


def _tagged_three_buckets(group: str, size: int) -> fx.GraphModule:
    """``_three_buckets`` after ``reshard``, its markers carrying a group of ``size`` (the
    fake world's own group: the passes never look at it)."""
    gm = run("joint", reshard, _three_buckets(group))
    for node in calls(gm, UNSHARD):
        spec = marker_args(node)._replace(reshard_group=group, reshard_size=size)
        node.args = tuple(spec)
    return gm


def test_keep_group_pieces_reads_freed_markers_through_the_groups_gather(group):
    """Each freed marker (the first two buckets) gets this rank's piece over the group of 2
    (``MUST_SAVE``) and an ``unshard`` of it over that group (``MUST_RECOMPUTE``), which
    the matmul now reads; the kept bucket and a marker without a group are left alone."""
    gm = run("joint", keep_group_pieces, _tagged_three_buckets(group, 2))
    pieces = calls(gm, TAKE_GROUP_PIECE)
    assert [shape(p) for p in pieces] == [(4, 8), (4, 8)]  # [8, 8] over 2 ranks
    assert all(p.meta["recompute"] == CheckpointPolicy.MUST_SAVE for p in pieces)
    regathers = [n for n in calls(gm, UNSHARD) if marker_args(n).shard in pieces]
    assert [(marker_args(n).world_size, marker_args(n).reshard_size) for n in regathers] == [
        (2, 1), (2, 1)]
    assert all(n.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE for n in regathers)
    mms = calls(gm, aten.mm.default)
    assert [mm.args[1] for mm in mms[:2]] == regathers
    assert marker_args(mms[2].args[1]).reshard_size == 2  # the kept bucket: read as it was
    untagged = run("joint", keep_group_pieces, _tagged_three_buckets(group, 1))
    assert not calls(untagged, TAKE_GROUP_PIECE)


def test_read_forward_gathers_reads_the_first_gather(group):
    """In a forward, the group's gather of a piece of a gathered parameter is that
    parameter: its reader reads the first gather; the piece stays (saved for backward)."""
    gm = run("joint", keep_group_pieces, _tagged_three_buckets(group, 2))
    first = [n for n in calls(gm, UNSHARD) if marker_args(n).reshard_size == 2]
    gm.graph.output_node().args = (gm.graph.output_node().args[0],
                                   *calls(gm, TAKE_GROUP_PIECE))
    gm = run("fw", read_forward_gathers, gm)
    assert len(calls(gm, UNSHARD)) == 3
    assert [mm.args[1] for mm in calls(gm, aten.mm.default)] == first
    assert len(calls(gm, TAKE_GROUP_PIECE)) == 2


# ------------------------------------------------------------------------------ lower_unshard


FULL = {"w": [5, 8], "b": [5], "s": []}


def _bucket_reads(group: str, rank: int, names=("w", "b"), **spec) -> fx.GraphModule:
    """Rank ``rank``'s forward reading the parameters ``names`` (of ``FULL``), one bucket."""
    b = Builder(group)
    layouts = [Dim0Layout(FULL[n], WORLD) for n in names]
    shards = [b.input(n, *layout.local_shape(layout.valid_rows(rank)))
              for n, layout in zip(names, layouts, strict=True)]
    reads = [b.unshard(s, FULL[n], 0, n, **spec) for s, n in zip(shards, names, strict=True)]
    return b.module(*[b(aten.mul.Tensor, r, 2.0) for r in reads])


def test_lower_unshard_one_gather_per_bucket_with_every_parameter_rebuilt(group):
    """A bucket of w [5, 8] and b [5] on rank 0 (3 rows each): one all-gather of the flat
    27 elements (216 bytes gathered), one wait, and each parameter cut from its column."""
    gm = run("fw", lower_unshard, _bucket_reads(group, 0))
    (gather,) = calls(gm, AG)
    (wait,) = calls(gm, WAIT)
    assert gather.args[1:] == (WORLD, group) and wait.args == (gather,)
    assert shape(gather.args[0]) == (27,) and shape(gather) == (54,) and nbytes(gather) == 216
    assert gather.meta["graphshard"] == {"kind": "unshard", "bucket": 0, "params": ["w", "b"]}
    assert not calls(gm, UNSHARD) and not calls(gm, aten.constant_pad_nd.default)
    rebuilt = [mul.args[0] for mul in calls(gm, aten.mul.Tensor)]
    assert [shape(n) for n in rebuilt] == [(5, 8), (5,)]
    assert [s.args[1:] for s in calls(gm, aten.slice.Tensor)[::2]] == [(1, 0, 24), (1, 24, 27)]


def test_lower_unshard_pads_a_short_shard(group):
    """Rank 1 holds 2 of w's 5 rows: its piece is padded by one row (8 zeros) to 24."""
    gm = run("fw", lower_unshard, _bucket_reads(group, 1, names=("w",)))
    (pad,) = calls(gm, aten.constant_pad_nd.default)
    assert pad.args[1:] == ([0, 8], 0.0) and shape(pad) == (24,)
    (gather,) = calls(gm, AG)
    assert gather.args[0] is pad and shape(gather) == (48,)


def test_lower_unshard_single_parameter_bucket_needs_no_cat_or_column(group):
    """One parameter: the gathered buffer is viewed as its padded rows, then cut to 5."""
    gm = run("fw", lower_unshard, _bucket_reads(group, 0, names=("w",)))
    assert targets(gm) == [aten.view.default, AG, WAIT, aten.view.default, aten.slice.Tensor,
                           aten.mul.Tensor]
    view, cut = calls(gm, aten.view.default)[1], calls(gm, aten.slice.Tensor)[0]
    assert view.args[1] == [6, 8] and cut.args[1:] == (0, 0, 5) and shape(cut) == (5, 8)


def test_lower_unshard_casts_to_param_dtype_before_the_gather(group):
    """``param_dtype=bf16``: each shard is cast first, so the gather moves half the bytes."""
    gm = run("fw", lower_unshard, _bucket_reads(group, 0, param_dtype=torch.bfloat16))
    casts = calls(gm, prims.convert_element_type.default)
    assert [c.args[1] for c in casts] == [torch.bfloat16] * 2
    (gather,) = calls(gm, AG)
    assert gather.meta["val"].dtype == torch.bfloat16 and nbytes(gather) == 108
    assert {n.meta["val"].dtype for n in calls(gm, aten.mul.Tensor)} == {torch.bfloat16}


def test_lower_unshard_tied_reads_share_one_slot(group):
    """Two markers of one shard in a bucket: one slot in the buffer, both users rebuilt
    from it."""
    b = Builder(group)
    w = b.input("w", 3, 8)
    first, second = b.unshard(w, [5, 8], 0, "w"), b.unshard(w, [5, 8], 0, "w")
    gm = run("fw", lower_unshard, b.module(b(aten.add.Tensor, first, second)))
    (gather,) = calls(gm, AG)
    assert shape(gather) == (48,) and gather.meta["graphshard"]["params"] == ["w"]
    (add,) = calls(gm, aten.add.Tensor)
    assert add.args[0] is add.args[1] and shape(add.args[0]) == (5, 8)


def test_lower_unshard_gathers_each_bucket_before_its_first_read(group):
    """Two buckets: two gathers, each placed just before its bucket's first marker."""
    b = Builder(group)
    x, w0, w1 = b.input("x", 4, 8), b.input("w0", 4, 8), b.input("w1", 4, 8)
    h = b(aten.mm.default, x, b.unshard(w0, [8, 8], 0, "w0"))
    h = b(aten.mm.default, h, b.unshard(w1, [8, 8], 1, "w1"))
    gm = run("fw", lower_unshard, b.module(h))
    assert schedule_string(gm) == "AG0:64 W(AG0) MM AG1:64 W(AG1) MM"
    assert [g.meta["graphshard"]["bucket"] for g in calls(gm, AG)] == [0, 1]


def test_lower_unshard_rebuilds_the_full_parameters(group):
    """Run on both ranks with the gather done by hand: every rank gets w, b and a 0-D s
    back exactly (rank 1's padding cut off)."""
    torch.manual_seed(0)
    full = {n: torch.randn(s) for n, s in FULL.items()}
    names = tuple(FULL)
    graphs = [run("fw", lower_unshard, _bucket_reads(group, r, names)) for r in range(WORLD)]
    inputs = [[Dim0Layout(FULL[n], WORLD).local(full[n], r).contiguous() for n in names]
              for r in range(WORLD)]
    for rank_out in run_ranks(graphs, inputs):
        for n, got in zip(names, rank_out, strict=True):
            torch.testing.assert_close(got, 2.0 * full[n], rtol=0, atol=0)


# -------------------------------------------------------------------------- lower_reduce_grad


def _bucket_grads(group: str, rank: int, names=("w", "b"), dtype=torch.float32,
                  **kwargs) -> fx.GraphModule:
    """Rank ``rank``'s backward reducing the full gradients of ``names`` in one bucket."""
    b = Builder(group)
    grads = [b.input(f"grad_{n}", *FULL[n], dtype=dtype) for n in names]
    reds = [b.reduce_grad(g, 0, n, Dim0Layout(FULL[n], WORLD).valid_rows(rank), **kwargs)
            for g, n in zip(grads, names, strict=True)]
    return b.module(*reds)


def test_lower_reduce_grad_one_averaging_reduce_scatter_per_bucket(group):
    """w [5, 8] and b [5]: one ``avg`` reduce-scatter of both padded gradients (2 x 27
    elements), one wait, and each rank's rows of each gradient cut from its piece."""
    gm = run("bw", lower_reduce_grad, _bucket_grads(group, 1))
    (reduce,) = calls(gm, RS)
    (wait,) = calls(gm, WAIT)
    assert reduce.args[1:] == ("avg", WORLD, group) and wait.args == (reduce,)
    assert shape(reduce.args[0]) == (54,) and shape(reduce) == (27,)
    assert reduce.meta["val"].dtype == torch.float32
    assert reduce.meta["graphshard"] == {"kind": "reduce_grad", "bucket": 0,
                                         "params": ["w", "b"]}
    assert not calls(gm, REDUCE_GRAD)
    assert [shape(o) for o in outputs(gm)] == [(2, 8), (2,)]  # rank 1 holds 2 rows
    assert [shape(p) for p in calls(gm, aten.constant_pad_nd.default)] == [(6, 8), (6, 1)]


def test_lower_reduce_grad_single_parameter_bucket_takes_the_piece_whole(group):
    """One parameter: no cat and no column slice; rank 0 keeps its 3 rows unpadded."""
    gm = run("bw", lower_reduce_grad, _bucket_grads(group, 0, names=("w",)))
    assert not calls(gm, aten.cat.default) and not calls(gm, aten.slice.Tensor)
    (reduce,) = calls(gm, RS)
    assert shape(reduce) == (24,) and shape(outputs(gm)[0]) == (3, 8)


def test_lower_reduce_grad_reduces_in_reduce_dtype_and_returns_out_dtype(group):
    """``reduce_dtype=bf16`` for fp32 gradients: cast before (half the bytes on the wire),
    and the result cast back to the shard's fp32."""
    gm = run("bw", lower_reduce_grad, _bucket_grads(
        group, 0, reduce_dtype=torch.bfloat16, out_dtype=torch.float32))
    (reduce,) = calls(gm, RS)
    assert reduce.meta["val"].dtype == torch.bfloat16 and nbytes(reduce.args[0]) == 108
    casts = calls(gm, prims.convert_element_type.default)
    assert [c.args[1] for c in casts] == [torch.bfloat16, torch.bfloat16, torch.float32]
    assert {o.meta["val"].dtype for o in outputs(gm)} == {torch.float32}


def test_lower_reduce_grad_fp16_divides_then_sums(group):
    """fp16 gradients are scaled by 1/world and summed, not averaged (no overflow)."""
    gm = run("bw", lower_reduce_grad, _bucket_grads(group, 0, dtype=torch.float16))
    (reduce,) = calls(gm, RS)
    (scale,) = calls(gm, aten.mul.Tensor)
    assert reduce.args[:2] == (scale, "sum") and scale.args[1] == 1 / WORLD


def test_lower_reduce_grad_adds_held_back_gradients_before_reducing(group):
    """``pending_full`` (what ``no_sync`` accumulated) is added to the gradient before it is
    laid out and reduce-scattered, so both travel in the one collective."""
    b = Builder(group)
    g, pending = b.input("g", 5, 8), b.input("pending", 5, 8)
    gm = run("bw", lower_reduce_grad, b.module(
        b.reduce_grad(g, 0, "w", 3, pending_full=pending)))
    (add,) = calls(gm, aten.add.Tensor)
    assert [a.name for a in add.args] == ["g", "pending"]
    (reduce,) = calls(gm, RS)
    assert shape(reduce.args[0]) == (48,)
    feeding, todo = set(), [reduce.args[0]]  # what the reduce-scatter's input is made from
    while todo:
        node = todo.pop()
        feeding.add(node)
        todo.extend(node.all_input_nodes)
    assert add in feeding and calls(gm, aten.clone.default) == []  # padded, never cloned


def test_lower_reduce_grad_all_reduces_across_replicas(group):
    """HSDP (``replica_size=2``): the reduce-scatter's result is all-reduced over the replica
    group and waited, before the shards are cut from it."""
    gm = run("bw", lower_reduce_grad, _bucket_grads(group, 0, replica_group="rep",
                                                     replica_size=2))
    assert schedule_string(gm) == "RS0:54 W(RS0) AR0:27 W(AR0)"
    (across,) = calls(gm, AR)
    assert across.args[1:] == ("avg", "rep")
    assert across.meta["graphshard"]["kind"] == "replica_reduce"


def test_lower_reduce_grad_with_a_divide_factor_scales_then_sums_on_every_path(group):
    """``shard(gradient_divide_factor=4.0)``: the flat buffer is multiplied by 1/4 and
    summed (FSDP2's pre-multiplied sum), by the reduce-scatter, by the all-to-all (summed
    after its wait, not averaged) and by the coalesced reduce-scatter; across HSDP replicas
    the all-reduce sums, the factor applied once. 1.0 is a plain sum, with no multiply."""
    gm = run("bw", lower_reduce_grad, _bucket_grads(group, 1, divide_factor=4.0))
    (reduce,) = calls(gm, RS)
    (scale,) = calls(gm, aten.mul.Tensor)
    assert reduce.args[:2] == (scale, "sum") and scale.args[1] == 0.25
    a2a = run("bw", lower_reduce_grad, _bucket_grads(group, 1, divide_factor=4.0),
              reduce_scatter_via="all_to_all")
    (scale,) = calls(a2a, aten.mul.Tensor)
    assert calls(a2a, A2A)[0].args[0] is scale and scale.args[1] == 0.25
    assert calls(a2a, aten.sum.dim_IntList) and not calls(a2a, aten.div.Tensor)
    coalesced = run("bw", lower_reduce_grad, _bucket_grads(group, 1, divide_factor=4.0),
                    reduce_scatter_via="coalesced")
    (reduce,) = calls(coalesced, c10d.reduce_scatter_tensor_coalesced.default)
    assert reduce.args[1] == "sum"
    assert [s.args[1] for s in calls(coalesced, aten.mul.Tensor)] == [0.25, 0.25]
    hsdp = run("bw", lower_reduce_grad, _bucket_grads(group, 0, divide_factor=1.0,
                                                       replica_group="rep", replica_size=2))
    assert calls(hsdp, RS)[0].args[1] == "sum" and calls(hsdp, AR)[0].args[1:] == ("sum", "rep")
    assert not calls(hsdp, aten.mul.Tensor)


def test_lower_reduce_grad_with_a_divide_factor_hands_each_rank_the_divided_sum(group):
    """Run on both ranks with the reduce-scatter done by hand: each rank gets its rows of
    the ranks' summed gradients divided by the factor (0-D ``s`` whole)."""
    torch.manual_seed(0)
    names = tuple(FULL)
    grads = [[torch.randn(FULL[n]) for n in names] for _ in range(WORLD)]
    graphs = [run("bw", lower_reduce_grad, _bucket_grads(group, r, names, divide_factor=4.0))
              for r in range(WORLD)]
    for rank, rank_out in enumerate(run_ranks(graphs, grads)):
        for i, (n, got) in enumerate(zip(names, rank_out, strict=True)):
            want = Dim0Layout(FULL[n], WORLD).local((grads[0][i] + grads[1][i]) / 4, rank)
            torch.testing.assert_close(got, want)


def test_lower_reduce_grad_issues_each_bucket_at_its_last_gradient(group):
    """Buckets 0 (w0, w2) and 1 (w1), gradients computed w0, w1, w2: bucket 1 is reduced
    once w1's gradient exists, bucket 0 only once w2's does, and each waited at once."""
    b = Builder(group)
    x = b.input("x", 4, 8)
    g0 = b(aten.mm.default, b(aten.t.default, x), x)
    r0 = b.reduce_grad(g0, 0, "w0", 4)
    g1 = b(aten.mm.default, g0, g0)
    r1 = b.reduce_grad(g1, 1, "w1", 4)
    g2 = b(aten.mm.default, g1, g1)
    r2 = b.reduce_grad(g2, 0, "w2", 4)
    gm = run("bw", lower_reduce_grad, b.module(r0, r1, r2))
    assert schedule_string(gm) == "MM MM RS0:64 W(RS0) MM RS1:128 W(RS1)"
    assert [r.meta["graphshard"]["bucket"] for r in calls(gm, RS)] == [1, 0]
    assert [shape(o) for o in outputs(gm)] == [(4, 8)] * 3


def test_lower_reduce_grad_refuses_a_gradient_used_before_its_bucket_is_complete(group):
    """A use of a gradient before the bucket's last gradient exists cannot be lowered."""
    b = Builder(group)
    g0, g1 = b.input("g0", 4, 8), b.input("g1", 4, 8)
    r0 = b.reduce_grad(g0, 0, "w0", 2)
    early = b(aten.mul.Tensor, r0, 2.0)
    r1 = b.reduce_grad(g1, 0, "w1", 2)
    with pytest.raises(GraphLoweringError, match="'w0'.*before the bucket's last gradient"):
        run("bw", lower_reduce_grad, b.module(early, r1))


def test_lower_reduce_grad_hands_each_rank_the_averaged_rows(group):
    """Run on both ranks with the reduce-scatter done by hand: each rank gets its rows of
    the mean of the ranks' gradients (w, b, and the 0-D s, which every rank gets whole)."""
    torch.manual_seed(0)
    names = tuple(FULL)
    grads = [[torch.randn(FULL[n]) for n in names] for _ in range(WORLD)]
    graphs = [run("bw", lower_reduce_grad, _bucket_grads(group, r, names))
              for r in range(WORLD)]
    for rank, rank_out in enumerate(run_ranks(graphs, grads)):
        for i, (n, got) in enumerate(zip(names, rank_out, strict=True)):
            mean = (grads[0][i] + grads[1][i]) / 2
            want = Dim0Layout(FULL[n], WORLD).local(mean, rank)
            torch.testing.assert_close(got, want)


def test_lower_reduce_grad_via_all_to_all_sums_the_received_pieces(group):
    """``reduce_scatter_via="all_to_all"`` (gloo's choice): the same flat buffer goes out in
    one all-to-all with even splits, carrying the reduce-scatter's tag; after its wait the
    WORLD received pieces are summed over the rank dimension and averaged. No
    reduce-scatter is left."""
    gm = run("bw", lower_reduce_grad, _bucket_grads(group, 1), reduce_scatter_via="all_to_all")
    assert not calls(gm, RS)
    (a2a,) = calls(gm, A2A)
    assert shape(a2a.args[0]) == (54,) and a2a.args[1:] == ([27, 27], [27, 27], group)
    assert a2a.meta["graphshard"] == {"kind": "reduce_grad", "bucket": 0,
                                      "params": ["w", "b"], "group_size": WORLD}
    (wait,) = calls(gm, WAIT)
    (total,) = calls(gm, aten.sum.dim_IntList)
    (mean,) = calls(gm, aten.div.Tensor)
    assert total.args[0].args[0] is wait and shape(total.args[0]) == (WORLD, 27)
    assert total.args[1] == [0] and mean.args == (total, WORLD) and shape(mean) == (27,)
    assert [shape(o) for o in outputs(gm)] == [(2, 8), (2,)]
    fp16 = run("bw", lower_reduce_grad, _bucket_grads(group, 0, dtype=torch.float16),
               reduce_scatter_via="all_to_all")
    assert calls(fp16, aten.mul.Tensor) and not calls(fp16, aten.div.Tensor)  # scaled, summed


def test_lower_reduce_grad_auto_picks_all_to_all_for_gloo_groups_only(group):
    """``"auto"`` reads the group backend the compiler recorded on the markers: gloo gets
    the all-to-all, any other backend (or none recorded, offline) the reduce-scatter."""
    for backend, want in (("gloo", A2A), ("nccl", RS), (None, RS)):
        gm = _bucket_grads(group, 0)
        for node in calls(gm, REDUCE_GRAD):
            node.meta["group_backend"] = backend
        gm = run("bw", lower_reduce_grad, gm)
        assert [n.target for n in gm.graph.nodes if n.target in (RS, A2A)] == [want], backend


def test_lower_reduce_grad_via_all_to_all_hands_each_rank_the_averaged_rows(group):
    """The all-to-all lowering, run on both ranks with the exchange done by hand, gives
    each rank exactly what the reduce-scatter lowering gives it."""
    torch.manual_seed(0)
    names = tuple(FULL)
    grads = [[torch.randn(FULL[n]) for n in names] for _ in range(WORLD)]
    got = {}
    for via in ("reduce_scatter", "all_to_all"):
        graphs = [run("bw", lower_reduce_grad, _bucket_grads(group, r, names),
                      reduce_scatter_via=via) for r in range(WORLD)]
        got[via] = run_ranks(graphs, grads)
    for rs_out, a2a_out in zip(got["reduce_scatter"], got["all_to_all"], strict=True):
        for a, b in zip(rs_out, a2a_out, strict=True):
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------------- prefetch


def _lowered_forward(group: str, buckets: int = 3, cast: bool = False) -> fx.GraphModule:
    """A lowered forward of ``buckets`` buckets, each gathered just before its first use
    (as ``lower_unshard`` leaves it): gather w_k [4, 8] -> [8, 8], mm, relu."""
    b = Builder(group)
    x = b.input("x", 4, 8)
    shards = [b.input(f"w{k}", 4, 8) for k in range(buckets)]
    h = b(aten.relu.default, x)
    for k, shard in enumerate(shards):
        source = b(prims.convert_element_type.default, shard, torch.float32) if cast else shard
        h = b(aten.relu.default, b(aten.mm.default, h, b.gather(source, k)))
    return b.module(h)


def test_prefetch_depth1_issues_the_next_gather_before_this_buckets_matmul(group):
    """Depth 1: the first gather before any compute, bucket k+1's gather right after
    bucket k's wait (before its matmul), each wait still just before its first use."""
    gm = _lowered_forward(group)
    assert schedule_string(gm) == "AG0:64 W(AG0) MM AG1:64 W(AG1) MM AG2:64 W(AG2) MM"
    gm = run("fw", prefetch, gm, prefetch_depth=1)
    assert schedule_string(gm) == "AG0:64 W(AG0) AG1:64 MM W(AG1) AG2:64 MM W(AG2) MM"
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    assert first.target is AG  # before the relu of x
    for wait in calls(gm, WAIT):
        assert next(iter(wait.users)).target is aten.mm.default
        assert wait.next.target is aten.mm.default or wait.next.target is AG


def test_prefetch_depth2_and_depth0(group):
    """Depth 2: two gathers before the first wait, then one after each wait; depth 0
    leaves the graph as it is."""
    gm = run("fw", prefetch, _lowered_forward(group, buckets=4), prefetch_depth=2)
    assert schedule_string(gm) == (
        "AG0:64 AG1:64 W(AG0) AG2:64 MM W(AG1) AG3:64 MM W(AG2) MM W(AG3) MM")
    before = str(_lowered_forward(group).graph)
    assert str(run("fw", prefetch, _lowered_forward(group), prefetch_depth=0).graph) == before


def test_prefetch_respects_the_memory_cap(group):
    """Depth 2, each bucket gathering 256 bytes. Uncapped, three buckets are alive after the
    first wait; a cap of 512 delays bucket 2's gather to after bucket 1's wait (bucket 0's
    buffer is dead by then); 511 allows no second bucket alive (no prefetch at all); a cap
    below one bucket warns."""
    gm = run("fw", prefetch, _lowered_forward(group), prefetch_depth=2)
    assert schedule_string(gm) == "AG0:64 AG1:64 W(AG0) AG2:64 MM W(AG1) MM W(AG2) MM"
    gm = run("fw", prefetch, _lowered_forward(group), prefetch_depth=2, max_unsharded_bytes=512)
    assert schedule_string(gm) == "AG0:64 AG1:64 W(AG0) MM W(AG1) AG2:64 MM W(AG2) MM"
    gm = run("fw", prefetch, _lowered_forward(group), prefetch_depth=2, max_unsharded_bytes=511)
    assert schedule_string(gm) == "AG0:64 W(AG0) MM AG1:64 W(AG1) MM AG2:64 W(AG2) MM"
    with pytest.warns(UserWarning, match="bucket 0 gathers 256 bytes"):
        run("fw", prefetch, _lowered_forward(group), max_unsharded_bytes=255)


def test_prefetch_moves_the_gathers_inputs_with_it(group):
    """What a gather reads (here a cast of the shard) moves with it, just before it."""
    gm = run("fw", prefetch, _lowered_forward(group, cast=True), prefetch_depth=1)
    assert schedule_string(gm) == "AG0:64 W(AG0) AG1:64 MM W(AG1) AG2:64 MM W(AG2) MM"
    for gather in calls(gm, AG):
        assert gather.prev is gather.args[0]
        assert gather.args[0].target is prims.convert_element_type.default


# ----------------------------------------------------------------------------- overlap_reduce


def _lowered_backward(group: str, buckets: int = 3, hsdp: bool = False) -> fx.GraphModule:
    """A lowered backward of ``buckets`` buckets, as ``lower_reduce_grad`` leaves it: bucket
    k's weight gradient (an mm) reduce-scattered and waited at once, its shard a view of the
    result; then the next activation gradient (an mm); the input gradient (an mm) last.
    With ``hsdp`` an all-reduce across replicas follows each reduce-scatter's wait."""
    b = Builder(group)
    x, dy, w = b.input("x", 4, 8), b.input("dy", 4, 8), b.input("w", 8, 8)
    xt = b(aten.t.default, x)
    shards = []
    for k in range(buckets):
        grad = b(aten.view.default, b(aten.mm.default, xt, dy), [-1])
        reduced = b(RS, grad, "avg", WORLD, group)
        reduced.meta["graphshard"] = {"kind": "reduce_grad", "bucket": k, "params": []}
        result = b(WAIT, reduced)
        if hsdp:
            across = b(AR, result, "avg", "rep")
            across.meta["graphshard"] = {"kind": "replica_reduce", "bucket": k}
            result = b(WAIT, across)
        shards.append(b(aten.view.default, result, [4, 8]))
        dy = b(aten.mm.default, dy, w)
    return b.module(dy, *shards)


def test_overlap_reduce_waits_each_reduce_scatter_at_the_next_ones_issue(group):
    """Each reduce-scatter's wait (and the shard view after it) moves to just before the
    next reduce-scatter, the last one's to the end: one reduction in flight under the next
    bucket's compute."""
    gm = _lowered_backward(group)
    assert schedule_string(gm) == (
        "MM RS0:64 W(RS0) MM MM RS1:64 W(RS1) MM MM RS2:64 W(RS2) MM")
    gm = run("bw", overlap_reduce, gm)
    assert schedule_string(gm) == (
        "MM RS0:64 MM MM W(RS0) RS1:64 MM MM W(RS1) RS2:64 MM W(RS2)")
    for wait in calls(gm, WAIT):
        assert wait.next.target is aten.view.default and wait.next.args[0] is wait
    assert list(gm.graph.nodes)[-2].args[0] is calls(gm, WAIT)[-1]


def test_overlap_reduce_single_reduce_scatter_waits_at_the_end(group):
    """One bucket: its wait moves past all the compute that follows, before the output."""
    gm = run("bw", overlap_reduce, _lowered_backward(group, buckets=1))
    assert schedule_string(gm) == "MM RS0:64 MM W(RS0)"


def test_overlap_reduce_delays_the_replica_all_reduce_one_bucket_further(group):
    """HSDP: the all-reduce is issued where its reduce-scatter is waited and itself waited
    just before the reduce-scatter after next (or the output)."""
    gm = run("bw", overlap_reduce, _lowered_backward(group, hsdp=True))
    assert schedule_string(gm) == (
        "MM RS0:64 MM MM W(RS0) AR0:32 RS1:64 MM MM W(RS1) AR1:32 W(AR0) RS2:64 MM "
        "W(RS2) AR2:32 W(AR1) W(AR2)")


# ------------------------------------------------------------------------ graphs w/o markers


def _plain(group: str) -> fx.GraphModule:
    b = Builder(group)
    x, w = b.input("x", 4, 8), b.input("w", 8, 8)
    return b.module(b(aten.relu.default, b(aten.mm.default, x, w)))


@pytest.mark.parametrize("stage, fn", [
    ("dynamo", dedupe_unshard), ("joint", fold_views), ("joint", merge_reduce_grad),
    ("joint", assign_buckets), ("joint", reshard), ("fw", lower_unshard), ("fw", prefetch),
    ("bw", lower_reduce_grad), ("bw", overlap_reduce),
])
def test_a_graph_without_markers_or_collectives_is_left_unchanged(group, stage, fn):
    """No marker and no graphshard collective: every pass leaves the graph as it was."""
    before = str(_plain(group).graph)
    gm = run(stage, fn, _plain(group), bucketing="size", prefetch_depth=2)
    assert str(gm.graph) == before


def test_auto_bucketing_under_a_cap_no_two_parameters_meet(group):
    """A cap below every pair of neighbouring parameters: no crash, the finest split."""
    gm = run("joint", assign_buckets, _joint_params(group), bucketing="auto",
             max_unsharded_bytes=100)
    assert buckets(gm, UNSHARD) == {"a": 0, "b": 1, "c": 2, "d": 3}


def test_size_bucketing_keeps_every_read_of_a_parameter_in_one_bucket(group):
    """A parameter read twice (inside and outside a checkpoint it keeps two markers on the
    joint graph) is packed once, at its first read: both reads and its gradient share that
    bucket, so it is gathered once."""
    b = Builder(group)
    a, c = b.input("a", 3, 8), b.input("c", 4, 8)
    ga, gc = b.input("grad_a", 5, 8), b.input("grad_c", 8, 8)
    reads = [b.unshard(a, [5, 8], 0, "a"), b.unshard(c, [8, 8], 0, "c"),
             b.unshard(a, [5, 8], 0, "a")]
    grads = [b.reduce_grad(ga, 0, "a", 3), b.reduce_grad(gc, 0, "c", 4)]
    gm = run("joint", assign_buckets, b.module(*reads, *grads), bucketing="size",
             bucket_bytes=300)
    assert [(marker_args(n).name, marker_args(n).bucket) for n in calls(gm, UNSHARD)] == [
        ("a", 0), ("c", 1), ("a", 0)]
    assert buckets(gm, REDUCE_GRAD) == {"a": 0, "c": 1}


def _mixed_dtype_params(group: str) -> fx.GraphModule:
    """Parameters a (fp32), b (bf16), c (bf16), d (fp32), all small, all in bucket 0."""
    b = Builder(group)
    dtypes = {"a": torch.float32, "b": torch.bfloat16, "c": torch.bfloat16, "d": torch.float32}
    shards = {n: b.input(n, 2, 4, dtype=d) for n, d in dtypes.items()}
    return b.module(*[b.unshard(shards[n], [4, 4], 0, n) for n in dtypes])


@pytest.mark.parametrize("bucketing", ["size", "auto"])
def test_bucketing_never_mixes_dtypes_in_a_bucket(group, bucketing):
    """A bucket's shards share one flat buffer, where two dtypes would promote one: packing
    starts a new bucket where the dtype changes, even when the bytes would fit."""
    gm = run("joint", assign_buckets, _mixed_dtype_params(group), bucketing=bucketing,
             bucket_bytes=1 << 20, max_unsharded_bytes=1 << 20)
    got = buckets(gm, UNSHARD)
    assert got["b"] == got["c"] and len({got["a"], got["b"], got["d"]}) == 3
