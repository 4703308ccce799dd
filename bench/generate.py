"""Greedy decoding on a sharded model: with and without holding the gathered parameters.

    python -m bench.generate --world-size 2 --model llama-small --new-tokens 32 --rounds 3 \\
        [--json out.json] [--markdown out.md]

A generation loop (an RL rollout, an evaluation) runs the model once per new token without
gradients. Eagerly, a sharded model gathers each module's parameters per call, so every token
gathers the whole model again; holding the gathered parameters for the loop removes that.
Every rank decodes its own prompt (the same for every system), eagerly, under
``torch.no_grad()``, ``--new-tokens`` tokens, each step a full forward of the tokens so far
(no KV cache). Systems, all from one initial model:

- ``graphshard``: :func:`graphshard.shard`, gathering per module call;
- ``graphshard-unshard``: the same model inside ``with graphshard.unshard(model):``;
- ``fsdp2``: ``fully_shard`` on every block, then the root, gathering per module call;
- ``fsdp2-unshard``: the same model after ``set_reshard_after_forward(False)`` and
  ``unshard()`` on every FSDP module, ``reshard()`` after (FSDP2's recipe for rollouts);
- ``single``: the plain model, one process's compute floor (every rank runs it alone).

Rounds interleave the systems (the order rotated each round); a round's time is the slowest
rank's, after a barrier. Reported per system: the median time per new token over the rounds,
the ratio of each to ``graphshard-unshard`` per round, and whether its tokens are
``single``'s (every system must decode the same tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import graphshard
from graphshard.models.llama import CONFIGS, Llama, llama_config

__all__ = ["SYSTEMS", "main", "parse_args", "to_markdown"]

SYSTEMS = ("graphshard", "graphshard-unshard", "fsdp2", "fsdp2-unshard", "single")
REFERENCE = "graphshard-unshard"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (gloo)")
    parser.add_argument("--model", default="llama-small", choices=sorted(CONFIGS))
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (one untimed first)")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--markdown", help="write the table here")
    return parser.parse_args(argv)


def _decode(model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    ids = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids


def _fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _fsdp2_held(model: nn.Module, run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``run()`` with every FSDP module unsharded and kept so until it returns."""
    modules = _fsdp2_modules(model)
    for module in modules:
        module.set_reshard_after_forward(False)
        module.unshard()
    try:
        return run()
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(True)


def _build(args: argparse.Namespace) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each system as a function of the prompt: the decoded ids."""
    from torch.distributed.fsdp import fully_shard

    def model() -> Llama:
        torch.manual_seed(0)
        return Llama(llama_config(args.model))

    ours, fsdp2, single = graphshard.shard(model()), model(), model()
    for block in fsdp2.layers:
        fully_shard(block)
    fully_shard(fsdp2)
    n = args.new_tokens

    def ours_held(prompt: torch.Tensor) -> torch.Tensor:
        with graphshard.unshard(ours):
            return _decode(ours, prompt, n)

    return {
        "graphshard": lambda prompt: _decode(ours, prompt, n),
        "graphshard-unshard": ours_held,
        "fsdp2": lambda prompt: _decode(fsdp2, prompt, n),
        "fsdp2-unshard": lambda prompt: _fsdp2_held(fsdp2, lambda: _decode(fsdp2, prompt, n)),
        "single": lambda prompt: _decode(single, prompt, n),
    }


def _worker(rank: int, args: argparse.Namespace, store_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, args.world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.world_size,
                            timeout=timedelta(seconds=600))
    try:
        systems = _build(args)
        vocab = llama_config(args.model).vocab_size
        prompt = torch.randint(0, vocab, (1, args.prompt_len),
                               generator=torch.Generator().manual_seed(rank))
        times: dict[str, list[float]] = {name: [] for name in SYSTEMS}
        tokens: dict[str, torch.Tensor] = {}
        for round_ in range(args.rounds + 1):
            shift = round_ % len(SYSTEMS)
            for name in SYSTEMS[shift:] + SYSTEMS[:shift]:
                dist.barrier()
                start = time.perf_counter()
                tokens[name] = systems[name](prompt)
                elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if round_:  # the first round is warm-up
                    times[name].append(elapsed.item())
        same = {name: bool(torch.equal(ids, tokens["single"])) for name, ids in tokens.items()}
        agree = torch.tensor([all(same.values())], dtype=torch.int32)
        dist.all_reduce(agree, op=dist.ReduceOp.MIN)
        if rank == 0:
            records = [_record(name, times, same[name] and bool(agree.item()), args)
                       for name in SYSTEMS]
            Path(out_path).write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()


def _record(name: str, times: dict[str, list[float]], same: bool,
            args: argparse.Namespace) -> dict[str, Any]:
    ratios = [ref / mine for ref, mine in zip(times[REFERENCE], times[name], strict=True)]
    return {"system": name, "s_per_token_median": statistics.median(times[name]) / args.new_tokens,
            "reference_ratio_median": statistics.median(ratios), "tokens_match_single": same,
            "model": args.model, "world_size": args.world_size, "new_tokens": args.new_tokens,
            "rounds": args.rounds}


def to_markdown(records: list[dict[str, Any]]) -> str:
    """The records as a table."""
    lines = [f"| system | ms per token | {REFERENCE} / this | tokens as one process |",
             "|---|---:|---:|---|"]
    for r in records:
        lines.append(f"| {r['system']} | {1e3 * r['s_per_token_median']:.1f} | "
                     f"{r['reference_ratio_median']:.2f} | "
                     f"{'yes' if r['tokens_match_single'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the bench; print the table and return the records."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
        out_path = os.path.join(tmp, "records.json")
        mp.start_processes(_worker, args=(args, os.path.join(tmp, "store"), out_path),
                           nprocs=args.world_size, join=True, start_method="spawn")
        records = json.loads(Path(out_path).read_text())
    table = to_markdown(records)
    print(table, end="")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(table)
    return records


if __name__ == "__main__":
    main()
