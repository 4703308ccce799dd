"""Rank jobs for ``test_outside_reads``: a tied output head computed outside the model's
``forward`` (the embedding's weight read again by the loss), in the two ways that train as one
process does, eagerly and compiled, and the single-process reference.

- ``method``: the head is a method registered with ``graphshard.register_forward_method``;
  it runs as a forward, so the weight is gathered and its gradient reduced as in
  ``forward``;
- ``avg``: the loss reads the sharded weight as ``full_tensor(grad_placements=[Partial("avg")])``,
  which tells DTensor that each rank's gradient of the full weight is its own part of the
  mean (the default, ``Replicate``, takes it for the same on every rank and keeps only this
  rank's rows of it).

The blocks end in ``Tanh`` under an outer residual, so the compiled runs also cover the
region outputs read once (``passes/regions.py``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from training_loops_jobs import sgd_steps

import graphshard

STEPS = 3
ROWS = 2  # per rank
RECIPES = ("method", "avg")
MODES = tuple((recipe, compiled) for recipe in RECIPES for compiled in (False, True))


class TiedOutside(nn.Module):
    """An embedding, three ``Linear`` + ``Tanh`` blocks added to the stream, a norm; the
    output head (``logits``) is the embedding's weight, applied outside ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.norm = nn.LayerNorm(16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.embed.weight.t()


def build() -> TiedOutside:
    torch.manual_seed(0)
    return TiedOutside()


def batch(step: int) -> torch.Tensor:
    """The global batch of ``step``: ``2 * ROWS`` sequences of 6 tokens."""
    return torch.randint(0, 32, (2 * ROWS, 6), generator=torch.Generator().manual_seed(step))


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _train(model: TiedOutside, loss_at) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """``STEPS`` steps of SGD with momentum on ``loss_at(step)``: the losses and the full
    state after."""
    losses = sgd_steps(model.parameters(), loss_at, STEPS, lr=0.5)
    return losses, {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                    for k, v in model.state_dict().items()}


def reference() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model = build()

    def loss_at(step: int) -> torch.Tensor:
        halves = batch(step).split(ROWS)
        return sum(_loss(model.logits(model(t)), t) for t in halves) / 2

    return _train(model, loss_at)


def _head(model: TiedOutside, recipe: str, h: torch.Tensor) -> torch.Tensor:
    if recipe == "method":
        return model.logits(h)
    weight = model.embed.weight  # outside forward: the sharded DTensor
    assert isinstance(weight, DTensor)
    return h @ weight.full_tensor(grad_placements=[Partial("avg")]).t()


def run_modes(rank: int, world: int
              ) -> dict[str, tuple[list[torch.Tensor], dict[str, torch.Tensor]]]:
    """Each of :data:`MODES` trained on rank ``rank`` of ``world`` (2)."""
    assert world == 2
    out = {}
    for recipe, compiled in MODES:
        torch._dynamo.reset()
        model = graphshard.shard(build())
        if recipe == "method":
            graphshard.register_forward_method(model, "logits")
        run = torch.compile(model, backend=graphshard.backend()) if compiled else model

        def loss_at(step: int, model=model, run=run, recipe=recipe) -> torch.Tensor:
            tokens = batch(step).split(ROWS)[rank]
            return _loss(_head(model, recipe, run(tokens)), tokens)

        out[f"{recipe}-{'compiled' if compiled else 'eager'}"] = _train(model, loss_at)
    return out
