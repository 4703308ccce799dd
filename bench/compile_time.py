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

Each row gives the first step's seconds and what the caches did: Inductor's FX-graph cache
(``fxgraph_cache_hit``/``miss``) and AOTAutograd's cache (``autograd_cache_*``, which
graphshard's backend uses by default on torch 2.13 and newer; the system
``graphshard-compiled[aot_cache=False]`` turns it off). ``--json`` writes every row, with the
seconds of each compile phase torch records (``phases_s``: Dynamo's tracing, AOTAutograd's,
Inductor's code generation, the C++ compiler, loading cached code) and graphshard's passes
(``pass_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["measure", "main", "table"]

_ROOT = Path(__file__).resolve().parents[1]


def _child(system: str, layers: int, dim: int, world: int, batch: int, seq: int) -> dict:
    """One first forward + backward of ``system`` in this (fresh) process."""
    import torch
    from torch._dynamo.utils import counters

    from bench.fake_world import init_fake_world
    from bench.systems import BenchContext, build_system
    from graphshard.models.llama import llama_config

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    init_fake_world(world)
    cfg = llama_config("llama-small", n_layers=layers, dim=dim, max_seq_len=seq)
    ctx = BenchContext(cfg=cfg, seed=0, lr=1e-3, device=torch.device("cpu"), world_size=world)
    built = build_system(system, ctx)
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    start = time.perf_counter()
    with built.context():
        out = built.run(ids)
        out.loss.backward()
    first = time.perf_counter() - start
    start = time.perf_counter()
    with built.context():
        built.run(ids).loss.backward()
    second = time.perf_counter() - start
    row: dict[str, Any] = {"first_step_s": first, "second_step_s": second,
                           "loss": out.loss.item()}
    for group in ("inductor", "aot_autograd"):
        row.update({k: v for k, v in counters[group].items() if "cache" in k})
    from torch._dynamo.utils import compilation_time_metrics

    row["phases_s"] = {k: round(sum(v), 3) for k, v in compilation_time_metrics.items()
                       if sum(v) >= 0.05}
    if built.backend is not None:
        row["pass_s"] = round(sum(built.backend.pass_seconds.values()), 3)
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
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.layers[0], args.dim, args.world, args.batch,
                                args.seq)))
        return []
    rows = []
    for layers in args.layers:
        for system in args.systems:
            with tempfile.TemporaryDirectory(prefix="compile_time_") as cache:
                for label in ("cold", "warm"):
                    if label == "warm" and "warm" not in args.caches:
                        break
                    row = measure(system, layers, cache, dim=args.dim, world=args.world,
                                  batch=args.batch, seq=args.seq)
                    row["cache"] = label
                    if label in args.caches:
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
