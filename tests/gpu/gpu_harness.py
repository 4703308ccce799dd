"""What the CUDA tier's cases share: the two worlds, the models and batches, a sharded
training run, its one-process reference, and the comparison of the two.

Every function takes the device from a :class:`World`, so the same code runs on the GPU
(``tests/gpu``) and, as a smoke test of the harness itself, on the CPU
(``tests/test_gpu_tier_cpu.py``).

**The fake world's reference.** In :mod:`bench.fake_world` this process is rank 0 of N and
every other rank is imagined to hold exactly what rank 0 holds: an all-gather returns this
rank's shard tiled N times, a reduce-scatter (``AVG``) returns this rank's piece of its own
gradient. So the model that really runs is not the one the seed built, but the one whose
every parameter is rank 0's block tiled to the full shape; and after each step only rank
0's block is updated (from rank 0's block of that model's gradient), and tiled again by the
next gather. That is a plain model, and one process can train it exactly: build the
reference with the same seed, replace each parameter by its leading block (the shape of the
sharded parameter's local tensor: rank 0 holds the leading rows, and under tensor
parallelism the leading block of its TP piece) tiled to the full shape, and do that again
after every optimizer step (:func:`project`). The optimizer must update each element from
its own gradient and state only (SGD, Adam, ...: the rows outside the leading block are
overwritten anyway). Then the sharded run's local tensors must equal the reference's
leading blocks, step after step, within the round-off of the dtype. Tensor parallelism fits
the same rule: the imagined TP rank computes what rank 0 computes (the same heads, the same
FFN columns), which is what the tiled model computes in the TP rank's half. Every
parameter's dimensions must divide evenly (:func:`project` checks), so the tiny Llama's
shapes are chosen to be multiples of 8. At world 1 the projection is the identity, and the
reference is the plain model.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import graphshard
from bench.fake_world import init_fake_world, shutdown_fake_world
from graphshard.models.llama import Llama, llama_config

STEPS = 3
LR, MOMENTUM = 0.1, 0.9
BATCH, SEQ = 4, 32
SEED = 1234  # the model's construction (global RNG)
INIT_SEED = 7  # Llama.init_weights(seed=...) after meta-device construction
MODES = ("eager", "compiled")

# tiny: vocab 256, dim 64, 4 heads (2 kv heads) of 16, FFN 176, 2 layers: every dimension a
# multiple of 8, and of dp 4 x tp 2 (the fake world's projection needs even blocks).
TINY = llama_config("tiny")
# CPU offload's memory check: 2.5 M parameters (10 MB in fp32), so that the shards, their
# gradients and the optimizer state that offload keeps off the device dominate the peak.
OFFLOAD = llama_config("llama-small", n_layers=2, max_seq_len=64)

PRECISIONS: dict[str, graphshard.MixedPrecision | None] = {
    "fp32": None,
    "bf16": graphshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "fp16": graphshard.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16),
}


@dataclass(frozen=True)
class Tolerance:
    """How close a sharded run must come to its reference.

    ``loss``: relative, per step. ``rtol``/``atol``: every final parameter element (None:
    not checked element by element). ``update``: the largest difference of any final
    parameter element, relative to the largest change any element made in training (a
    wrong averaging factor or a lost gradient is off by 0.5 or more)."""

    loss: float
    rtol: float | None
    atol: float | None
    update: float


# fp32: Inductor's fusions and the GPU's reductions round differently from eager (1e-7
# relative per op); bf16 keeps 8 bits of mantissa, fp16 11: the compiled graph rounds its
# intermediate values in other places than the eager modules do. Measured on the CPU,
# compiled against the reference (fake world of 8; world 1): update 4.7e-7 / 5.7e-3;
# 1.2e-2 / 6.4e-4; 1.0e-3 and loss 2.6e-7 / 3.5e-5; 1.2e-5 / 4.0e-6; 3.6e-6 for fp32 /
# bf16 / fp16; eager 0 (fp16 in the fake world: 3.6e-4, the division before the sum). A
# wrong averaging factor is off by 0.5.
TOLERANCES = {
    "fp32": Tolerance(loss=1e-4, rtol=1e-4, atol=1e-5, update=1e-3),
    "bf16": Tolerance(loss=1e-2, rtol=None, atol=None, update=0.1),
    "fp16": Tolerance(loss=2e-3, rtol=None, atol=None, update=2e-2),
}


# --------------------------------------------------------------------------- worlds


@dataclass(frozen=True)
class World:
    """A process group this process runs in: ``size`` ranks of which this is rank 0
    (``fake``: the others are imagined, :mod:`bench.fake_world`)."""

    name: str
    device: torch.device
    size: int
    fake: bool

    def mesh(self, shape: tuple[int, ...] | None = None,
             names: tuple[str, ...] | None = None) -> DeviceMesh:
        """A mesh of every rank, on this world's device type: 1-D by default."""
        return init_device_mesh(self.device.type, shape or (self.size,), mesh_dim_names=names)


@contextlib.contextmanager
def world1(device: str) -> Iterator[World]:
    """A real one-rank process group in this process: ``cpu:gloo,cuda:nccl`` for a CUDA
    device (NCCL for the collectives, gloo for host tensors: CPU offload's state dicts and
    norms), gloo alone for the CPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
    if dist.is_initialized():  # pragma: no cover - a test left its group behind
        dist.destroy_process_group()
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1,
                                timeout=timedelta(seconds=300))
        try:
            yield World("world1", dev, 1, fake=False)
        finally:
            torch._dynamo.reset()
            dist.destroy_process_group()


@contextlib.contextmanager
def fake_world(size: int, device: str) -> Iterator[World]:
    """Rank 0 of a :mod:`bench.fake_world` of ``size`` ranks, on ``device``."""
    dev = torch.device(device)
    if dist.is_initialized():  # pragma: no cover - a test left its group behind
        dist.destroy_process_group()
    init_fake_world(size, device=dev.type)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
    try:
        yield World(f"fake{size}", dev, size, fake=True)
    finally:
        torch._dynamo.reset()
        shutdown_fake_world()


# --------------------------------------------------------------------------- models, batches


@dataclass(frozen=True)
class Job:
    """A model (``build``: on the CPU, the same values at every call), the batch of each
    (step, micro-batch) (on the CPU), and the loss of a model on a batch."""

    build: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple]
    loss: Callable[[nn.Module, tuple], torch.Tensor]


def _llama_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    return model(*batch).loss


def llama_job(cfg=TINY, cls: type[Llama] = Llama, init_seed: int | None = None) -> Job:
    """The shipped Llama of ``cfg`` built from :data:`SEED` (and, with ``init_seed``,
    re-initialised by ``init_weights(seed=init_seed)``, the values a meta-built model gets
    from the same call), on random tokens."""

    def build() -> nn.Module:
        torch.manual_seed(SEED)
        model = cls(cfg)
        if init_seed is not None:
            model.init_weights(seed=init_seed)
        return model

    def batch(step: int, micro: int) -> tuple:
        gen = torch.Generator().manual_seed(1000 * step + micro)
        return (torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen),)

    return Job(build, batch, _llama_loss)


def to_device(batch: tuple, device: torch.device) -> tuple:
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in batch)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: elementwise (the fake world's reference needs it), and unlike Adam
    it does not magnify round-off where a gradient is near zero."""
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR,
                           momentum=MOMENTUM)


def shard_job(world: World, job: Job, precision: str = "fp32", mesh: DeviceMesh | None = None,
              **shard_options: Any) -> nn.Module:
    """``job``'s model moved to the world's device and sharded over ``mesh`` (default: the
    world's 1-D mesh)."""
    model = job.build().to(world.device)
    return graphshard.shard(model, mesh if mesh is not None else world.mesh(),
                            mixed_precision=PRECISIONS[precision], **shard_options)


# --------------------------------------------------------------------------- training


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor: a DTensor's local tensor, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's local tensor, copied to the host (no device memory)."""
    return {n: local(p).detach().to("cpu", copy=True) for n, p in model.named_parameters()}


@dataclass
class Outcome:
    """A training run: the loss of each step (summed over micro-batches), the parameters'
    local tensors before and after, their shapes."""

    losses: list[float]
    initial: dict[str, torch.Tensor]
    final: dict[str, torch.Tensor]
    local_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


def train(world: World, model: nn.Module, job: Job, mode: str, *,
          backend_options: dict | None = None, micro: int = 1,
          opt: torch.optim.Optimizer | None = None, steps: range = range(STEPS),
          after_backward: Callable[[nn.Module], None] | None = None) -> Outcome:
    """Train the sharded ``model`` on ``job``'s batches, eagerly or through
    ``torch.compile(backend=graphshard.backend(**backend_options))``; with ``micro`` > 1
    every micro-batch but the last of a step runs under ``graphshard.no_sync``."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    torch._dynamo.reset()
    run = (torch.compile(model, backend=graphshard.backend(**(backend_options or {})))
           if mode == "compiled" else model)
    opt = make_optimizer(model) if opt is None else opt
    initial = snapshot(model)
    losses = []
    for step in steps:
        total = 0.0
        for m in range(micro):
            held = graphshard.no_sync(model) if m < micro - 1 else contextlib.nullcontext()
            with held:
                loss = job.loss(run, to_device(job.batch(step, m), world.device))
                loss.backward()
            total += loss.item()
            if after_backward is not None:
                after_backward(model)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    shapes = {n: tuple(local(p).shape) for n, p in model.named_parameters()}
    return Outcome(losses, initial, snapshot(model), shapes)


def leading_block(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The block of ``t`` that rank 0 holds when its local tensor has ``shape``."""
    return t[tuple(slice(0, s) for s in shape)]


@torch.no_grad()
def project(model: nn.Module, shapes: dict[str, tuple[int, ...]] | None) -> None:
    """Replace each parameter by its leading block of ``shapes[name]`` tiled to its full
    shape: the model the fake world computes with (see the module docstring)."""
    if not shapes:
        return
    for name, p in model.named_parameters():
        shape = tuple(shapes[name])
        if shape == tuple(p.shape):
            continue
        if len(shape) != p.dim() or any(
                s == 0 or n % s for n, s in zip(p.shape, shape, strict=True)):
            raise ValueError(
                f"{name}: a local tensor of {shape} does not tile the full {tuple(p.shape)}: "
                "the fake world's reference needs dimensions that divide evenly"
            )
        block = leading_block(p, shape).clone()
        p.copy_(block.repeat(*(n // s for n, s in zip(p.shape, shape, strict=True))))


def reference(job: Job, device: torch.device, *, precision: str = "fp32", micro: int = 1,
              shapes: dict[str, tuple[int, ...]] | None = None,
              steps: int = STEPS) -> Outcome:
    """One process, the plain model on ``device``: the same batches and optimizer.

    With a ``precision`` other than fp32 it does what ``MixedPrecision`` does, by hand: the
    forward and backward run on a copy of the parameters in ``param_dtype``, each gradient
    is cast to ``reduce_dtype`` and then to the master's dtype, and the optimizer steps on
    the fp32 master. ``shapes`` (the sharded run's local shapes) turns it into the fake
    world's reference (:func:`project`)."""
    model = job.build().to(device)
    project(model, shapes)
    policy = PRECISIONS[precision]
    low = None
    if policy is not None:
        low = copy.deepcopy(model)
        for p in low.parameters():
            p.data = p.data.to(policy.param_dtype)
    opt = make_optimizer(model)
    initial = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    losses = []
    for step in range(steps):
        if low is not None:
            with torch.no_grad():
                for lp, mp in zip(low.parameters(), model.parameters(), strict=True):
                    lp.copy_(mp)
        total = 0.0
        for m in range(micro):
            loss = job.loss(model if low is None else low, to_device(job.batch(step, m), device))
            loss.backward()
            total += loss.item()
            if low is not None:
                for lp, mp in zip(low.parameters(), model.parameters(), strict=True):
                    if lp.grad is None:
                        continue
                    grad = lp.grad.to(policy.gradient_dtype).to(mp.dtype)
                    mp.grad = grad if mp.grad is None else mp.grad + grad
                    lp.grad = None
        opt.step()
        opt.zero_grad()
        project(model, shapes)
        losses.append(total)
    final = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    return Outcome(losses, initial, final)


def check(out: Outcome, ref: Outcome, precision: str = "fp32", what: str = "") -> None:
    """The sharded run matches its reference: the same starting values (exactly), losses
    and final parameters within :data:`TOLERANCES` of ``precision``."""
    tol = TOLERANCES[precision]
    assert out.initial.keys() == ref.initial.keys(), what
    for name, got in out.initial.items():
        torch.testing.assert_close(got, leading_block(ref.initial[name], got.shape), rtol=0,
                                   atol=0, msg=lambda m, n=name: f"{what} initial {n}: {m}")
    torch.testing.assert_close(torch.tensor(out.losses, dtype=torch.float64),
                               torch.tensor(ref.losses, dtype=torch.float64), rtol=tol.loss,
                               atol=0, msg=lambda m: f"{what} losses: {m}")
    worst, scale, where = 0.0, 0.0, ""
    for name, got in out.final.items():
        want = leading_block(ref.final[name], got.shape)
        if tol.rtol is not None:
            torch.testing.assert_close(got, want, rtol=tol.rtol, atol=tol.atol,
                                       msg=lambda m, n=name: f"{what} final {n}: {m}")
        diff = (got.double() - want.double()).abs().max().item()
        if diff > worst:
            worst, where = diff, name
        scale = max(scale, (want.double() - out.initial[name].double()).abs().max().item())
    assert scale > 0, f"{what}: the reference did not train"
    assert worst <= tol.update * scale, (
        f"{what}: {where} is {worst:.3g} from the reference, {worst / scale:.3g} of the "
        f"largest update ({scale:.3g}); allowed {tol.update}"
    )


# --------------------------------------------------------------------------- device memory


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[dict[str, int]]:
    """The peak of the device memory allocated inside the block, above what was allocated
    when it began: ``out["peak"]`` after the block."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out: dict[str, int] = {}
    yield out
    torch.cuda.synchronize(device)
    out["peak"] = torch.cuda.max_memory_allocated(device) - start


def warm_up(device: torch.device) -> None:
    """One eager forward and backward of the tiny Llama on ``device``: the libraries'
    one-time workspaces (cuBLAS, ...) are allocated before any measured block."""
    torch.manual_seed(0)
    model = Llama(TINY).to(device)
    model(torch.randint(0, TINY.vocab_size, (BATCH, SEQ), device=device)).loss.backward()
    del model
    gc.collect()
