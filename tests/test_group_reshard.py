"""``shard(reshard_after_forward=k)``: the backward gathers over groups of ``k`` ranks from the
``1/k`` piece the forward kept (``graphshard.passes.group_reshard``).

Graph structure on a fake world of 4 in this process; numerics on 4 gloo ranks against one
process, one launch for every job."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from graph_utils import (
    TwoBlock,
    c10d,
    calls,
    compile_and_step,
    fake_process_group,
    gathered_values,
    saved_for_backward,
)
from group_reshard_jobs import reference, run_jobs
from parity import assert_matches

import graphshard
from graphshard.errors import GraphshardTypeError, GraphshardValueError
from graphshard.passes.layout import Dim0Layout
from graphshard.passes.markers import TAKE_GROUP_PIECE

# (case, mode, reshard_after_forward, precision)
# "lowered": graphshard's passes without Inductor (cheaper to compile); "compiled" takes the
# piece and the gathers through Inductor too.
JOBS = [
    ("mlp_odd", "compiled", 2, "fp32"),  # rows that do not split evenly over 4 or 2
    ("llama_untied", "lowered", 2, "fp32"),  # the blocks compiled once as regions
    ("llama_tied", "lowered", 2, "fp32"),  # the embedding read first and, tied, last
    ("blocks_checkpointed", "lowered", 2, "fp32"),  # computed again in the backward
    # one bucket, freed too: a 0-D value, rows fewer than the group, a 3-D weight
    ("odd_params", "lowered_last", 2, "fp32"),
    ("mlp_odd", "eager", 2, "fp32"),  # eagerly: the pieces kept by saved-tensor hooks
    ("llama_untied", "eager", 2, "fp32"),
    # per module: a block kept, a block over groups of 2, the rest freed over all 4
    ("llama_untied", "lowered", "per_module", "fp32"),
    ("llama_untied", "eager", "per_module", "fp32"),
    ("llama_untied", "lowered", 2, "bf16"),
    ("llama_untied", "lowered", True, "bf16"),
]
FP32_JOBS = [job for job in JOBS if job[3] == "fp32"]


@pytest.fixture(scope="module")
def world4():
    return run_ranks(run_jobs, 4, JOBS)


@pytest.fixture
def fake4():
    with fake_process_group(4) as group:
        torch.manual_seed(0)
        yield group


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    return list(module.parameters())


def test_backward_gathers_pieces_over_the_group(fake4):
    stages = compile_and_step(graphshard.shard(TwoBlock(), reshard_after_forward=2))
    fw = calls(stages["fw"], c10d.all_gather_into_tensor.default)
    bw = calls(stages["bw"], c10d.all_gather_into_tensor.default)
    assert [g.args[1] for g in fw] == [4, 4, 4]
    assert [g.args[1] for g in bw] == [2, 2]  # the blocks; the head's bucket is kept
    assert len({g.args[2] for g in bw}) == 1 and bw[0].args[2] != fw[0].args[2]
    # each rank sends its piece over the group of 2: half of each weight the backward reads
    # (block 1: both weights; block 0: the down projection, the input needs no gradient)
    blocks = TwoBlock().blocks
    half = [Dim0Layout(p.shape, 2).piece_numel for p in (blocks[1].up.weight,
                                                         blocks[1].down.weight)]
    assert [g.args[0].meta["val"].numel() for g in bw] == [
        sum(half), Dim0Layout(blocks[0].down.weight.shape, 2).piece_numel]


def test_forward_saves_the_pieces_not_the_gathered_parameters(fake4):
    stages = compile_and_step(graphshard.shard(TwoBlock(), reshard_after_forward=2),
                              reshard_last_bucket=True)
    saved = saved_for_backward(stages["fw"], num_user_outputs=1)
    pieces = [n for n in saved if n.target is TAKE_GROUP_PIECE]
    assert not set(saved) & gathered_values(stages["fw"])
    block = TwoBlock().blocks[0]
    assert sorted(tuple(n.meta["val"].shape) for n in pieces) == sorted(
        [Dim0Layout(block.down.weight.shape, 2).piece_shape]
        + [Dim0Layout(w.shape, 2).piece_shape for w in (block.up.weight, block.down.weight)]
        + [Dim0Layout(TwoBlock().head.weight.shape, 2).piece_shape])
    # the forward gathers once per bucket: the regathers for the backward are not in it
    assert len(calls(stages["fw"], c10d.all_gather_into_tensor.default)) == 3


def test_hsdp_gathers_within_runs_of_its_shard_groups():
    """HSDP on 2 x 4 (a fake world of 8): the backward gathers over 2 of the 4 ranks of this
    rank's shard group; the gradients still go over the whole shard group and replicas."""
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(8):
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        stages = compile_and_step(graphshard.shard(TwoBlock(), mesh, reshard_after_forward=2))
    assert [g.args[1] for g in calls(stages["fw"], c10d.all_gather_into_tensor.default)] == [
        4, 4, 4]
    assert [g.args[1] for g in calls(stages["bw"], c10d.all_gather_into_tensor.default)] == [
        2, 2]
    assert [n.args[2] for n in calls(stages["bw"], c10d.reduce_scatter_tensor.default)] == [
        4, 4, 4]


def test_eagerly_the_bucket_kept_whole_keeps_no_pieces(fake4):
    """The head, saved last, keeps its gathered copy for the backward: a piece of it as
    well would be memory held for nothing."""
    from graphshard.api.sharding import shard_state

    model = graphshard.shard(TwoBlock(), reshard_after_forward=2)
    state = shard_state(model)
    out = model(torch.randn(4, 8))
    name_of = {id(entry): entry.names[0] for entry in state.params}
    assert sorted(name_of[key[1]] for key in state.group_pieces) == [
        "blocks.0.down.weight", "blocks.1.down.weight", "blocks.1.up.weight"]
    out.sum().backward()
    assert not state.group_pieces  # let go with their last handles


@pytest.mark.parametrize("reshard,bw_gathers", [(1, 0), (4, 2)])
def test_one_and_the_world_read_as_false_and_true(fake4, reshard, bw_gathers):
    model = graphshard.shard(TwoBlock(), reshard_after_forward=reshard)
    stages = compile_and_step(model)
    gathers = calls(stages["bw"], c10d.all_gather_into_tensor.default)
    assert len(gathers) == bw_gathers and all(g.args[1] == 4 for g in gathers)
    assert not any(n.target is TAKE_GROUP_PIECE for n in stages["fw"].graph.nodes)


@pytest.mark.parametrize("reshard", [3, 0, -2, 8])
def test_an_int_that_does_not_divide_the_ranks_is_refused(fake4, reshard):
    with pytest.raises(GraphshardValueError, match=r"pass one of \[1, 2, 4\]"):
        graphshard.shard(TwoBlock(), reshard_after_forward=reshard)


def test_another_type_is_refused(fake4):
    with pytest.raises(GraphshardTypeError, match="an int k"):
        graphshard.shard(TwoBlock(), reshard_after_forward=2.0)


@pytest.mark.parametrize("job", FP32_JOBS, ids=["-".join(map(str, j[:3])) for j in FP32_JOBS])
def test_trains_like_one_process(world4, job):
    expected = reference(job[0], 4)
    for rank_results in world4:
        assert_matches(rank_results[job], expected)


@pytest.mark.parametrize("job", FP32_JOBS, ids=lambda j: f"{j[0]}-{j[1]}")
def test_backward_gathers_over_groups_of_two(world4, job):
    """Compiled, and eagerly (through the saved-tensor hooks' handles)."""
    for rank_results in world4:
        assert set(rank_results[job]["fw_gathers"]) == {4}
        assert set(rank_results[job]["bw_gathers"]) == {2}


@pytest.mark.parametrize("mode", ["lowered", "eager"])
def test_per_module_the_kept_block_is_not_gathered_again(world4, mode):
    """``reshard_after_forward={"layers.0": False, "layers.1": 2}``: the backward gathers
    the second block again over groups of 2 and never the first, where ``2`` for the whole
    model gathers both (the embedding's backward reads no weight; the output, read last, is
    kept either way)."""
    for rank_results in world4:
        per_module = rank_results[("llama_untied", mode, "per_module", "fp32")]
        whole = rank_results[("llama_untied", mode, 2, "fp32")]
        assert set(per_module["bw_gathers"]) == {2}
        assert 2 * len(per_module["bw_gathers"]) == len(whole["bw_gathers"]) > 0


def test_bf16_is_bit_identical_to_resharding_fully(world4):
    for rank_results in world4:
        groups = rank_results[("llama_untied", "lowered", 2, "bf16")]
        fully = rank_results[("llama_untied", "lowered", True, "bf16")]
        assert groups["losses"] == fully["losses"]
        for name, value in fully["state"].items():
            assert torch.equal(groups["state"][name], value), name
        assert set(groups["bw_gathers"]) == {2} and set(fully["bw_gathers"]) == {4}


def test_groups_are_runs_of_consecutive_ranks(world4):
    for rank, rank_results in enumerate(world4):
        out = rank_results["groups"]
        assert out["world"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert out["repeated"]  # made once per process group, not per shard() call
        assert out["hsdp_alone"] == (False, None)
        assert out["hsdp_runs_of_1"] == [rank]
        full = torch.arange(7 * 3, dtype=torch.float32).view(7, 3)
        expected = full[:4] if rank % 2 == 0 else torch.cat([full[4:], torch.zeros(1, 3)])
        assert torch.equal(out["piece"], expected)
        assert out["piece_group"]
        assert torch.equal(out["piece_0d"], torch.tensor([2.5]))
