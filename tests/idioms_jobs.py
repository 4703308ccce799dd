"""Rank jobs for ``test_torch_idioms``: torch's own idioms, written as a user writes them,
run on a ``graphshard.shard``-ed model, plus the single-process references they must match.

Every rank builds the same model (same seed), shards it, and runs each job in "eager" mode
(the sharded module called directly) and "compiled" mode (``torch.compile(model,
backend="graphshard")``, without Inductor beyond world 2: :func:`compile_backend`; the idioms
then go through the compiled wrapper, as a user who writes ``model = torch.compile(model)``
calls them). Ranks return plain tensors only.

The reference runs every rank's batch in one process and averages the per-rank losses, so
its gradient is the average the reduce-scatter (and, on HSDP, the all-reduce) computes.
"""

from __future__ import annotations

import copy
import functools
import math
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import graphshard

MODES = ("eager", "compiled")
OPTIMIZERS = ("sgd", "adam", "adamw", "adamw_fused")
SEED, OTHER_SEED = 1234, 99
TRAIN_STEPS = 3  # item 3: steps per optimizer
RESUME_AT, RESUME_STEPS = 2, 2  # item 5: state dicts taken after 2 steps, then 2 more
MAX_NORM = 0.05  # below the reference gradient norm: clip_grad_norm_ clips
CLIP_VALUE = 0.004  # below the largest clipped gradient entry: clip_grad_value_ clips
FULL = StateDictOptions(full_state_dict=True)


class OddNet(nn.Module):
    """Odd shapes: Linear(13, 30) and Linear(30, 7), a 3-D ``mix`` (5 rows: 2+2+1 at world
    3), a ``shift`` of 2 rows (rank 2 of 3 holds none) and a 0-D ``scale``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(13, 30)
        self.fc2 = nn.Linear(30, 7)
        self.mix = nn.Parameter(torch.randn(5, 7, 3) * 0.3)
        self.shift = nn.Parameter(torch.randn(2, 3) * 0.1)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.tanh(self.fc1(x)))
        out = torch.einsum("bj,kjc->bkc", h, self.mix)
        return self.scale * out + self.shift.sum(0)


def build(seed: int = SEED) -> nn.Module:
    """A fresh ``OddNet`` with its parameters drawn from ``seed``."""
    torch.manual_seed(seed)
    return OddNet()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (input, target) at ``step``: 3 rows, the same in every process."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(3, 13, generator=gen), torch.randn(3, 5, 3, generator=gen)


def loss_fn(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error of ``model`` on one batch."""
    x, y = data
    return nn.functional.mse_loss(model(x), y)


# Item 3, eagerly: torch's other optimizers, without a scheduler (name[+foreach] -> kwargs).
# The element-wise ones step through DTensor; Adafactor (means along the sharded dimension)
# and Rprop (masked writes, list copies) through graphshard's handlers
# (graphshard.api.optimizer_steps), in both of their paths.
OTHER_OPTIMIZERS = {"Adagrad": {"lr": 0.05}, "RMSprop": {"lr": 0.01}, "Adamax": {"lr": 0.02},
                    "NAdam": {"lr": 0.02}, "RAdam": {"lr": 0.02}, "ASGD": {"lr": 0.05},
                    "Adadelta": {"lr": 1.0},
                    "Adafactor": {"lr": 0.05, "foreach": False},
                    "Adafactor+foreach": {"lr": 0.05, "foreach": True},
                    "Rprop": {"lr": 0.01, "foreach": False},
                    "Rprop+foreach": {"lr": 0.01, "foreach": True}}


def make_optimizer(name: str, params) -> tuple[torch.optim.Optimizer, object]:
    """Optimizer ``name`` over ``params`` with its LR scheduler."""
    sched = torch.optim.lr_scheduler
    if name == "sgd":
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return opt, sched.StepLR(opt, step_size=2, gamma=0.5)
    if name == "adam":
        opt = torch.optim.Adam(params, lr=0.01, foreach=True)
        return opt, sched.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    if name == "adamw":
        opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, foreach=True)
        return opt, sched.StepLR(opt, step_size=1, gamma=0.7)
    if name == "adamw_fused":
        opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, fused=True)
        return opt, sched.LambdaLR(opt, lambda step: 0.8**step)
    if name in OTHER_OPTIMIZERS:
        cls = getattr(torch.optim, name.split("+")[0])
        return cls(params, **OTHER_OPTIMIZERS[name]), None
    raise ValueError(name)


def resume_optimizer(params) -> torch.optim.Optimizer:
    """The optimizer of the resume test (item 5)."""
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, foreach=True)


# --------------------------------------------------------------------------- helpers


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain copy of ``t``: its full tensor when it is a DTensor."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().clone()


def local(t: torch.Tensor) -> torch.Tensor:
    """A plain copy of this rank's part of ``t`` (``t`` itself when it is not a DTensor)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.detach().clone()


def describe(t: torch.Tensor | None) -> dict | None:
    """What a (possibly DTensor) tensor is, in plain values."""
    if t is None:
        return None
    mesh = getattr(t, "device_mesh", None)
    return {
        "dtensor": isinstance(t, DTensor),
        "placements": tuple(getattr(t, "placements", ())),
        "mesh_shape": None if mesh is None else tuple(mesh.shape),
        "shape": tuple(t.shape),
        "numel": t.numel(),
        "local": local(t),
    }


def full_state(model: nn.Module, **options) -> dict[str, torch.Tensor]:
    """``get_model_state_dict(model, full_state_dict=True, ...)`` with plain copied values."""
    opts = StateDictOptions(full_state_dict=True, **options)
    return {k: full(v) for k, v in get_model_state_dict(model, options=opts).items()}


def make_mesh(world_size: int, hsdp: bool):
    """None (shard across the default group) or a (replicate, shard) HSDP mesh."""
    if not hsdp:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))


def shard_coords(rank: int, world_size: int, mesh) -> tuple[int, int]:
    """(this rank's index in its shard group, the shard group's size), from torch's mesh."""
    if mesh is None:
        return rank, world_size
    return mesh.get_local_rank("shard"), mesh.size(1)


def compile_backend() -> object:
    """``backend="graphshard"`` at world 2, as users write it; at world 3 and 4 the same
    backend without Inductor (``graphshard.backend(inductor=False)``): the idioms act outside
    the compiled graphs, world 2 has them go through Inductor's code, and each Inductor
    compile of a launch costs the suite half a minute."""
    return "graphshard" if dist.get_world_size() == 2 else graphshard.backend(inductor=False)


def sharded(mode: str, mesh, seed: int = SEED) -> tuple[nn.Module, nn.Module]:
    """(the sharded module, what the user calls: itself or its compiled wrapper)."""
    net = graphshard.shard(build(seed), mesh)
    model = torch.compile(net, backend=compile_backend()) if mode == "compiled" else net
    return net, model


def train(model, opt, sched, steps, rank: int) -> list[float]:
    """The user's loop over ``steps``; this rank's losses."""
    return _loop(model, opt, sched, steps, [rank])


def _loop(model, opt, sched, steps, ranks: list[int]) -> list[float]:
    """The training loop on the batches of ``ranks`` (their losses averaged) per step."""
    losses = []
    for step in steps:
        loss = sum(loss_fn(model, batch(step, r)) for r in ranks) / len(ranks)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# --------------------------------------------------------------------------- rank jobs


def job_basics(rank: int, world_size: int, mesh, mode: str, inf_norm: bool) -> dict:
    """Items 1 and 2: parameters and gradients are DTensors; clipping and norms.

    ``inf_norm`` only where every rank holds rows of every parameter: torch's
    ``_foreach_norm`` refuses the infinity norm of an empty local shard (FSDP2 alike).
    """
    net, model = sharded(mode, mesh)
    out: dict = {
        "names": [n for n, _ in net.named_parameters()],
        "numel": sum(p.numel() for p in model.parameters()),
        "params": {n: describe(p) for n, p in net.named_parameters()},
    }
    loss_fn(model, batch(0, rank)).backward()
    out["grads"] = {n: describe(p.grad) for n, p in net.named_parameters()}
    out["grads_full"] = {n: full(p.grad) for n, p in net.named_parameters()}
    grads = [p.grad for p in model.parameters()]
    out["total_norm"] = full(torch.nn.utils.get_total_norm(grads))
    if inf_norm:
        inf = torch.nn.utils.get_total_norm(grads, norm_type=math.inf)
        out["total_norm_inf"] = full(inf)
    saved = [p.grad.detach().clone() for p in model.parameters()]
    out["gs_clip_norm"] = full(graphshard.clip_grad_norm_(model.parameters(), MAX_NORM))
    out["gs_clipped"] = {n: full(p.grad) for n, p in net.named_parameters()}
    for p, grad in zip(model.parameters(), saved, strict=True):
        p.grad = grad
    out["clip_norm"] = full(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    out["clipped"] = {n: full(p.grad) for n, p in net.named_parameters()}
    torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
    out["value_clipped"] = {n: full(p.grad) for n, p in net.named_parameters()}
    model.zero_grad()
    out["grads_after_zero_grad"] = [p.grad for p in model.parameters()]
    return out


def _trained(name: str, mode: str, mesh, rank: int) -> tuple[nn.Module, dict]:
    """A fresh sharded model trained with optimizer ``name``: it, and its losses and state."""
    _, model = sharded(mode, mesh)
    opt, sched = make_optimizer(name, model.parameters())
    losses = train(model, opt, sched, range(TRAIN_STEPS), rank)
    return model, {"losses": losses, "state": full_state(model)}


def job_other_optim(rank: int, world_size: int, mesh, mode: str) -> dict:
    """Item 3 for :data:`OTHER_OPTIMIZERS`: losses and final state of each."""
    return {name: _trained(name, mode, mesh, rank)[1] for name in OTHER_OPTIMIZERS}


def job_optim(rank: int, world_size: int, mesh, mode: str, save_dir: str | None) -> dict:
    """Item 3 (every optimizer with its scheduler); with ``save_dir``, item 4's save and a
    same-world reload: the SGD-trained model goes through ``dcp.save(model.state_dict())``
    and a fresh model (another seed) loads it with ``dcp.load`` + ``load_state_dict``."""
    out: dict = {}
    for name in OPTIMIZERS:
        model, out[name] = _trained(name, mode, mesh, rank)
        if name == "sgd" and save_dir is not None:
            sd = model.state_dict()
            out["saved_types"] = {k: describe(v) for k, v in sd.items()}
            dcp.save(sd, checkpoint_id=f"{save_dir}/{mode}")
            out["saved"] = full_state(model)
            out["reloaded"] = dcp_load(rank, world_size, mesh, mode, save_dir)
    return out


def dcp_load(rank: int, world_size: int, mesh, mode: str, save_dir: str) -> dict:
    """Item 4: a fresh model (another seed) loads the checkpoint as torch documents it."""
    _, model = sharded(mode, mesh, seed=OTHER_SEED)
    before = full_state(model)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=f"{save_dir}/{mode}")
    result = model.load_state_dict(sd)
    with torch.no_grad():
        loss = loss_fn(model, batch(7, rank)).item()
    return {
        "before": before,
        "state": full_state(model),
        "missing": list(result.missing_keys),
        "unexpected": list(result.unexpected_keys),
        "loss": loss,
    }


def _optim_full(model, opt) -> dict:
    osd = get_optimizer_state_dict(model, opt, options=FULL)
    return {k: {s: full(v) for s, v in st.items()} for k, st in osd["state"].items()}


def job_state_dict(rank: int, world_size: int, mesh, mode: str) -> dict:
    """Item 5: ``get_model_state_dict`` full / sharded / offloaded."""
    _, model = sharded(mode, mesh)
    offload = StateDictOptions(cpu_offload=True)
    return {
        "full": full_state(model),
        "sharded": {k: describe(v) for k, v in get_model_state_dict(model).items()},
        "sharded_offload": {
            k: describe(v) for k, v in get_model_state_dict(model, options=offload).items()
        },
        "full_offload": full_state(model, cpu_offload=True),  # rank 0 only
    }


def job_broadcast(rank: int, world_size: int, mesh, mode: str) -> dict:
    """Item 5: ``set_model_state_dict`` of rank 0's full state dict, broadcast."""
    full_sd = build().state_dict() if rank == 0 else {}
    _, model = sharded(mode, mesh, seed=OTHER_SEED)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_sd, options=options)
    return {"state": full_state(model)}


def job_resume(rank: int, world_size: int, mesh, mode: str, full_flag: bool) -> dict:
    """Item 5: train 2 steps, take model and optimizer state dicts (``full_state_dict`` =
    ``full_flag``), train 2 more; a fresh model and optimizer (another seed) load them and
    train the same 2 steps."""
    opts = StateDictOptions(full_state_dict=full_flag)
    _, model = sharded(mode, mesh)
    opt = resume_optimizer(model.parameters())
    out: dict = {"first": train(model, opt, None, range(RESUME_AT), rank)}
    # Copies, as a checkpoint holds them: training goes on in place.
    msd = copy.deepcopy(get_model_state_dict(model, options=opts))
    osd = copy.deepcopy(get_optimizer_state_dict(model, opt, options=opts))
    out["optim_at_resume"] = _optim_full(model, opt)
    out["msd_types"] = {k: describe(v) for k, v in msd.items()}
    out["osd_types"] = {
        k: {s: describe(v) if torch.is_tensor(v) else v for s, v in st.items()}
        for k, st in osd["state"].items()
    }
    steps = range(RESUME_AT, RESUME_AT + RESUME_STEPS)
    out["continued"] = train(model, opt, None, steps, rank)
    out["continued_state"] = full_state(model)

    _, model = sharded(mode, mesh, seed=OTHER_SEED)
    opt = resume_optimizer(model.parameters())
    set_model_state_dict(model, msd, options=opts)
    set_optimizer_state_dict(model, opt, osd, options=opts)
    out["resumed_optim"] = _optim_full(model, opt)
    out["resumed"] = train(model, opt, None, steps, rank)
    out["resumed_state"] = full_state(model)
    return out


# Item 6: torch.amp.GradScaler. SGD is unscaled by ``unscale_``'s foreach op; the fused AdamW
# takes the scale and the inf flag into its own step.
SCALER_OPTIMIZERS = ("sgd", "adamw_fused")
INIT_SCALE, INF_STEP = 1024.0, 1


def put_inf(grad: torch.Tensor, holds_last_row: bool) -> None:
    """An inf in the last row of ``grad`` (a DTensor: only the rank that holds that row)."""
    if isinstance(grad, DTensor):
        if holds_last_row:
            grad.to_local()[-1].view(-1)[0] = math.inf
    else:
        grad[-1].view(-1)[0] = math.inf


def scaled_loop(net: nn.Module, model: nn.Module, opt, steps, ranks: list[int],
                holds_last_row: bool) -> dict:
    """The AMP loop (``scaler.scale(loss).backward()``, ``scaler.step``, ``scaler.update``)
    with an inf put into one gradient entry at ``INF_STEP``; per step, the scale after the
    update and whether the parameters changed."""
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    scales, stepped = [], []
    for step in steps:
        loss = sum(loss_fn(model, batch(step, r)) for r in ranks) / len(ranks)
        scaler.scale(loss).backward()
        if step == INF_STEP:
            put_inf(net.fc1.weight.grad, holds_last_row)
        before = [full(p) for p in net.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        stepped.append(any(not torch.equal(b, full(p))
                           for b, p in zip(before, net.parameters(), strict=True)))
    return {"scales": scales, "stepped": stepped}


def job_grad_scaler(rank: int, world_size: int, mesh, mode: str) -> dict:
    """Item 6: an inf in one rank's gradient shard skips the step on every rank (the scaler's
    inf check is reduced across the mesh) and halves the scale everywhere; the other steps
    train as without scaling."""
    index, count = shard_coords(rank, world_size, mesh)
    last = len(torch.chunk(torch.empty(OddNet().fc1.weight.shape[0]), count)) - 1
    out: dict = {}
    for name in SCALER_OPTIMIZERS:
        net, model = sharded(mode, mesh)
        opt, _ = make_optimizer(name, model.parameters())
        out[name] = scaled_loop(net, model, opt, range(TRAIN_STEPS), [rank], index == last)
        out[name]["state"] = full_state(net)
    return out


# Item 7: torch.distributed.pipelining with data parallelism per stage (pp 2 x dp 2, 4 ranks),
# as torchtitan composes PP with FSDP: each stage's module sharded on its dp group.
PIPE_MICROBATCHES, PIPE_SPLIT = 2, 4  # stage 0: layers [:4] of pipe_model(), stage 1: the rest


def pipe_model() -> nn.Sequential:
    """The whole model the two stages split."""
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def pipe_stage(stage: int) -> tuple[nn.Sequential, int]:
    """Stage ``stage``'s layers of :func:`pipe_model` and the index of its first layer."""
    layers = list(pipe_model())
    first = 0 if stage == 0 else PIPE_SPLIT
    return nn.Sequential(*(layers[:PIPE_SPLIT] if stage == 0 else layers[PIPE_SPLIT:])), first


def pipe_batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``dp``'s (input, target) at ``step``: 4 rows, 2 microbatches."""
    gen = torch.Generator().manual_seed(10 * step + dp)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)


def pipe_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean()


def job_pipeline(rank: int, world_size: int, mesh, mode: str) -> dict:
    """Item 7: ``PipelineStage`` and ``ScheduleGPipe`` on a stage sharded on its dp group
    (eager, or compiled before it becomes a stage), 3 SGD steps; the stage's trained
    parameters under the whole model's names, and the last stage's microbatch losses."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    pipe_mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp"))
    stage, dp = pipe_mesh["pp"].get_local_rank(), pipe_mesh["dp"].get_local_rank()
    module, first = pipe_stage(stage)
    graphshard.shard(module, pipe_mesh["dp"])
    run = torch.compile(module, backend=compile_backend()) if mode == "compiled" else module
    schedule = ScheduleGPipe(
        PipelineStage(run, stage, 2, torch.device("cpu"), group=pipe_mesh["pp"].get_group()),
        n_microbatches=PIPE_MICROBATCHES, loss_fn=pipe_loss)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(TRAIN_STEPS):
        inputs, target = pipe_batch(step, dp)
        if stage == 0:
            schedule.step(inputs)
        else:
            micro: list[torch.Tensor] = []
            schedule.step(target=target, losses=micro)
            losses.append([loss.item() for loss in micro])
        opt.step()
        opt.zero_grad()
    params = {}
    for name, param in module.named_parameters():
        index, attr = name.split(".", 1)
        params[f"{int(index) + first}.{attr}"] = full(param)
    return {"stage": stage, "dp": dp, "losses": losses, "params": params}


# ------------------------------------------------------------------------ functional_call

FUNCTIONAL_SCALE = 0.5  # the tensors given to functional_call: the model's, scaled


def functional_tensors(model: nn.Module, as_dtensors: bool) -> dict[str, torch.Tensor]:
    """What a user hands ``torch.func.functional_call``: every parameter scaled, as plain
    full tensors that require grad (an EMA's or MAML's fast weights) or as DTensors (clones
    of the sharded parameters)."""
    if as_dtensors:
        return {n: p.detach() * FUNCTIONAL_SCALE for n, p in model.named_parameters()}
    return {n: (full(p) * FUNCTIONAL_SCALE).requires_grad_() for n, p in model.named_parameters()}


def functional_outputs(model: nn.Module, call, rank: int) -> dict[str, torch.Tensor]:
    """``call(model, tensors, x)`` with each kind of tensors on rank ``rank``'s step-0 input:
    the outputs, and the gradient of the plain tensors' output's mean square."""
    x = batch(0, rank)[0]
    plain = functional_tensors(model, as_dtensors=False)
    out = call(plain, x)
    grads = torch.autograd.grad(out.square().mean(), list(plain.values()))
    with torch.no_grad():
        out_dtensors = call(functional_tensors(model, as_dtensors=True), x)
    return {"plain": out.detach(), "dtensors": out_dtensors,
            "grads": {n: full(g) for n, g in zip(plain, grads, strict=True)}}


def job_functional_call(rank: int, world_size: int, mesh, mode: str) -> dict:
    """``torch.func.functional_call`` on the model as the user calls it (compiled in
    "compiled" mode), and inside a compiled function; then a plain forward."""
    import warnings

    from torch.func import functional_call

    from graphshard.api import eager_roots

    eager_roots._WARNED.clear()  # once per process: each job starts afresh
    net, model = sharded(mode, mesh)
    results = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results["direct"] = functional_outputs(
            net, lambda tensors, x: functional_call(model, tensors, (x,)), rank)
        inside = torch.compile(lambda tensors, x: functional_call(net, tensors, (x,)),
                               backend="graphshard")
        results["inside_compile"] = functional_outputs(net, inside, rank)
    with torch.no_grad():
        results["after"] = model(batch(0, rank)[0])
    results["warned"] = [str(w.message) for w in caught
                         if issubclass(w.category, graphshard.EagerForwardWarning)]
    # Under no_sync, a backward through DTensors given in the parameters' places leaves the
    # model's held-back gradients alone: the next synced backward gives the plain gradients.
    with graphshard.no_sync(model):
        given = functional_tensors(net, as_dtensors=True)
        for tensor in given.values():
            tensor.requires_grad_()
        functional_call(net, given, (batch(0, rank)[0],)).square().mean().backward()
    results["given_grads"] = all(t.grad is not None for t in given.values())
    loss_fn(model, batch(0, rank)).backward()
    results["grads_after"] = {n: full(p.grad) for n, p in net.named_parameters()}
    return results


def reference_functional_call(rank: int) -> dict[str, torch.Tensor]:
    """:func:`functional_outputs` of the plain model, and its own output."""
    from torch.func import functional_call

    model = build()
    out = functional_outputs(model, lambda tensors, x: functional_call(model, tensors, (x,)),
                             rank)
    with torch.no_grad():
        out["after"] = model(batch(0, rank)[0])
    return out


JOBS: dict[str, Callable[..., dict]] = {
    "functional_call": job_functional_call,
    "pipeline": job_pipeline,
    "grad_scaler": job_grad_scaler,
    "basics": job_basics,
    "optim": job_optim,
    "other_optim": job_other_optim,
    "dcp_load": dcp_load,  # item 4 at another world size / mesh: the world-2 checkpoint
    "state_dict": job_state_dict,
    "broadcast": job_broadcast,
    "resume_full": functools.partial(job_resume, full_flag=True),
    "resume_sharded": functools.partial(job_resume, full_flag=False),
}


def run_jobs(rank: int, world_size: int, hsdp: bool, jobs: list[tuple]) -> dict:
    """Entry point of each rank: run every ``(job, mode, *args)`` in turn.

    A job that raises records its traceback under ``"error"`` (the tests fail with it), so
    one broken idiom does not hide the results of the others.
    """
    torch.manual_seed(0)
    mesh = make_mesh(world_size, hsdp)
    coords = shard_coords(rank, world_size, mesh)
    results: dict = {"shard_coords": coords}
    counters = torch._dynamo.utils.counters
    stats = counters["stats"]
    for name, mode, *args in jobs:
        torch._dynamo.reset()
        graphs, breaks = stats["unique_graphs"], sum(counters["graph_break"].values())
        try:
            results[(name, mode)] = JOBS[name](rank, world_size, mesh, mode, *args)
        except (Exception, CheckpointException):  # DCP's is a BaseException
            results[(name, mode)] = {"error": traceback.format_exc()}
        results[(name, mode)]["graphs"] = stats["unique_graphs"] - graphs  # Dynamo graphs
        results[(name, mode)]["breaks"] = sum(counters["graph_break"].values()) - breaks
        dist.barrier()
    return results


# --------------------------------------------------------------------------- references


def reference_grads(world: int) -> tuple[nn.Module, torch.Tensor]:
    """The plain model after one backward of the rank-averaged loss of step 0."""
    model = build()
    loss = sum(loss_fn(model, batch(0, r)) for r in range(world)) / world
    loss.backward()
    return model, loss


def reference_train(model: nn.Module, opt, sched, steps, world: int) -> list[float]:
    """The plain loop on every rank's batch; the rank-averaged losses."""
    return _loop(model, opt, sched, steps, list(range(world)))


def plain_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A plain model's state dict, detached copies."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_pipeline(dp_size: int) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """:func:`pipe_model` trained in one process on every microbatch of every dp rank: the
    schedule scales each stage's gradients by 1 / microbatches (torch's ``scale_grads``) and
    the dp group averages them, so the loss is the mean over all microbatches. The final
    parameters, and per step the microbatch losses of each dp rank."""
    model = pipe_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(TRAIN_STEPS):
        micro = []
        for dp in range(dp_size):
            inputs, target = pipe_batch(step, dp)
            micro.append([pipe_loss(model(x), y)
                          for x, y in zip(inputs.chunk(PIPE_MICROBATCHES),
                                          target.chunk(PIPE_MICROBATCHES), strict=True)])
        (sum(sum(m) for m in micro) / (dp_size * PIPE_MICROBATCHES)).backward()
        opt.step()
        opt.zero_grad()
        losses.append([[loss.item() for loss in m] for m in micro])
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses
