"""The graphshard command: offline graph dumps, what-if plans, machine calibration.

    graphshard dump MODULE:FACTORY --world-size 8 --out DIR [--tp 2]
    graphshard plan --model llama3-8b --world-size 8,64,512,1024 --profile h100-nvlink
    graphshard plan --model llama3-70b --world-size 1024 --tp 8   # (dp, tp) = (128, 8)
    graphshard plan --model llama3-8b --world-size 8 --memory-budget 40GiB   # keep/free per bucket
    graphshard calibrate
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__all__ = ["main"]


TP_HELP = (
    "tensor-parallel degree (default 1: none). The world size counts all ranks, dp x tp: "
    "--world-size 1024 --tp 8 is a (dp, tp) = (128, 8) mesh; tp must divide it. The model is "
    "parallelize_module'd on mesh['tp'] with its plan (Llama presets: "
    "graphshard.models.llama.tensor_parallel_plan; MODULE:FACTORY: FACTORY returns (model, "
    "inputs, tp_plan)), then sharded over mesh['dp']; the inputs are one dp rank's"
)


def _memory_budget(text: str) -> int:
    """``--memory-budget``: bytes, as ``graphshard.backend(memory_budget=...)`` takes them."""
    from graphshard.errors import GraphshardError
    from graphshard.passes.plan import parse_bytes

    try:
        return parse_bytes(int(text) if text.isdigit() else text, "--memory-budget")
    except GraphshardError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _reshard(text: str) -> bool | int:
    """``--reshard-after-forward``: true, false, or ``k``, the ranks of a group."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(
        f"expected true, false or a positive int k (the backward gathers within groups of k "
        f"ranks, e.g. the 8 GPUs of a node), got {text!r}")


def _shard_options(args: argparse.Namespace) -> dict:
    """``graphshard.shard`` options of the trace: ``--memory-budget`` shards with
    ``reshard_after_forward="auto"``; ``--reshard-after-forward`` sets it."""
    if args.memory_budget is not None and args.reshard_after_forward is not None:
        raise SystemExit("graphshard: --memory-budget chooses reshard_after_forward per "
                         "bucket ('auto'); leave --reshard-after-forward out with it")
    if args.memory_budget is not None:
        return {"reshard_after_forward": "auto"}
    if args.reshard_after_forward is not None:
        return {"reshard_after_forward": args.reshard_after_forward}
    return {}


def _add_plan_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=1, help=TP_HELP)
    parser.add_argument("--bucketing", choices=["block", "size", "auto"], default="block",
                        help="bucketing strategy (user groups from shard() always kept)")
    parser.add_argument("--bucket-bytes", type=int, default=25 * 2**20,
                        help="byte cap of the 'size' strategy")
    parser.add_argument("--prefetch-depth", type=int, default=1,
                        help="all-gathers issued ahead of the bucket computing")
    parser.add_argument("--max-unsharded-bytes", type=int, default=None,
                        help="cap on gathered bytes alive at once")
    parser.add_argument("--reshard-after-forward", default=None, type=_reshard,
                        help="shard(reshard_after_forward=...): true (default), false, or k: "
                        "the backward gathers within groups of k ranks (a node's GPUs; "
                        "price it with --profile h100-cluster)")
    parser.add_argument("--memory-budget", default=None, type=_memory_budget,
                        help="bytes of memory per rank (e.g. 40GiB, 80GB, 42949672960): shard "
                        "with reshard_after_forward='auto' and let the compiler keep or free "
                        "each bucket to fit it; prints the choice per bucket and the predicted "
                        "peak")
    parser.add_argument("--all-gather-via", choices=["flat", "coalesced"], default="flat",
                        help="gather a bucket through one flat buffer, or by one coalesced "
                        "all-gather of its shards as they are (no copy in or out)")
    parser.add_argument("--reduce-scatter-via",
                        choices=["auto", "reduce_scatter", "all_to_all", "coalesced"],
                        default="auto", help="how a bucket's gradients are reduce-scattered "
                        "(coalesced: each gradient where it lives, no copy into a buffer)")
    parser.add_argument("--profile", default="cpu-gloo",
                        help="hardware profile: h100-nvlink, h100-infiniband, h100-cluster "
                        "(nodes of 8: NVLink within, InfiniBand between), cpu-gloo, or a "
                        "calibrated one")


def _plan_options(args: argparse.Namespace) -> dict:
    return {
        "bucketing": args.bucketing,
        "bucket_bytes": args.bucket_bytes,
        "prefetch_depth": args.prefetch_depth,
        "max_unsharded_bytes": args.max_unsharded_bytes,
        "profile": args.profile,
        "all_gather_via": args.all_gather_via,
        "reduce_scatter_via": args.reduce_scatter_via,
        "tp": args.tp,
        **({} if args.memory_budget is None else {"memory_budget": args.memory_budget}),
    }


def cmd_dump(args: argparse.Namespace) -> int:
    """Trace MODULE:FACTORY offline and write graphs, bucket tables and timelines."""
    from graphshard.tools.offline import load_factory, mesh_shape, trace_offline

    dp, tp = mesh_shape(args.world_size, args.tp)
    sys.path.insert(0, str(Path.cwd()))
    factory = load_factory(args.factory)
    out = Path(args.out)
    start = time.perf_counter()
    graphs = trace_offline(factory, args.world_size, dump_dir=str(out),
                           shard_options=_shard_options(args) or None, **_plan_options(args))
    elapsed = time.perf_counter() - start
    mesh = f" ((dp, tp) = ({dp}, {tp}))" if tp > 1 else ""
    print(f"traced {len(graphs)} graph(s) at world size {args.world_size}{mesh} in "
          f"{elapsed:.1f} s")
    for table in sorted(out.glob("rank0/graph*/*_schedule.txt")):
        print(f"\n== {table.relative_to(out)}\n{table.read_text()}")
    print(f"graphs, bucket tables and timelines (*.json for ui.perfetto.dev, *.png) in {out}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Size up a model at several world sizes from fake-tensor traces."""
    import json
    import os

    from graphshard.tools.offline import mesh_shape
    from graphshard.tools.whatif import (
        format_reshard_choices,
        format_table,
        plan_many,
        resolve_factory,
        rows_as_dicts,
        symbolic_report,
    )

    sizes = [int(n) for n in args.world_size.split(",")]
    for n in sizes:  # fail before tracing: tp divides every world size, splits the model
        mesh_shape(n, args.tp)
    resolve_factory(args.model, args.batch_size, args.seq_len, args.tp)
    jobs = args.jobs or min(len(sizes), os.cpu_count() or 1)
    options = {**_plan_options(args), "shard_options": _shard_options(args) or None}
    rows = []
    for row in plan_many(args.model, args.batch_size, args.seq_len, sizes, options, jobs):
        rows.append(row)
        mesh = f" (dp {row.dp} x tp {row.tp})" if row.tp > 1 else ""
        print(f"N={row.world_size}{mesh}: traced in {row.trace_s:.1f} s (passes "
              f"{row.passes_s:.1f} s)", flush=True)
    print(f"\n{args.model} on {args.profile}, memory per rank, bytes per rank and step\n")
    print(format_table(rows))
    if args.memory_budget is not None:
        from graphshard.passes.auto_reshard import format_bytes

        print(f"reshard_after_forward='auto' within --memory-budget "
              f"{format_bytes(args.memory_budget)} per rank (predicted by the cost model)\n")
        print(format_reshard_choices(rows))
    if args.symbolic:
        print(symbolic_report(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows_as_dicts(rows), indent=2))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure this machine and save it as a hardware profile."""
    from graphshard.passes.cost_model import save_profile
    from graphshard.tools.calibrate import measure_profile

    profile = measure_profile(args.world_size, name=args.name, big_bytes=args.bytes)
    path = save_profile(profile)
    print(f"alpha {profile.alpha_s * 1e6:.1f} us/hop, bandwidth "
          f"{profile.bandwidth_Bps / 1e9:.2f} GB/s, matmul {profile.peak_flops / 1e9:.1f} "
          f"GFLOP/s, copy {profile.mem_bandwidth_Bps / 1e9:.2f} GB/s")
    print(f"saved profile {profile.name!r} to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``graphshard`` command."""
    parser = argparse.ArgumentParser(prog="graphshard", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    dump = sub.add_parser("dump", help="trace a model offline (fake ranks and tensors) and "
                          "write its graphs before and after every pass, bucket tables and "
                          "predicted timelines (Perfetto JSON and PNG); see docs/dumps.md")
    dump.add_argument("factory", help="MODULE:FACTORY; FACTORY() returns (model, inputs), or "
                      "(model, inputs, tp_plan) for --tp")
    dump.add_argument("--world-size", type=int, default=8,
                      help="ranks in all (dp x tp with --tp)")
    dump.add_argument("--out", required=True, help="output directory")
    _add_plan_options(dump)
    dump.set_defaults(func=cmd_dump)

    plan = sub.add_parser("plan", help="what-if: per-rank memory, traffic and predicted step "
                          "time at several world sizes, from fake-tensor traces and the cost "
                          "model; see docs/cost-model.md")
    plan.add_argument("--model", default="llama3-8b",
                      help="a preset of graphshard.models.llama (llama3-8b, llama3-70b, ...) "
                      "or MODULE:FACTORY")
    plan.add_argument("--world-size", default="8,64,512,1024",
                      help="comma-separated world sizes, each counting all ranks (dp x tp "
                      "with --tp: --world-size 1024 --tp 8 is dp 128)")
    plan.add_argument("--batch-size", type=int, default=1,
                      help="sequences per dp rank (presets; the tp ranks of one dp rank share "
                      "them)")
    plan.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (presets)")
    plan.add_argument("--symbolic", action="store_true",
                      help="also print bytes and memory as formulas in N, checked")
    plan.add_argument("--json", default=None, help="write the rows as JSON here")
    plan.add_argument("--jobs", type=int, default=0,
                      help="world sizes traced at once, each in its own process "
                      "(default: one per CPU core)")
    _add_plan_options(plan)
    plan.set_defaults(func=cmd_plan, profile="h100-nvlink")

    calibrate = sub.add_parser("calibrate", help="measure this machine's gloo collectives and "
                               "compute; save them as the hardware profile --name "
                               "(default cpu-gloo, whose built-in figures they then "
                               "override); see docs/cost-model.md")
    calibrate.add_argument("--world-size", type=int, default=2)
    calibrate.add_argument("--name", default="cpu-gloo")
    calibrate.add_argument("--bytes", type=int, default=32 * 2**20,
                           help="size of the large all-gather that measures bandwidth")
    calibrate.set_defaults(func=cmd_calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``graphshard`` command."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
