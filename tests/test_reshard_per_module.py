"""``shard(reshard_after_forward={module: setting})``: one setting per module, as FSDP2's
``fully_shard`` calls give one per module (``graphshard.api.reshard_settings``).

Graph structure on a fake world of 4 in this process. Training against one process, compiled
and eager, with a block kept, a block over groups of 2 and the rest freed, is in
``tests/test_group_reshard.py`` (its world-4 launch)."""

from __future__ import annotations

import pytest
import torch
from graph_utils import TwoBlock, c10d, calls, compile_and_step, fake_process_group
from torch import nn

import graphshard
from graphshard.api.sharding import shard_state
from graphshard.errors import GraphshardTypeError, GraphshardValueError
from graphshard.passes.layout import Dim0Layout
from graphshard.safety.fingerprint import shard_fingerprint

GATHER = c10d.all_gather_into_tensor.default
WEIGHT = (96,)  # up (12 x 8) and down (8 x 12): 96 elements each, the backward reads them


@pytest.fixture
def fake4():
    with fake_process_group(4) as group:
        torch.manual_seed(0)
        yield group


def _piece(world: int, weights: int = 1) -> int:
    return weights * Dim0Layout(WEIGHT, world).piece_numel


def _gathers(gm) -> list[tuple[int, int]]:
    """(group size, elements this rank sends) of each all-gather of ``gm``, sorted (the
    order the scheduler leaves them in differs between torch releases)."""
    return sorted((g.args[1], g.args[0].meta["val"].numel()) for g in calls(gm, GATHER))


def test_a_block_kept_is_not_gathered_in_the_backward(fake4):
    whole = compile_and_step(graphshard.shard(TwoBlock()))
    # both blocks again (block 0: its down projection only; its input needs no gradient);
    # the head, read last, is kept either way
    assert _gathers(whole["bw"]) == sorted([(4, _piece(4, 2)), (4, _piece(4))])
    model = TwoBlock()
    stages = compile_and_step(graphshard.shard(model, reshard_after_forward={
        model.blocks[0]: False}))
    assert _gathers(stages["bw"]) == [(4, _piece(4, 2))]  # block 1 only
    assert len(calls(stages["fw"], GATHER)) == 3


def test_a_bucket_asked_two_settings_becomes_two(fake4):
    model = graphshard.shard(TwoBlock(), reshard_after_forward={"blocks.1.up": 2})
    state = shard_state(model)
    assert state.bucket_names == ["blocks.0", "blocks.1[reshard_after_forward=2]",
                                  "blocks.1[reshard_after_forward=True]", "<rest>"]
    assert state.reshard_of_bucket == [True, 2, True, True]
    stages = compile_and_step(model)
    assert [size for size, _ in _gathers(stages["fw"])] == [4, 4, 4, 4]
    # block 1's down projection over all 4, its up projection over the group of 2 (from
    # the piece the forward kept), block 0's down projection over all 4
    assert _gathers(stages["bw"]) == sorted([(4, _piece(4)), (2, _piece(2)), (4, _piece(4))])


@pytest.mark.parametrize("setting,head", [
    # the innermost key wins; the head, under no key, takes the default
    (lambda m: {m.blocks: False, m.blocks[1]: True}, True),
    (lambda m: {"": False, "blocks.1": True}, False),  # by name; "" is the root
    (lambda m: {m: False, m.blocks[1]: 4, m.blocks[0]: 1}, False),  # 1: False; 4: True
], ids=["innermost", "names", "one_and_four"])
def test_a_parameter_takes_its_innermost_key(fake4, setting, head):
    model = TwoBlock()
    model = graphshard.shard(model, reshard_after_forward=setting(model))
    assert shard_state(model).reshard_of_bucket == [False, True, head]
    stages = compile_and_step(model)
    assert _gathers(stages["bw"]) == [(4, _piece(4, 2))]  # block 1 only


def test_the_plan_records_settings_by_module_name(fake4):
    model = TwoBlock()
    first = graphshard.shard(model, reshard_after_forward={model.blocks[0]: 1, model.head: 2})
    assert shard_state(first).reshard_after_forward == {"blocks.0": False, "head": 2}
    other = TwoBlock()
    second = graphshard.shard(other, reshard_after_forward={other.blocks[1]: False})
    # ranks sharding with different settings disagree here (guards' plan check)
    assert (shard_fingerprint(shard_state(first))["reshard_after_forward"]
            != shard_fingerprint(shard_state(second))["reshard_after_forward"])


def test_size_bucketing_keeps_the_settings_apart(fake4):
    packed = compile_and_step(graphshard.shard(TwoBlock()), bucketing="size",
                              bucket_bytes=1 << 20)
    # everything in one bucket, read last and so kept: nothing is gathered again
    assert len(calls(packed["fw"], GATHER)) == 1 and not calls(packed["bw"], GATHER)
    model = TwoBlock()
    stages = compile_and_step(graphshard.shard(model, reshard_after_forward={
        model.head: False}), bucketing="size", bucket_bytes=1 << 20)
    assert len(calls(stages["fw"], GATHER)) == 2  # the head apart from the blocks
    # the blocks' bucket, freed, is gathered again (the weights the backward reads)
    assert _gathers(stages["bw"]) == [(4, _piece(4, 3))]


def test_auto_for_one_module_beside_fixed_ones(fake4):
    """``"auto"`` chooses for its module's bucket only (on the CPU, with no memory budget,
    it keeps it); the others keep their fixed setting."""
    model = TwoBlock()
    stages = compile_and_step(graphshard.shard(model, reshard_after_forward={
        model.blocks[0]: "auto"}))
    assert _gathers(stages["bw"]) == [(4, _piece(4, 2))]


@pytest.mark.parametrize("setting,error,match", [
    (lambda m: {nn.Linear(2, 2): False}, GraphshardValueError, "not a submodule"),
    (lambda m: {"blocks.7": False}, GraphshardValueError, "'blocks.7', which is not a submodule"),
    (lambda m: {m.blocks[0]: "no"}, GraphshardTypeError, r"reshard_after_forward\[<Block>\]"),
    (lambda m: {0: False}, GraphshardTypeError, "got a key 0"),
    (lambda m: {m.blocks[0]: 3}, GraphshardValueError, r"pass one of \[1, 2, 4\]"),
    (lambda m: {m.blocks[0]: False, "blocks.0": True}, GraphshardValueError,
     "two settings: False"),
], ids=["foreign_module", "unknown_name", "bad_value", "bad_key", "bad_int", "two_settings"])
def test_bad_settings_are_refused_before_anything_changes(fake4, setting, error, match):
    model = TwoBlock()
    before = {name: p for name, p in model.named_parameters()}
    with pytest.raises(error, match=match):
        graphshard.shard(model, reshard_after_forward=setting(model))
    assert dict(model.named_parameters()) == before  # nothing sharded


def test_a_key_without_parameters_is_refused(fake4):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.raises(GraphshardValueError, match="holds no parameters"):
        graphshard.shard(model, reshard_after_forward={model[1]: False})
