"""Rank-side jobs of ``tests/test_auto_reshard.py`` (spawned processes import them by name):
``reshard_after_forward`` True, False and ``"auto"`` (with and without a memory budget)
trained side by side on real gloo ranks, with each step's measured peak tensor memory."""

from __future__ import annotations

from typing import Any

import torch
from dist_utils import full_state
from torch import nn

import graphshard
from graphshard.passes.markers import ALL_GATHER_SINGLE

STEPS = 6


class Stack(nn.Module):
    """``n`` residual blocks (dim -> hidden -> dim) and a head: one bucket per block + rest."""

    def __init__(self, n: int = 4, dim: int = 256, hidden: int = 1024) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
            for _ in range(n)
        )
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(32, 256, generator=torch.Generator().manual_seed(100 * step + rank))


def _state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of shards, gradients and optimizer state alive now (once per storage)."""
    tensors = [*model.parameters()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for state in opt.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {}
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def _peak_allocated(prof: Any) -> int:
    """Peak of the running sum of the profiler's CPU memory events (as bench/memory.py)."""
    from torch._C._autograd import DeviceType

    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    running = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    return peak


def train(rank: int, reshard: bool | str, options: dict) -> dict:
    """``STEPS`` AdamW steps of the sharded, compiled ``Stack``; losses, final parameters, the
    auto choice, backward gathers per bucket, and each step's measured peak (state alive at
    the step's start + the profiler's peak of allocations during forward and backward)."""
    from torch.profiler import ProfilerActivity, profile

    from graphshard.passes.reshard import reshard_choice

    torch.manual_seed(0)
    model = graphshard.shard(Stack(), reshard_after_forward=reshard)
    backend = graphshard.backend(**options)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    losses, peaks = [], []
    for step in range(STEPS):
        opt.zero_grad()  # grads to None: the backward allocates them (counted in the peak)
        baseline = _state_bytes(model, opt)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = compiled(batch(step, rank)).square().mean()
            loss.backward()
        peaks.append(baseline + _peak_allocated(prof))
        losses.append(loss.item())
        opt.step()
    stages = backend.graphs[-1]
    c10d = torch.ops._c10d_functional
    gathers = (c10d.all_gather_into_tensor.default, ALL_GATHER_SINGLE)  # the latter on gloo
    bw_gathers = [n.meta["graphshard"]["bucket"] for n in stages["bw"].graph.nodes
                  if n.target in gathers]
    choice = reshard_choice(stages["joint"])
    return {
        "losses": losses,
        "params": full_state(model),
        "peaks": peaks,
        "bw_gathers": bw_gathers,
        "choice": None if choice is None else {
            "kept": choice.kept, "freed": choice.freed, "peak": choice.predicted_peak_bytes,
            "depth": choice.prefetch_depth, "fits": choice.fits},
    }


def run_all(rank: int, world_size: int, jobs: dict[str, tuple[Any, dict]]) -> dict:
    """Every job of ``jobs`` (name -> (reshard_after_forward, backend options)) in turn."""
    torch.set_num_threads(1)
    out = {}
    for name, (reshard, options) in jobs.items():
        out[name] = train(rank, reshard, options)
        torch._dynamo.reset()
    return out
