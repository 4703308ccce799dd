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
  ``graphshard.report.step_summary`` over the compiled graphs; the others from the ``c10d::``
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
import math
import os
import platform
import statistics
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

from bench.systems import SYSTEMS, BenchContext, System, build_system
from graphshard.models.data import SyntheticTokens
from graphshard.models.llama import CONFIGS, llama_config

__all__ = ["main", "parse_args", "to_markdown", "zero3_bytes", "FIELDS"]

# The fields of every system object in the JSON report, in order.
FIELDS: tuple[str, ...] = (
    "system",
    "step_s_median",
    "step_s_p90",
    "compile_s",
    "peak_mem_bytes",
    "collectives_per_step",
    "bytes_per_step",
    "final_loss",
    "predicted_step_s",
    "notes",
)

# c10d op -> (collective kind, index of the argument that holds the full buffer).
_COLLECTIVES: dict[str, tuple[str, int]] = {
    "c10d::_allgather_base_": ("all_gather", 0),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d::allgather_": ("all_gather", 0),
    "c10d::allgather_coalesced_": ("all_gather", 0),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_": ("reduce_scatter", 1),
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::allreduce_coalesced_": ("all_reduce", 0),
    "c10d::broadcast_": ("broadcast", 0),
}
_NOT_COMMUNICATION = {"c10d::barrier", "c10d::monitored_barrier_"}
_DTYPE_BYTES = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
}


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(system: System, tokens: torch.Tensor) -> torch.Tensor:
    """One full step: forward, backward, optimizer step, gradients set to None."""
    loss = system.run(tokens).loss
    loss.backward()
    system.optimizer.step()
    system.optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (FSDP2 parameters and their optimizer state), else ``t``."""
    return getattr(t, "_local_tensor", t)


def state_bytes(system: System) -> int:
    """Bytes of the model state alive now: parameters, buffers, gradients, optimizer state.

    Counted once per storage (shards and views share one), so padding is included.
    """
    module = system.module
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [p.grad for p in module.parameters() if p.grad is not None]
    for state in system.optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    storages: dict[int, int] = {}
    for t in tensors:
        storage = _local(t).untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _peak_allocated(events: list[Any]) -> int:
    """Peak of the running sum of the CPU memory events (allocations +, frees -) in time order."""
    from torch._C._autograd import DeviceType

    memory = [e for e in events if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    running = peak = 0
    for event in sorted(memory, key=lambda e: e.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    return peak


def _numel(shape: Any) -> int:
    """Elements of a recorded shape: a list of ints (one tensor) or nested lists (a list)."""
    if all(isinstance(d, int) for d in shape):
        return math.prod(shape)
    return sum(_numel(s) for s in shape)


def count_collectives(events: list[Any], world_size: int, default_elem: int) -> dict[str, Any]:
    """Count the ``c10d::`` collectives among profiler events and the ring bytes one rank sends.

    ``default_elem`` is the element size used where the profiler records no dtype (tensor-list
    arguments). Returns counts per kind, ``total``, ``bytes`` and any unrecognised c10d ops.
    """
    ring = (world_size - 1) / world_size
    factor = {"all_gather": ring, "reduce_scatter": ring, "broadcast": ring, "all_reduce": 2 * ring}
    counts = dict.fromkeys(factor, 0)
    sent = 0.0
    unrecognised: set[str] = set()
    for event in events:
        name = event.name()
        if not name.startswith("c10d::") or name in _NOT_COMMUNICATION:
            continue
        if name not in _COLLECTIVES:
            unrecognised.add(name)
            continue
        kind, arg = _COLLECTIVES[name]
        counts[kind] += 1
        shapes, dtypes = event.structured_input_shapes(), event.dtypes()
        elem = _DTYPE_BYTES.get(dtypes[arg] if arg < len(dtypes) else "", default_elem)
        if arg < len(shapes):
            sent += factor[kind] * _numel(shapes[arg]) * elem
    return {
        **counts,
        "total": sum(counts.values()),
        "bytes": int(round(sent)),
        "unrecognised": sorted(unrecognised),
    }


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
        _sync(device)
    events = list(prof.profiler.kineto_results.events())
    if on_cpu:
        peak = baseline + _peak_allocated(events)
    else:
        peak = torch.cuda.max_memory_allocated(device)
    world_size = dist.get_world_size() if system.distributed else 1
    param = next(system.module.parameters())
    comm = count_collectives(events, world_size, _local(param).element_size())
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
        _sync(ctx.device)
        return tokens

    times: list[float] = []
    losses: list[float] = []
    for step in range(args.steps):
        tokens = next_batch(step)
        start = time.perf_counter()
        loss = train_step(system, tokens)
        _sync(ctx.device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    result = {"times": times, "losses": losses, "notes": list(system.notes)}
    result.update(profiled_step(system, next_batch(args.steps), ctx.device))
    if system.backend is not None:
        result["summary"] = _graphshard_summary(system, ctx.device)
    return result


def _graphshard_summary(system: System, device: torch.device) -> dict:
    """``step_summary`` of the graphs the graphshard backend compiled, on the matching profile.

    A failure is returned as ``{"error": ...}``: the profiled counts then stand in.
    """
    from graphshard.report import step_summary
    from passes.cost_model import get_profile

    profile = "h100-nvlink" if device.type == "cuda" else "cpu-gloo"
    try:
        summary = step_summary(system.backend.graphs, get_profile(profile))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return {**summary, "profile": profile, "graphs": len(system.backend.graphs)}


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


# ----------------------------------------------------------------------------- the report


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100])."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _timing(ranks: list[dict], warmup: int) -> dict[str, Any]:
    """Step-time statistics (a step takes as long as its slowest rank) and the losses."""
    step_times = [max(ts) for ts in zip(*(res["times"] for res in ranks), strict=True)]
    timed = step_times[warmup:]
    median = statistics.median(timed)
    loss_per_step = [
        statistics.fmean(ls) for ls in zip(*(res["losses"] for res in ranks), strict=True)
    ]
    return {
        "step_s_median": median,
        "step_s_p90": _percentile(timed, 90),
        "compile_s": step_times[0] - median,
        "final_loss": _finite(loss_per_step[-1]),
        "loss_per_step": loss_per_step,
    }


def _communication(ranks: list[dict], notes: list[str]) -> dict[str, Any]:
    """Collectives and bytes per step: graphshard's ``step_summary`` if any, else profiled."""
    comm = [res["comm"] for res in ranks]
    out: dict[str, Any] = {
        "collectives_per_step": max(c["total"] for c in comm),
        "bytes_per_step": max(c["bytes"] for c in comm),
        "comm_profiled": comm[0],
    }
    if any((c["total"], c["bytes"]) != (comm[0]["total"], comm[0]["bytes"]) for c in comm):
        notes.append("profiled collectives differ between ranks; the largest is reported")
    unrecognised = sorted({op for c in comm for op in c["unrecognised"]})
    if unrecognised:
        notes.append(f"c10d ops without a byte rule (counted as 0 bytes): {unrecognised}")
    summary = ranks[0].get("summary")
    if summary is None:
        return out
    if "error" in summary:
        notes.append(f"step_summary failed ({summary['error']}): collectives and bytes are the "
                     "profiled ones, predicted_step_s is missing")
        return out
    out.update(
        collectives_per_step=summary["all_gathers"] + summary["reduce_scatters"],
        bytes_per_step=summary["bytes_sent_per_rank"],
        predicted_step_s=summary["predicted_step_s"],
        graphshard_summary=summary,
    )
    if out["collectives_per_step"] != comm[0]["total"]:
        notes.append(f"step_summary counts {out['collectives_per_step']} collectives, the "
                     f"profiler saw {comm[0]['total']}")
    return out


def summarize(name: str, per_rank: list[dict], warmup: int) -> dict:
    """One system's record from what each rank measured (see :data:`FIELDS`).

    Statistics skip the first ``warmup`` steps. A failure on any rank leaves every number
    None and the ranks' errors in ``notes``.
    """
    record: dict[str, Any] = dict.fromkeys(FIELDS)
    record["system"] = name
    errors = [f"rank {r}: {res['error']}" for r, res in enumerate(per_rank) if "error" in res]
    if errors:
        record["notes"] = "; ".join(["failed", *errors])
        return record
    ranks = [res for res in per_rank if not res.get("idle")]
    notes = list(dict.fromkeys(n for res in ranks for n in res["notes"]))  # unique, in order
    record.update(_timing(ranks, warmup))
    record.update(_communication(ranks, notes))
    record["peak_mem_bytes"] = max(res["peak_mem_bytes"] for res in ranks)
    record["peak_mem_bytes_by_rank"] = [res["peak_mem_bytes"] for res in ranks]
    record["notes"] = "; ".join(notes) or None
    return record


def machine_info(device: str) -> dict[str, Any]:
    """Where the numbers were taken: platform, CPUs, torch version, device name."""
    if device == "cuda":
        name = torch.cuda.get_device_name(0)
    else:
        name = platform.processor() or platform.machine()
        cpuinfo = Path("/proc/cpuinfo")
        if cpuinfo.exists():
            for line in cpuinfo.read_text().splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "device": device,
        "device_name": name,
    }


def zero3_bytes(num_params: int, world_size: int, b_param: int = 4, b_reduce: int = 4) -> float:
    """Bytes one rank sends per ZeRO-3 step: ``(N-1)/N * Psi * (2*b_param + b_reduce)``."""
    return (world_size - 1) / world_size * num_params * (2 * b_param + b_reduce)


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value is not None and base else "n/a"


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value * scale:,.{digits}f}"


def to_markdown(report: dict) -> str:
    """The report as a markdown table, ratios against fsdp2-eager and single-compiled."""
    systems = report["systems"]
    by_name = {s["system"]: s for s in systems}
    fsdp = by_name.get("fsdp2-eager", {})
    single = by_name.get("single-compiled", {})
    cfg = report["config"]
    lines = [
        f"{cfg['model']} ({report['reference']['params']:,} parameters), world size "
        f"{cfg['world_size']}, batch {cfg['batch_size']}x{cfg['seq_len']} per rank, "
        f"{cfg['steps']} steps ({cfg['warmup']} warm-up), {report['machine']['device_name']}, "
        f"torch {report['machine']['torch']}",
        "",
        "| system | median ms | p90 ms | compile s | vs fsdp2-eager | vs single-compiled "
        "| peak mem MiB | mem vs fsdp2-eager | collectives/step | MB sent/rank/step "
        "| final loss | predicted ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in systems:
        median, mem = s["step_s_median"], s["peak_mem_bytes"]
        loss = "n/a" if s["final_loss"] is None else f"{s['final_loss']:.4f}"
        lines.append(
            f"| {s['system']} | {_fmt(median, 1e3)} | {_fmt(s['step_s_p90'], 1e3)} "
            f"| {_fmt(s['compile_s'], 1, 2)} | {_ratio(median, fsdp.get('step_s_median'))} "
            f"| {_ratio(median, single.get('step_s_median'))} | {_fmt(mem, 2**-20, 2)} "
            f"| {_ratio(mem, fsdp.get('peak_mem_bytes'))} "
            f"| {'n/a' if s['collectives_per_step'] is None else s['collectives_per_step']} "
            f"| {_fmt(s['bytes_per_step'], 1e-6, 3)} | {loss} "
            f"| {_fmt(s['predicted_step_s'], 1e3)} |"
        )
    ref = report["reference"]
    measured = by_name.get("graphshard-compiled", {}).get("bytes_per_step")
    lines += [
        "",
        f"ZeRO-3 formula (N-1)/N * Psi * (2*4 + 4) = {ref['zero3_bytes_per_rank']:,.0f} bytes "
        f"per rank per step; graphshard-compiled measured "
        f"{'n/a' if measured is None else f'{measured:,}'} bytes "
        f"({_ratio(measured, ref['zero3_bytes_per_rank'])} of the formula).",
    ]
    noted = [s for s in systems if s["notes"]]
    if noted:
        lines += ["", "Notes:", ""]
        lines += [f"- {s['system']}: {s['notes']}" for s in noted]
    return "\n".join(lines) + "\n"


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
