"""Harness for the step edges (``step_prefetch``, ``split_last_reduce``) on real gloo ranks.

A job ``(optimizer, precision, scenario, feature)`` trains the untied tiny Llama (its root
bucket holds the embedding, read first in forward and reduced last in backward, and the
output layer) compiled for ``STEPS`` steps, with both features on or off, and returns
rank-mean losses, the full state and the prefetch counts. The jobs of
:data:`THROUGH_INDUCTOR` run Inductor's code; the others run graphshard's transformed graphs
as they are (``backend(inductor=False)``): what they check is what the step does between
graphs, and each Inductor compile costs the suite about half a minute. Scenarios:

- ``plain``: forward, backward, ``step()``, ``zero_grad()``, a logging all-reduce;
- ``edit``: after step 1 every rank scales the embedding in place (a DTensor op); after
  step 2 rank 0 alone adds to its own rows of it (``to_local()``): the prefetched gathers are
  stale, on one rank only in the second case;
- ``twice``: two training forwards per step (the second has nothing prefetched), then an
  evaluation forward under ``no_grad`` after the step;
- ``accum``: two micro-batches per step, the first under ``graphshard.no_sync``.

:func:`train_reference` trains the same scenario in one process on every rank's batches.
:func:`profile_step` records where the gathers of one step run.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist
from dist_utils import full_state
from torch import nn

import graphshard
from graphshard.api import step_prefetch
from graphshard.models.llama import Llama, llama_config
from graphshard.passes.markers import TAKE_PREFETCHED

STEPS = 3
# (optimizer, precision, scenario) whose jobs are compiled by Inductor.
THROUGH_INDUCTOR = {("adam", "fp32", "plain")}
EDIT_ROWS = 128  # rank 0's rows of the 256-row embedding at world 2


class GlobalNormSGD(torch.optim.SGD):
    """SGD on gradients scaled by their global norm: a step that reads every parameter's
    gradient before it updates any, so it is not per-parameter (and must not be split)."""

    calls: list[int]

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(norm, torch.distributed.tensor.DTensor):
            norm = norm.full_tensor()
        for p in params:
            p.grad.mul_(1.0 / (float(norm) + 1.0))
        self.__dict__.setdefault("calls", []).append(len(params))
        return super().step(closure)


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    # Adam's eps is raised so that gradients at round-off level (the attention's query and
    # key weights at init) do not get full-size updates whose sign the round-off picks: one
    # process and the ranks round differently.
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.1)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return GlobalNormSGD(model.parameters(), lr=0.05, momentum=0.9)


def build() -> nn.Module:
    torch.manual_seed(1234)
    return Llama(llama_config("tiny", tie_embeddings=False))


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, 256, (2, 16), generator=gen)


def _edit(model: nn.Module, step: int, rank: int, sharded: bool) -> None:
    """The scenario's in-place edits after ``step``'s optimizer step."""
    weight = model.tok_embeddings.weight
    with torch.no_grad():
        if step == 0:
            weight.mul_(0.5)
        elif step == 1 and sharded and rank == 0:
            weight.to_local().add_(0.01)
        elif step == 1 and not sharded:  # what rank 0's local edit does to the full tensor
            weight[:EDIT_ROWS].add_(0.01)


def train_sharded(rank: int, world_size: int, opt_name: str, precision: str, scenario: str,
                  feature: bool) -> dict:
    """One job on this rank: rank-mean losses, full state, prefetch counts."""
    torch._dynamo.reset()
    policy = None
    if precision == "bf16":
        policy = graphshard.MixedPrecision(param_dtype=torch.bfloat16,
                                           reduce_dtype=torch.float32)
    model = graphshard.shard(build(), mixed_precision=policy)
    backend = graphshard.backend(step_prefetch=feature, split_last_reduce=feature,
                                 inductor=(opt_name, precision, scenario) in THROUGH_INDUCTOR)
    run = torch.compile(model, backend=backend)
    opt = _optimizer(opt_name, model)
    step_prefetch.reset_stats()
    losses = []
    for step in range(STEPS):
        if scenario == "accum":
            with graphshard.no_sync(model):
                first = run(batch(step, 0, rank)).loss
                first.backward()
            loss = run(batch(step, 1, rank)).loss
            loss.backward()
            loss = loss.detach() + first.detach()
        elif scenario == "twice":
            loss = run(batch(step, 0, rank)).loss + run(batch(step, 1, rank)).loss
            loss.backward()
        else:
            loss = run(batch(step, 0, rank)).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
        if scenario == "edit":
            _edit(model, step, rank, sharded=True)
        if scenario == "twice":
            with torch.no_grad():
                run(batch(step, 2, rank))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return {
        "losses": losses,
        "state": full_state(model),
        "stats": step_prefetch.stats(),
        "global_norm_calls": getattr(opt, "calls", None),
    }


def train_reference(opt_name: str, scenario: str, world_size: int) -> dict:
    """The same training in one process on every rank's batches, losses rank-averaged."""
    model = build()
    opt = _optimizer(opt_name, model)
    losses = []
    for step in range(STEPS):
        micros = 2 if scenario in ("accum", "twice") else 1
        total = 0.0
        for micro in range(micros):
            per_rank = [model(batch(step, micro, r)).loss for r in range(world_size)]
            total = total + sum(per_rank) / world_size
        total.backward()
        opt.step()
        opt.zero_grad()
        if scenario == "edit":
            _edit(model, step, 0, sharded=False)
        losses.append(total.item())
    return {"losses": losses, "state": {k: v.detach() for k, v in model.state_dict().items()}}


def profile_step(rank: int, world_size: int) -> dict:
    """Where one step's gathers run: profile ``optimizer.step()`` and the next forward after
    two warm-up steps (AdamW, both features on)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch._dynamo.reset()
    model = graphshard.shard(build())
    run = torch.compile(model, backend=graphshard.backend(step_prefetch=True, inductor=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        run(batch(step, 0, rank)).loss.backward()
        opt.step()
        opt.zero_grad()
    loss = run(batch(2, 0, rank)).loss
    loss.backward()
    step_prefetch.reset_stats()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("edges::step"):
            opt.step()
        opt.zero_grad()
        with record_function("edges::forward"):
            run(batch(3, 0, rank)).loss.backward()
    events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()]
    return {"events": events, "stats": step_prefetch.stats()}


LEFTOVER_JOB = ("sgd", "fp32", "accum", True)


def train_beside_a_leftover(rank: int, world_size: int) -> dict:
    """:data:`LEFTOVER_JOB` while an earlier model of the same shape is still alive on rank 0
    only, with the gathers its last step issued never taken (as when one rank's garbage
    collector has not reached it yet). The job's first forward runs under ``no_sync``, whose
    graph gets its parameters detached by AOTAutograd: it must still find its own model,
    and no rank may take the earlier model's gathers."""
    torch._dynamo.reset()
    old = graphshard.shard(build())
    run = torch.compile(old, backend=graphshard.backend(step_prefetch=True, inductor=False))
    opt = _optimizer("sgd", old)
    for step in range(2):
        run(batch(step, 0, rank)).loss.backward()
        opt.step()  # the last one issues gathers no forward takes
        opt.zero_grad()
    kept = [old, run, opt] if rank == 0 else []
    del old, run, opt
    gc.collect()
    out = train_sharded(rank, world_size, *LEFTOVER_JOB)
    kept.clear()
    return out


def gather_after_its_input_changed(rank: int, world_size: int) -> torch.Tensor:
    """A forward's gather with nothing prefetched, its input overwritten between the kernel's
    return and the graph's ``wait_tensor`` (as Inductor, which sees an opaque op, may reuse
    a dead input's buffer there): the gathered buffer. Rank 0's gloo workers are kept busy
    with all-reduces rank 1 joins late, so its gather cannot start before the overwrite."""
    if rank == 1:
        time.sleep(0.5)
    busy = [dist.all_reduce(torch.ones(1), async_op=True) for _ in range(8)]
    flat = torch.full((4,), float(rank + 1))
    out = TAKE_PREFETCHED(flat, world_size, dist.group.WORLD.group_name, shards=[flat],
                          piece_numels=[4], key="k", lead="k", peers=[], peer_keys=[])
    flat.fill_(-1.0)
    for work in busy:
        work.wait()
    return torch.ops._c10d_functional.wait_tensor(out).clone()


def run_jobs(rank: int, world_size: int, jobs: list[tuple]) -> dict:
    """Entry point of each rank: every training job in turn, the job beside a leftover
    model, then the profiled step."""
    out = {job: train_sharded(rank, world_size, *job) for job in jobs}
    out["leftover"] = train_beside_a_leftover(rank, world_size)
    out["profile"] = profile_step(rank, world_size)
    return out
