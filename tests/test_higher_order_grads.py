"""Higher-order gradients across ranks: a gradient penalty (``autograd.grad(...,
create_graph=True)``, then a loss built from the gradients) through the eager sharded model
trains as one process trains on the ranks' mean loss plus the penalty of their mean
gradient, for a penalty built the DTensor way (``full_tensor()``, or DTensor ops on the
sharded gradients). The second backward runs through ``reduce_grad``'s adjoint
(``graphshard/api/eager_kernels.py``); before it had one, autograd ran the kernel's
collectives as constants and at world >= 2 the penalty's gradient was silently wrong."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import full_state, run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import graphshard

STEPS = 3
LR = 0.1
WEIGHT = 0.1  # of the penalty


class Odd(nn.Module):
    """A 0-D scale (replicated on every rank) and rows that shard unevenly over 4 ranks
    (5 rows: 2, 2, 1, 0; and a weight of one row)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.a = nn.Linear(8, 5)
        self.b = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x) * self.scale))


def _build() -> nn.Module:
    torch.manual_seed(0)
    return Odd()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)


def _mse(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _penalty(grads: tuple, how: str) -> torch.Tensor:
    """The squared norm of the (full) gradient, built as a user of DTensor builds it."""
    if how == "full_tensor":
        return sum(g.full_tensor().square().sum() for g in grads)
    total = sum(g.square().sum() for g in grads)  # DTensor ops on the shards
    return total.full_tensor()


def _mesh(kind: str, world_size: int):
    """FSDP over every rank, or HSDP: 2 replicas of ``world_size / 2`` shards."""
    return init_device_mesh("cpu", (2, world_size // 2) if kind == "hsdp" else (world_size,))


def train_penalized(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict:
    """Each (mesh, penalty) case: the eager sharded model, SGD on its loss plus the penalty;
    the rank-mean of the penalized losses, and the full state after the steps. On torch
    2.11, whose eager sharded model refuses ``create_graph`` (every rank alike, before any
    collective of the backward), the refusal's message instead."""
    from graphshard.api.eager_kernels import _to_local_keeps_history

    out = {}
    for mesh_kind, how in cases:
        if not _to_local_keeps_history():
            out[(mesh_kind, how)] = {"refused": _refusal(mesh_kind, world_size)}
            continue
        model = graphshard.shard(_build(), mesh=_mesh(mesh_kind, world_size))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses = []
        for step in range(STEPS):
            loss = _mse(model, _batch(step, rank))
            grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
            assert all(isinstance(g, DTensor) and g.requires_grad for g in grads)
            total = loss + WEIGHT * _penalty(grads, how)
            total.backward()
            opt.step()
            opt.zero_grad()
            mean = total.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world_size)
        out[(mesh_kind, how)] = {"losses": losses, "state": full_state(model)}
    return out


def _refusal(mesh_kind: str, world_size: int) -> str:
    model = graphshard.shard(_build(), mesh=_mesh(mesh_kind, world_size))
    loss = _mse(model, _batch(0, dist.get_rank()))
    try:
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    except graphshard.GraphshardError as exc:
        return str(exc)
    return "not refused"


def _one_process(world_size: int) -> dict:
    """The objective in one process: the ranks' mean loss plus the penalty of its gradient."""
    model = _build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = sum(_mse(model, _batch(step, r)) for r in range(world_size)) / world_size
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        total = loss + WEIGHT * sum(g.square().sum() for g in grads)
        total.backward()
        opt.step()
        opt.zero_grad()
        losses.append(total.item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "state": state}


CASES = [("fsdp", "full_tensor"), ("fsdp", "dtensor_ops"), ("hsdp", "full_tensor")]


@pytest.fixture(scope="module")
def world4() -> dict:
    """One launch of 4 ranks per mesh kind (before the adjoint, HSDP's second backward
    raised where FSDP's trained silently wrong: separate launches show both)."""
    results: dict = {}
    for kind in dict.fromkeys(k for k, _ in CASES):
        results.update(run_ranks(train_penalized, 4, [c for c in CASES if c[0] == kind])[0])
    return results


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_a_gradient_penalty_trains_like_one_process(world4, case):
    """FSDP over 4 ranks (uneven rows, a 0-D parameter) and HSDP 2 x 2: the penalized losses
    and every parameter after 3 steps are one process's."""
    result, reference = world4[case], _one_process(4)
    if "refused" in result:  # torch 2.11 (tests/test_local_inputs.py has the reason)
        assert "needs torch 2.12 or newer" in result["refused"], result
        return
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]))
    assert result["state"].keys() == reference["state"].keys()
    for key, value in reference["state"].items():
        torch.testing.assert_close(result["state"][key], value, msg=key)


def test_third_order_gradients_are_refused(one_rank):
    """Differentiating a gradient's gradient again (``create_graph`` in the second backward)
    would run ``reduce_grad``'s adjoint as constants: it raises, naming what to change."""
    from graphshard.api.eager_kernels import _to_local_keeps_history

    model = graphshard.shard(_build())
    loss = _mse(model, _batch(0, 0))
    if not _to_local_keeps_history():  # torch 2.11 refuses the second order already
        with pytest.raises(graphshard.GraphshardError, match="needs torch 2.12 or newer"):
            torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        return
    grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    penalty = _penalty(grads, "full_tensor")
    with pytest.raises(graphshard.GraphshardError, match="third-order gradients"):
        torch.autograd.grad(penalty, list(model.parameters()), create_graph=True)
    penalty.backward()  # without create_graph the second backward runs
    assert all(p.grad is not None for p in model.parameters())
