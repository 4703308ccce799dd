"""Dynamo's guard check per step of a compiled model, alone and after another compile.

Before each call of a compiled frame Dynamo evaluates its guards. torch 2.11 skips a
module's guards whole while none of the dictionaries it recorded under the module has
changed, but any AOTAutograd trace elsewhere in the process moves nn.Module's class
dictionary (``torch.fx`` patches and restores its methods), and from then on the skipping
is off for every module whose guards depend on that dictionary (``docs/torch-versions.md``).
A recompile for ``model.eval()``, a last batch of another shape or a second compiled model
is enough. So this measures both: the torch profiler's ``TorchDynamo Cache Lookup`` per
step over ``--steps`` steps, then again after compiling a two-op function with
``aot_eager``, and the number of leaf guards of the model's frame.

Usage (one process, world 1 on gloo; ``--plain`` for the unsharded model)::

    python -m bench.guard_check --model tiny-deep
    python -m bench.guard_check --model tiny-deep --plain

``--no-inductor`` compiles without Inductor (graphshard's transformed graphs run as they
are, ``aot_eager`` for ``--plain``): Dynamo installs the same guards, and the compile takes a
few seconds instead of a minute. The guard check per step is Dynamo's either way.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["leaf_guards", "lookup_ms", "main", "measure"]


def leaf_guards(model: Any) -> int:
    """The number of leaf guards of the compiled frame of ``model``'s forward."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    (entry,) = _debug_get_cache_entry_list(type(model).forward.__code__)
    lines = [line.split("+- ", 1)[1] for line in str(entry.guard_manager).splitlines()
             if "+- " in line]
    return sum(1 for line in lines if not line.split(":", 1)[0].endswith("Manager"))


def lookup_ms(step: Any, steps: int) -> float:
    """Milliseconds of ``TorchDynamo Cache Lookup`` per call of ``step``, over ``steps``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    total = sum(e.cpu_time_total for e in prof.key_averages() if "Cache Lookup" in e.key)
    return total / steps / 1e3


def measure(model_name: str, sharded: bool, steps: int, rounds: int,
            inductor: bool = True) -> dict:
    """Train ``model_name`` compiled at world 1 (graphshard's backend when ``sharded``,
    Inductor otherwise; without Inductor when not ``inductor``: graphshard's graphs as they
    are, or ``aot_eager``) with fused AdamW; the guard check per step alone and after
    another compile (``rounds`` measurements each)."""
    import torch
    import torch.distributed as dist

    import graphshard
    from graphshard.models.llama import CONFIGS, Llama

    # one rank: an in-process store, no port to collide with another run's
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        config = CONFIGS[model_name]
        model = Llama(config)
        if sharded:
            model = graphshard.shard(model)
            backend = graphshard.backend(inductor=inductor)
        else:
            backend = "inductor" if inductor else "aot_eager"
        compiled = torch.compile(model, backend=backend)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        tokens = torch.randint(0, config.vocab_size, (2, 32))

        def step() -> None:
            compiled(tokens, tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        for _ in range(3):
            step()
        alone = [lookup_ms(step, steps) for _ in range(rounds)]
        torch.compile(lambda a: a * 2 + 1, backend="aot_eager")(torch.randn(3))
        after = [lookup_ms(step, steps) for _ in range(rounds)]
        return {"model": model_name, "system": "graphshard" if sharded else "plain",
                "inductor": inductor, "torch": torch.__version__,
                "leaf_guards": leaf_guards(model),
                "lookup_ms_alone": alone, "lookup_ms_after_another_compile": after}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    """Print (and with ``--json``, write) the measurement."""
    parser = argparse.ArgumentParser(prog="python -m bench.guard_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-deep", help="a preset of graphshard.models")
    parser.add_argument("--plain", action="store_true", help="the unsharded model instead")
    parser.add_argument("--steps", type=int, default=10, help="steps per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="measurements alone and after")
    parser.add_argument("--no-inductor", dest="inductor", action="store_false",
                        help="compile without Inductor (the same guards, a faster compile)")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    result = measure(args.model, not args.plain, args.steps, args.rounds, args.inductor)
    spans = {key: f"{min(result[key]):.3f}-{max(result[key]):.3f}"
             for key in ("lookup_ms_alone", "lookup_ms_after_another_compile")}
    print(f"{result['system']} {result['model']} (torch {result['torch']}): "
          f"{result['leaf_guards']} leaf guards; guard check per step "
          f"{spans['lookup_ms_alone']} ms alone, "
          f"{spans['lookup_ms_after_another_compile']} ms after another compile")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
