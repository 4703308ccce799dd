"""A training script in the usual FSDP2 shape; ``--impl graphshard`` swaps in graphshard's calls.

    torchrun --nproc-per-node 2 examples/from_fsdp2.py --impl fsdp2
    torchrun --nproc-per-node 2 examples/from_fsdp2.py --impl graphshard
    torchrun --nproc-per-node 2 examples/from_fsdp2.py --impl graphshard --resume ckpt/step_2

FSDP2's ``fully_shard`` per block and on the root with a ``MixedPrecisionPolicy``, or
graphshard's one ``shard`` call with the blocks as buckets and ``MixedPrecision``: the two
differ only in :func:`parallelize`. Everything else (the mesh, the optimizer,
``clip_grad_norm_``, DCP checkpoints through ``torch.distributed.checkpoint``) is the same
code, because both make every parameter a ``DTensor`` sharded on dim 0. A checkpoint one
writes, the other loads. See docs/migrating-from-fsdp2.md.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import graphshard
from graphshard.models.data import SyntheticTokens
from graphshard.models.llama import Llama, llama_config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parallelize(model: Llama, mesh, impl: str, param_dtype: torch.dtype, compile: bool):
    """The only lines that differ. Returns the module to call for a step."""
    if impl == "fsdp2":
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return torch.compile(model) if compile else model
    mp = graphshard.MixedPrecision(param_dtype=param_dtype, reduce_dtype=torch.float32)
    graphshard.shard(model, mesh, buckets=list(model.layers), mixed_precision=mp)
    return torch.compile(model, backend="graphshard") if compile else model


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impl", choices=["fsdp2", "graphshard"], default="graphshard")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=10, help="last step (counting from 1)")
    parser.add_argument("--param-dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--no-compile", action="store_true", help="run eagerly")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl)")
    parser.add_argument("--checkpoint-dir", default=None, help="dcp.save every --save-every")
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--resume", default=None, help="a directory dcp.save wrote")
    args = parser.parse_args(argv)

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world_size,))

    torch.manual_seed(0)  # the same initial model on every rank
    model = Llama(llama_config(args.model)).to(device)
    step_model = parallelize(model, mesh, args.impl, DTYPES[args.param_dtype],
                             compile=not args.no_compile)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    start = 0
    if args.resume:  # the model and optimizer state of both impls are DTensors: same calls
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=args.resume)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        start = int(state["step"])

    data = SyntheticTokens(model.cfg.vocab_size, seed=0)
    losses = []
    for step in range(start + 1, args.steps + 1):
        tokens = data.batch(step, rank, batch_size=4, seq_len=32).to(device)
        loss = step_model(tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
        if rank == 0:
            print(f"{args.impl} step {step}: loss {losses[-1]:.6f}", flush=True)
        if args.checkpoint_dir and step % args.save_every == 0:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)},
                     checkpoint_id=os.path.join(args.checkpoint_dir, f"step_{step}"))

    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
