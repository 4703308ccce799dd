"""The ``graphshard`` command: offline graph dumps and machine calibration.

    graphshard dump MODULE:FACTORY --world-size 8 --out DIR
    graphshard calibrate
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _add_plan_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bucketing", choices=["block", "size", "auto"], default="block",
                        help="bucketing strategy (user groups from shard() always kept)")
    parser.add_argument("--bucket-bytes", type=int, default=25 * 2**20,
                        help="byte cap of the 'size' strategy")
    parser.add_argument("--prefetch-depth", type=int, default=1,
                        help="all-gathers issued ahead of the bucket computing")
    parser.add_argument("--max-unsharded-bytes", type=int, default=None,
                        help="cap on gathered bytes alive at once")
    parser.add_argument("--profile", default="cpu-gloo",
                        help="hardware profile: h100-nvlink, h100-infiniband, cpu-gloo, or a "
                        "calibrated one")


def _plan_options(args: argparse.Namespace) -> dict:
    return {
        "bucketing": args.bucketing,
        "bucket_bytes": args.bucket_bytes,
        "prefetch_depth": args.prefetch_depth,
        "max_unsharded_bytes": args.max_unsharded_bytes,
        "profile": args.profile,
    }


def cmd_dump(args: argparse.Namespace) -> int:
    """Trace MODULE:FACTORY offline and write graphs, bucket tables and timelines."""
    from graphshard.offline import load_factory, trace_offline

    sys.path.insert(0, str(Path.cwd()))
    factory = load_factory(args.factory)
    out = Path(args.out)
    start = time.perf_counter()
    graphs = trace_offline(factory, args.world_size, dump_dir=str(out), **_plan_options(args))
    elapsed = time.perf_counter() - start
    print(f"traced {len(graphs)} graph(s) at world size {args.world_size} in {elapsed:.1f} s")
    for table in sorted(out.glob("rank0/graph*/*_schedule.txt")):
        print(f"\n== {table.relative_to(out)}\n{table.read_text()}")
    print(f"graphs, bucket tables and timelines (*.json for ui.perfetto.dev, *.png) in {out}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure this machine and save it as a hardware profile."""
    from graphshard.calibrate import measure_profile
    from passes.cost_model import save_profile

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
                          "write its graphs, bucket table and predicted timeline")
    dump.add_argument("factory", help="MODULE:FACTORY; FACTORY() returns (model, inputs)")
    dump.add_argument("--world-size", type=int, default=8)
    dump.add_argument("--out", required=True, help="output directory")
    _add_plan_options(dump)
    dump.set_defaults(func=cmd_dump)

    calibrate = sub.add_parser("calibrate", help="measure this machine's collectives and "
                               "compute; save as a hardware profile")
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
