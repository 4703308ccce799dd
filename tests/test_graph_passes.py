"""Graph-level tests of the lowering passes, one process, fake process group (structure only)."""

from __future__ import annotations

import json
import re

import expecttest
import pytest
import torch
from graph_utils import (
    TwoBlock,
    c10d,
    calls,
    derived_from,
    fake_process_group,
    gathered_values,
    graph_text,
    saved_for_backward,
)
from torch import nn

import graphshard
from passes.layout import Dim0Layout


def compile_and_step(model: nn.Module, **backend_options) -> dict:
    """Shard-compile ``model`` with the graph-only backend, run fw+bw, return the graphs."""
    backend = graphshard.backend(inductor=False, **backend_options)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    compiled(torch.randn(4, 8)).sum().backward()
    (stages,) = backend.graphs
    return stages


@pytest.fixture
def world2():
    with fake_process_group(2) as group:
        torch.manual_seed(0)
        yield group


class LoweredGraphs(expecttest.TestCase):
    """The full lowered forward and backward graphs of a two-block model (3 buckets)."""

    def test_two_blocks(self):
        with fake_process_group(2) as group:
            torch.manual_seed(0)
            stages = compile_and_step(graphshard.shard(TwoBlock()))
            fw = graph_text(stages["fw"], group.group_name)
            bw = graph_text(stages["bw"], group.group_name)
        self.assertExpectedInline(fw, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[4, 8]", primals_2: "f32[6, 8]", primals_4: "f32[6]", primals_6: "f32[4, 12]", primals_8: "f32[4]", primals_10: "f32[6, 8]", primals_12: "f32[6]", primals_14: "f32[4, 12]", primals_16: "f32[4]", primals_18: "f32[2, 8]", primals_20: "f32[2]"):
        view_default: "f32[48]" = torch.ops.aten.view.default(primals_2, [-1]);  primals_2 = None
        view_default_1: "f32[6]" = torch.ops.aten.view.default(primals_4, [-1]);  primals_4 = None
        view_default_2: "f32[48]" = torch.ops.aten.view.default(primals_6, [-1])
        view_default_3: "f32[4]" = torch.ops.aten.view.default(primals_8, [-1]);  primals_8 = None
        cat_default: "f32[106]" = torch.ops.aten.cat.default([view_default, view_default_1, view_default_2, view_default_3]);  view_default = view_default_1 = view_default_2 = view_default_3 = None
        all_gather_into_tensor_default: "f32[212]" = torch.ops._c10d_functional.all_gather_into_tensor.default(cat_default, 2, 'G');  cat_default = None
        wait_tensor_default: "f32[212]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default);  all_gather_into_tensor_default = None
        view_default_9: "f32[48]" = torch.ops.aten.view.default(primals_10, [-1])
        view_default_10: "f32[6]" = torch.ops.aten.view.default(primals_12, [-1]);  primals_12 = None
        view_default_11: "f32[48]" = torch.ops.aten.view.default(primals_14, [-1])
        view_default_12: "f32[4]" = torch.ops.aten.view.default(primals_16, [-1]);  primals_16 = None
        cat_default_1: "f32[106]" = torch.ops.aten.cat.default([view_default_9, view_default_10, view_default_11, view_default_12]);  view_default_9 = view_default_10 = view_default_11 = view_default_12 = None
        all_gather_into_tensor_default_1: "f32[212]" = torch.ops._c10d_functional.all_gather_into_tensor.default(cat_default_1, 2, 'G');  cat_default_1 = None
        view_default_4: "f32[2, 106]" = torch.ops.aten.view.default(wait_tensor_default, [2, 106]);  wait_tensor_default = None
        slice_tensor: "f32[2, 48]" = torch.ops.aten.slice.Tensor(view_default_4, 1, 0, 48)
        clone_default: "f32[2, 48]" = torch.ops.aten.clone.default(slice_tensor, memory_format = torch.contiguous_format);  slice_tensor = None
        view_default_5: "f32[12, 8]" = torch.ops.aten.view.default(clone_default, [12, 8]);  clone_default = None
        slice_tensor_1: "f32[2, 6]" = torch.ops.aten.slice.Tensor(view_default_4, 1, 48, 54)
        clone_default_1: "f32[2, 6]" = torch.ops.aten.clone.default(slice_tensor_1, memory_format = torch.contiguous_format);  slice_tensor_1 = None
        view_default_6: "f32[12]" = torch.ops.aten.view.default(clone_default_1, [12]);  clone_default_1 = None
        slice_tensor_2: "f32[2, 48]" = torch.ops.aten.slice.Tensor(view_default_4, 1, 54, 102)
        clone_default_2: "f32[2, 48]" = torch.ops.aten.clone.default(slice_tensor_2, memory_format = torch.contiguous_format);  slice_tensor_2 = None
        view_default_7: "f32[8, 12]" = torch.ops.aten.view.default(clone_default_2, [8, 12]);  clone_default_2 = None
        slice_tensor_3: "f32[2, 4]" = torch.ops.aten.slice.Tensor(view_default_4, 1, 102, 106);  view_default_4 = None
        clone_default_3: "f32[2, 4]" = torch.ops.aten.clone.default(slice_tensor_3, memory_format = torch.contiguous_format);  slice_tensor_3 = None
        view_default_8: "f32[8]" = torch.ops.aten.view.default(clone_default_3, [8]);  clone_default_3 = None
        permute: "f32[8, 12]" = torch.ops.aten.permute.default(view_default_5, [1, 0]);  view_default_5 = None
        addmm: "f32[4, 12]" = torch.ops.aten.addmm.default(view_default_6, primals_1, permute);  view_default_6 = permute = None
        relu: "f32[4, 12]" = torch.ops.aten.relu.default(addmm);  addmm = None
        permute_1: "f32[12, 8]" = torch.ops.aten.permute.default(view_default_7, [1, 0]);  view_default_7 = None
        addmm_1: "f32[4, 8]" = torch.ops.aten.addmm.default(view_default_8, relu, permute_1);  view_default_8 = permute_1 = None
        add: "f32[4, 8]" = torch.ops.aten.add.Tensor(primals_1, addmm_1);  addmm_1 = None
        wait_tensor_default_1: "f32[212]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_1);  all_gather_into_tensor_default_1 = None
        view_default_18: "f32[16]" = torch.ops.aten.view.default(primals_18, [-1]);  primals_18 = None
        view_default_19: "f32[2]" = torch.ops.aten.view.default(primals_20, [-1]);  primals_20 = None
        cat_default_2: "f32[18]" = torch.ops.aten.cat.default([view_default_18, view_default_19]);  view_default_18 = view_default_19 = None
        all_gather_into_tensor_default_2: "f32[36]" = torch.ops._c10d_functional.all_gather_into_tensor.default(cat_default_2, 2, 'G');  cat_default_2 = None
        view_default_13: "f32[2, 106]" = torch.ops.aten.view.default(wait_tensor_default_1, [2, 106]);  wait_tensor_default_1 = None
        slice_tensor_4: "f32[2, 48]" = torch.ops.aten.slice.Tensor(view_default_13, 1, 0, 48)
        clone_default_4: "f32[2, 48]" = torch.ops.aten.clone.default(slice_tensor_4, memory_format = torch.contiguous_format);  slice_tensor_4 = None
        view_default_14: "f32[12, 8]" = torch.ops.aten.view.default(clone_default_4, [12, 8]);  clone_default_4 = None
        slice_tensor_5: "f32[2, 6]" = torch.ops.aten.slice.Tensor(view_default_13, 1, 48, 54)
        clone_default_5: "f32[2, 6]" = torch.ops.aten.clone.default(slice_tensor_5, memory_format = torch.contiguous_format);  slice_tensor_5 = None
        view_default_15: "f32[12]" = torch.ops.aten.view.default(clone_default_5, [12]);  clone_default_5 = None
        slice_tensor_6: "f32[2, 48]" = torch.ops.aten.slice.Tensor(view_default_13, 1, 54, 102)
        clone_default_6: "f32[2, 48]" = torch.ops.aten.clone.default(slice_tensor_6, memory_format = torch.contiguous_format);  slice_tensor_6 = None
        view_default_16: "f32[8, 12]" = torch.ops.aten.view.default(clone_default_6, [8, 12]);  clone_default_6 = None
        slice_tensor_7: "f32[2, 4]" = torch.ops.aten.slice.Tensor(view_default_13, 1, 102, 106);  view_default_13 = None
        clone_default_7: "f32[2, 4]" = torch.ops.aten.clone.default(slice_tensor_7, memory_format = torch.contiguous_format);  slice_tensor_7 = None
        view_default_17: "f32[8]" = torch.ops.aten.view.default(clone_default_7, [8]);  clone_default_7 = None
        permute_2: "f32[8, 12]" = torch.ops.aten.permute.default(view_default_14, [1, 0]);  view_default_14 = None
        addmm_2: "f32[4, 12]" = torch.ops.aten.addmm.default(view_default_15, add, permute_2);  view_default_15 = permute_2 = None
        relu_1: "f32[4, 12]" = torch.ops.aten.relu.default(addmm_2);  addmm_2 = None
        permute_3: "f32[12, 8]" = torch.ops.aten.permute.default(view_default_16, [1, 0]);  view_default_16 = None
        addmm_3: "f32[4, 8]" = torch.ops.aten.addmm.default(view_default_17, relu_1, permute_3);  view_default_17 = permute_3 = None
        add_1: "f32[4, 8]" = torch.ops.aten.add.Tensor(add, addmm_3);  addmm_3 = None
        wait_tensor_default_2: "f32[36]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_2);  all_gather_into_tensor_default_2 = None
        view_default_20: "f32[2, 18]" = torch.ops.aten.view.default(wait_tensor_default_2, [2, 18]);  wait_tensor_default_2 = None
        slice_tensor_8: "f32[2, 16]" = torch.ops.aten.slice.Tensor(view_default_20, 1, 0, 16)
        clone_default_8: "f32[2, 16]" = torch.ops.aten.clone.default(slice_tensor_8, memory_format = torch.contiguous_format);  slice_tensor_8 = None
        view_default_21: "f32[4, 8]" = torch.ops.aten.view.default(clone_default_8, [4, 8]);  clone_default_8 = None
        slice_tensor_9: "f32[3, 8]" = torch.ops.aten.slice.Tensor(view_default_21, 0, 0, 3);  view_default_21 = None
        slice_tensor_10: "f32[2, 2]" = torch.ops.aten.slice.Tensor(view_default_20, 1, 16, 18);  view_default_20 = None
        clone_default_9: "f32[2, 2]" = torch.ops.aten.clone.default(slice_tensor_10, memory_format = torch.contiguous_format);  slice_tensor_10 = None
        view_default_22: "f32[4]" = torch.ops.aten.view.default(clone_default_9, [4]);  clone_default_9 = None
        slice_tensor_11: "f32[3]" = torch.ops.aten.slice.Tensor(view_default_22, 0, 0, 3);  view_default_22 = None
        permute_4: "f32[8, 3]" = torch.ops.aten.permute.default(slice_tensor_9, [1, 0]);  slice_tensor_9 = None
        addmm_4: "f32[4, 3]" = torch.ops.aten.addmm.default(slice_tensor_11, add_1, permute_4);  slice_tensor_11 = None
        permute_5: "f32[3, 8]" = torch.ops.aten.permute.default(permute_4, [1, 0]);  permute_4 = None
        return (addmm_4, primals_1, primals_6, primals_10, primals_14, relu, add, relu_1, add_1, permute_5)
""")
        self.assertExpectedInline(bw, """\
class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[4, 8]", primals_6: "f32[4, 12]", primals_10: "f32[6, 8]", primals_14: "f32[4, 12]", relu: "f32[4, 12]", add: "f32[4, 8]", relu_1: "f32[4, 12]", add_1: "f32[4, 8]", permute_5: "f32[3, 8]", tangents_1: "f32[4, 3]"):
        view_default: "f32[48]" = torch.ops.aten.view.default(primals_14, [-1]);  primals_14 = None
        view_default_1: "f32[48]" = torch.ops.aten.view.default(primals_10, [-1]);  primals_10 = None
        cat_default: "f32[96]" = torch.ops.aten.cat.default([view_default, view_default_1]);  view_default = view_default_1 = None
        all_gather_into_tensor_default: "f32[192]" = torch.ops._c10d_functional.all_gather_into_tensor.default(cat_default, 2, 'G');  cat_default = None
        mm: "f32[4, 8]" = torch.ops.aten.mm.default(tangents_1, permute_5);  permute_5 = None
        permute_6: "f32[3, 4]" = torch.ops.aten.permute.default(tangents_1, [1, 0])
        mm_1: "f32[3, 8]" = torch.ops.aten.mm.default(permute_6, add_1);  permute_6 = add_1 = None
        permute_7: "f32[8, 3]" = torch.ops.aten.permute.default(mm_1, [1, 0]);  mm_1 = None
        sum_1: "f32[1, 3]" = torch.ops.aten.sum.dim_IntList(tangents_1, [0], True);  tangents_1 = None
        view_10: "f32[3]" = torch.ops.aten.view.default(sum_1, [3]);  sum_1 = None
        permute_8: "f32[3, 8]" = torch.ops.aten.permute.default(permute_7, [1, 0]);  permute_7 = None
        clone_default_2: "f32[3]" = torch.ops.aten.clone.default(view_10, memory_format = torch.contiguous_format);  view_10 = None
        view_default_7: "f32[3, 1]" = torch.ops.aten.view.default(clone_default_2, [3, 1]);  clone_default_2 = None
        constant_pad_nd_default: "f32[4, 1]" = torch.ops.aten.constant_pad_nd.default(view_default_7, [0, 0, 0, 1], 0.0);  view_default_7 = None
        view_default_8: "f32[2, 2]" = torch.ops.aten.view.default(constant_pad_nd_default, [2, 2]);  constant_pad_nd_default = None
        clone_default_3: "f32[3, 8]" = torch.ops.aten.clone.default(permute_8, memory_format = torch.contiguous_format);  permute_8 = None
        view_default_9: "f32[3, 8]" = torch.ops.aten.view.default(clone_default_3, [3, 8]);  clone_default_3 = None
        constant_pad_nd_default_1: "f32[4, 8]" = torch.ops.aten.constant_pad_nd.default(view_default_9, [0, 0, 0, 1], 0.0);  view_default_9 = None
        view_default_10: "f32[2, 16]" = torch.ops.aten.view.default(constant_pad_nd_default_1, [2, 16]);  constant_pad_nd_default_1 = None
        cat_default_1: "f32[2, 18]" = torch.ops.aten.cat.default([view_default_8, view_default_10], 1);  view_default_8 = view_default_10 = None
        view_default_11: "f32[36]" = torch.ops.aten.view.default(cat_default_1, [-1]);  cat_default_1 = None
        reduce_scatter_tensor_default: "f32[18]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(view_default_11, 'avg', 2, 'G');  view_default_11 = None
        wait_tensor_default: "f32[192]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default);  all_gather_into_tensor_default = None
        view_default_5: "f32[48]" = torch.ops.aten.view.default(primals_6, [-1]);  primals_6 = None
        all_gather_into_tensor_default_1: "f32[96]" = torch.ops._c10d_functional.all_gather_into_tensor.default(view_default_5, 2, 'G');  view_default_5 = None
        view_default_2: "f32[2, 96]" = torch.ops.aten.view.default(wait_tensor_default, [2, 96]);  wait_tensor_default = None
        slice_tensor: "f32[2, 48]" = torch.ops.aten.slice.Tensor(view_default_2, 1, 0, 48)
        clone_default: "f32[2, 48]" = torch.ops.aten.clone.default(slice_tensor, memory_format = torch.contiguous_format);  slice_tensor = None
        view_default_3: "f32[8, 12]" = torch.ops.aten.view.default(clone_default, [8, 12]);  clone_default = None
        slice_tensor_1: "f32[2, 48]" = torch.ops.aten.slice.Tensor(view_default_2, 1, 48, 96);  view_default_2 = None
        clone_default_1: "f32[2, 48]" = torch.ops.aten.clone.default(slice_tensor_1, memory_format = torch.contiguous_format);  slice_tensor_1 = None
        view_default_4: "f32[12, 8]" = torch.ops.aten.view.default(clone_default_1, [12, 8]);  clone_default_1 = None
        permute_3: "f32[12, 8]" = torch.ops.aten.permute.default(view_default_3, [1, 0]);  view_default_3 = None
        permute_9: "f32[8, 12]" = torch.ops.aten.permute.default(permute_3, [1, 0]);  permute_3 = None
        mm_2: "f32[4, 12]" = torch.ops.aten.mm.default(mm, permute_9);  permute_9 = None
        permute_10: "f32[8, 4]" = torch.ops.aten.permute.default(mm, [1, 0])
        mm_3: "f32[8, 12]" = torch.ops.aten.mm.default(permute_10, relu_1);  permute_10 = None
        permute_11: "f32[12, 8]" = torch.ops.aten.permute.default(mm_3, [1, 0]);  mm_3 = None
        sum_2: "f32[1, 8]" = torch.ops.aten.sum.dim_IntList(mm, [0], True)
        view_13: "f32[8]" = torch.ops.aten.view.default(sum_2, [8]);  sum_2 = None
        permute_12: "f32[8, 12]" = torch.ops.aten.permute.default(permute_11, [1, 0]);  permute_11 = None
        alias_1: "f32[4, 12]" = torch.ops.aten.alias.default(relu_1);  relu_1 = None
        alias_2: "f32[4, 12]" = torch.ops.aten.alias.default(alias_1);  alias_1 = None
        le: "b8[4, 12]" = torch.ops.aten.le.Scalar(alias_2, 0);  alias_2 = None
        scalar_tensor: "f32[]" = torch.ops.aten.scalar_tensor.default(0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
        where: "f32[4, 12]" = torch.ops.aten.where.self(le, scalar_tensor, mm_2);  le = mm_2 = None
        permute_2: "f32[8, 12]" = torch.ops.aten.permute.default(view_default_4, [1, 0]);  view_default_4 = None
        permute_13: "f32[12, 8]" = torch.ops.aten.permute.default(permute_2, [1, 0]);  permute_2 = None
        mm_4: "f32[4, 8]" = torch.ops.aten.mm.default(where, permute_13);  permute_13 = None
        permute_14: "f32[12, 4]" = torch.ops.aten.permute.default(where, [1, 0])
        mm_5: "f32[12, 8]" = torch.ops.aten.mm.default(permute_14, add);  permute_14 = add = None
        permute_15: "f32[8, 12]" = torch.ops.aten.permute.default(mm_5, [1, 0]);  mm_5 = None
        sum_3: "f32[1, 12]" = torch.ops.aten.sum.dim_IntList(where, [0], True);  where = None
        view_16: "f32[12]" = torch.ops.aten.view.default(sum_3, [12]);  sum_3 = None
        add_2: "f32[4, 8]" = torch.ops.aten.add.Tensor(mm, mm_4);  mm = mm_4 = None
        permute_16: "f32[12, 8]" = torch.ops.aten.permute.default(permute_15, [1, 0]);  permute_15 = None
        clone_default_4: "f32[8]" = torch.ops.aten.clone.default(view_13, memory_format = torch.contiguous_format);  view_13 = None
        view_default_14: "f32[8, 1]" = torch.ops.aten.view.default(clone_default_4, [8, 1]);  clone_default_4 = None
        view_default_15: "f32[2, 4]" = torch.ops.aten.view.default(view_default_14, [2, 4]);  view_default_14 = None
        clone_default_5: "f32[8, 12]" = torch.ops.aten.clone.default(permute_12, memory_format = torch.contiguous_format);  permute_12 = None
        view_default_16: "f32[8, 12]" = torch.ops.aten.view.default(clone_default_5, [8, 12]);  clone_default_5 = None
        view_default_17: "f32[2, 48]" = torch.ops.aten.view.default(view_default_16, [2, 48]);  view_default_16 = None
        clone_default_6: "f32[12]" = torch.ops.aten.clone.default(view_16, memory_format = torch.contiguous_format);  view_16 = None
        view_default_18: "f32[12, 1]" = torch.ops.aten.view.default(clone_default_6, [12, 1]);  clone_default_6 = None
        view_default_19: "f32[2, 6]" = torch.ops.aten.view.default(view_default_18, [2, 6]);  view_default_18 = None
        clone_default_7: "f32[12, 8]" = torch.ops.aten.clone.default(permute_16, memory_format = torch.contiguous_format);  permute_16 = None
        view_default_20: "f32[12, 8]" = torch.ops.aten.view.default(clone_default_7, [12, 8]);  clone_default_7 = None
        view_default_21: "f32[2, 48]" = torch.ops.aten.view.default(view_default_20, [2, 48]);  view_default_20 = None
        cat_default_2: "f32[2, 106]" = torch.ops.aten.cat.default([view_default_15, view_default_17, view_default_19, view_default_21], 1);  view_default_15 = view_default_17 = view_default_19 = view_default_21 = None
        view_default_22: "f32[212]" = torch.ops.aten.view.default(cat_default_2, [-1]);  cat_default_2 = None
        wait_tensor_default_2: "f32[18]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default);  reduce_scatter_tensor_default = None
        slice_tensor_2: "f32[2]" = torch.ops.aten.slice.Tensor(wait_tensor_default_2, 0, 0, 2)
        view_default_12: "f32[2]" = torch.ops.aten.view.default(slice_tensor_2, [2]);  slice_tensor_2 = None
        slice_tensor_3: "f32[16]" = torch.ops.aten.slice.Tensor(wait_tensor_default_2, 0, 2, 18);  wait_tensor_default_2 = None
        view_default_13: "f32[2, 8]" = torch.ops.aten.view.default(slice_tensor_3, [2, 8]);  slice_tensor_3 = None
        reduce_scatter_tensor_default_1: "f32[106]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(view_default_22, 'avg', 2, 'G');  view_default_22 = None
        wait_tensor_default_1: "f32[96]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_default_1);  all_gather_into_tensor_default_1 = None
        view_default_6: "f32[8, 12]" = torch.ops.aten.view.default(wait_tensor_default_1, [8, 12]);  wait_tensor_default_1 = None
        permute_1: "f32[12, 8]" = torch.ops.aten.permute.default(view_default_6, [1, 0]);  view_default_6 = None
        permute_17: "f32[8, 12]" = torch.ops.aten.permute.default(permute_1, [1, 0]);  permute_1 = None
        mm_6: "f32[4, 12]" = torch.ops.aten.mm.default(add_2, permute_17);  permute_17 = None
        permute_18: "f32[8, 4]" = torch.ops.aten.permute.default(add_2, [1, 0])
        mm_7: "f32[8, 12]" = torch.ops.aten.mm.default(permute_18, relu);  permute_18 = None
        permute_19: "f32[12, 8]" = torch.ops.aten.permute.default(mm_7, [1, 0]);  mm_7 = None
        sum_4: "f32[1, 8]" = torch.ops.aten.sum.dim_IntList(add_2, [0], True);  add_2 = None
        view_19: "f32[8]" = torch.ops.aten.view.default(sum_4, [8]);  sum_4 = None
        permute_20: "f32[8, 12]" = torch.ops.aten.permute.default(permute_19, [1, 0]);  permute_19 = None
        alias: "f32[4, 12]" = torch.ops.aten.alias.default(relu);  relu = None
        alias_3: "f32[4, 12]" = torch.ops.aten.alias.default(alias);  alias = None
        le_1: "b8[4, 12]" = torch.ops.aten.le.Scalar(alias_3, 0);  alias_3 = None
        where_1: "f32[4, 12]" = torch.ops.aten.where.self(le_1, scalar_tensor, mm_6);  le_1 = scalar_tensor = mm_6 = None
        permute_21: "f32[12, 4]" = torch.ops.aten.permute.default(where_1, [1, 0])
        mm_8: "f32[12, 8]" = torch.ops.aten.mm.default(permute_21, primals_1);  permute_21 = primals_1 = None
        permute_22: "f32[8, 12]" = torch.ops.aten.permute.default(mm_8, [1, 0]);  mm_8 = None
        sum_5: "f32[1, 12]" = torch.ops.aten.sum.dim_IntList(where_1, [0], True);  where_1 = None
        view_22: "f32[12]" = torch.ops.aten.view.default(sum_5, [12]);  sum_5 = None
        permute_23: "f32[12, 8]" = torch.ops.aten.permute.default(permute_22, [1, 0]);  permute_22 = None
        clone_default_8: "f32[8]" = torch.ops.aten.clone.default(view_19, memory_format = torch.contiguous_format);  view_19 = None
        view_default_27: "f32[8, 1]" = torch.ops.aten.view.default(clone_default_8, [8, 1]);  clone_default_8 = None
        view_default_28: "f32[2, 4]" = torch.ops.aten.view.default(view_default_27, [2, 4]);  view_default_27 = None
        clone_default_9: "f32[8, 12]" = torch.ops.aten.clone.default(permute_20, memory_format = torch.contiguous_format);  permute_20 = None
        view_default_29: "f32[8, 12]" = torch.ops.aten.view.default(clone_default_9, [8, 12]);  clone_default_9 = None
        view_default_30: "f32[2, 48]" = torch.ops.aten.view.default(view_default_29, [2, 48]);  view_default_29 = None
        clone_default_10: "f32[12]" = torch.ops.aten.clone.default(view_22, memory_format = torch.contiguous_format);  view_22 = None
        view_default_31: "f32[12, 1]" = torch.ops.aten.view.default(clone_default_10, [12, 1]);  clone_default_10 = None
        view_default_32: "f32[2, 6]" = torch.ops.aten.view.default(view_default_31, [2, 6]);  view_default_31 = None
        clone_default_11: "f32[12, 8]" = torch.ops.aten.clone.default(permute_23, memory_format = torch.contiguous_format);  permute_23 = None
        view_default_33: "f32[12, 8]" = torch.ops.aten.view.default(clone_default_11, [12, 8]);  clone_default_11 = None
        view_default_34: "f32[2, 48]" = torch.ops.aten.view.default(view_default_33, [2, 48]);  view_default_33 = None
        cat_default_3: "f32[2, 106]" = torch.ops.aten.cat.default([view_default_28, view_default_30, view_default_32, view_default_34], 1);  view_default_28 = view_default_30 = view_default_32 = view_default_34 = None
        view_default_35: "f32[212]" = torch.ops.aten.view.default(cat_default_3, [-1]);  cat_default_3 = None
        wait_tensor_default_3: "f32[106]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default_1);  reduce_scatter_tensor_default_1 = None
        slice_tensor_4: "f32[4]" = torch.ops.aten.slice.Tensor(wait_tensor_default_3, 0, 0, 4)
        view_default_23: "f32[4]" = torch.ops.aten.view.default(slice_tensor_4, [4]);  slice_tensor_4 = None
        slice_tensor_5: "f32[48]" = torch.ops.aten.slice.Tensor(wait_tensor_default_3, 0, 4, 52)
        view_default_24: "f32[4, 12]" = torch.ops.aten.view.default(slice_tensor_5, [4, 12]);  slice_tensor_5 = None
        slice_tensor_6: "f32[6]" = torch.ops.aten.slice.Tensor(wait_tensor_default_3, 0, 52, 58)
        view_default_25: "f32[6]" = torch.ops.aten.view.default(slice_tensor_6, [6]);  slice_tensor_6 = None
        slice_tensor_7: "f32[48]" = torch.ops.aten.slice.Tensor(wait_tensor_default_3, 0, 58, 106);  wait_tensor_default_3 = None
        view_default_26: "f32[6, 8]" = torch.ops.aten.view.default(slice_tensor_7, [6, 8]);  slice_tensor_7 = None
        reduce_scatter_tensor_default_2: "f32[106]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(view_default_35, 'avg', 2, 'G');  view_default_35 = None
        wait_tensor_default_4: "f32[106]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor_default_2);  reduce_scatter_tensor_default_2 = None
        slice_tensor_8: "f32[4]" = torch.ops.aten.slice.Tensor(wait_tensor_default_4, 0, 0, 4)
        view_default_36: "f32[4]" = torch.ops.aten.view.default(slice_tensor_8, [4]);  slice_tensor_8 = None
        slice_tensor_9: "f32[48]" = torch.ops.aten.slice.Tensor(wait_tensor_default_4, 0, 4, 52)
        view_default_37: "f32[4, 12]" = torch.ops.aten.view.default(slice_tensor_9, [4, 12]);  slice_tensor_9 = None
        slice_tensor_10: "f32[6]" = torch.ops.aten.slice.Tensor(wait_tensor_default_4, 0, 52, 58)
        view_default_38: "f32[6]" = torch.ops.aten.view.default(slice_tensor_10, [6]);  slice_tensor_10 = None
        slice_tensor_11: "f32[48]" = torch.ops.aten.slice.Tensor(wait_tensor_default_4, 0, 58, 106);  wait_tensor_default_4 = None
        view_default_39: "f32[6, 8]" = torch.ops.aten.view.default(slice_tensor_11, [6, 8]);  slice_tensor_11 = None
        return (None, view_default_39, view_default_38, view_default_37, view_default_36, view_default_26, view_default_25, view_default_24, view_default_23, view_default_13, view_default_12)
""")


def test_collectives_per_bucket(world2):
    model = graphshard.shard(TwoBlock())
    stages = compile_and_step(model, reshard_last_bucket=True)
    buckets = 3  # two blocks and the rest (head)
    assert len(calls(stages["fw"], c10d.all_gather_into_tensor.default)) == buckets
    assert len(calls(stages["bw"], c10d.all_gather_into_tensor.default)) == buckets
    assert len(calls(stages["bw"], c10d.reduce_scatter_tensor.default)) == buckets
    # Bytes: each gather moves exactly its bucket's shards.
    gathers = calls(stages["fw"], c10d.all_gather_into_tensor.default)
    sizes = [g.args[0].meta["val"].numel() for g in gathers]
    block_params = [p for p in TwoBlock().blocks[0].parameters()]
    per_block = sum(Dim0Layout(p.shape, 2).piece_numel for p in block_params)
    head = sum(Dim0Layout(p.shape, 2).piece_numel for p in TwoBlock().head.parameters())
    assert sizes == [per_block, per_block, head]
    total = sum(Dim0Layout(p.shape, 2).piece_numel for p in model.parameters())
    rs = calls(stages["bw"], c10d.reduce_scatter_tensor.default)
    assert sum(n.args[0].meta["val"].numel() for n in rs) == 2 * total


def test_last_bucket_is_kept_for_backward_by_default(world2):
    stages = compile_and_step(graphshard.shard(TwoBlock()))
    bw_gathers = calls(stages["bw"], c10d.all_gather_into_tensor.default)
    assert [g.meta["graphshard"]["bucket"] for g in bw_gathers] == [1, 0]  # not the head's
    assert len(calls(stages["bw"], c10d.reduce_scatter_tensor.default)) == 3
    saved = set(saved_for_backward(stages["fw"], num_user_outputs=1))
    head_gather = calls(stages["fw"], c10d.all_gather_into_tensor.default)[-1]
    assert saved & gathered_values(stages["fw"]) <= derived_from(head_gather)
    assert saved & derived_from(head_gather)


def test_forward_saves_no_unsharded_parameter(world2):
    stages = compile_and_step(graphshard.shard(TwoBlock()), reshard_last_bucket=True)
    saved = saved_for_backward(stages["fw"], num_user_outputs=1)
    assert saved, "the forward saves activations"
    assert not set(saved) & gathered_values(stages["fw"])


def test_zero2_keeps_unsharded_parameters_and_skips_regather(world2):
    stages = compile_and_step(graphshard.shard(TwoBlock(), reshard_after_forward=False))
    saved = saved_for_backward(stages["fw"], num_user_outputs=1)
    assert set(saved) & gathered_values(stages["fw"])
    assert calls(stages["bw"], c10d.all_gather_into_tensor.default) == []
    assert len(calls(stages["bw"], c10d.reduce_scatter_tensor.default)) == 3


def test_non_neighbour_bucket_is_one_gather(world2):
    model = TwoBlock()
    graphshard.shard(model, buckets=[[model.blocks[0], model.head]])
    stages = compile_and_step(model)
    gathers = calls(stages["fw"], c10d.all_gather_into_tensor.default)
    assert len(gathers) == 2  # the group, then the rest (block 1)
    group_numel = sum(
        Dim0Layout(p.shape, 2).piece_numel
        for m in (TwoBlock().blocks[0], TwoBlock().head)
        for p in m.parameters()
    )
    assert gathers[0].args[0].meta["val"].numel() == group_numel
    assert gathers[0].meta["graphshard"] == {
        "kind": "unshard",
        "bucket": 0,
        "params": ["blocks.0.up.weight", "blocks.0.up.bias", "blocks.0.down.weight",
                   "blocks.0.down.bias", "head.weight", "head.bias"],
    }


def test_tied_parameter_is_gathered_and_reduced_once(world2):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 6)
            self.out = nn.Linear(6, 10, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, ids):
            return self.out(self.emb(ids))

    model = graphshard.shard(Tied())
    assert len(list(model.parameters())) == 1
    backend = graphshard.backend(inductor=False)
    torch.compile(model, backend=backend)(torch.tensor([[1, 2, 3]])).sum().backward()
    (stages,) = backend.graphs
    assert len(calls(stages["fw"], c10d.all_gather_into_tensor.default)) == 1
    assert len(calls(stages["bw"], c10d.reduce_scatter_tensor.default)) == 1


def test_dump_files_name_graph_stage_and_pass(world2, tmp_path):
    compile_and_step(graphshard.shard(TwoBlock()), dump_dir=str(tmp_path))
    (graph_dir,) = (tmp_path / "rank0").iterdir()
    names = sorted(p.name for p in graph_dir.iterdir())
    passes_dumped = [n for n in names if re.match(r"[a-z]+_\d\d_", n)]
    schedule = [n for n in names if n not in passes_dumped]
    assert schedule == [
        "bw_schedule.txt", "bw_timeline.json", "bw_timeline.png",
        "fw_schedule.txt", "fw_timeline.json", "fw_timeline.png",
    ]
    trace = json.loads((graph_dir / "fw_timeline.json").read_text())
    assert any(e.get("args", {}).get("kind") == "unshard" for e in trace["traceEvents"])
    table = (graph_dir / "bw_schedule.txt").read_text()
    assert table.count("reduce_scatter") == 3 and "blocks.1.down.bias" in table
    assert passes_dumped == [
        "bw_00_input.txt",
        "bw_01_lower_unshard.txt",
        "bw_02_lower_reduce_grad.txt",
        "bw_03_prefetch.txt",
        "bw_04_overlap_reduce.txt",
        "dynamo_00_input.txt",
        "dynamo_01_dedupe_unshard.txt",
        "fw_00_input.txt",
        "fw_01_lower_unshard.txt",
        "fw_02_prefetch.txt",
        "joint_00_input.txt",
        "joint_01_fold_views.txt",
        "joint_02_merge_reduce_grad.txt",
        "joint_03_assign_buckets.txt",
        "joint_04_reshard.txt",
    ]
    assert "graphshard.unshard" in (graph_dir / "fw_00_input.txt").read_text()
    assert "all_gather_into_tensor" in (graph_dir / "fw_01_lower_unshard.txt").read_text()


def test_dump_dir_from_environment(world2, tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSHARD_DUMP_DIR", str(tmp_path))
    compile_and_step(graphshard.shard(TwoBlock()))
    assert (tmp_path / "rank0").is_dir()
    assert any((tmp_path / "rank0").rglob("bw_02_lower_reduce_grad.txt"))


