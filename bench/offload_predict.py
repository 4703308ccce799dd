"""Predict a CPU-offload step's forward and backward on a GPU profile, without a GPU.

Traces a Llama sharded with ``CPUOffload`` on fake tensors of a stand-in accelerator (this
process registers it: run this module on its own) and replays each compiled graph in the
simulator (:mod:`graphshard.passes.simulate`): compute from FLOPs and bytes, the copies
between host and device over the profile's host link, on the compute stream or on copy
streams of their own. One row per setting:

    python -m bench.offload_predict --model llama-1b --batch-size 2 --seq-len 1024 \
        --mixed-precision bf16 --profile h100-nvlink

It prices what the graph moves and computes, not the host: no optimizer step, no Python
overhead, no allocator. Compare settings with it; time them on the GPU.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

# name, backend options, reshard_after_forward. The copy streams are on by default; the
# "compute stream" rows turn both off (every copy on the compute stream).
_SERIAL = {"grad_copy_stream": False, "shard_copy_stream": False}
SETTINGS: list[tuple[str, dict[str, Any], bool | str]] = [
    ("compute stream", _SERIAL, True),
    ("copy streams (default)", {}, True),
    ('"auto", compute stream', _SERIAL, "auto"),
    ('"auto" + copy streams', {}, "auto"),
]


def predict(model: str, batch_size: int, seq_len: int, world_size: int, profile: str,
            mixed_precision: str | None, options: dict[str, Any],
            reshard_after_forward: bool | str) -> dict[str, float]:
    """Predicted milliseconds of the forward and backward graphs, their compute, their
    host-device copies, and compute's stalls on copies, for one setting."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    import graphshard
    from graphshard.models.llama import Llama, llama_config
    from graphshard.passes.cost_model import get_profile
    from graphshard.passes.simulate import simulate
    from graphshard.tools.offline import fake_process_group, register_fake_accelerator

    device = register_fake_accelerator()
    torch._dynamo.reset()
    mp = None
    if mixed_precision is not None:
        mp = graphshard.MixedPrecision(param_dtype=getattr(torch, mixed_precision),
                                       reduce_dtype=torch.float32)
    with fake_process_group(world_size):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        cfg = llama_config(model)
        mesh = init_device_mesh(device, (world_size,))
        with mode:
            net = Llama(cfg)  # built on the host, as offloaded models are
            graphshard.shard(net, mesh, offload=graphshard.CPUOffload(), mixed_precision=mp,
                             reshard_after_forward=reshard_after_forward)
        backend = graphshard.backend(inductor=False, profile=profile, **options)
        compiled = torch.compile(net, backend=backend, fullgraph=True)
        with mode:
            tokens = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), device=device)
            compiled(tokens).loss.backward()
    hardware = get_profile(profile)
    out: dict[str, float] = {}
    for stage in ("fw", "bw"):
        timeline = simulate(backend.graphs[-1][stage], hardware, world_size=world_size)
        out[stage] = timeline.total_time * 1e3
        for key in ("compute_time", "copy_time", "exposed_copy"):
            out[key] = out.get(key, 0.0) + getattr(timeline, key) * 1e3
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Print (and return) one predicted row per setting of :data:`SETTINGS`."""
    from bench.systems import sequence_length
    from graphshard.models.llama import CONFIGS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b", choices=list(CONFIGS))
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=None,
                        help="default: 1024, or the model's longest where that is shorter")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--profile", default="h100-nvlink")
    parser.add_argument("--mixed-precision", choices=["bf16", "fp16"], default=None)
    args = parser.parse_args(argv)
    args.seq_len = sequence_length(parser, args.model, args.seq_len, 1024)
    dtype = {"bf16": "bfloat16", "fp16": "float16", None: None}[args.mixed_precision]
    print(f"{args.model}, world {args.world_size}, batch {args.batch_size}x{args.seq_len}, "
          f"{args.mixed_precision or 'fp32'}, CPUOffload, profile {args.profile} (predicted ms)")
    print("| setting | forward | backward | forward + backward | compute | host-device "
          "copies | compute waiting on copies |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for name, options, reshard in SETTINGS:
        row = predict(args.model, args.batch_size, args.seq_len, args.world_size,
                      args.profile, dtype, options, reshard)
        rows.append({"setting": name, **row})
        print(f"| {name} | {row['fw']:.1f} | {row['bw']:.1f} | {row['fw'] + row['bw']:.1f} | "
              f"{row['compute_time']:.1f} | {row['copy_time']:.1f} | {row['exposed_copy']:.1f} |",
              flush=True)
    return rows


if __name__ == "__main__":
    main()
