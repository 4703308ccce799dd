"""Does graphshard train an architecture nobody here wrote as one process does?

Each architecture of ``bench.zoo`` (transformers' models, diffusers' denoisers and autoencoder,
torchvision's and timm's image classifiers) is sharded with ``graphshard.shard``'s defaults (or the
options given) on ``--world-size`` gloo ranks and trained for ``--steps`` AdamW steps, eagerly
and compiled with graphshard's backend, every rank on batches of its own. The same training in
one process, on every rank's batches with the ranks' losses averaged (the gradient the
reduce-scatter averages), is the reference. Buffers stay per rank, as in DDP: the reference
keeps a set for each rank and runs rank r's batch with rank r's set (a batch norm's running
statistics follow that rank's batches alone). The table gives the largest relative difference
of the rank-mean losses, the largest absolute difference of the final state (every rank's state
dict, parameters gathered whole, against that rank's reference) and a verdict against
``--rtol``/``--atol``. A compiled run that Dynamo split into several step graphs trains the
same, but its collectives cannot overlap across the breaks: the verdict says in how many. It
also counts the graphs compiled again after the first step (a guard that failed: a
recompile, which costs a compile at that step; ``TORCH_LOGS=recompiles`` says which guard).

AdamW's ``eps`` is raised to 1e-3: a gradient at round-off level (the bias of a
convolution before a batch norm, the query and key weights of an attention at init) would
otherwise get a full-size update whose sign the round-off picks, and one process and the
ranks round differently.

Usage (CPU, gloo; about a minute per architecture and mode on two cores)::

    python -m bench.architectures
    python -m bench.architectures --models gemma2 whisper --modes compiled --world-size 2
    python -m bench.architectures --models unet_text dit sd3 flux vae
    python -m bench.architectures --models resnet densenet swin --world-size 2
    python -m bench.architectures --models gpt2 t5 flux --gradient-checkpointing \
        --shard-option reshard_after_forward=False --backend-option all_gather_via=coalesced
    python -m bench.architectures --models t5 mixtral --world-size 4 --replicas 2
    python -m bench.architectures --models t5 whisper --resume-after 1

``--shard-option`` and ``--backend-option`` hand an option of ``graphshard.shard`` or of
``graphshard.backend`` to every model (``offload=cpu`` is a ``CPUOffload()``; ``offload=host``
checks offload's graphs on the CPU, the host standing in for the accelerator);
``--gradient-checkpointing`` turns on each model's own activation checkpointing, as its
library's users do; ``--replicas`` shards over a 2-D mesh (HSDP); ``--resume-after K`` saves a
checkpoint after step K and trains on from it in a model built, sharded and compiled anew. The
reference is the same one-process training either way: none of these may change what is
computed.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench import zoo
from bench.zoo import ARCHITECTURES, DIFFUSION_KINDS, Architecture, batch, build, loss

__all__ = ["ARCHITECTURES", "DIFFUSION_KINDS", "MODES", "Architecture", "Setup", "batch", "build",
           "compare", "full_state", "loss", "main", "parse_option", "table", "train_ranks",
           "train_reference", "zoo"]

MODES = ("eager", "compiled")
_INSTALL = {  # how to get each library the models come from
    "transformers": "pip install transformers",
    "diffusers": "pip install diffusers",
    # PyPI's torchvision wheels are CUDA builds: beside torch's CPU build they fail to import
    "torchvision": "pip install the torchvision release that matches the installed torch "
                   "(torch 2.14.1: torchvision 0.29.1)",
    "timm": "pip install timm (it imports torchvision: see above)",
}


def full_state(model: Any) -> dict[str, Any]:
    """The model's state dict with every sharded entry gathered whole (a collective)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def _optimizer(model: Any) -> Any:
    import torch

    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)


def _train(optimizer: Any, losses_at: Callable[[int], Any], steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = losses_at(step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def parse_option(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` as ``(NAME, value)``: a Python literal where the value reads as one
    (``False``, ``2``, ``"auto"``), else the text. ``offload=cpu`` is a ``CPUOffload()`` (on
    an accelerator); ``offload=host`` offloads on the CPU with the host standing in for the
    accelerator (``graphshard.api.offload.host_standing_in_for_device``)."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=VALUE, e.g. "
                                         "reshard_after_forward=False")
    if name == "offload":
        if value not in ("cpu", "host"):
            raise argparse.ArgumentTypeError(
                f"{text!r}: the offload option takes offload=cpu (graphshard.CPUOffload(), "
                "on an accelerator mesh) or offload=host (the CPU standing in for one)")
        return name, value
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def _shard(model: Any, mesh: Any, options: dict[str, Any]) -> Any:
    """``graphshard.shard(model, mesh, **options)``, ``offload`` given as ``parse_option``
    reads it."""
    import graphshard
    from graphshard.api.offload import host_standing_in_for_device

    offload = options.get("offload")
    if offload == "cpu":
        return graphshard.shard(model, mesh, **{**options, "offload": graphshard.CPUOffload()})
    if offload == "host":
        with host_standing_in_for_device():
            return graphshard.shard(model, mesh, **{
                **options, "offload": graphshard.CPUOffload(pin_memory=False)})
    return graphshard.shard(model, mesh, **options)


@dataclass(frozen=True)
class Setup:
    """How ``train_ranks`` shards, compiles and trains each model beyond the defaults.

    Attributes:
        shard: ``graphshard.shard`` options (``offload`` as :func:`parse_option` reads it).
        backend: ``graphshard.backend`` options, for the compiled runs.
        gradient_checkpointing: turn on the model library's own activation checkpointing
            (:func:`bench.zoo.enable_gradient_checkpointing`) before sharding.
        replicas: > 1 shards over a 2-D mesh of that many replicas (HSDP).
        resume_after: save a checkpoint (``graphshard.save_checkpoint``, model and AdamW)
            after this many steps under ``checkpoint_dir``, then build, shard and compile the
            model anew, load it (``graphshard.load_checkpoint``) and train the remaining
            steps: the training must be the uninterrupted one's.
        checkpoint_dir: a directory every rank sees, for ``resume_after``.
    """

    shard: dict[str, Any] = field(default_factory=dict)
    backend: dict[str, Any] = field(default_factory=dict)
    gradient_checkpointing: bool = False
    replicas: int = 1
    resume_after: int | None = None
    checkpoint_dir: str | None = None

    def __post_init__(self) -> None:
        if self.resume_after is not None and self.checkpoint_dir is None:
            raise ValueError("Setup(resume_after=...) needs a checkpoint_dir every rank sees")


def _sharded(name: str, mode: str, setup: Setup, mesh: Any) -> tuple[Any, Any, Any]:
    """Architecture ``name`` built, sharded as ``setup`` says, what runs it (itself, or it
    compiled with graphshard's backend) and that backend (None eagerly)."""
    import torch

    import graphshard

    built = build(name)
    if setup.gradient_checkpointing:
        zoo.enable_gradient_checkpointing(built)
    model = _shard(built, mesh, setup.shard)
    if mode == "compiled":
        backend = graphshard.backend(**setup.backend)
        return model, torch.compile(model, backend=backend), backend
    return model, model, None


def _train_job(name: str, mode: str, rank: int, steps: int, setup: Setup, mesh: Any) -> dict:
    """One job of :func:`train_ranks`: its losses, full state and a parameter's placements."""
    import torch
    from torch.distributed.tensor import DTensor

    import graphshard

    def train(run: Any, optimizer: Any, at: range) -> list[float]:
        return _train(optimizer, lambda step: loss(name, run, step, rank), at)

    model, run, backend = _sharded(name, mode, setup, mesh)
    optimizer = _optimizer(model)
    stop = steps if setup.resume_after is None else setup.resume_after
    losses = train(run, optimizer, range(min(1, stop)))
    # the graphs Dynamo made for the first step (more than one where the model breaks the
    # graph), then those it made again for later steps (a guard failed: a recompile)
    graphs = None if backend is None else len(backend.graphs)
    losses += train(run, optimizer, range(len(losses), stop))
    recompiles = None if backend is None else len(backend.graphs) - graphs
    if setup.resume_after is not None:
        directory = Path(setup.checkpoint_dir) / f"{name}-{mode}"
        graphshard.save_checkpoint(directory, model, optimizer, step=stop)
        torch._dynamo.reset()  # as a restarted job: nothing compiled
        model, run, _ = _sharded(name, mode, setup, mesh)
        optimizer = _optimizer(model)
        info = graphshard.load_checkpoint(directory, model, optimizer)
        if rank == 0:
            print(f"[architectures] {name} {mode}: resumed from {info.path.name}",
                  file=sys.stderr, flush=True)
        losses += train(run, optimizer, range(info.step, steps))
    first = next(p for p in model.parameters() if isinstance(p, DTensor))
    return {"losses": losses, "state": full_state(model),
            "placements": tuple(map(str, first.placements)), "graphs": graphs,
            "recompiles": recompiles}


def train_ranks(rank: int, world_size: int, jobs: list[tuple[str, str]], steps: int,
                setup: Setup | None = None) -> dict:
    """On each rank of a started process group: every ``(architecture, mode)`` job in turn,
    this rank's losses and the full state after ``steps`` steps, sharded and trained as
    ``setup`` says (the defaults where None); a job that raises records its traceback under
    ``"error"`` and the next job runs (``"placements"``: a sharded parameter's, which show
    the mesh)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    setup = setup or Setup()
    mesh = None
    if setup.replicas > 1:
        mesh = init_device_mesh("cpu", (setup.replicas, world_size // setup.replicas),
                                mesh_dim_names=("replicate", "shard"))
    results: dict[Any, Any] = {}
    for name, mode in jobs:
        torch._dynamo.reset()
        try:
            results[(name, mode)] = _train_job(name, mode, rank, steps, setup, mesh)
        except Exception:  # noqa: BLE001  (reported in the table)
            results[(name, mode)] = {"error": traceback.format_exc()}
        if rank == 0:
            done = "raised" if "error" in results[(name, mode)] else "trained"
            graphs = results[(name, mode)].get("graphs")
            if graphs:
                done += f" ({graphs} step graph{'s' if graphs > 1 else ''}"
                recompiles = results[(name, mode)].get("recompiles")
                done += f", {recompiles} recompiled after step 1)" if recompiles else ")"
            print(f"[architectures] {name} {mode}: {done}", file=sys.stderr, flush=True)
    return results


def train_reference(name: str, world_size: int, steps: int, compiled: bool = False) -> dict:
    """The unsharded model in this process, every rank's batches each step, their losses
    averaged; each rank's batch runs with that rank's own buffers. ``"states"`` holds the
    final state as each rank should have it (the parameters, and that rank's buffers).
    ``compiled``: the model runs under plain ``torch.compile`` (Inductor), so that a compiled
    run meets Inductor's own round-off on both sides."""
    import torch

    model = build(name)
    run = torch.compile(model) if compiled else model
    rank_buffers = [_buffer_set(model) for _ in range(world_size)]

    def losses_at(step: int) -> Any:
        total = 0
        for rank in range(world_size):
            with _buffers_of(model, rank_buffers[rank]):
                total = total + loss(name, run, step, rank)
        return total / world_size

    losses = _train(_optimizer(model), losses_at, range(steps))
    states = []
    for buffers in rank_buffers:
        with _buffers_of(model, buffers):
            states.append(full_state(model))
    return {"losses": losses, "states": states}


def _buffer_set(model: Any) -> dict[tuple[Any, str], Any]:
    """A copy of every buffer of ``model``, keyed by (owning module, name); a buffer that
    several modules register stays one tensor."""
    copies: dict[int, Any] = {}
    return {(module, key): copies.setdefault(id(buffer), buffer.detach().clone())
            for module in model.modules() for key, buffer in module._buffers.items()
            if buffer is not None}


@contextmanager
def _buffers_of(model: Any, buffers: dict[tuple[Any, str], Any]) -> Iterator[None]:
    """Run ``model`` with ``buffers`` in place of its own. The tensors are swapped, not
    copied into: a forward's in-place update (a batch norm's running statistics) lands in
    ``buffers``, and the autograd graph keeps the tensors it saved."""
    own = {}
    for (module, key), buffer in buffers.items():
        own[(module, key)] = module._buffers[key]
        module._buffers[key] = buffer
    try:
        yield
    finally:
        for (module, key), buffer in own.items():
            buffers[(module, key)] = module._buffers[key]
            module._buffers[key] = buffer


def compare(per_rank: list[dict], reference: dict, rtol: float, atol: float) -> dict:
    """One row: the rank-mean losses' largest relative difference from the reference's, the
    largest absolute difference of any rank's final state from that rank's reference state,
    and whether both are within tolerance (``|a - b| <= atol + rtol * |b|`` everywhere, as
    ``torch.isclose``); for a compiled run, ``graphs``: the step graphs Dynamo made for the
    first step, and ``recompiles``: those it made again for the later ones, where any."""
    import torch

    failed = next((r["error"] for r in per_rank if "error" in r), None)
    if failed is not None:
        return {"ok": False, "error": failed.strip().splitlines()[-1]}
    graphs = {key: per_rank[0][key] for key in ("graphs", "recompiles")
              if per_rank[0].get(key)}
    world = len(per_rank)
    mean = torch.tensor([sum(r["losses"][s] for r in per_rank) / world
                         for s in range(len(reference["losses"]))], dtype=torch.float64)
    want = torch.tensor(reference["losses"], dtype=torch.float64)
    loss_rel = float(((mean - want).abs() / want.abs()).max())
    ok = bool(torch.isclose(mean, want, rtol=rtol, atol=atol).all())
    state_abs = 0.0
    for rank, (result, expected) in enumerate(zip(per_rank, reference["states"], strict=True)):
        state = result["state"]
        if state.keys() != expected.keys():
            differ = sorted(expected.keys() ^ state.keys())
            return {"ok": False, "loss_rel": loss_rel, **graphs,
                    "error": f"rank {rank}'s state keys differ: {differ}"}
        for key, value in expected.items():
            got = state[key].to(value.dtype)
            if value.numel():
                state_abs = max(state_abs, float((got - value).abs().max()))
            ok = ok and bool(torch.isclose(got, value, rtol=rtol, atol=atol).all())
    return {"ok": ok, "loss_rel": loss_rel, "state_abs": state_abs, **graphs}


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows``: one line per architecture, a column per mode with the
    losses' largest relative and the state's largest absolute difference."""
    modes = list(dict.fromkeys(row["mode"] for row in rows))
    by_name: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_name.setdefault(row["architecture"], {})[row["mode"]] = row
    lines = ["| architecture | exercises | " + " | ".join(
        f"{mode}: losses / state" for mode in modes) + " | verdict |",
        "|---|---|" + "---:|" * len(modes) + "---|"]
    for name, cells in by_name.items():
        shown, verdicts = [], []
        for mode in modes:
            row = cells.get(mode)
            if row is None:
                shown.append("")
                continue
            if "loss_rel" in row and "state_abs" in row:
                shown.append(f"{row['loss_rel']:.1e} / {row['state_abs']:.1e}")
            else:
                shown.append("")
            if "error" in row:
                verdicts.append(f"{mode} failed: {row['error'][:200]}")
            elif not row["ok"]:
                verdicts.append(f"**{mode} differs**")
            if row.get("graphs", 1) > 1:  # trains alike, but its collectives overlap less
                verdicts.append(f"{mode} in {row['graphs']} graphs (graph breaks)")
            if row.get("recompiles"):  # each one a compile more, at a later step
                verdicts.append(f"{mode} again for later steps: {row['recompiles']} "
                                "recompile(s)")
        verdict = "; ".join(verdicts) or "as one process"
        if verdicts and all(row.get("ok") for row in cells.values()):
            verdict = f"as one process; {verdict}"
        lines.append(f"| {name} | {ARCHITECTURES[name].exercises} | {' | '.join(shown)} "
                     f"| {verdict} |")
    return "\n".join(lines) + "\n"


def _worker(rank: int, world_size: int, store_path: str, out_dir: str, jobs: list,
            steps: int, setup: Setup) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=600))
    try:
        results = train_ranks(rank, world_size, jobs, steps, setup)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.architectures",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(ARCHITECTURES),
                        default=list(ARCHITECTURES), metavar="NAME",
                        help=f"architectures to check (default: all of {', '.join(ARCHITECTURES)})")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps (default 3)")
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--atol", type=float, default=1e-6)
    parser.add_argument("--compiled-reference", choices=("eager", "compiled"), default="eager",
                        help="what the compiled runs are compared with: the one-process "
                             "training eager (default), or under plain torch.compile, where "
                             "Inductor's own round-off departs from eager (a batch norm's "
                             "variance, fused reductions)")
    parser.add_argument("--shard-option", action="append", type=parse_option, default=[],
                        metavar="NAME=VALUE", dest="shard_options",
                        help="a graphshard.shard option for every model (repeatable), e.g. "
                             "reshard_after_forward=False, offload=cpu, or offload=host (on "
                             "the CPU, the host standing in for the accelerator)")
    parser.add_argument("--backend-option", action="append", type=parse_option, default=[],
                        metavar="NAME=VALUE", dest="backend_options",
                        help="a graphshard.backend option for the compiled runs (repeatable), "
                             "e.g. all_gather_via=coalesced, prefetch_depth=2")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="turn on each model's own activation checkpointing "
                             "(transformers', diffusers' and timm's) before sharding; "
                             "torchvision's models have none")
    parser.add_argument("--replicas", type=int, default=1,
                        help="HSDP: shard over a mesh of this many replicas, each of "
                             "--world-size / replicas ranks (default 1: FSDP)")
    parser.add_argument("--resume-after", type=int, metavar="K",
                        help="save a checkpoint (graphshard.save_checkpoint) after step K, "
                             "then build, shard and compile each model anew, load it and "
                             "train the remaining steps: the training must be the "
                             "uninterrupted one's")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.steps < 1:
        parser.error("--world-size and --steps must be at least 1")
    if args.replicas < 1 or args.world_size % args.replicas:
        parser.error(f"--replicas {args.replicas} must be at least 1 and divide --world-size "
                     f"{args.world_size}")
    if args.resume_after is not None and not 0 < args.resume_after < args.steps:
        parser.error(f"--resume-after {args.resume_after} must be between 1 and --steps - 1 "
                     f"({args.steps - 1})")
    args.shard_options = dict(args.shard_options)
    args.backend_options = dict(args.backend_options)
    if args.gradient_checkpointing:
        without = [name for name in args.models if ARCHITECTURES[name].library == "torchvision"]
        if without:
            parser.error(f"--gradient-checkpointing: {', '.join(without)} (torchvision) have "
                         "no activation checkpointing of their own; leave them out with "
                         "--models")
    missing = []
    for library in dict.fromkeys(ARCHITECTURES[name].library for name in args.models):
        if importlib.util.find_spec(library) is None:
            chosen = [name for name in args.models if ARCHITECTURES[name].library == library]
            missing.append(f"{', '.join(chosen)} need {library}: {_INSTALL[library]}")
    if missing:
        parser.error("; ".join(missing) + "; or leave them out with --models")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Check the architectures: print the table, write ``--json`` where given, return the
    rows."""
    args = parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    jobs = [(name, mode) for name in args.models for mode in args.modes]
    with tempfile.TemporaryDirectory(prefix="architectures-") as tmp:
        setup = Setup(args.shard_options, args.backend_options, args.gradient_checkpointing,
                      args.replicas, args.resume_after, os.path.join(tmp, "checkpoints"))
        mp.start_processes(_worker, args=(args.world_size, os.path.join(tmp, "store"), tmp,
                                          jobs, args.steps, setup),
                           nprocs=args.world_size, join=True, start_method="spawn")
        per_rank = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False)
                    for r in range(args.world_size)]
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: a kernel's reductions split by thread count, and
    # a batch-norm net amplifies that (DenseNet under Inductor on torch 2.11: 1e-3 apart)
    try:
        for name in args.models:
            references = {"eager": train_reference(name, args.world_size, args.steps)}
            if args.compiled_reference == "compiled" and "compiled" in args.modes:
                torch._dynamo.reset()
                references["compiled"] = train_reference(name, args.world_size, args.steps,
                                                         True)
            for mode in args.modes:
                reference = references.get(mode, references["eager"])
                row = compare([r[(name, mode)] for r in per_rank], reference, args.rtol,
                              args.atol)
                rows.append({"architecture": name, "mode": mode, **row})
    finally:
        torch.set_num_threads(threads)  # main() also runs inside callers' processes (tests)
    text = table(rows)
    print(text, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(0 if all(row["ok"] for row in main()) else 1)
