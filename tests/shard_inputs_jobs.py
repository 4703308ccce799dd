"""Rank jobs for ``test_shard_inputs``: a model with unusual parameters (a transposed,
non-contiguous one; a complex one stored as its real view) and a method other than
``forward`` (``encode``, registered with ``graphshard.register_forward_method``), trained
eagerly and compiled on every rank, and the single-process reference they must match.

Rank ``r`` trains on its rows of each global batch; the reference trains the unsharded model
on the whole batch. Each rank's loss is a mean over its rows, so the gradient the
reduce-scatter averages is the reference's gradient.
"""

from __future__ import annotations

import torch
from torch import nn

import graphshard

SEED = 7
STEPS = 3
BATCH = 4  # global rows per step (2 per rank at world 2)
# (how the model is run, whether it is compiled)
MODES = (("forward", False), ("forward", True), ("encode", False), ("encode", True))


class OddParams(nn.Module):
    """``t`` is a transposed view (strides (1, 5)); ``c`` a complex (8, 4) matrix stored as
    its real view (8, 4, 2), the form graphshard's complex-parameter error asks for."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 8)
        self.t = nn.Parameter(torch.randn(8, 5).t())
        self.c = nn.Parameter(torch.view_as_real(torch.randn(8, 4, dtype=torch.complex64)))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) + x @ self.t
        z = h.to(torch.complex64) @ torch.view_as_complex(self.c)
        return torch.view_as_real(z).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encode(x)


def build() -> OddParams:
    torch.manual_seed(SEED)
    return OddParams()


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED + 1)
    return [torch.randn(BATCH, 5, generator=gen) for _ in range(STEPS)]


def _train(model: nn.Module, run, rows: slice) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in batches():
        loss = run(batch[rows]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    state = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }
    return losses, state


def reference() -> dict[str, tuple[list[torch.Tensor], dict[str, torch.Tensor]]]:
    """The unsharded model on the whole batch (the per-rank losses are averaged by the
    caller: equal rows per rank, so the whole batch's mean is their mean)."""
    model = build()
    return _train(model, model, slice(None))


def run_modes(rank: int, world_size: int) -> dict[str, tuple[list[torch.Tensor], dict]]:
    rows = BATCH // world_size
    out = {}
    for method, compiled in MODES:
        torch._dynamo.reset()
        model = graphshard.shard(build())
        assert model.t.to_local().is_contiguous()
        if method == "encode":
            graphshard.register_forward_method(model, "encode")
            run = model.encode
        else:
            run = model
        if compiled:
            run = torch.compile(run, backend=graphshard.backend(inductor=False), fullgraph=True)
        out[f"{method}-{'compiled' if compiled else 'eager'}"] = _train(
            model, run, slice(rank * rows, (rank + 1) * rows)
        )
    return out
