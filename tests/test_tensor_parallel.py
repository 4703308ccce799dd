"""FSDP x TP: torch's ``parallelize_module`` on ``mesh["tp"]``, then ``graphshard.shard(model,
mesh["dp"])``. dp 2 x tp 2 on 4 gloo ranks (one launch) and HSDP 2 x 2 x tp 2 on 8 (one
launch), eager and compiled, against one process and against FSDP2 on the same TP model.
To keep 4 and 8 processes on 2 cores affordable, the MLP and both Llama plans go through
Inductor; no_sync, bf16 and HSDP x TP run graphshard's lowered graphs op by op ("lowered":
the same passes and collectives, no Inductor compile)."""

from __future__ import annotations

import pytest
import torch
import tp_jobs
from dist_utils import run_ranks
from tp_jobs import MODES

TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_ranks(tp_jobs.dp_tp_job, 4, str(tmp_path_factory.mktemp("tp_dcp")))


def _assert_matches(results: list[dict], key, reference: dict) -> None:
    for res in results:
        got = res[key] if key is not None else res
        assert got["losses"] == pytest.approx(reference["losses"][res["dp"]], rel=1e-5)
        if "norms" in got:  # torch's clip_grad_norm_ on the (dp, tp) DTensor gradients
            assert got["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        for name, value in reference["params"].items():
            torch.testing.assert_close(got["params"][name], value, **TOL, msg=name)


@pytest.mark.parametrize("mode", MODES)
def test_dp_by_tp_matches_one_process(world4, mode):
    _assert_matches(world4, ("mlp", mode), tp_jobs.reference("mlp", 2))
    for res in world4:  # uneven rows (10 over 2 x 2, 7 over 2): DTensor's layout, no padding
        placements = res[("mlp", mode)]["placements"]
        assert placements["fc1.weight"] == ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)")
        assert placements["fc2.weight"] == ("Shard(dim=0)", "Shard(dim=1)")
        assert placements["fc2.bias"] == ("Shard(dim=0)", "Replicate()")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("plan", ["llama", "llama_sp"])
def test_llama_with_its_tp_plan_matches_one_process(world4, plan, mode):
    """The Megatron plan, and with sequence parallel (SequenceParallel norms,
    PrepareModuleInput, row-split embedding, column-split output) as torchtitan runs it."""
    _assert_matches(world4, (plan, mode), tp_jobs.reference("llama", 2, lr=0.5))


@pytest.mark.parametrize("kind", ["mlp", "llama"])
def test_adafactor_steps_dp_by_tp_parameters_like_one_process(world4, kind):
    """torch's Adafactor, whose factored second moment takes means along dimensions sharded
    over dp and over tp (graphshard.api.optimizer_steps), eagerly."""
    lr = 0.5 if kind == "llama" else 0.1
    _assert_matches(world4, ("adafactor", kind),
                    tp_jobs.reference(kind, 2, lr=lr, optimizer="adafactor"))


def test_every_parameter_lives_on_the_one_dp_tp_mesh(world4):
    """What the plan leaves alone (embedding, norms, output) is Replicate() on tp: one mesh
    for all, so torch's clip_grad_norm_ can stack the norms (checked in the runs above)."""
    meshes = world4[0]["llama_meshes"]
    assert {names for names, _ in meshes.values()} == {("dp", "tp")}
    assert meshes["norm.weight"][1] == ("Shard(dim=0)", "Replicate()")
    assert meshes["layers.0.attention.wq.weight"][1] == (
        "_StridedShard(dim=0, sf=2)", "Shard(dim=0)")


@pytest.mark.parametrize("mode", MODES)
def test_no_sync_accumulates_and_matches_one_process(world4, mode):
    _assert_matches(world4, ("no_sync", mode), tp_jobs.reference("mlp", 2, accum=2))


@pytest.mark.parametrize("mode", MODES)
def test_bf16_matches_fsdp2_on_the_same_tp_model(world4, mode):
    """graphshard and FSDP2 with the same bf16/fp32 policy on the same TP model: the same
    rounding points (bf16 gathers and compute, fp32 reduction and master weights)."""
    fp32 = tp_jobs.reference("mlp", 2)
    for res in world4:
        ours, peer = res[("bf16", mode)], res["fsdp2_bf16"]
        assert ours["losses"] == pytest.approx(peer["losses"], rel=2e-3)
        for name, value in peer["params"].items():
            assert ours["params"][name].dtype == torch.float32
            torch.testing.assert_close(ours["params"][name], value, rtol=2e-2, atol=2e-3,
                                       msg=name)
        # and bf16 really was used: the result is not the fp32 one
        assert max((ours["params"][n] - v).abs().max().item()
                   for n, v in fp32["params"].items()) > 1e-4


def test_state_dicts_and_dcp_on_the_dp_tp_mesh(world4):
    for res in world4:
        got = res["state"]
        for name, value in res[("llama", "eager")]["params"].items():
            torch.testing.assert_close(got["full"][name], value, rtol=0, atol=0, msg=name)
            torch.testing.assert_close(got["reloaded"][name], value, rtol=0, atol=0, msg=name)


def test_checkpoints_resume_exactly_and_full_weights_load(world4):
    for res in world4:
        got = res["checkpoint"]
        for name, value in got["continued"].items():
            torch.testing.assert_close(got["resumed"][name], value, rtol=0, atol=0, msg=name)
            torch.testing.assert_close(got["full_loaded"][name], got["saved"][name], rtol=0,
                                       atol=0, msg=name)


def test_wrong_orders_say_the_right_one(world4):
    errors = world4[0]["errors"]
    right_order = "parallelize_module(model, mesh['tp'], plan); graphshard.shard(model, mesh['dp'])"
    for case in ("tp_after_shard", "no_mesh", "whole_mesh", "tp_mesh", "overlapping"):
        assert errors[case].startswith("ShardedModelError"), (case, errors[case])
        assert right_order in errors[case], case
    assert "already sharded by graphshard" in errors["tp_after_shard"]
    assert "got no mesh" in errors["no_mesh"]
    assert "not a sub-mesh" in errors["overlapping"]
    assert errors["offload"].startswith("GraphshardNotImplementedError")


@pytest.fixture(scope="module")
def world8():
    return run_ranks(tp_jobs.hsdp_tp_job, 8)


@pytest.mark.parametrize("mode", ["eager", "lowered"])
def test_hsdp_by_tp_on_a_3d_mesh_matches_one_process(world8, mode):
    _assert_matches(world8, mode, tp_jobs.reference("mlp", 4))
    placements = world8[0][mode]["placements"]
    assert placements["fc1.weight"] == (
        "Replicate()", "_StridedShard(dim=0, sf=2)", "Shard(dim=0)")
    assert placements["fc2.weight"] == ("Replicate()", "Shard(dim=0)", "Shard(dim=1)")
