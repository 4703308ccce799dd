"""On gloo, graphshard's eager gathers avoid the collective that corrupts the heap
(:mod:`graphshard.safety.gloo_gather`): two real gloo ranks, one launch.

- An eager training step of a sharded model issues no ``_c10d_functional`` all-gather
  (gloo's ``allgather_into_tensor_coalesced``), yet gathers, and trains as before.
- :func:`graphshard.safety.gloo_gather.all_gather` issued while an all-to-all is in flight, as
  the eager step issues its gathers, gives the right values every time, and its output is
  completed by ``wait_tensor`` like the functional op's.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks

ROUNDS = 2000


def _eager_step_and_overlapped_gathers(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode

    import graphshard
    from graphshard.safety.gloo_gather import all_gather

    c10d = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    ops: list[str] = []

    class Names(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = graphshard.shard(nn.Sequential(*(nn.Linear(8, 8) for _ in range(3))))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        x = torch.full((4, 8), float(rank + step + 1))
        with Names():
            loss = model(x).square().mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    wrong = []
    gen = torch.Generator().manual_seed(0)  # the same sizes on both ranks
    for i in range(ROUNDS):
        n = int(torch.randint(1, 2000, (1,), generator=gen))
        m = int(torch.randint(1, 2000, (1,), generator=gen))
        sent = torch.full((2 * n,), float(rank + 1))
        in_flight = c10d.all_to_all_single(sent, [n, n], [n, n], group)
        gathered = c10d.wait_tensor(all_gather(torch.full((m,), float(rank)), world_size, group))
        if not torch.equal(gathered, torch.arange(world_size).repeat_interleave(m).float()):
            wrong.append(("gather", i))
        received = c10d.wait_tensor(in_flight)
        if not torch.equal(received, torch.arange(1.0, world_size + 1).repeat_interleave(n)):
            wrong.append(("all_to_all", i))
    return {"ops": ops, "losses": losses, "wrong": wrong}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_eager_step_and_overlapped_gathers, 2)


def test_the_eager_step_gathers_without_the_functional_all_gather(ranks):
    for result in ranks:
        functional = [op for op in result["ops"] if op.startswith("_c10d_functional.all_gather")]
        gathers = [op for op in result["ops"] if "allgather" in op or "all_gather" in op]
        assert functional == [], functional
        assert gathers, "the step gathered nothing"
        assert all(torch.isfinite(torch.tensor(result["losses"])))
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank its own batch


def test_gathers_issued_beside_an_all_to_all_in_flight_are_right(ranks):
    for result in ranks:
        assert result["wrong"] == []
