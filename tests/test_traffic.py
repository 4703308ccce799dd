"""``graphshard.passes.traffic`` on graphs small enough to count by hand: bytes graphshard's
own kernels move (fused as Inductor fuses them, or op by op) and the minimum."""

from __future__ import annotations

import pytest
import torch
from graph_utils import TwoBlock, fake_process_group
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

import graphshard
from graphshard.passes.fx_util import NodeMaker
from graphshard.passes.traffic import (
    CATEGORIES,
    Traffic,
    format_traffic,
    step_traffic,
    traffic,
)

aten, prims = torch.ops.aten, torch.ops.prims
c10d = torch.ops._c10d_functional
F32 = 4  # bytes per fp32 element


class Builder:
    """A graph with fake placeholders; ``make`` appends ops, tagged as graphshard's inside
    ``lowered(side, bucket)``."""

    def __init__(self) -> None:
        self.mode = FakeTensorMode()
        self.graph = fx.Graph()
        self.make: NodeMaker | None = None

    def input(self, name: str, *shape: int, dtype=torch.float32, strided=False) -> fx.Node:
        node = self.graph.placeholder(name)
        with self.mode:
            val = torch.empty(shape, dtype=dtype)
            node.meta["val"] = val.t() if strided else val
        return node

    def __call__(self, target, *args, **kwargs) -> fx.Node:
        if self.make is None:
            self.make = NodeMaker(self.graph)
        return self.make(target, *args, **kwargs)

    def lowered(self, side: str, bucket: int = 0):
        if self.make is None:
            self.make = NodeMaker(self.graph)
        return self.make.lowering(side, bucket)

    def module(self, *outputs: fx.Node) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        return fx.GraphModule(torch.nn.Module(), self.graph)


def only(t: Traffic, **expected: int) -> dict:
    """Check ``t.moved`` is ``expected`` (other categories zero); return it."""
    assert {k: v for k, v in t.moved.items() if v} == expected, t.moved
    return t.moved


def two_param_gather(b: Builder):
    """Shards a [2, 3] (of [4, 3]) and b [1] (of [3], padded to 2 rows) gathered over 2
    ranks into one 8-element buffer, each rebuilt by a copy of its column."""
    a, s = b.input("a", 2, 3), b.input("b", 1)
    with b.lowered("unshard"):
        pa = b(aten.view.default, a, [-1])
        pb = b(aten.constant_pad_nd.default, b(aten.view.default, s, [-1]), [0, 1], 0.0)
        flat = b(aten.cat.default, [pa, pb])
        gathered = b(c10d.wait_tensor.default,
                     b(c10d.all_gather_into_tensor.default, flat, 2, "0"))
        matrix = b(aten.view.default, gathered, [2, 8])
        ca = b(aten.clone.default, b(aten.slice.Tensor, matrix, 1, 0, 6))
        cb = b(aten.clone.default, b(aten.slice.Tensor, matrix, 1, 6, 8))
        full_a = b(aten.view.default, ca, [4, 3])
        full_b = b(aten.slice.Tensor, b(aten.view.default, cb, [4]), 0, 0, 3)
    return b.module(full_a, full_b)


def test_gather_fused_as_inductor_fuses_it():
    t = traffic(two_param_gather(Builder()))
    # copy-in, one kernel (the pad is fused into the cat): reads a (6) and b (1), writes the
    # 8-element buffer, of which 1 element is padding
    # interleave: a's column, 2 x 6 read and written; b's, 2 x 2 (b's padding row included)
    only(t, copy_in=(6 + 1 + 8 - 1) * F32, padding=1 * F32,
         interleave=(2 * 12 + 2 * 4) * F32)
    assert t.kernels == 3
    # the minimum: the same copy-in; each parameter read and written once, real rows only
    assert t.minimum["copy_in"] == t.moved["copy_in"]
    assert t.minimum["padding"] == 1 * F32
    assert t.minimum["interleave"] == 2 * (12 + 3) * F32
    assert t.total - t.total_minimum == 2 * 1 * F32  # b's padding row, copied out


def test_gather_op_by_op():
    t = traffic(two_param_gather(Builder()), fused=False)
    # the pad reads 1 element and writes 2 (1 of them padding), then the cat reads 6 + 2
    # and writes 8: b's data is written twice
    only(t, copy_in=(1 + 1) * F32 + (6 + 2 + 8) * F32, padding=1 * F32,
         interleave=(2 * 12 + 2 * 4) * F32)
    assert t.kernels == 4
    assert t.minimum == traffic(two_param_gather(Builder())).minimum


def test_a_single_unpadded_shard_is_gathered_in_place():
    b = Builder()
    a = b.input("a", 2, 3)
    with b.lowered("unshard"):
        gathered = b(c10d.wait_tensor.default, b(c10d.all_gather_into_tensor.default,
                                                 b(aten.view.default, a, [-1]), 2, "0"))
        full = b(aten.view.default, gathered, [4, 3])
    t = traffic(b.module(full))
    assert t.total == t.total_minimum == 0 and t.kernels == 0


def test_a_cast_is_fused_into_the_copy_in():
    b = Builder()
    a, s = b.input("a", 2, 3), b.input("b", 2)
    with b.lowered("unshard"):
        casts = [b(prims.convert_element_type.default, x, torch.bfloat16) for x in (a, s)]
        flat = b(aten.cat.default, [b(aten.view.default, x, [-1]) for x in casts])
        gathered = b(c10d.wait_tensor.default,
                     b(c10d.all_gather_into_tensor.default, flat, 2, "0"))
    gm = b.module(gathered)
    # one kernel: 8 fp32 read, 8 bf16 written
    only(traffic(gm), copy_in=8 * F32 + 8 * 2)
    # op by op: each cast writes bf16 that the cat reads again
    t = traffic(gm, fused=False)
    only(t, cast=8 * F32 + 8 * 2, copy_in=8 * 2 + 8 * 2)
    assert t.minimum["cast"] == 0 and t.minimum["copy_in"] == 8 * F32 + 8 * 2


def test_a_single_cast_shard_is_its_own_copy_in():
    b = Builder()
    a = b.input("a", 2, 3)
    with b.lowered("unshard"):
        cast = b(prims.convert_element_type.default, a, torch.bfloat16)
        gathered = b(c10d.wait_tensor.default, b(c10d.all_gather_into_tensor.default,
                                                 b(aten.view.default, cast, [-1]), 2, "0"))
    t = traffic(b.module(gathered))
    only(t, copy_in=6 * F32 + 6 * 2)
    assert t.minimum == t.moved


def grad_reduce(b: Builder, strided: bool = False):
    """Gradients g [4, 3] and h [3] (padded to 4 rows) laid out rank-major and
    reduce-scattered over 2 ranks; each rank keeps its rows."""
    g, h = b.input("g", *((3, 4) if strided else (4, 3)), strided=strided), b.input("h", 3)
    with b.lowered("reduce_grad"):
        if strided:
            g = b(aten.clone.default, g, memory_format=torch.contiguous_format)
        cg = b(aten.view.default, g, [2, 6])
        ch = b(aten.view.default, b(aten.constant_pad_nd.default,
                                    b(aten.view.default, h, [3, 1]), [0, 0, 0, 1], 0.0), [2, 2])
        flat = b(aten.view.default, b(aten.cat.default, [cg, ch], 1), [-1])
        piece = b(c10d.wait_tensor.default,
                  b(c10d.reduce_scatter_tensor.default, flat, "avg", 2, "0"))
        rg = b(aten.view.default, b(aten.slice.Tensor, piece, 0, 0, 6), [2, 3])
        rh = b(aten.view.default, b(aten.slice.Tensor, piece, 0, 6, 8), [2])
    return b.module(rg, rh)


def test_gradients_into_the_reduce_scatter_buffer():
    t = traffic(grad_reduce(Builder()))
    # one kernel: reads g (12) and h (3), writes 16, of which 1 is padding
    only(t, grad_copy_in=(12 + 3 + 16 - 1) * F32, grad_padding=1 * F32)
    assert t.minimum == t.moved and t.kernels == 1


def test_the_sum_after_an_all_to_all_reduce_scatter_is_the_reduction():
    """gloo's lowering: the same buffer goes out in an all-to-all; the kernel that sums the
    2 received pieces (2 x 8 read) and averages them (8 written), fused as Inductor fuses
    it, is ``grad_reduce``, which the minimum counts at what it moves."""
    b = Builder()
    g, h = b.input("g", 4, 3), b.input("h", 3)
    with b.lowered("reduce_grad"):
        cg = b(aten.view.default, g, [2, 6])
        ch = b(aten.view.default, b(aten.constant_pad_nd.default,
                                    b(aten.view.default, h, [3, 1]), [0, 0, 0, 1], 0.0), [2, 2])
        flat = b(aten.view.default, b(aten.cat.default, [cg, ch], 1), [-1])
        received = b(c10d.wait_tensor.default,
                     b(c10d.all_to_all_single.default, flat, [8, 8], [8, 8], "0"))
        total = b(aten.sum.dim_IntList, b(aten.view.default, received, [2, -1]), [0])
        piece = b(aten.div.Tensor, total, 2)
        rg = b(aten.view.default, b(aten.slice.Tensor, piece, 0, 0, 6), [2, 3])
        rh = b(aten.view.default, b(aten.slice.Tensor, piece, 0, 6, 8), [2])
    t = traffic(b.module(rg, rh))
    only(t, grad_copy_in=(12 + 3 + 16 - 1) * F32, grad_padding=1 * F32,
         grad_reduce=(16 + 8) * F32)
    assert t.minimum == t.moved and t.kernels == 2


def test_a_strided_gradient_copied_first_costs_a_kernel_op_by_op():
    gm = grad_reduce(Builder(), strided=True)
    fused = traffic(gm)
    only(fused, grad_copy_in=(12 + 3 + 16 - 1) * F32, grad_padding=1 * F32)
    t = traffic(gm, fused=False)
    # op by op: the clone (12 read, 12 written), the pad (3 read, 4 written), the cat
    assert t.moved["grad_copy_in"] == (24 + (3 + 4 - 1) + (12 + 4 + 16)) * F32
    assert t.moved["grad_padding"] == 1 * F32
    assert t.minimum["grad_copy_in"] == (12 + 3 + 16 - 1) * F32


def test_a_clone_inductor_drops_costs_nothing_fused():
    """A dense gradient cloned to the same strides: Inductor removes the clone (a no-op in a
    functional graph), so the reduce-scatter reads the gradient itself; op by op it is a
    copy, more than the minimum (nothing)."""
    b = Builder()
    g = b.input("g", 4, 3)
    with b.lowered("reduce_grad"):
        flat = b(aten.view.default, b(aten.clone.default, g), [-1])
        piece = b(c10d.wait_tensor.default,
                  b(c10d.reduce_scatter_tensor.default, flat, "avg", 2, "0"))
    gm = b.module(piece)
    fused = traffic(gm)
    assert fused.total == fused.total_minimum == 0 and fused.kernels == 0
    only(traffic(gm, fused=False), grad_copy_in=2 * 12 * F32)


def test_an_expanded_scalar_is_read_once():
    b = Builder()
    g = b.input("g")
    with b.lowered("reduce_grad"):
        row = b(aten.expand.default, b(aten.view.default, g, [1, 1]), [4, 1])
        flat = b(aten.view.default, b(aten.clone.default, row), [-1])
        piece = b(c10d.wait_tensor.default,
                  b(c10d.reduce_scatter_tensor.default, flat, "avg", 4, "0"))
    only(traffic(b.module(piece)), grad_copy_in=(1 + 4) * F32)


def local_cast(consumer):
    b = Builder()
    shard, x = b.input("shard", 4, 3), b.input("x", 2, 3, dtype=torch.bfloat16)
    with b.lowered("unshard"):
        full = b(prims.convert_element_type.default, shard, torch.bfloat16)
    return b.module(consumer(b, x, full))


def test_world1_cast_read_by_a_matmul_is_a_kernel():
    t = traffic(local_cast(lambda b, x, w: b(aten.mm.default, x, b(aten.t.default, w))))
    only(t, cast=12 * F32 + 12 * 2)
    assert t.minimum == t.moved  # the semantics ask for it


def test_world1_cast_read_by_pointwise_compute_is_fused_into_it():
    t = traffic(local_cast(lambda b, x, w: b(aten.mul.Tensor, w, 2.0)))
    assert t.total == t.total_minimum == 0 and t.kernels == 0


def test_categories_add_up_over_graphs():
    gm = two_param_gather(Builder())
    one = traffic(gm)
    assert traffic([gm, gm]).moved == {k: 2 * v for k, v in one.moved.items()}
    assert set(one.moved) == set(CATEGORIES)
    text = format_traffic(one)
    assert "interleave" in text and "total" in text and "grad_copy_in" not in text


@pytest.fixture
def two_block_world2():
    with fake_process_group(2):
        torch.manual_seed(0)
        backend = graphshard.backend(inductor=False)
        model = torch.compile(graphshard.shard(TwoBlock()), backend=backend, fullgraph=True)
        model(torch.randn(4, 8)).sum().backward()
        yield backend.graphs


def test_two_blocks_at_world2_by_hand(two_block_world2):
    """TwoBlock (blocks: up [12, 8] + [12], down [8, 12] + [8]; head [3, 8] + [3]) on two
    ranks, as lowered: rank 0 holds 6 + 6 + 4 + 4 rows of a block, 2 + 2 of the head."""
    (stages,) = two_block_world2
    t = step_traffic(two_block_world2)
    assert t == traffic([stages["fw"], stages["bw"]])
    # copy-in: forward gathers two blocks and the head, each from its bucket's flat storage
    # (nothing copied: graphshard.api.bucket_storage); backward gathers block 1's weights
    # again without their biases (48 + 48, part of the storage: copied) and block 0's down
    # weight alone (its shard is the buffer: no copy)
    copy_in = 2 * 96
    # interleave: each parameter of a several-parameter bucket read and written once; the
    # head's padded 4th row comes along (8 + 1 elements, read and written)
    interleave = 2 * 2 * 212 + 2 * (32 + 4) + 2 * (96 + 96)
    # gradients: read once (212 a block, 27 the head) and written into the buffers (212,
    # 2 x 18 for the head, of which 9 padding zeros)
    grad_copy_in = 2 * (212 + 212) + (27 + 36 - 9)
    only(t, copy_in=copy_in * F32, interleave=interleave * F32,
         grad_copy_in=grad_copy_in * F32, grad_padding=9 * F32)
    assert t.minimum["interleave"] == t.moved["interleave"] - 2 * (8 + 1) * F32
    assert {k: t.minimum[k] for k in ("copy_in", "grad_copy_in", "grad_padding")} == {
        "copy_in": t.moved["copy_in"], "grad_copy_in": t.moved["grad_copy_in"],
        "grad_padding": t.moved["grad_padding"]}
