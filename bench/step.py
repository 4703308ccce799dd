"""Side-by-side training-step benchmark: graphshard vs FSDP2, DDP and a single process.

    python -m bench.step --world-size 2 --model llama-small --steps 30 --json out.json \\
        [--markdown out.md] [--device cpu|cuda] [--systems NAME ...] [--batch-size 4] \\
        [--seq-len 128] [--warmup 5]

The command spawns the ranks itself (``torch.multiprocessing``, a ``FileStore``; gloo on the
CPU, NCCL with ``--device cuda``) and runs every system of :data:`bench.systems.SYSTEMS` one
after the other from the same initial model and on the same batches. Per system:

- ``step_s_median`` / ``step_s_p90``: wall time of a full step (forward, backward, optimizer)
  over the steps after warm-up; every step starts after a barrier and a step's time is the
  slowest rank's. ``--steps`` counts all steps, warm-up included.
- ``compile_s``: the first step's time minus the median (first-step overhead; compilation
  for the compiled systems).
- ``peak_mem_bytes``: peak tensor memory of the most loaded rank during one extra profiled
  step after the timed ones. CPU: the model state alive when the step starts (parameters,
  buffers, gradients and optimizer state, unique storages) plus the peak of the running sum
  of the profiler's memory events in time order. CUDA: ``torch.cuda.max_memory_allocated``.
- ``collectives_per_step`` / ``bytes_per_step``: graphshard-compiled from
  ``graphshard.analysis.report.step_summary`` over the compiled graphs; the others from the
  ``c10d::``
  collective ops the profiler records during the profiled step. Bytes are what one rank sends
  on a ring: ``(N-1)/N`` of the full buffer for all-gather, reduce-scatter and broadcast,
  ``2(N-1)/N`` for all-reduce (the profiler records no dtype for tensor-list arguments; those
  are counted at the element size of the model's parameters).
- ``final_loss``: the loss of the last timed step, averaged over the ranks that trained.
- ``predicted_step_s``: graphshard-compiled only, the cost model's forward+backward estimate
  (profile ``cpu-gloo`` on the CPU, ``h100-nvlink`` on CUDA; the optimizer is not modelled).

A system that raises on some rank is recorded with its error in ``notes`` and the others
still run: every rank catches, and the ranks meet on the store (not the process group, whose
pending operations a failure can leave mismatched) before the next system.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.comm import count_collectives, graphshard_summary, zero3_bytes
from bench.memory import local_tensor, peak_allocated, state_bytes
from bench.report import FIELDS, machine_info, summarize, to_markdown
from bench.systems import SYSTEMS, BenchContext, System, build_system
from bench.timing import sync, train_step
from graphshard.models.data import SyntheticTokens
from graphshard.models.llama import CONFIGS, llama_config

__all__ = ["main", "parse_args", "to_markdown", "zero3_bytes", "FIELDS"]


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.step",
        description="Benchmark graphshard against FSDP2, DDP and one process, step by step.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn")
    parser.add_argument("--model", default="llama-small", choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=30, help="steps per system, warm-up included")
    parser.add_argument("--warmup", type=int, default=5, help="untimed first steps (>= 1)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--systems", nargs="+", default=list(SYSTEMS), help=f"subset of: {' '.join(SYSTEMS)}"
    )
    parser.add_argument("--json", required=True, help="write the report here")
    parser.add_argument("--markdown", default=None, help="also write the table here")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads per rank [CPU count / ranks]"
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds a collective may wait"
    )
    args = parser.parse_args(argv)
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, args.world_size))
    args.systems = list(dict.fromkeys(s for item in args.systems for s in item.split(",") if s))
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    if args.world_size < 1:
        parser.error("--world-size must be at least 1")
    if not 1 <= args.warmup < args.steps:
        parser.error("need 1 <= --warmup < --steps (the first step is compile, never timed)")
    max_seq = llama_config(args.model).max_seq_len
    if not 2 <= args.seq_len <= max_seq:
        parser.error(f"--seq-len must be in [2, {max_seq}] for {args.model}")
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        parser.error(f"--device cuda needs {args.world_size} GPUs, found "
                     f"{torch.cuda.device_count()}")
    return args


# ----------------------------------------------------------------------------- measurement


def profiled_step(system: System, tokens: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """Run one step under the profiler; return its peak tensor memory and collectives."""
    from torch.profiler import ProfilerActivity, profile

    on_cpu = device.type == "cpu"
    baseline = state_bytes(system) if on_cpu else 0
    if not on_cpu:
        torch.cuda.reset_peak_memory_stats(device)
    with profile(
        activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=on_cpu
    ) as prof:
        train_step(system, tokens)
        sync(device)
    events = list(prof.profiler.kineto_results.events())
    if on_cpu:
        peak = baseline + peak_allocated(events)
    else:
        peak = torch.cuda.max_memory_allocated(device)
    world_size = dist.get_world_size() if system.distributed else 1
    param = next(system.module.parameters())
    comm = count_collectives(events, world_size, local_tensor(param).element_size())
    return {"peak_mem_bytes": int(peak), "comm": comm}


def run_system(name: str, ctx: BenchContext, args: argparse.Namespace, rank: int) -> dict:
    """Build ``name``, train ``args.steps`` timed steps, then one profiled step, on this rank."""
    if name == "single-compiled" and rank != 0:
        return {"idle": True}
    system = build_system(name, ctx)
    data = SyntheticTokens(ctx.cfg.vocab_size, args.seed)

    def next_batch(step: int) -> torch.Tensor:
        tokens = data.batch(step, rank, args.batch_size, args.seq_len).to(ctx.device)
        if system.distributed:
            dist.barrier()  # every rank starts the step together
        sync(ctx.device)
        return tokens

    times: list[float] = []
    losses: list[float] = []
    for step in range(args.steps):
        tokens = next_batch(step)
        start = time.perf_counter()
        loss = train_step(system, tokens)
        sync(ctx.device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    result = {"times": times, "losses": losses, "notes": list(system.notes)}
    result.update(profiled_step(system, next_batch(args.steps), ctx.device))
    if system.backend is not None:
        result["summary"] = graphshard_summary(system, ctx.device)
    return result


# ----------------------------------------------------------------------------- the ranks


def _exchange(store: dist.Store, tag: str, rank: int, world: int, payload: Any, wait_s: float):
    """Every rank posts ``payload`` under ``tag`` and gets all ranks' payloads (a barrier)."""
    keys = [f"bench/{tag}/{r}" for r in range(world)]
    store.set(keys[rank], json.dumps(payload))
    store.wait(keys, timedelta(seconds=wait_s))
    return [json.loads(store.get(key)) for key in keys]


def _init_process_group(rank: int, args: argparse.Namespace, store: dist.Store, generation: int):
    """Start the default process group (gloo, or NCCL on CUDA) under a fresh key prefix."""
    store = dist.PrefixStore(f"pg{generation}", store)
    timeout = timedelta(seconds=args.timeout)
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=args.world_size, timeout=timeout,
            device_id=device,
        )
        return device
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=args.world_size, timeout=timeout
    )
    return torch.device("cpu")


def _run_isolated(name: str, ctx: BenchContext, args: argparse.Namespace, rank: int) -> dict:
    """``run_system``, with any exception turned into an ``error`` entry (printed here)."""
    try:
        return run_system(name, ctx, args, rank)
    except Exception as exc:  # recorded, and the next system still runs
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    finally:
        torch._dynamo.reset()
        gc.collect()


def _worker(rank: int, args: argparse.Namespace, store_path: str, out_path: str) -> None:
    """One rank: run every system, meet the other ranks on the store after each.

    After a failure the process group is replaced by a new one: a rank that failed alone
    leaves the others timed out in a collective, and gloo then closes the connections.
    """
    torch.set_num_threads(args.threads)
    store = dist.FileStore(store_path, args.world_size)
    generation = 0
    device = _init_process_group(rank, args, store, generation)
    ctx = BenchContext(llama_config(args.model), args.seed, args.lr, device, args.world_size)
    wait_s = max(3600.0, 3 * args.timeout)
    records = []
    try:
        for name in args.systems:
            result = _run_isolated(name, ctx, args, rank)
            per_rank = _exchange(store, name, rank, args.world_size, result, wait_s)
            if rank == 0:
                records.append(summarize(name, per_rank, args.warmup))
                _progress(records[-1])
            if any("error" in res for res in per_rank):
                dist.destroy_process_group()
                generation += 1
                _init_process_group(rank, args, store, generation)
        if rank == 0:
            Path(out_path).write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


def _progress(record: dict) -> None:
    median = record["step_s_median"]
    shown = "failed" if median is None else f"{median * 1e3:.1f} ms/step"
    print(f"[bench] {record['system']}: {shown}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the run


def _spawn(args: argparse.Namespace) -> list[dict]:
    """Run the ranks; return rank 0's records (one per system)."""
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        out_path = os.path.join(tmp, "records.json")
        mp.start_processes(
            _worker,
            args=(args, os.path.join(tmp, "store"), out_path),
            nprocs=args.world_size,
            join=True,
            start_method="spawn",
        )
        return json.loads(Path(out_path).read_text())


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark: write ``--json`` (and ``--markdown``), print the table, return it."""
    args = parse_args(argv)
    cfg = llama_config(args.model)
    num_params = sum(p.numel() for p in _count_model(cfg).parameters())
    start = time.perf_counter()
    records = _spawn(args)
    report = {
        "machine": machine_info(args.device),
        "config": {**vars(args), "wall_s": time.perf_counter() - start},
        "reference": {
            "params": num_params,
            "zero3_bytes_per_rank": zero3_bytes(num_params, args.world_size),
            "formula": "(N-1)/N * Psi * (2*b_param + b_reduce), fp32: b = 4",
        },
        "systems": records,
    }
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    table = to_markdown(report)
    if args.markdown:
        Path(args.markdown).write_text(table)
    print(table, flush=True)
    return report


def _count_model(cfg):
    """The unsharded model on the meta device (parameter count only, nothing allocated)."""
    from graphshard.models.llama import Llama

    with torch.device("meta"):
        return Llama(cfg)


if __name__ == "__main__":
    main()
