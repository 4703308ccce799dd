"""Harness for mixed precision, gradient accumulation and HSDP on real gloo ranks.

Each job trains a few optimizer steps of 4 micro-batches; the single-process reference sums
the micro-batch losses of every rank, averaged over ranks, so its gradient is what the
sharded run's reductions must produce. Jobs are ``(case, mode, accum, mesh, precision)``:
- ``mode``: "eager", "compiled" (Inductor) or "lowered" (the passes' graph run op by op,
  which checks their arithmetic without paying for Inductor on 4 ranks);
- ``accum``: "sync" (every micro-batch reduced), "no_sync" (held back unreduced) or
  "reduce_scatter" (``no_sync(reduce_scatter=True)``: partials, all-reduced once on HSDP);
  with "+one_backward", each micro-batch is forwarded as before (the last one outside
  ``no_sync``) and then one backward of the summed losses runs;
- ``mesh``: "1d" or "2d" (replicate 2 x shard world/2);
- ``precision``: "fp32" or "bf16/fp32", "bf16/bf16", "fp16/fp16" (param/reduce dtypes);
- optionally ``divide_factor``: ``shard(gradient_divide_factor=...)``, the ranks' gradients
  summed and divided by it; each rank's loss is then scaled by ``divide_factor / world``
  (for 1.0, torchtitan's loss already divided by a global count), so that the reference,
  which averages, is still the answer.
"""

from __future__ import annotations

import contextlib

import parity
import torch
import torch.distributed as dist
from dist_utils import full_state
from parity import Case
from torch import nn

import graphshard
from graphshard.models.mlp import MLPOutput

STEPS, MICRO = 2, 4
LR = 0.05
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _policy(precision: str) -> graphshard.MixedPrecision | None:
    if precision == "fp32":
        return None
    param, reduce = precision.split("/")
    return graphshard.MixedPrecision(param_dtype=DTYPES[param], reduce_dtype=DTYPES[reduce])


def _mesh(kind: str, world_size: int):
    if kind == "1d":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))


class RereadAcrossBreak(nn.Module):
    """Reads ``inner`` on both sides of a graph break: compiled, two graphs each reduce a
    gradient for it, and what no_sync held back must be folded into only one of them."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(13, 13)
        self.mid = nn.Linear(13, 13)
        self.out = nn.Linear(13, 3)

    def forward(self, x, y):
        x = torch.tanh(self.inner(x))
        torch._dynamo.graph_break()
        x = self.out(torch.tanh(self.inner(torch.tanh(self.mid(x)))))
        return MLPOutput(torch.nn.functional.mse_loss(x, y), x)


class ScaledByItsNorm(nn.Module):
    """A residual block that reads its weight under ``torch.no_grad()`` before the read that
    trains (a statistic taken as a constant: a scale, a logged norm). Traced, the two reads are
    two markers of one parameter, the first without autograd history; the parameter's
    gradient must come from the second, and what no_sync held back must be folded into it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(13, 13) / 4)
        self.bias = nn.Parameter(torch.zeros(13))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = self.weight.abs().mean()
        return x + torch.tanh(torch.nn.functional.linear(x, self.weight, self.bias)) * scale


class NoGradReadsFirst(nn.Module):
    """Three :class:`ScaledByItsNorm` blocks under a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ScaledByItsNorm() for _ in range(3))
        self.out = nn.Linear(13, 3)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        x = self.out(x)
        return MLPOutput(torch.nn.functional.mse_loss(x, y), x)


class SkipsABranchLast(nn.Module):
    """A side branch that every micro-batch of a step takes but the last (an image tower
    that a text-only micro-batch skips; the harness sets ``last_micro``, see
    :func:`_before_micro`). The synced backward's forward does not read the branch, yet what
    no_sync held back for it must be reduced in that step, as DDP does; before 2026-12-06 it
    stayed held back and the next step that read the branch added it in."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = parity.CASES["mlp_odd"].build()
        self.side = nn.Linear(13, 3)
        self.last_micro = False

    def forward(self, x, y):
        out = self.mlp(x).output
        if not self.last_micro:
            out = out + torch.tanh(self.side(x))
        return MLPOutput(torch.nn.functional.mse_loss(out, y), out)


def _before_micro(model: nn.Module, micro: int) -> None:
    """What a case changes per micro-batch: :class:`SkipsABranchLast`'s branch."""
    if isinstance(model, SkipsABranchLast):
        model.last_micro = micro == MICRO - 1


def _hooked_mlp() -> nn.Module:
    """``mlp_odd`` with gradient hooks registered before ``shard()``, both linear in the
    gradient (a sharded run calls them once on a held-back sum, one process per
    micro-batch): the first weight's gradient doubled, the last bias's negated."""
    model = parity.CASES["mlp_odd"].build()
    model.layers[0].weight.register_hook(lambda grad: grad * 2.0)
    model.layers[-1].bias.register_hook(lambda grad: -grad)
    return model


CASES = {**parity.CASES, "reread_break": Case(RereadAcrossBreak, parity.CASES["mlp_odd"].batch),
         "no_grad_read_first": Case(NoGradReadsFirst, parity.CASES["mlp_odd"].batch),
         "hooked_mlp": Case(_hooked_mlp, parity.CASES["mlp_odd"].batch),
         "skips_a_branch_last": Case(SkipsABranchLast, parity.CASES["mlp_odd"].batch)}


def build(case: str) -> nn.Module:
    torch.manual_seed(1234)
    return CASES[case].build()


def _micro_batch(case: str, step: int, micro: int, rank: int) -> tuple:
    gen = torch.Generator().manual_seed(1000 * (step * MICRO + micro) + rank)
    return CASES[case].batch(gen)


def train_sharded(rank: int, world_size: int, case: str, mode: str, accum: str, mesh: str,
                  precision: str, divide_factor: float | None = None) -> dict:
    """Train with gradient accumulation over ``MICRO`` micro-batches; rank-mean losses."""
    torch._dynamo.reset()
    model = graphshard.shard(build(case), _mesh(mesh, world_size),
                             mixed_precision=_policy(precision),
                             gradient_divide_factor=divide_factor)
    loss_scale = 1.0 if divide_factor is None else divide_factor / world_size
    if mode == "eager":
        run = model
    else:
        run = torch.compile(model, backend=graphshard.backend(inductor=mode == "compiled"))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    kind, one_backward = accum.removesuffix("+one_backward"), accum.endswith("+one_backward")
    losses = []
    for step in range(STEPS):
        total, pending = 0.0, []
        for micro in range(MICRO):
            held_back = kind != "sync" and micro < MICRO - 1
            hold = graphshard.no_sync(model, reduce_scatter=kind == "reduce_scatter")
            _before_micro(model, micro)
            with hold if held_back else contextlib.nullcontext():
                loss = CASES[case].loss(run, _micro_batch(case, step, micro, rank))
                pending.append(loss.float() * loss_scale)
                if not one_backward:
                    pending.pop().backward()
            total += loss.detach().float()
        if pending:
            sum(pending).backward()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return {"losses": losses, "state": full_state(model)}


def train_reference(case: str, world_size: int) -> dict:
    """One process, fp32: every rank's micro-batches; losses averaged over ranks."""
    model = build(case)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(MICRO):
            _before_micro(model, micro)
            for r in range(world_size):
                loss = CASES[case].loss(model, _micro_batch(case, step, micro, r)) / world_size
                loss.backward()
                total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "state": {k: v.detach() for k, v in model.state_dict().items()}}


def train_fsdp2(rank: int, world_size: int, case: str, precision: str) -> dict:
    """PyTorch FSDP2 (``fully_shard`` per block, then the root) with the same precision."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch._dynamo.reset()
    model = build(case)
    param, reduce = precision.split("/")
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[param], reduce_dtype=DTYPES[reduce])
    mesh = init_device_mesh("cpu", (world_size,))
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            for block in module:
                fully_shard(block, mesh=mesh, mp_policy=policy)
            break
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        for micro in range(MICRO):
            CASES[case].loss(model, _micro_batch(case, step, micro, rank)).float().backward()
        opt.step()
        opt.zero_grad()
    return {"state": {k: v.full_tensor() for k, v in model.state_dict().items()}}


def run_jobs(rank: int, world_size: int, jobs: list[tuple]) -> dict:
    """Entry point for each rank: every job in turn (FSDP2 jobs start with "fsdp2")."""
    results = {}
    for job in jobs:
        if job[0] == "fsdp2":
            results[job] = train_fsdp2(rank, world_size, *job[1:])
        else:
            results[job] = train_sharded(rank, world_size, *job)
    return results


def update_error(state: dict, reference: dict, initial: dict) -> float:
    """How far the training update (final - initial) is from the reference's, relative to
    the largest reference update: a wrong divide factor is off by 50% or more."""
    worst, scale = 0.0, 0.0
    for key, ref in reference.items():
        if not ref.is_floating_point():
            continue
        ref_update = ref.float() - initial[key].float()
        worst = max(worst, (state[key].float() - initial[key].float() - ref_update).abs().max())
        scale = max(scale, ref_update.abs().max())
    return float(worst / scale)
