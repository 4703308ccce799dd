"""Side-by-side training-step benchmark: graphshard vs FSDP2, SimpleFSDP, DDP and one process.

    python -m bench.step --world-size 2 --model llama-small --steps 30 --json out.json \\
        [--markdown out.md] [--device cpu|cuda] [--systems NAME ...] [--batch-size 4] \\
        [--seq-len 128] [--warmup 5] [--round-steps 1] [--sequential] [--fake-world N] \\
        [--mixed-precision none|bf16|fp16] [--compiler inductor|aot_eager]

    python -m bench.step --systems graphshard-compiled \\
        'graphshard-compiled[reshard_after_forward=False]' --json out.json

The command spawns the ranks itself (``torch.multiprocessing``, a ``FileStore``; gloo on the
CPU, NCCL with ``--device cuda``) and runs every system of :data:`bench.systems.SYSTEMS` from
the same initial model and on the same batches (batch ``(step, rank)`` is the same tensor for
every system).

Schedule. Each system is built and runs its first step (compilation) one system at a time;
then all of them stay alive and their other steps are interleaved: every round runs
``--round-steps`` steps of each system in turn, the order rotated by one system each round,
until each has run ``--steps`` steps in all, of which the first ``--warmup`` are not timed
(a timed step that compiles new graphs is noted). A slow spell of the (shared) machine then
hits every system in the same round instead of whichever system happened to be running,
and the ratio between two systems is taken round by round. The systems share one process
per rank but no compiled code: each has its own process group, Inductor backend and copy of
the model's code (:func:`bench.systems.private_llama_class`). ``--sequential`` runs the
systems one after the other instead, each alone (build, every step, profile, free): less
memory, noisier ratios.

Per system:

- ``step_s_median`` / ``step_s_p10`` / ``step_s_p90``: wall time of a full step (forward,
  backward, optimizer) over the timed steps; every step starts after a barrier on the
  system's process group and a step's time is the slowest rank's.
- ``graphshard_ratio``: graphshard-compiled's step time over this system's, per round (the
  ratio of the two round medians), summarised by its median, p10, p90, min and max over the
  rounds: below 1 means graphshard-compiled is faster.
- ``compile_s``: the first step's time minus the median (first-step overhead; compilation
  for the compiled systems), with whatever Inductor cache the environment names.
  ``--compile-cache cold-warm`` runs the whole bench twice on a new, empty cache directory:
  ``compile_s`` is then the first run's (cold: nothing compiled before) and
  ``compile_s_warm`` the second's (a restart of the same job in fresh processes; the other
  numbers are the first run's). ``python -m bench.compile_time`` gives the first
  forward+backward alone, cold and warm, by model depth.
- ``peak_mem_bytes``: peak tensor memory of the most loaded rank during the extra profiled
  steps after the timed ones (``--profiled-steps``, default one). CPU: the model state
  alive when the step starts (parameters, buffers, gradients and optimizer state, unique
  storages) plus the peak of the running sum of the profiler's memory events in time order.
  CUDA: the step's rise of ``torch.cuda.max_memory_allocated`` above the memory allocated
  when it starts, plus what the system held then (the allocated memory it added from its
  build to the end of its first step, so the other systems alive beside it are not
  counted).
- ``collectives_per_step`` / ``bytes_per_step``: graphshard-compiled from
  ``graphshard.analysis.report.step_summary`` over the compiled graphs; the others from the
  ``c10d::`` collective ops the profiler records during the profiled step (in a fake world,
  from the fake groups' own log). Bytes are what one rank sends on a ring: ``(N-1)/N`` of
  the full buffer for all-gather, reduce-scatter and broadcast, ``2(N-1)/N`` for all-reduce
  (the profiler records no dtype for tensor-list arguments; those are counted at the element
  size of the model's parameters).
- ``wait_s``: graphshard systems only, the time the profiled step spent blocked on
  communication: inside the compiled graphs' ``wait_tensor`` and the forward's
  ``take_prefetched`` (its check and wait), and at the end of the step for the gathers the
  optimizer step issued (``System.settle``), slowest rank, the median over the profiled
  steps: the exposed part of the collectives.
- ``copy_bytes_per_step`` / ``copy_floor_bytes``: graphshard systems only, the bytes
  graphshard's own kernels move per step and rank (copy-in, casts, padding, copy-out,
  interleave, gradients into the reduce-scatter buffer; ``graphshard.passes.traffic``, as
  Inductor fuses them) and the least they could move.
- ``first_loss`` / ``final_loss``: the loss of the first and the last step, averaged over
  the ranks that trained (same init and batches: the first losses of all systems agree).
- ``predicted_step_s``: graphshard-compiled only, the cost model's forward+backward estimate
  (profile ``cpu-gloo`` on the CPU, ``h100-nvlink`` on CUDA; the optimizer is not modelled).
- ``host_tax``: compiled systems only (:func:`bench.host_tax.applies_to`), the split of
  ``--host-tax-steps`` more steps (default 3), each under the profiler without shapes or
  memory, into time inside the compiled graphs, Dynamo's guards, AOTAutograd's runtime
  wrappers, the optimizer, the bench's waits and the rest: the median of those steps, on
  the rank whose median step was slowest (:mod:`bench.host_tax`).
- ``device_time``: on an accelerator, with ``--device-profile-steps N``, the median of N
  steps profiled with the device's activity: device busy and idle time, kernel count, the
  largest kernels (:mod:`bench.device_time`); None on the CPU.

``--mixed-precision bf16`` (or ``fp16``; default ``none``, fp32) gives every system the same
precision through its own mechanism (:mod:`bench.systems`): parameters gathered and computed
in that dtype and gradients reduced in fp32 (graphshard ``MixedPrecision``, FSDP2 and
SimpleFSDP ``MixedPrecisionPolicy``), or ``torch.autocast`` around forward and loss (DDP,
single-compiled); master weights and AdamW state stay fp32 everywhere. fp16 runs without a
``GradScaler`` (a benchmark times steps; its losses are not a convergence result).

``--compiler aot_eager`` runs every compiled system's graphs op by op after AOTAutograd
(``graphshard.backend(inductor=False)``, ``torch.compile(backend="aot_eager")``), without
Inductor's code generation: a run that checks the bench (the systems, their collectives and
losses) in a fraction of the time, or tells whether a failure is Inductor's. Its step times
are no system's, and SimpleFSDP's bucketing, an Inductor pass, does not run; the table's
header says so.

``--fake-world N`` runs one process as rank 0 of N ranks (:mod:`bench.fake_world`): the
collectives are computed locally with real data (a gather tiles this rank's shard), so the
times are the compute side of an N-rank step without the network. Those local copies run
inline, on the step's own thread, where a real group's transfers would not; on the CPU each
step's time inside them is recorded too, and the report gives each system's step without it
(:func:`bench.report.fake_world_lines`).

A system that cannot be built because its package is missing (SimpleFSDP without
torchtitan) is recorded as skipped, and one that raises on some rank as failed, with the
(shortened) exception in ``notes``; the others still run. Every rank catches, the ranks meet
on the store (not a process group) after each phase, and each system has a process group of
its own, so a failure that leaves one system's collectives mismatched does not touch the
others'.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.comm import count_collectives, count_logged, graphshard_summary, zero3_bytes
from bench.device_time import profile_device_steps
from bench.host_tax import applies_to, median_split, profile_steps, sync_event
from bench.memory import local_tensor, peak_allocated, state_bytes
from bench.report import (
    FIELDS,
    add_loss_checks,
    add_ratios,
    machine_info,
    summarize,
    to_markdown,
)
from bench.systems import (
    ADAMW_IMPLEMENTATIONS,
    COMPILERS,
    MIXED_PRECISION,
    OFFLOAD_SYSTEMS,
    ONE_PROCESS_SYSTEMS,
    SYSTEMS,
    BenchContext,
    PeerUnavailable,
    System,
    build_system,
    is_offload,
    is_system,
    sequence_length,
    trains_alone,
)
from bench.timing import sync, train_step, wait_time
from graphshard.models.data import SyntheticTokens
from graphshard.models.llama import CONFIGS, llama_config

__all__ = ["main", "parse_args", "to_markdown", "zero3_bytes", "FIELDS", "describe_exception"]


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.step",
        description="Benchmark graphshard against FSDP2, SimpleFSDP, DDP and one process.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn")
    parser.add_argument("--model", default="llama-small", choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=30, help="steps per system, warm-up included")
    parser.add_argument("--warmup", type=int, default=5, help="untimed first steps (>= 1)")
    parser.add_argument(
        "--profiled-steps", type=int, default=1,
        help="profiled steps after the timed ones (peak memory: their largest; comm wait: "
        "their median)",
    )
    parser.add_argument(
        "--host-tax-steps", type=int, default=3,
        help="steps profiled without shapes or memory for the host-tax split of the compiled "
        "systems (guards, wrappers, optimizer, rest: bench/host_tax.py); 0: none",
    )  # fmt: skip
    parser.add_argument(
        "--trace-dir", default=None,
        help="write the host-tax steps' profile of each compiled system and rank here as a "
        "Chrome trace, <system>.rank<R>.json (python -m bench.trace_split splits it by kind of "
        "work)",
    )  # fmt: skip
    parser.add_argument(
        "--device-profile-steps", type=int, default=0,
        help="steps profiled with the accelerator's activity for each system's device time "
        "(busy, idle, kernels, the largest kernels: bench/device_time.py); 0: none, and "
        "none on the CPU",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence (default: 128, or the model's longest where "
                        "that is shorter)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--systems", nargs="+", default=list(SYSTEMS),
        help=f"subset of: {' '.join(SYSTEMS)}; on an accelerator also {' '.join(OFFLOAD_SYSTEMS)}"
        " (CPU offload, run only when named); and variants graphshard-compiled[option=value,"
        "...] (backend options, reshard_after_forward) and graphshard-offload-compiled[...], "
        "quoted for the shell",
    )
    parser.add_argument(
        "--round-steps", type=int, default=1, help="steps of one system per interleaved round"
    )
    parser.add_argument(
        "--sequential", action="store_true",
        help="run the systems one after the other, each alone, instead of interleaved",
    )  # fmt: skip
    parser.add_argument(
        "--fake-world", type=int, default=None, metavar="N",
        help="one process as rank 0 of N ranks, collectives computed locally (compute side)",
    )  # fmt: skip
    parser.add_argument("--json", default=None,
                        help="also write the report here (the table is printed either way)")
    parser.add_argument("--markdown", default=None, help="also write the table here")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument(
        "--optimizer", default="default", choices=list(ADAMW_IMPLEMENTATIONS),
        help="AdamW's implementation, the same for every system: torch's default (its "
        "per-parameter loop on the CPU, foreach on a GPU), loop, foreach or fused",
    )
    parser.add_argument(
        "--clip-grad-norm", type=float, default=None, metavar="MAX_NORM",
        help="clip the gradients' global norm to MAX_NORM between backward and the optimizer "
        "step, for every system: graphshard.clip_grad_norm_ for graphshard's, "
        "torch.nn.utils.clip_grad_norm_ for the others (default: no clip)",
    )  # fmt: skip
    parser.add_argument(
        "--mixed-precision", default="none", choices=list(MIXED_PRECISION),
        help="parameter/compute dtype for every system, gradients reduced in fp32: graphshard "
        "MixedPrecision, FSDP2 and SimpleFSDP mp_policy, torch.autocast for DDP and "
        "single-compiled (fp16 without a GradScaler)",
    )  # fmt: skip
    parser.add_argument(
        "--compiler", default="inductor", choices=list(COMPILERS),
        help="what the compiled systems' graphs run on: inductor (as their users run them), "
        "or aot_eager (op by op after AOTAutograd: a quick check of the bench, or of whether "
        "a failure is Inductor's; its step times are no system's)",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch threads per process [CPU count / world size, also in a fake world]",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds a collective may wait"
    )
    parser.add_argument(
        "--compile-cache", default="inherit", choices=["inherit", "cold-warm"],
        help="inherit: the environment's Inductor cache; cold-warm: run twice on a new empty "
        "cache directory, compile_s from the first run (cold), compile_s_warm from the second",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.fake_world is not None:
        if args.fake_world < 1:
            parser.error("--fake-world must be at least 1")
        args.world_size = args.fake_world
    args.processes = 1 if args.fake_world else args.world_size
    # A fake world's one process gets a real rank's share of the CPUs, not all of them.
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, args.world_size))
    # "a,b" lists two systems; the commas inside a variant's brackets are its own
    listed = (s for item in args.systems for s in re.split(r",(?![^\[]*\])", item) if s)
    args.systems = list(dict.fromkeys(listed))
    try:
        unknown = sorted(name for name in args.systems if not is_system(name))
    except ValueError as exc:
        parser.error(str(exc))
    if unknown:
        parser.error(f"unknown system(s) {unknown}; choose from "
                     f"{', '.join(SYSTEMS + OFFLOAD_SYSTEMS)} or "
                     "graphshard-compiled[option=value,...]")
    if args.world_size < 1:
        parser.error("--world-size must be at least 1")
    if not 1 <= args.warmup < args.steps:
        parser.error("need 1 <= --warmup < --steps (the first step is compile, never timed)")
    if args.round_steps < 1:
        parser.error("--round-steps must be at least 1")
    if args.host_tax_steps < 0:
        parser.error("--host-tax-steps must be at least 0")
    if args.device_profile_steps < 0:
        parser.error("--device-profile-steps must be at least 0")
    args.seq_len = sequence_length(parser, args.model, args.seq_len, 128)
    if args.device == "cuda" and torch.cuda.device_count() < args.processes:
        parser.error(
            f"--device cuda needs {args.processes} GPUs, found {torch.cuda.device_count()}"
        )
    return args


# ----------------------------------------------------------------------------- failures


def describe_exception(exc: BaseException, limit: int = 600) -> str:
    """``Type: message`` (first lines, Dynamo's advice cut), and where it was raised: the
    innermost three frames as ``package/module.py:function``, innermost first."""
    message = str(exc).split("\n\nSet TORCH", 1)[0].split("\n\nYou can suppress", 1)[0]
    lines = [line for line in message.strip().splitlines() if line.strip()][:3]
    text = f"{type(exc).__name__}: {' / '.join(lines)}"
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    if frames:
        where = [
            f"{frame.filename.split('site-packages/')[-1]}:{frame.name}"
            for frame in reversed(frames)
        ]
        text += f" (raised in {' <- '.join(where)})"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------- measurement


@dataclass
class Trial:
    """A built system on this rank and what it has measured so far."""

    name: str
    system: System
    data: SyntheticTokens
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    compiled: list[int] = field(default_factory=list)  # new Dynamo graphs, per step
    rounds: list[int] = field(default_factory=list)  # the round of each step (-1: first)
    resident_bytes: int = 0  # CUDA: memory the system added from build to its first step
    # fake world on the CPU: seconds of each step spent in the fake groups' collectives
    collective_times: list[float] = field(default_factory=list)


def _tokens(trial: Trial, args: argparse.Namespace, rank: int, device: torch.device):
    step = len(trial.times)
    tokens = trial.data.batch(step, rank, args.batch_size, args.seq_len).to(device)
    if trial.system.distributed:
        dist.barrier(group=trial.system.group)  # every rank starts the step together
    sync(device)
    return tokens


def _timed_step(
    trial: Trial, args: argparse.Namespace, rank: int, device: torch.device, round_: int = -1
) -> None:
    from torch._dynamo.utils import counters

    from bench.fake_world import collective_seconds

    tokens = _tokens(trial, args, rank, device)
    graphs = counters["stats"]["unique_graphs"]
    inline = collective_seconds()
    start = time.perf_counter()
    loss = train_step(trial.system, tokens)
    sync(device)
    trial.times.append(time.perf_counter() - start)
    if args.fake_world and device.type == "cpu":  # on CUDA the copies run on the device
        trial.collective_times.append(collective_seconds() - inline)
    trial.losses.append(loss.item())
    trial.compiled.append(counters["stats"]["unique_graphs"] - graphs)
    trial.rounds.append(round_)


def prepare(name: str, ctx: BenchContext, args: argparse.Namespace, rank: int) -> Trial | None:
    """Build ``name`` and run its first step; None where this rank has nothing to run."""
    if name in ONE_PROCESS_SYSTEMS and rank != 0:
        return None
    cuda = ctx.device.type == "cuda"
    before = torch.cuda.memory_allocated(ctx.device) if cuda else 0
    trial = Trial(name, build_system(name, ctx), SyntheticTokens(ctx.cfg.vocab_size, args.seed))
    _timed_step(trial, args, rank, ctx.device)
    if cuda:
        trial.resident_bytes = torch.cuda.memory_allocated(ctx.device) - before
    return trial


def profiled_step(
    trial: Trial, args: argparse.Namespace, rank: int, device: torch.device
) -> dict[str, Any]:
    """Run one step under the profiler; return its peak tensor memory and collectives."""
    from torch.profiler import ProfilerActivity, profile

    from bench.fake_world import collective_log

    system = trial.system
    tokens = _tokens(trial, args, rank, device)
    on_cpu = device.type == "cpu"
    baseline = state_bytes(system) if on_cpu else 0
    if not on_cpu:
        torch.cuda.reset_peak_memory_stats(device)
        start_allocated = torch.cuda.memory_allocated(device)
    with collective_log() as logged, profile(
        activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=on_cpu
    ) as prof:
        train_step(system, tokens)
        sync(device)
    events = list(prof.profiler.kineto_results.events())
    if on_cpu:
        peak = baseline + peak_allocated(events)
    else:
        rise = torch.cuda.max_memory_allocated(device) - start_allocated
        peak = trial.resident_bytes + rise
    world_size = dist.get_world_size() if system.distributed else 1
    if args.fake_world:
        comm = count_logged(logged, world_size)
    else:
        param = next(system.module.parameters())
        comm = count_collectives(events, world_size, local_tensor(param).element_size(),
                                 gloo=device.type == "cpu")
    result = {"peak_mem_bytes": int(peak), "comm": comm}
    if system.backend is not None:
        result["wait_s"] = wait_time(events)
    return result


def _synced_step(trial: Trial, device: torch.device):
    """One training step of ``trial`` on a batch, ending in the device sync (marked as the
    bench's wait): what the profiles of a step run."""

    def step(tokens: torch.Tensor) -> None:
        train_step(trial.system, tokens)
        with sync_event():
            sync(device)

    return step


def host_tax(
    trial: Trial, args: argparse.Namespace, rank: int, device: torch.device
) -> dict[str, Any] | None:
    """The host-tax split of the median of ``--host-tax-steps`` profiled steps on this rank
    (:mod:`bench.host_tax`), None where it does not apply or none were asked for."""
    if not args.host_tax_steps or not applies_to(trial.name):
        return None
    trace = None
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        trace = os.path.join(args.trace_dir, f"{trial.name}.rank{rank}.json")
    splits = profile_steps(_synced_step(trial, device), args.host_tax_steps,
                           lambda: _tokens(trial, args, rank, device), trace_path=trace)
    return median_split(splits)


def device_time(
    trial: Trial, args: argparse.Namespace, rank: int, device: torch.device
) -> dict[str, Any] | None:
    """The device time of the median of ``--device-profile-steps`` steps profiled with the
    accelerator's activity (:mod:`bench.device_time`); None on the CPU or where none were
    asked for."""
    if not args.device_profile_steps or device.type == "cpu":
        return None
    return profile_device_steps(_synced_step(trial, device), args.device_profile_steps,
                                lambda: _tokens(trial, args, rank, device))


def finish(trial: Trial, args: argparse.Namespace, rank: int, device: torch.device) -> dict:
    """The rank's result for a system whose timed steps are done: times, losses, profile."""
    result: dict[str, Any] = {
        "times": list(trial.times),
        "losses": list(trial.losses),
        "rounds": list(trial.rounds),
        "notes": list(trial.system.notes),
    }
    if trial.collective_times:
        result["collective_times"] = list(trial.collective_times)
    recompiled = sum(1 for n in trial.compiled[args.warmup :] if n)
    if recompiled:
        result["notes"].append(
            f"{recompiled} timed step(s) compiled new graphs (their times include compilation)"
        )
    profiled = [profiled_step(trial, args, rank, device) for _ in range(args.profiled_steps)]
    result.update(profiled[-1])
    result["peak_mem_bytes"] = max(p["peak_mem_bytes"] for p in profiled)
    if "wait_s" in result:
        result["wait_s"] = statistics.median(p["wait_s"] for p in profiled)
    result["host_tax"] = host_tax(trial, args, rank, device)
    try:  # a diagnostic: the row's timings stand without it
        result["device_time"] = device_time(trial, args, rank, device)
    except Exception as exc:  # noqa: BLE001 - reported in the row's notes
        result["device_time"] = None
        result["notes"].append(f"device profile failed: {describe_exception(exc)}")
    if trial.system.backend is not None:
        result["summary"] = graphshard_summary(trial.system, device)
        if trial.system.backend.plan.step_prefetch:
            from graphshard.api.step_prefetch import stats

            # process-wide counts: the only bench system that binds gathers to the step
            result["step_prefetch"] = stats()
    return result


def _attempt(fn, *args: Any) -> tuple[Any, dict | None]:
    """``fn(*args)``, or None and a ``skipped`` / ``error`` entry (the exception, printed)."""
    try:
        return fn(*args), None
    except PeerUnavailable as exc:
        return None, {"skipped": str(exc)}
    except Exception as exc:  # recorded, and the other systems still run
        traceback.print_exc()
        text = describe_exception(exc)
        if "No module named 'triton'" in text:
            text = f"needs triton, which is not installed here: {text}"
        elif "0 active drivers" in text:  # triton installed, but no GPU for it
            text = f"needs triton and a GPU driver, which triton does not find here: {text}"
        return None, {"error": text}


# ----------------------------------------------------------------------------- the ranks


def _exchange(store: dist.Store, tag: str, rank: int, world: int, payload: Any, wait_s: float):
    """Every rank posts ``payload`` under ``tag`` and gets all ranks' payloads (a barrier)."""
    keys = [f"bench/{tag}/{r}" for r in range(world)]
    store.set(keys[rank], json.dumps(payload))
    store.wait(keys, timedelta(seconds=wait_s))
    return [json.loads(store.get(key)) for key in keys]


def _init_process_group(rank: int, args: argparse.Namespace, store: dist.Store) -> torch.device:
    """Start the default process group: gloo, NCCL on CUDA, or a fake world of N ranks."""
    if args.fake_world:
        from bench.fake_world import init_fake_world

        init_fake_world(args.fake_world, rank=0, device=args.device)
        return torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    timeout = timedelta(seconds=args.timeout)
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        # CPU offload keeps shards and gradients on the host: gloo serves any collective on
        # them, as users of offload set it up (docs/cpu-offload.md); NCCL alone otherwise
        offload = any(is_offload(name) for name in args.systems)
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if offload else "nccl", store=store, rank=rank,
            world_size=args.world_size, timeout=timeout, device_id=device,
        )  # fmt: skip
        return device
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=args.world_size, timeout=timeout
    )
    return torch.device("cpu")


def _configure_dynamo() -> None:
    """Let the systems, which share the model's code objects, compile side by side.

    Each keeps its own static frames: Dynamo's default limit of 8 entries per code object
    would silently send the ninth system to eager, and automatic dynamic shapes would take
    one system's shapes (a sharded weight) differing from another's (the full weight) for a
    shape that changes, and recompile the first system dynamic in its timed steps.
    """
    config = torch._dynamo.config
    config.automatic_dynamic_shapes = False
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 64))
            return


class _Rank:
    """One rank's run of a group of systems that are alive together: warm-up one by one,
    interleaved timed rounds, a profiled step each. Ranks agree on the store after each
    phase, so a system that fails anywhere is dropped everywhere."""

    def __init__(self, rank: int, args: argparse.Namespace, ctx: BenchContext, store):
        self.rank, self.args, self.ctx, self.store = rank, args, ctx, store
        self.wait_s = max(3600.0, 3 * args.timeout)
        self.calls = 0

    def agree(self, payload: Any) -> list[Any]:
        """All processes' payloads (in rank order)."""
        self.calls += 1
        return _exchange(
            self.store, str(self.calls), self.rank, self.args.processes, payload, self.wait_s
        )

    def run(self, names: list[str]) -> dict[str, list[dict]]:
        """Every process's result per system name (see :func:`bench.report.summarize`)."""
        args, rank, device = self.args, self.rank, self.ctx.device
        outcome: dict[str, dict] = {}  # this rank's final entry for a dropped system
        live: dict[str, Trial | None] = {}
        for name in names:
            trial, failure = _attempt(prepare, name, self.ctx, args, rank)
            statuses = self.agree(failure or {})
            if any(statuses):
                outcome[name] = failure or {"error": "stopped: another rank failed"}
            else:
                live[name] = trial
        remaining = args.steps - 1
        for round_ in range(math.ceil(remaining / args.round_steps)):
            steps = min(args.round_steps, remaining)
            remaining -= steps
            failed: dict[str, dict] = {}
            order = list(live)  # rotated every round: no system always runs first
            shift = round_ % max(1, len(order))
            for name in order[shift:] + order[:shift]:
                trial = live[name]
                if trial is None:
                    continue
                for _ in range(steps):
                    _, failure = _attempt(_timed_step, trial, args, rank, device, round_)
                    if failure:
                        failed[name] = failure
                        break
            dropped = {name for entries in self.agree(list(failed)) for name in entries}
            for name in dropped:
                outcome[name] = failed.get(name, {"error": "stopped: another rank failed"})
                del live[name]
        results: dict[str, list[dict]] = {}
        for name in names:
            if name in live:
                trial = live[name]
                if trial is None:
                    entry = {"idle": True}
                else:
                    result, failure = _attempt(finish, trial, args, rank, device)
                    entry = failure or result
            else:
                entry = outcome[name]
            results[name] = self.agree(entry)
        live.clear()
        torch._dynamo.reset()
        gc.collect()
        return results


def _worker(rank: int, args: argparse.Namespace, store_path: str, out_path: str) -> None:
    """One process: run every system (interleaved, or one group per system with
    ``--sequential``); rank 0 writes the records."""
    torch.set_num_threads(args.threads)
    _configure_dynamo()
    store = dist.FileStore(store_path, args.processes)
    device = _init_process_group(rank, args, dist.PrefixStore("pg", store))
    ctx = BenchContext(llama_config(args.model), args.seed, args.lr, device, args.world_size,
                       args.optimizer, args.mixed_precision, args.clip_grad_norm,
                       args.compiler)
    runner = _Rank(rank, args, ctx, store)
    groups = [[name] for name in args.systems] if args.sequential else [args.systems]
    records = []
    try:
        for names in groups:
            for name, per_rank in runner.run(names).items():
                if rank == 0:
                    records.append(summarize(name, per_rank, args.warmup))
                    _progress(records[-1])
        if rank == 0:
            add_ratios(records)
            add_loss_checks(records, trains_alone(bool(args.fake_world)), args.mixed_precision)
            Path(out_path).write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


def _progress(record: dict) -> None:
    median = record["step_s_median"]
    shown = "no timing" if median is None else f"{median * 1e3:.1f} ms/step"
    note = "" if median is not None else f" ({(record['notes'] or '')[:160]})"
    print(f"[bench] {record['system']}: {shown}{note}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the run


def _spawn(args: argparse.Namespace) -> list[dict]:
    """Run the processes; return rank 0's records (one per system)."""
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        out_path = os.path.join(tmp, "records.json")
        mp.start_processes(
            _worker,
            args=(args, os.path.join(tmp, "store"), out_path),
            nprocs=args.processes,
            join=True,
            start_method="spawn",
        )
        return json.loads(Path(out_path).read_text())


def _spawn_cold_warm(args: argparse.Namespace) -> list[dict]:
    """:func:`_spawn` twice on a new, empty Inductor cache directory: the first run's records
    with ``compile_s_warm``, the second run's ``compile_s``, added to each."""
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="bench-inductor-") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # inherited by the spawned ranks
        try:
            cold = _spawn(args)
            warm = {r["system"]: r for r in _spawn(args)}
        finally:
            if previous is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
    for record in cold:
        record["compile_s_warm"] = warm.get(record["system"], {}).get("compile_s")
    return cold


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark: print the table, write ``--json`` and ``--markdown`` where given,
    return the report."""
    args = parse_args(argv)
    cfg = llama_config(args.model)
    num_params = sum(p.numel() for p in _count_model(cfg).parameters())
    param_dtype = MIXED_PRECISION[args.mixed_precision]
    b_param = 4 if param_dtype is None else param_dtype.itemsize
    start, load_start = time.perf_counter(), _load_average()
    records = _spawn(args) if args.compile_cache == "inherit" else _spawn_cold_warm(args)
    report = {
        "machine": {**machine_info(args.device), "load_average": [load_start, _load_average()]},
        "config": {**vars(args), "wall_s": time.perf_counter() - start},
        "reference": {
            "params": num_params,
            "zero3_bytes_per_rank": zero3_bytes(num_params, args.world_size, b_param, 4),
            "b_param": b_param,
            "b_reduce": 4,
            "formula": "(N-1)/N * Psi * (2*b_param + b_reduce), fp32: b = 4, bf16/fp16: b = 2",
        },
        "systems": records,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    table = to_markdown(report)
    if args.markdown:
        Path(args.markdown).write_text(table)
    print(table, flush=True)
    return report


def _load_average() -> float | None:
    """The machine's 1-minute load average (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _count_model(cfg):
    """The unsharded model on the meta device (parameter count only, nothing allocated)."""
    from graphshard.models.llama import Llama

    with torch.device("meta"):
        return Llama(cfg)


if __name__ == "__main__":
    main()
