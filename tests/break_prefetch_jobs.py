"""Rank jobs of ``tests/test_break_prefetch.py``: the untied tiny Llama with a graph break
before its final norm, compiled with ``backend(break_prefetch=...)`` and trained against one
process; what was pending at the break, what each graph bound, and the prefetch counts."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_utils import full_state
from torch import nn

import graphshard
from graphshard.api import break_prefetch, step_prefetch
from graphshard.api.sharding import shard_state
from graphshard.errors import GraphshardRuntimeError
from graphshard.models.llama import Llama, llama_config
from graphshard.passes.markers import TAKE_PREFETCHED

STEPS = 4
EDIT_STEP = 2  # the "edit" scenario changes the final norm's shard at this step's break


def build(edit: bool = False) -> nn.Module:
    """The Llama, with an eager call (a graph break) before its final norm that records how
    many gathers the graph before it issued are pending there; with ``edit``, at
    :data:`EDIT_STEP` it also updates the final norm's local shard in place (a misuse)."""
    torch.manual_seed(1234)
    model = Llama(llama_config("tiny", tie_embeddings=False))
    model.seen_pending = []

    @torch._dynamo.disable
    def at_the_break(module, args):
        model.seen_pending.append(break_prefetch.pending())
        if edit and len(model.seen_pending) == EDIT_STEP + 1:
            (entry,) = [e for e in shard_state(model).params if e.names == ["norm.weight"]]
            with torch.no_grad():
                entry.param.to_local().mul_(1.0)

    model.norm.register_forward_pre_hook(at_the_break)
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 256, (2, 16), generator=gen)


def train(rank: int, world_size: int, feature: bool, mode: str, scenario: str) -> dict:
    """``mode``: "inductor" or "lowered" (graphshard's passes, no Inductor). ``scenario``:
    "plain" (forward, backward, step), "eval" (and an evaluation forward under ``no_grad``
    after each step), "edit" (see :func:`build`) or "with_step" (``step_prefetch`` on too:
    the first graph's leading gathers come from the optimizer step)."""
    torch._dynamo.reset()
    model = graphshard.shard(build(edit=scenario == "edit"))
    backend = graphshard.backend(break_prefetch=feature, inductor=mode == "inductor",
                                 step_prefetch=scenario == "with_step")
    run = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step_prefetch.reset_stats()
    losses, error = [], None
    for step in range(STEPS):
        try:
            loss = run(batch(step, rank)).loss
        except GraphshardRuntimeError as e:
            error = str(e)
            break
        loss.backward()
        opt.step()
        opt.zero_grad()
        if scenario == "eval":
            with torch.no_grad():
                run(batch(step, rank + 100))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return {"losses": losses, "state": full_state(model), "stats": step_prefetch.stats(),
            "seen_pending": list(model.seen_pending), "error": error,
            "bound": [[n.kwargs["sources"] for n in stages["fw"].graph.nodes
                       if n.target is TAKE_PREFETCHED]
                      for stages in backend.graphs if "fw" in stages],
            "left": break_prefetch.pending()}


def reference(world_size: int) -> dict:
    """One process on every rank's batches, the losses averaged."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(STEPS):
        loss = sum(model(batch(step, r)).loss for r in range(world_size)) / world_size
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach() for k, v in model.state_dict().items()}}


def run_jobs(rank: int, world_size: int, jobs: list[tuple]) -> dict:
    """Entry point of each rank: every job in turn."""
    return {job: train(rank, world_size, *job) for job in jobs}
