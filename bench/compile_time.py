"""Compile time: the first forward + backward of a system, cold and warm, by model depth.

Why a command of its own: compile time depends on what the process has already compiled and
on what the Inductor cache directory holds, so every measurement here runs in a fresh Python
process (``python -m bench.compile_time --child ...``) on a fake world
(:mod:`bench.fake_world`, no other process needed), one first step per process:

- ``cold``: a new, empty ``TORCHINDUCTOR_CACHE_DIR`` (what the first launch of a job pays,
  Inductor's one-off CPU ISA probing included);
- ``warm``: a second fresh process on the same cache directory (a restart of the same job:
  same code, model, world size and options).

Usage (the compile-time-versus-depth table; dim-256 Llama, fake world 8)::

    python -m bench.compile_time --layers 2 8 16 \\
        --systems graphshard-compiled fsdp2-compiled single-compiled --caches cold warm

``--gloo-ranks N`` measures instead one compilation shared by N real gloo ranks (the
backend's ``share_compiled``): cold, each rank compiling in its own process
(``TORCHINDUCTOR_COMPILE_THREADS=1``, so that the C++ compiler's CPU time is counted), each
rank's CPU seconds in its first step and their sum; ``--gloo-cache shared`` puts every rank
on one cache directory (one host), ``per-rank`` each on its own (ranks on different hosts)::

    python -m bench.compile_time --gloo-ranks 2 --layers 16 --gloo-cache per-rank shared \
        --systems 'graphshard-compiled[share_compiled=False]' graphshard-compiled

Each row gives the first step's seconds and what the caches did: Inductor's FX-graph cache
(``fxgraph_cache_hit``/``miss``) and AOTAutograd's cache (``autograd_cache_*``, which
graphshard's backend uses by default on torch 2.13 and newer; the system
``graphshard-compiled[aot_cache=False]`` turns it off). ``--json`` writes every row, with the
seconds of each compile phase torch records (``phases_s``: Dynamo's tracing, AOTAutograd's,
Inductor's code generation, the C++ compiler, loading cached code) and graphshard's passes
(``pass_s``); ``--phases N`` also prints the N phases with the most seconds, one column per
measurement, to show where the time went (what grows with depth, what sets a system apart).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["measure", "main", "phase_table", "table"]

_ROOT = Path(__file__).resolve().parents[1]


def _cpu_seconds() -> float:
    """CPU seconds of this process and of the children it has waited for (the C++ compiler
    runs, with ``TORCHINDUCTOR_COMPILE_THREADS=1`` all of Inductor's compiles)."""
    import resource

    own, children = (resource.getrusage(who) for who in
                     (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _child(system: str, layers: int, dim: int, world: int, batch: int, seq: int,
           gloo: bool = False) -> dict:
    """One first forward + backward of ``system`` in this (fresh) process: a rank of a fake
    world, or with ``gloo`` a real rank of a gloo group (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``MASTER_PORT`` in the environment)."""
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from bench.fake_world import init_fake_world
    from bench.systems import BenchContext, build_system
    from graphshard.models.llama import llama_config

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if gloo:
        dist.init_process_group("gloo")
        world = dist.get_world_size()
    else:
        init_fake_world(world)
    cfg = llama_config("llama-small", n_layers=layers, dim=dim, max_seq_len=seq)
    ctx = BenchContext(cfg=cfg, seed=0, lr=1e-3, device=torch.device("cpu"), world_size=world)
    built = build_system(system, ctx)
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    start, cpu = time.perf_counter(), _cpu_seconds()
    with built.context():
        out = built.run(ids)
        out.loss.backward()
    first, first_cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    start = time.perf_counter()
    with built.context():
        built.run(ids).loss.backward()
    second = time.perf_counter() - start
    row: dict[str, Any] = {"first_step_s": first, "second_step_s": second,
                           "first_step_cpu_s": round(first_cpu, 2), "loss": out.loss.item()}
    for group in ("inductor", "aot_autograd"):
        row.update({k: v for k, v in counters[group].items() if "cache" in k})
    from torch._dynamo.utils import compilation_time_metrics

    row["phases_s"] = {k: round(sum(v), 3) for k, v in compilation_time_metrics.items()
                       if sum(v) >= 0.05}
    row["cxx_compiles"] = len(compilation_time_metrics.get("compile_file", []))
    if built.backend is not None:
        row["pass_s"] = round(sum(built.backend.pass_seconds.values()), 3)
        share = getattr(built.backend, "share", None)
        if share is not None:
            stats = share.stats
            row["share"] = {"published": stats.published, "loaded": stats.loaded,
                            "compiled_alone": stats.compiled_alone}
    if gloo:
        dist.barrier()
        dist.destroy_process_group()
    return row


def measure(system: str, layers: int, cache_dir: str, *, dim: int = 256, world: int = 8,
            batch: int = 2, seq: int = 64, env: dict[str, str] | None = None) -> dict:
    """The first step of ``system`` at ``layers`` layers in a fresh process on ``cache_dir``."""
    environment = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir,
                       PYTHONPATH=os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]))
    environment.update(env or {})
    cmd = [sys.executable, "-m", "bench.compile_time", "--child", system, "--layers", str(layers),
           "--dim", str(dim), "--world", str(world), "--batch", str(batch), "--seq", str(seq)]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=environment, capture_output=True, text=True, cwd=_ROOT)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{system} at {layers} layers failed:\n{done.stderr[-4000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row.update(system=system, layers=layers, process_s=round(wall, 2))
    return row


def measure_gloo(system: str, layers: int, cache_dir: str, *, ranks: int = 2, dim: int = 256,
                 batch: int = 2, seq: int = 64, per_rank_cache: bool = False) -> dict:
    """The first step of ``system`` on ``ranks`` real gloo processes sharing ``cache_dir``
    (the ranks of one host), or each on a directory of its own inside it
    (``per_rank_cache``: ranks on different hosts), each compiling in its own process
    (``TORCHINDUCTOR_COMPILE_THREADS=1``) so that its CPU seconds are all counted. The row
    holds every rank's first step and CPU seconds, and their sum."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, TORCHINDUCTOR_COMPILE_THREADS="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(ranks),
                PYTHONPATH=os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "bench.compile_time", "--child", system, "--gloo",
           "--layers", str(layers), "--dim", str(dim), "--batch", str(batch), "--seq", str(seq)]
    dirs = [os.path.join(cache_dir, f"rank{rank}") if per_rank_cache else cache_dir
            for rank in range(ranks)]
    procs = [subprocess.Popen(cmd, cwd=_ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              env=dict(base, RANK=str(rank), TORCHINDUCTOR_CACHE_DIR=dirs[rank]))
             for rank in range(ranks)]
    outs = [proc.communicate() for proc in procs]
    for rank, (proc, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        if proc.returncode != 0:
            raise RuntimeError(f"{system} at {layers} layers, rank {rank} failed:\n{err[-4000:]}")
    per_rank = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    return {"system": system, "layers": layers, "ranks": per_rank,
            "cache": "per rank" if per_rank_cache else "shared",
            "first_step_s": max(r["first_step_s"] for r in per_rank),
            "cpu_s_sum": round(sum(r["first_step_cpu_s"] for r in per_rank), 2)}


def gloo_table(rows: list[dict]) -> str:
    """A markdown table of :func:`measure_gloo` rows: each rank's CPU seconds, their sum, and
    the sum over one rank's compilation: the busiest rank of any cold launch of the same
    depth (a rank that compiled everything itself, whichever row and cache it was in)."""
    lines = ["| system | cache directory | start | layers | first fwd+bw s | CPU s per rank | "
             "CPU s summed | summed / one rank compiling alone |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        one = max(r["first_step_cpu_s"] for cold in rows
                  if cold["layers"] == row["layers"] and cold.get("start", "cold") == "cold"
                  for r in cold["ranks"])
        cpu = " / ".join(f"{r['first_step_cpu_s']:.1f}" for r in row["ranks"])
        lines.append(f"| {row['system']} | {row['cache']} | {row.get('start', 'cold')} "
                     f"| {row['layers']} "
                     f"| {row['first_step_s']:.1f} | {cpu} "
                     f"| {row['cpu_s_sum']:.1f} | {row['cpu_s_sum'] / one:.2f} |")
    return "\n".join(lines)


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    return (f"{row['first_step_s']:.1f} (fx {row.get('fxgraph_cache_hit', 0)}h/"
            f"{row.get('fxgraph_cache_miss', 0)}m, aot {row.get('autograd_cache_hit', 0)}h/"
            f"{row.get('autograd_cache_miss', 0)}m)")


def table(rows: list[dict]) -> str:
    """A markdown table: one line per (system, layers), the cold and warm first steps."""
    lines = ["| system | layers | cold first fwd+bw s | warm first fwd+bw s |",
             "|---|---|---|---|"]
    keys = dict.fromkeys((r["system"], r["layers"]) for r in rows)
    for system, layers in keys:
        cells = {r["cache"]: r for r in rows if (r["system"], r["layers"]) == (system, layers)}
        lines.append(f"| {system} | {layers} | {_cell(cells.get('cold'))} "
                     f"| {_cell(cells.get('warm'))} |")
    return "\n".join(lines)


def phase_table(rows: list[dict], top: int) -> str:
    """A markdown table of where the first steps' seconds went: torch's compile phases
    (``phases_s``; nested phases overlap, so a column does not sum to the step) and the C++
    compiles, one column per row measured, the ``top`` phases with the most seconds in any
    column, largest first. What grows with depth, or sets one system apart, shows as a
    phase whose row grows from column to column."""
    totals: dict[str, float] = {}
    for row in rows:
        for phase, seconds in row.get("phases_s", {}).items():
            totals[phase] = max(totals.get(phase, 0.0), seconds)
    phases = sorted(totals, key=lambda phase: -totals[phase])[:top]
    heads = [f"{row['system']} {row['layers']}L {row.get('cache', row.get('start', ''))}".strip()
             for row in rows]
    lines = ["| phase (s) | " + " | ".join(heads) + " |",
             "|---|" + "---:|" * len(rows),
             "| C++ compiles | " + " | ".join(str(row.get("cxx_compiles", "")) for row in rows)
             + " |"]
    lines += [f"| {phase} | " + " | ".join(f"{row.get('phases_s', {}).get(phase, 0.0):.2f}"
                                            for row in rows) + " |" for phase in phases]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    """Parse ``argv``, measure every (system, depth) cold and/or warm, print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.compile_time",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", metavar="SYSTEM", help=argparse.SUPPRESS)
    parser.add_argument("--systems", nargs="+",
                        default=["graphshard-compiled", "fsdp2-compiled", "single-compiled"])
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 8, 16])
    parser.add_argument("--caches", nargs="+", choices=["cold", "warm"], default=["cold"],
                        help="cold: an empty cache directory; warm: a second process on it")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--world", type=int, default=8, help="fake world size")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--gloo", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-ranks", type=int, default=0, metavar="N",
                        help="instead: N real gloo ranks (cold, and warm: a second launch "
                             "on the same directories, with --caches), each rank's CPU "
                             "seconds and their sum")
    parser.add_argument("--gloo-cache", nargs="+", choices=["per-rank", "shared"],
                        default=["shared"], help="with --gloo-ranks: one cache directory for "
                        "all ranks (one host) and/or one per rank (ranks on different hosts)")
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--phases", type=int, default=0, metavar="N",
                        help="also print the N compile phases with the most seconds, one "
                             "column per measurement (where the time went)")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.layers[0], args.dim, args.world, args.batch,
                                args.seq, gloo=args.gloo)))
        return []
    rows: list[dict] = []
    if args.gloo_ranks:
        for layers in args.layers:
            for system in args.systems:
                for where in args.gloo_cache:
                    rows += _cold_then_warm(args.caches, "start", functools.partial(
                        measure_gloo, system, layers, ranks=args.gloo_ranks, dim=args.dim,
                        batch=args.batch, seq=args.seq, per_rank_cache=where == "per-rank"))
        return _report(rows, gloo_table(rows), args.json)
    for layers in args.layers:
        for system in args.systems:
            rows += _cold_then_warm(args.caches, "cache", functools.partial(
                measure, system, layers, dim=args.dim, world=args.world, batch=args.batch,
                seq=args.seq))
    text = table(rows)
    if args.phases:
        text += "\n\n" + phase_table(rows, args.phases)
    return _report(rows, text, args.json)


def _cold_then_warm(caches: list[str], label_key: str, measure_on: Any) -> list[dict]:
    """``measure_on(directory)`` on a new cache directory (cold), then again on the same one
    (warm, a restart) where ``caches`` asks for it: the rows asked for, each labelled."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="compile_time_") as cache:
        for label in ("cold", "warm"):
            if label == "warm" and "warm" not in caches:
                break
            row = measure_on(cache)
            row[label_key] = label
            if label in caches:
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def _report(rows: list[dict], text: str, json_path: str | None) -> list[dict]:
    print(text)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
