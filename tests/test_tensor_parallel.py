"""FSDP x TP (work in progress for the issue "FSDP x tensor parallel"): torch's
``parallelize_module`` on ``mesh["tp"]``, then ``graphshard.shard(model, mesh["dp"])``;
dp 2 x tp 2 on 4 gloo ranks, eager and compiled, against one process."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from torch import nn

STEPS = 3
MODES = ("eager", "compiled")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 16)
        self.fc2 = nn.Linear(16, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + dp)
    return torch.randn(4, 10, generator=gen), torch.randn(4, 6, generator=gen)


def job(rank: int, world_size: int, save_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import graphshard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for mode in MODES:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MLP()
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(),
                                               "fc2": RowwiseParallel()})
        graphshard.shard(model, mesh["dp"])
        run = torch.compile(model, backend="graphshard") if mode == "compiled" else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dp = mesh.get_coordinate()[0]
        losses = []
        for step in range(STEPS):
            x, y = batch(step, dp)
            loss = nn.functional.mse_loss(run(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[mode] = {
            "dp": dp, "losses": losses,
            "placements": {n: tuple(map(repr, p.placements)) for n, p in model.named_parameters()},
            "params": {n: p.full_tensor() for n, p in model.named_parameters()},
        }
    from graphshard.models.llama import Llama, llama_config, tensor_parallel_plan

    for mode in MODES:  # the shipped Llama with its TP plan (heads and FFN split)
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Llama(llama_config("tiny"))
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(model))
        graphshard.shard(model, mesh["dp"])
        run = torch.compile(model, backend="graphshard") if mode == "compiled" else model
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        dp = mesh.get_coordinate()[0]
        losses = []
        for step in range(STEPS):
            loss = run(tokens(step, dp)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[("llama", mode)] = {
            "dp": dp, "losses": losses,
            "params": {n: p.full_tensor() for n, p in model.named_parameters()},
        }
        if mode == "eager":
            out["state"] = _state_dict_round_trip(model, mesh, save_dir)
    return out


def _state_dict_round_trip(model, mesh, save_dir: str) -> dict:
    """torch's state-dict functions and DCP on the (dp, tp) mesh: the full state dict, and
    a ``dcp.save`` / ``dcp.load`` into a fresh dp x tp model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor.parallel import parallelize_module

    import graphshard
    from graphshard.models.llama import Llama, llama_config, tensor_parallel_plan

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    dcp.save(model.state_dict(), checkpoint_id=save_dir)
    torch.manual_seed(1)  # other values: the load must replace them
    fresh = Llama(llama_config("tiny"))
    parallelize_module(fresh, mesh["tp"], tensor_parallel_plan(fresh))
    graphshard.shard(fresh, mesh["dp"])
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=save_dir)
    fresh.load_state_dict(sd)
    return {"full": {k: v.detach().clone() for k, v in full.items()},
            "reloaded": {n: p.full_tensor() for n, p in fresh.named_parameters()}}


def tokens(step: int, dp: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(100 * step + dp))


@pytest.mark.parametrize("mode", MODES)
def test_llama_with_its_tp_plan_matches_one_process(world4, mode):
    from graphshard.models.llama import Llama, llama_config

    torch.manual_seed(0)
    model = Llama(llama_config("tiny"))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    per_dp: list[list[float]] = [[], []]
    for step in range(STEPS):
        losses = [model(tokens(step, d)).loss for d in range(2)]
        (sum(losses) / 2).backward()
        opt.step()
        opt.zero_grad()
        for d in range(2):
            per_dp[d].append(losses[d].item())
    for res in world4:
        got = res[("llama", mode)]
        assert got["losses"] == pytest.approx(per_dp[got["dp"]], rel=1e-5)
        for name, value in model.named_parameters():
            torch.testing.assert_close(got["params"][name], value.detach(), rtol=1e-5,
                                       atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_ranks(job, 4, str(tmp_path_factory.mktemp("tp_dcp")))


def test_state_dicts_and_dcp_on_the_dp_tp_mesh(world4):
    for res in world4:
        got = res["state"]
        trained = res[("llama", "eager")]["params"]
        for name, value in trained.items():
            torch.testing.assert_close(got["full"][name], value, rtol=0, atol=0, msg=name)
            torch.testing.assert_close(got["reloaded"][name], value, rtol=0, atol=0, msg=name)


def _reference() -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_dp: list[list[float]] = [[], []]
    for step in range(STEPS):
        losses = [nn.functional.mse_loss(model(batch(step, d)[0]), batch(step, d)[1])
                  for d in range(2)]
        (sum(losses) / 2).backward()
        opt.step()
        opt.zero_grad()
        for d in range(2):
            per_dp[d].append(losses[d].item())
    return per_dp, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", MODES)
def test_dp_by_tp_matches_one_process(world4, mode):
    losses, params = _reference()
    for res in world4:
        got = res[mode]
        assert got["losses"] == pytest.approx(losses[got["dp"]], rel=1e-5)
        assert got["placements"]["fc1.weight"] == ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)")
        assert got["placements"]["fc2.weight"] == ("Shard(dim=0)", "Shard(dim=1)")
        for name, value in params.items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6)
