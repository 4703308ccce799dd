"""Train a Llama-style model with graphshard on synthetic tokens.

    torchrun --nproc-per-node 2 examples/train_llama.py                 # llama-small, CPU, gloo
    torchrun --nproc-per-node 2 examples/train_llama.py --model tiny --steps 5
    torchrun --nproc-per-node 8 examples/train_llama.py --device cuda   # NCCL, one GPU a rank
    python examples/train_llama.py --model tiny                         # one process
    torchrun --nproc-per-node 4 examples/train_llama.py --model tiny \
        --mixed-precision bf16 --grad-accum 4 --replicas 2              # bf16, no_sync, HSDP
    torchrun --nproc-per-node 4 examples/train_llama.py --model tiny --tp 2   # dp 2 x tp 2

Every rank builds the same model from the same seed, ``graphshard.shard`` keeps its own slice
of every parameter, and ``torch.compile`` with the graphshard backend inserts the
all-gathers and reduce-scatters. Each rank draws its own batch (data parallel).

With ``--tp N`` the ranks form a ``(dp, tp)`` mesh (``(replicate, shard, tp)`` with
``--replicas``): torch's ``parallelize_module`` splits attention heads and the FFN over the
N ranks of ``mesh["tp"]`` (``tensor_parallel_plan``), then ``graphshard.shard`` shards over
the data-parallel dims. The N ranks of a tensor-parallel group share one batch; each
data-parallel rank draws its own.

With ``--meta-init`` (the default for the ``llama3-*`` presets) no rank ever holds the whole
model: it is built on the meta device, sharded, ``to_empty``'d (each rank allocates its
rows), then initialised (``init_weights``: the same values as without ``--meta-init``) or
loaded with ``--load`` (rank 0 reads a full checkpoint and sends each rank its rows).

The synthetic data is learnable so the loss visibly falls: each sequence starts at a random
token and follows a fixed random "next token" permutation of ``--data-vocab`` token ids, with
a ``--noise`` fraction of tokens drawn at random instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from tqdm import tqdm

import graphshard
from graphshard.models.data import SyntheticTokens
from graphshard.models.llama import (
    CONFIGS,
    Llama,
    check_tensor_parallel,
    llama_config,
    llama_config_from_hf,
    llama_name_from_hf,
    tensor_parallel_plan,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Sharded (FSDP-style) training of a Llama model with graphshard.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="llama-small",
        choices=list(CONFIGS),
        help="model preset (llama3-* are the real shapes and need real hardware)",
    )
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence; None means min(128, the preset's max_seq_len)",
    )
    parser.add_argument(
        "--lr", type=float, default=1e-3, help="peak AdamW learning rate (betas 0.9, 0.95)"
    )
    parser.add_argument(
        "--warmup-steps", type=int, default=5, help="linear learning-rate warmup steps"
    )
    parser.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    parser.add_argument(
        "--clip-grad-norm", type=float, default=1.0,
        help="clip the global gradient norm to this (graphshard.clip_grad_norm_: torch's "
        "clip_grad_norm_ on the sharded DTensor gradients, run on their local shards); 0 "
        "turns it off",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    parser.add_argument(
        "--noise",
        type=float,
        default=0.1,
        help="fraction of synthetic tokens drawn at random instead of from the permutation",
    )
    parser.add_argument(
        "--data-vocab",
        type=int,
        default=128,
        help="how many distinct token ids the synthetic data uses (at most the vocabulary)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cpu uses gloo; cuda uses NCCL and the GPU given by LOCAL_RANK",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="parameter and activation dtype",
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="run the sharded model without torch.compile (eager all-gather / reduce-scatter)",
    )
    parser.add_argument(
        "--no-inductor",
        action="store_true",
        help="compile with the graphshard passes but run the graphs op by op (no Inductor)",
    )
    parser.add_argument(
        "--dump-dir",
        default=None,
        help="write every graph before and after every graphshard pass into this directory",
    )
    parser.add_argument(
        "--meta-init",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="build the model on the meta device and allocate only each rank's shards "
        "(default: on for the llama3-* presets, off otherwise)",
    )
    parser.add_argument(
        "--load",
        default=None,
        metavar="PATH",
        help="start from these weights instead of a fresh init: a full state dict written by "
        "--save (torch.save; rank 0 reads it, every rank gets its rows), or a Hugging Face "
        "Llama directory (save_pretrained; its config.json replaces --model, and each rank "
        "reads only its rows of the safetensors)",
    )
    parser.add_argument(
        "--save",
        default=None,
        metavar="PATH",
        help="after training, torch.save the full (unsharded) state dict here from rank 0",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save sharded checkpoints (model, optimizer, LR schedule) under this directory: "
        "every --checkpoint-every steps and after the last step",
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end)"
    )
    parser.add_argument(
        "--keep-last", type=int, default=2, help="checkpoints kept in --checkpoint-dir"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest complete checkpoint in --checkpoint-dir (at any world "
        "size); start fresh when there is none",
    )
    parser.add_argument(
        "--mixed-precision",
        choices=("none", "bf16", "fp16"),
        default="none",
        help="gather and compute in this dtype; gradients are reduced and the sharded weights "
        "and optimizer state kept in fp32",
    )
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="micro-batches per optimizer step; all but the last run under graphshard.no_sync "
        "(no communication), the last reduces them all at once",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="HSDP: replicate the model this many times and shard it across world/replicas "
        "ranks (gradients are reduce-scattered within a replica, all-reduced across them)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor parallelism: split attention heads and the FFN over this many ranks "
        "(torch's parallelize_module on mesh['tp']); graphshard shards over world/tp ranks",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=300.0,
        help="process-group timeout: a rank that died or hung makes the others fail after this "
        "long instead of waiting forever (long enough for the first compile and a checkpoint)",
    )
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    if args.grad_accum < 1 or args.replicas < 1 or args.tp < 1:
        parser.error("--grad-accum, --replicas and --tp must be at least 1")
    if args.meta_init is None:
        args.meta_init = args.model.startswith("llama3")
    return args


def init_distributed(
    device: str, timeout_s: float = 300.0
) -> tuple[int, int, torch.device]:
    """Initialise the default process group (also without torchrun); return rank, world, device.

    ``timeout_s`` bounds how long a collective waits for a rank that died or hung."""
    timeout = timedelta(seconds=timeout_s)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda was given but CUDA is not available")
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=dev, timeout=timeout)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), dev


def mesh_layout(world_size: int, replicas: int, tp: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The device-mesh shape and dim names for ``world_size`` ranks: ``(world,)`` plain FSDP,
    ``(replicate, shard)`` HSDP, ``(dp, tp)`` or ``(replicate, shard, tp)`` with TP.

    Raises:
        SystemExit: ``tp`` does not divide ``world_size``, or ``replicas`` does not divide
            the ``world_size // tp`` data-parallel ranks.
    """
    if world_size % tp:
        raise SystemExit(f"--tp {tp} does not divide the {world_size} ranks")
    dp = world_size // tp
    if dp % replicas:
        raise SystemExit(f"--replicas {replicas} does not divide the {dp} data-parallel ranks "
                         f"({world_size} ranks / --tp {tp})")
    if tp == 1:
        if replicas == 1:
            return (world_size,), ("dp",)
        return (replicas, dp // replicas), ("replicate", "shard")
    if replicas == 1:
        return (dp, tp), ("dp", "tp")
    return (replicas, dp // replicas, tp), ("replicate", "shard", "tp")


def data_parallel_rank(mesh: DeviceMesh | None, rank: int) -> int:
    """Which batch this rank draws: its data-parallel coordinate (the flattened
    ``(replicate, shard)`` or ``dp`` coordinate; every TP rank of a group gets the same),
    or ``rank`` without a mesh."""
    if mesh is None:
        return rank
    coord, shape = mesh.get_coordinate(), mesh.mesh.shape
    dims = [i for i, name in enumerate(mesh.mesh_dim_names) if name != "tp"]
    index = 0
    for i in dims:
        index = index * shape[i] + coord[i]
    return index


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    rank, world_size, device = init_distributed(args.device, args.timeout_s)
    try:
        return train(args, rank, world_size, device)
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, rank: int, world_size: int, device: torch.device) -> float:
    hf_dir = args.load is not None and os.path.isdir(args.load)
    if hf_dir:  # the shapes are the checkpoint's
        with open(os.path.join(args.load, "config.json")) as f:
            cfg = llama_config_from_hf(json.load(f))
    else:
        cfg = llama_config(args.model)
    seq_len = args.seq_len or min(128, cfg.max_seq_len)
    if seq_len > cfg.max_seq_len:
        raise SystemExit(
            f"--seq-len {seq_len} exceeds max_seq_len {cfg.max_seq_len} of {args.model}"
        )
    dtype = getattr(torch, args.dtype)
    shape, names = mesh_layout(world_size, args.replicas, args.tp)
    if args.tp > 1:
        try:
            check_tensor_parallel(cfg, args.tp)
        except ValueError as err:
            raise SystemExit(f"--tp {args.tp}: {err}") from err

    if args.meta_init:  # shapes only: nothing is allocated until to_empty below
        with torch.device("meta"):
            model = Llama(cfg).to(dtype=dtype)
    else:  # every rank holds the whole model until shard(); the same seed everywhere
        model = Llama(cfg).to(device=device, dtype=dtype)
        model.init_weights(seed=args.seed)
    n_params = model.num_params()
    mesh = None  # plain FSDP over the default group
    if len(shape) > 1:
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    dp_mesh = mesh
    if args.tp > 1:  # TP first: graphshard then shards the TP-local tensors over dp
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(model))
        dp_mesh = mesh["replicate", "shard"] if args.replicas > 1 else mesh["dp"]
    data_rank = data_parallel_rank(mesh, rank)
    first_of_tp = args.tp == 1 or mesh.get_coordinate()[-1] == 0  # counts its group's loss
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.mixed_precision)
    policy = None if low is None else graphshard.MixedPrecision(
        param_dtype=low, reduce_dtype=torch.float32, output_dtype=torch.float32)
    graphshard.shard(model, dp_mesh, mixed_precision=policy)
    if args.meta_init:
        model.to_empty(device=device)  # each rank's rows, uninitialised (rotary tables rebuilt)
        if args.load is None:
            model.init_weights(seed=args.seed)  # the values the unsharded model would get
    if hf_dir:
        graphshard.load_safetensors(model, args.load, rename=llama_name_from_hf)
    elif args.load is not None:
        graphshard.load_full_checkpoint(model, args.load)
        if rank == 0:
            print(f"loaded {args.load}", flush=True)
    if args.eager:
        run = model
    else:
        backend = graphshard.backend(dump_dir=args.dump_dir, inductor=not args.no_inductor)
        run = torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay
    )
    warmup = max(0, args.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1))
    )
    data = SyntheticTokens(cfg.vocab_size, args.seed, used=args.data_vocab, noise=args.noise)
    first_step = 0
    if args.resume:
        found = graphshard.latest_checkpoint(args.checkpoint_dir)
        if found is None:
            if rank == 0:
                print(f"no checkpoint in {args.checkpoint_dir}: starting fresh", flush=True)
        else:
            info = graphshard.load_checkpoint(found, model, optimizer)
            scheduler.load_state_dict(info.extra["scheduler"])
            first_step = info.step
            if rank == 0:
                print(f"resumed from {info.path} (step {info.step}, saved by "
                      f"{info.world_size} rank(s))", flush=True)

    def save(step: int) -> None:
        path = graphshard.save_checkpoint(
            args.checkpoint_dir, model, optimizer, step=step,
            extra={"scheduler": scheduler.state_dict(), "args": vars(args)},
            keep_last=args.keep_last,
        )
        if rank == 0:
            tqdm.write(f"saved checkpoint {path}")

    if rank == 0:
        mode = "eager" if args.eager else "compiled"
        layout = " x ".join(f"{n} {s}" for n, s in zip(names, shape, strict=True))
        print(
            f"{args.model}: {n_params / 1e6:.2f}M parameters, {world_size} rank(s) ({layout}) "
            f"on {device.type}, {mode}, batch {args.batch_size}x{seq_len} per data-parallel "
            "rank, "
            f"{args.steps} steps (uniform-guess loss {math.log(cfg.vocab_size):.3f})",
            flush=True,
        )
    bar = tqdm(range(first_step, args.steps), desc="train", disable=rank != 0,
               dynamic_ncols=True, initial=first_step, total=args.steps)
    losses: list[float] = []
    every = args.checkpoint_every
    # A rank that raises tells the others why; a rank that dies or hangs fails them after
    # --timeout-s, with an error that says so.
    with graphshard.report_rank_failures():
        for step in bar:
            losses.append(train_step(run, model, optimizer, scheduler, data, step, data_rank,
                                     world_size // args.tp, args, seq_len, device, bar,
                                     counts=first_of_tp))
            done = step + 1
            if args.checkpoint_dir and (done == args.steps or every and done % every == 0):
                save(done)
    bar.close()

    if rank == 0 and losses:
        print(f"final loss {losses[-1]:.4f} (first {losses[0]:.4f})", flush=True)
    if args.save:
        # a collective: every rank takes part; only rank 0 holds the tensors, on the CPU
        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.save)), exist_ok=True)
            torch.save(state, args.save)
            print(f"saved the full state dict to {args.save}", flush=True)
    return losses[-1] if losses else float("nan")


def train_step(run, model, optimizer, scheduler, data, step, data_rank, dp_size, args,
               seq_len, device, bar, counts=True) -> float:
    """One optimizer step on batch ``data_rank``'s ``--grad-accum`` micro-batches; the loss
    averaged over micro-batches and the ``dp_size`` data-parallel ranks. ``counts`` is False
    on all but one rank of a tensor-parallel group (they hold copies of the same loss)."""
    start = time.perf_counter()
    micro = args.grad_accum
    loss = torch.zeros((), device=device)
    for m in range(micro):
        tokens = data.batch(step * micro + m, data_rank, args.batch_size, seq_len).to(device)
        last = m == micro - 1
        with contextlib.nullcontext() if last else graphshard.no_sync(model):
            micro_loss = run(tokens).loss / micro
            micro_loss.backward()
        loss += micro_loss.detach()
    if args.clip_grad_norm > 0:  # the global norm (torch's call gives the same, slower)
        graphshard.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    mean_loss = loss.detach().float().clone() if counts else torch.zeros((), device=device)
    dist.all_reduce(mean_loss, op=dist.ReduceOp.SUM)
    mean = mean_loss.item() / dp_size  # .item() waits for the step to finish
    bar.set_postfix(loss=f"{mean:.4f}", step_s=f"{time.perf_counter() - start:.3f}")
    return mean


if __name__ == "__main__":
    main()
