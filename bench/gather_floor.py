"""What a step's extra all-gathers cost on this machine's process group, alone and beside compute.

``reshard_after_forward=True`` gathers every bucket again in the backward; ``"auto"`` (where
the model fits) keeps them from the forward. On the CPU the difference between the two rows
of ``bench.step`` is those gathers, and this measures them without the model: N ranks of gloo
all-gather ``--count`` shards of ``--shard-mb`` each, first back to back, then each issued
before ``--matmuls`` matrix products and waited for after them (the prefetch's overlap), and
the products alone. Where the collective's transfer runs on the same cores as the compute
(gloo on a small CPU machine), overlapping hides little of it: the overlapped time minus the
compute alone is the floor any schedule pays for the gathers there.

    python -m bench.gather_floor                       # llama-small's backward re-gathers
    python -m bench.gather_floor --shard-mb 4 --count 8 --world-size 2

The defaults are llama-small's at world 2 (``bench.step``, fp32): ``True`` sends 21.9 MB a
rank a step in 15 collectives, ``"auto"`` 16.0 MB in 11, so the backward's re-gathers are 4
collectives of about 1.475 MB a rank.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _measure(rank: int, world: int, store_path: str, args: argparse.Namespace,
             results: Any) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        numel = max(1, int(args.shard_mb * 1e6) // 4)
        shards = [torch.full((numel,), float(rank * args.count + i)) for i in range(args.count)]
        outs = [torch.empty(numel * world) for _ in range(args.count)]
        a, b = torch.randn(256, 256), torch.randn(256, 1024)

        def gathers() -> None:
            for out, shard in zip(outs, shards, strict=True):
                dist.all_gather_into_tensor(out, shard)

        def overlapped() -> None:
            for out, shard in zip(outs, shards, strict=True):
                work = dist.all_gather_into_tensor(out, shard, async_op=True)
                for _ in range(args.matmuls):
                    a @ b
                work.wait()

        def compute() -> None:
            for _ in range(args.count * args.matmuls):
                a @ b

        timings = {}
        for name, fn in (("gathers_ms", gathers), ("compute_ms", compute),
                         ("overlapped_ms", overlapped)):
            for _ in range(args.warmup):
                fn()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.rounds):
                fn()
            dist.barrier()
            timings[name] = (time.perf_counter() - start) / args.rounds * 1e3
        # every rank's shard arrived in its place (the products do not touch the buffers)
        exact = all(
            torch.equal(out.view(world, numel)[r], torch.full((numel,), float(r * args.count + i)))
            for i, out in enumerate(outs) for r in range(world)
        )
        results[rank] = {**timings, "exact": exact}
    finally:
        dist.destroy_process_group()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Rank 0's timings (ms per round of ``count`` gathers) and whether every gather was exact
    on every rank; ``hidden_ms`` is how much of the gathers the overlap hid."""
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_measure, args=(args.world_size, os.path.join(tmp, "store"), args, results),
                 nprocs=args.world_size)
        ranks = [dict(results[r]) for r in range(args.world_size)]
    report = {key: ranks[0][key] for key in ("gathers_ms", "compute_ms", "overlapped_ms")}
    report["hidden_ms"] = report["gathers_ms"] + report["compute_ms"] - report["overlapped_ms"]
    report["exact"] = all(r["exact"] for r in ranks)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gather_floor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks")
    parser.add_argument("--shard-mb", type=float, default=1.475, help="each gather's shard, MB")
    parser.add_argument("--count", type=int, default=4, help="gathers a round")
    parser.add_argument("--matmuls", type=int, default=4,
                        help="(256x256)@(256x1024) products beside each gather")
    parser.add_argument("--rounds", type=int, default=50, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds first")
    args = parser.parse_args(argv)
    for name in ("world_size", "count", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.shard_mb <= 0 or args.matmuls < 0 or args.warmup < 0:
        parser.error("--shard-mb must be positive, --matmuls and --warmup at least 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure, print one line and return the report."""
    args = parse_args(argv)
    report = measure(args)
    print(f"{args.count} gathers of {args.shard_mb:g} MB shards at world {args.world_size}: "
          f"{report['gathers_ms']:.2f} ms back to back; beside {report['compute_ms']:.2f} ms of "
          f"compute, {report['overlapped_ms']:.2f} ms in all ({report['hidden_ms']:.2f} ms "
          f"hidden); exact: {report['exact']}")
    return report


if __name__ == "__main__":
    main()
