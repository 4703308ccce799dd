"""Optimizer-step benchmark: torch's three AdamW implementations, and ``clip_grad_norm_``, on
graphshard's shards.

    python -m bench.optimizer --world-size 2 --model llama-small [--steps 20] [--rounds 3] \\
        [--threads 1] [--json out.json]

On the CPU ``torch.optim.AdamW`` defaults to its per-parameter loop (``foreach`` and
``fused`` are opt-in there; on a GPU ``foreach`` is the default). With DTensor parameters
(graphshard, and FSDP2 and SimpleFSDP alike) every operation of that loop goes through
DTensor's dispatch, which on a small model costs more than the arithmetic. The command times
``optimizer.step()`` for ``loop`` (``foreach=False``), ``foreach=True`` and ``fused=True``:

- ``sharded``: on the shards rank 0 holds after ``graphshard.shard`` in a fake world of
  ``--world-size`` ranks (:mod:`bench.fake_world`; no other process, no communication: the
  step is local to each rank);
- ``plain``: on the unsharded model, plain tensors (DDP's and one process's optimizer).

``fused`` on the shards runs on their local tensors (graphshard's local path for the fused
steps, :mod:`graphshard.api.fused_optimizer_ops`); ``fused_dtensor_dispatch_ms``, timed in the
same rounds, is that step through DTensor's own dispatch, what it costs without the local
path.

The implementations run interleaved, ``--rounds`` rounds of ``--steps`` timed steps each
after a few untimed ones, from fixed gradients; the figure is the median over the rounds,
in milliseconds per step. ``fused_vs_loop_max_abs_diff`` is the largest difference between
the sharded parameters after 5 steps of ``fused`` and of ``loop`` from the same start (the
fused kernel rounds differently, so it is small, not zero).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import graphshard
from bench.systems import ADAMW_IMPLEMENTATIONS, BenchContext, build_model
from graphshard.api import grad_norm_ops
from graphshard.api.fused_optimizer_ops import dtensor_dispatch
from graphshard.models.llama import CONFIGS, llama_config

__all__ = ["IMPLEMENTATIONS", "main", "parse_args"]

# name -> AdamW keyword arguments: the bench's explicit choices (not torch's default)
IMPLEMENTATIONS: dict[str, dict[str, bool]] = {
    name: kwargs for name, kwargs in ADAMW_IMPLEMENTATIONS.items() if name != "default"
}
_WARMUP = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.optimizer",
        description="Time torch's AdamW implementations on graphshard's shards and on the "
        "plain model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks of the fake world")
    parser.add_argument("--model", default="llama-small", choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error("--world-size must be at least 2 (at 1 nothing is sharded)")
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    return args


def _with_grads(model: nn.Module) -> nn.Module:
    """Fixed gradients, a function of the parameters (so two copies get the same ones)."""
    for param in model.parameters():
        param.grad = param.detach() * 1e-2
    return model


def _sharded(ctx: BenchContext) -> nn.Module:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", list(range(ctx.world_size)))
    return _with_grads(graphshard.shard(build_model(ctx), mesh))


def _time_steps(optimizer: torch.optim.Optimizer, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - start) / steps * 1e3


def _time_clips(model: nn.Module, steps: int, clip=torch.nn.utils.clip_grad_norm_) -> float:
    params = list(model.parameters())
    start = time.perf_counter()
    for _ in range(steps):
        clip(params, _NO_CLIP)
    return (time.perf_counter() - start) / steps * 1e3


_NO_CLIP = 1e9  # far above any norm here: the gradients are scaled by 1
_DTENSOR = ("sharded", "fused-dtensor-dispatch")  # fused on the shards, DTensor's dispatch
_CLIPS = {("sharded", "clip"), ("plain", "clip"), ("sharded", "clip-dtensor-dispatch"),
          ("sharded", "clip-graphshard")}


def _time(models: dict[str, nn.Module], args: argparse.Namespace) -> dict[str, Any]:
    """Median ms per call of every implementation's step and of ``clip_grad_norm_`` on
    every model, interleaved by round, and of the shards' fused step and clip through
    DTensor's dispatch."""
    optimizers = {
        (where, name): torch.optim.AdamW(model.parameters(), lr=1e-3, **kwargs)
        for where, model in models.items()
        for name, kwargs in IMPLEMENTATIONS.items()
    }
    optimizers[_DTENSOR] = torch.optim.AdamW(models["sharded"].parameters(), lr=1e-3,
                                             **IMPLEMENTATIONS["fused"])
    keys = [*optimizers, *sorted(_CLIPS)]

    def timed(key: tuple[str, str], steps: int) -> float:
        if key == _DTENSOR:
            with dtensor_dispatch():
                return _time_steps(optimizers[key], steps)
        if key == ("sharded", "clip-dtensor-dispatch"):
            with grad_norm_ops.dtensor_dispatch():
                return _time_clips(models["sharded"], steps)
        if key == ("sharded", "clip-graphshard"):
            return _time_clips(models["sharded"], steps, graphshard.clip_grad_norm_)
        if key in _CLIPS:
            return _time_clips(models[key[0]], steps)
        return _time_steps(optimizers[key], steps)

    for key in keys:
        timed(key, _WARMUP)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
    for _ in range(args.rounds):
        for key in keys:
            times[key].append(timed(key, args.steps))
    result: dict[str, Any] = {
        where: {name: statistics.median(times[where, name]) for name in IMPLEMENTATIONS}
        for where in models
    }
    result["fused_dtensor_dispatch_ms"] = statistics.median(times[_DTENSOR])
    result["clip_ms"] = {where: statistics.median(times[where, "clip"]) for where in models}
    result["clip_dtensor_dispatch_ms"] = statistics.median(
        times["sharded", "clip-dtensor-dispatch"])
    result["clip_graphshard_ms"] = statistics.median(times["sharded", "clip-graphshard"])
    return result


def _fused_vs_loop(ctx: BenchContext) -> float:
    after = {}
    for name in ("loop", "fused"):
        model = _sharded(ctx)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **IMPLEMENTATIONS[name])
        for _ in range(5):
            optimizer.step()
        after[name] = [param.to_local() for param in model.parameters()]
    return max(
        (a - b).abs().max().item() for a, b in zip(after["loop"], after["fused"], strict=True)
    )


def to_markdown(result: dict[str, Any]) -> str:
    """The result as a table: ms per ``optimizer.step()``, one row per model."""
    names = list(IMPLEMENTATIONS)
    lines = [
        f"{result['model']}, AdamW, world size {result['world_size']} (fake world, rank 0's "
        f"shards), {result['threads']} thread(s), torch {torch.__version__}",
        "",
        "| parameters | " + " | ".join(f"{n} ms" for n in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for where in ("sharded", "plain"):
        lines.append(f"| {where} | " + " | ".join(f"{result[where][n]:.2f}" for n in names) + " |")
    lines.append("")
    lines.append(f"fused on the shards through DTensor's dispatch (no local path): "
                 f"{result['fused_dtensor_dispatch_ms']:.2f} ms")
    lines.append(f"clip_grad_norm_: sharded {result['clip_ms']['sharded']:.2f} ms, through "
                 f"DTensor's dispatch {result['clip_dtensor_dispatch_ms']:.2f} ms, "
                 f"graphshard.clip_grad_norm_ {result['clip_graphshard_ms']:.2f} ms, plain "
                 f"{result['clip_ms']['plain']:.2f} ms")
    lines.append(f"fused vs loop after 5 steps, largest difference: "
                 f"{result['fused_vs_loop_max_abs_diff']:.3g}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark in this process; print the table and return the result."""
    from bench.fake_world import init_fake_world, shutdown_fake_world

    args = parse_args(argv)
    if dist.is_initialized():
        raise RuntimeError("bench.optimizer starts its own fake world: run it in a process "
                           "without a default process group")
    torch.set_num_threads(args.threads)
    ctx = BenchContext(llama_config(args.model), 0, 1e-3, torch.device("cpu"), args.world_size)
    init_fake_world(args.world_size)
    try:
        models = {"sharded": _sharded(ctx), "plain": _with_grads(build_model(ctx))}
        result: dict[str, Any] = {
            "model": args.model, "world_size": args.world_size, "threads": args.threads,
            **_time(models, args),
            "fused_vs_loop_max_abs_diff": _fused_vs_loop(ctx),
        }  # fmt: skip
    finally:
        shutdown_fake_world()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(to_markdown(result), flush=True)
    return result


if __name__ == "__main__":
    main()
