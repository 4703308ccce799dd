"""Measure this machine for the cost model: collective latency and bandwidth, FLOP rate, copy rate.

``graphshard calibrate`` runs a few timed gloo all-gathers between local ranks and a few
matmuls and copies, fits the α-β model (α from a tiny message, β from a large one), and saves
the result as the ``cpu-gloo`` profile, which then overrides the built-in defaults.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from datetime import date, timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphshard.errors import GraphshardValueError
from graphshard.passes.cost_model import HardwareProfile

__all__ = ["measure_profile"]

_c10d = torch.ops._c10d_functional


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gather_seconds(numel: int, world: int, repeats: int) -> float:
    x = torch.ones(numel)
    group = dist.group.WORLD.group_name

    def run():
        _c10d.wait_tensor(_c10d.all_gather_into_tensor(x, world, group))

    dist.barrier()
    return _timed(run, repeats)


def _rank(rank: int, world: int, store_path: str, out: str, big_bytes: int, repeats: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        small = _gather_seconds(1, world, repeats * 4)
        big = _gather_seconds(big_bytes // 4 // world, world, repeats)
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        matmul = _timed(lambda: torch.mm(a, b), repeats)
        buf = torch.empty(big_bytes // 4)
        copy = _timed(lambda: buf.clone(), repeats)
        if rank == 0:
            torch.save({"small": small, "big": big, "matmul": matmul, "copy": copy,
                        "n": n}, Path(out) / "result.pt")
    finally:
        dist.destroy_process_group()


def measure_profile(
    world_size: int = 2, *, name: str = "cpu-gloo", big_bytes: int = 32 * 2**20, repeats: int = 5
) -> HardwareProfile:
    """Measure a profile with ``world_size`` local gloo ranks (all on this machine)."""
    if world_size < 2:
        raise GraphshardValueError("calibration needs at least 2 ranks to time a collective")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(world_size, os.path.join(tmp, "store"), tmp, big_bytes,
                                        repeats), nprocs=world_size, start_method="spawn")
        r = torch.load(Path(tmp) / "result.pt")
    hops = world_size - 1
    alpha = r["small"] / hops
    wire = max(r["big"] - alpha * hops, 1e-9)
    bandwidth = hops / world_size * big_bytes / wire
    return HardwareProfile(
        name=name,
        alpha_s=alpha,
        bandwidth_Bps=bandwidth,
        peak_flops=2 * r["n"] ** 3 / r["matmul"],
        mem_bandwidth_Bps=2 * big_bytes / r["copy"],
        source=f"measured by graphshard calibrate on {platform.node()} ({world_size} gloo "
        f"ranks, {big_bytes} B all-gather) on {date.today().isoformat()}",
    )
