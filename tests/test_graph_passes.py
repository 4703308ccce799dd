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
    compile_and_step,
    derived_from,
    fake_process_group,
    gathered_values,
    saved_for_backward,
    schedule_string,
)
from torch import nn

import graphshard
from graphshard.passes.layout import Dim0Layout


@pytest.fixture
def world2():
    with fake_process_group(2) as group:
        torch.manual_seed(0)
        yield group


class LoweredGraphs(expecttest.TestCase):
    """The schedule of a two-block model's lowered forward and backward (3 buckets), as a
    normalised string (``graph_utils.schedule_string``): which collective of which size is
    issued and waited where among the matmuls. Node names and torch's own lowering are left
    out, so the string survives torch upgrades; the collectives' order and sizes do not."""

    def test_two_blocks(self):
        with fake_process_group(2):
            torch.manual_seed(0)
            stages = compile_and_step(graphshard.shard(TwoBlock()))
        # forward: bucket k+1's gather issued before bucket k's matmuls, the head last
        self.assertExpectedInline(schedule_string(stages["fw"]), """\
AG0:212 W(AG0) AG1:212 MM MM W(AG1) AG2:36 MM MM W(AG2) MM""")
        # backward: the head is kept from forward (no regather); the blocks are regathered
        # without their biases, and each reduce-scatter is waited one bucket later
        self.assertExpectedInline(schedule_string(stages["bw"]), """\
AG0:192 MM MM RS0:36 W(AG0) AG1:96 MM MM MM MM W(RS0) RS1:212 W(AG1) MM MM MM W(RS1) RS2:212 W(RS2)""")


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
        "bw_02_split_last_reduce.txt",
        "bw_03_lower_reduce_grad.txt",
        "bw_04_prefetch.txt",
        "bw_05_overlap_reduce.txt",
        "bw_06_grad_copy_stream.txt",
        "bw_07_shard_copy_stream.txt",
        "bw_08_sizes_outside_regions.txt",
        "bw_09_resolve_region_operand_views.txt",
        "bw_10_gloo_gathers.txt",
        "dynamo_00_input.txt",
        "dynamo_01_inline_unsupported_regions.txt",
        "dynamo_02_dedupe_unshard.txt",
        "dynamo_03_parameters_first_in_regions.txt",
        "dynamo_04_resolve_region_operand_views.txt",
        "fw_00_input.txt",
        "fw_01_read_forward_gathers.txt",
        "fw_02_lower_unshard.txt",
        "fw_03_prefetch.txt",
        "fw_04_step_prefetch.txt",
        "fw_05_shard_copy_stream.txt",
        "fw_06_sizes_outside_regions.txt",
        "fw_07_resolve_region_operand_views.txt",
        "fw_08_gloo_gathers.txt",
        "joint_00_input.txt",
        "joint_01_rewire_region_passthrough.txt",
        "joint_02_read_shared_region_outputs_once.txt",
        "joint_03_fold_views.txt",
        "joint_04_merge_reduce_grad.txt",
        "joint_05_assign_buckets.txt",
        "joint_06_reshard.txt",
        "joint_07_keep_group_pieces.txt",
    ]
    assert "graphshard.unshard" in (graph_dir / "fw_00_input.txt").read_text()
    assert "all_gather_into_tensor" in (graph_dir / "fw_02_lower_unshard.txt").read_text()


def test_dump_dir_from_environment(world2, tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHSHARD_DUMP_DIR", str(tmp_path))
    compile_and_step(graphshard.shard(TwoBlock()))
    assert (tmp_path / "rank0").is_dir()
    assert any((tmp_path / "rank0").rglob("bw_03_lower_reduce_grad.txt"))


