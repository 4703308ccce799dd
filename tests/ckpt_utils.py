"""Helpers for checkpoint and failure tests: a rank launcher that survives failing ranks,
small models with awkward shapes, deterministic batches, and full optimizer state.

:func:`launch` runs ``fn(rank, world_size, *args)`` on gloo ranks in separate processes,
like ``dist_utils.run_ranks``, but records per rank what it returned or raised and its exit
code, lets a rank die or hang, and kills whatever is still running at the deadline (or a
grace period after the first rank exits), so a test never hangs.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dist_utils import in_launch_env, rank_context
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from graphshard.models.llama import Llama, llama_config
from graphshard.models.mlp import MLPOutput


@dataclass
class RankOutcome:
    """How one rank ended."""

    rank: int
    exitcode: int | None  # None: still running at the deadline (then killed)
    result: Any = None
    error: str | None = None  # "Type: message" of what the rank raised
    error_type: str | None = None
    traceback: str | None = None
    seconds: float | None = None  # from the rank's start of ``fn`` to its end


def _rank_entry(rank, world_size, store_path, out_dir, pg_timeout_s, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world_size), rank=rank,
        world_size=world_size, timeout=timedelta(seconds=pg_timeout_s),
    )
    out: dict[str, Any] = {}
    code = 0
    start = time.monotonic()
    try:
        out["result"] = fn(rank, world_size, *args)
    except BaseException as exc:  # recorded for the test, then a non-zero exit
        out.update(error=f"{type(exc).__name__}: {exc}", error_type=type(exc).__name__,
                   traceback=traceback.format_exc())
        code = 1
    out["seconds"] = time.monotonic() - start
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    try:
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    pg_timeout_s: float = 60.0,
    deadline_s: float = 300.0,
    grace_s: float | None = None,
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; never hang.

    Args:
        pg_timeout_s: the process group's collective timeout.
        deadline_s: ranks still running after this many seconds are killed.
        grace_s: once one rank has exited, the others get this long before they are killed.
    """
    ctx = rank_context()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=in_launch_env,
                        args=(r, dict(os.environ), _rank_entry, world_size, store, tmp,
                              pg_timeout_s, fn, args))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        end = time.monotonic() + deadline_s
        while any(p.is_alive() for p in procs) and time.monotonic() < end:
            if grace_s is not None and any(not p.is_alive() for p in procs):
                end = min(end, time.monotonic() + grace_s)
                grace_s = None
            time.sleep(0.05)
        killed = set()
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                killed.add(r)
            p.join()
        outcomes = []
        for r, p in enumerate(procs):
            path = Path(tmp) / f"rank{r}.pt"
            data = torch.load(path, weights_only=False) if path.exists() else {}
            outcomes.append(RankOutcome(r, None if r in killed else p.exitcode, **data))
        return outcomes


@contextmanager
def single_rank_group(directory: str) -> Iterator[None]:
    """A world-1 gloo process group in this process, destroyed on exit."""
    assert not dist.is_initialized(), "a process group is already initialised here"
    store = dist.FileStore(tempfile.mktemp(prefix="store-", dir=directory), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def results(outcomes: list[RankOutcome]) -> list[Any]:
    """Every rank's result; fails with the tracebacks of ranks that did not succeed."""
    bad = [o for o in outcomes if o.exitcode != 0 or o.error is not None]
    if bad:
        text = "\n".join(f"rank {o.rank} (exit {o.exitcode}): {o.traceback or o.error}"
                         for o in bad)
        raise AssertionError(f"{len(bad)} rank(s) failed:\n{text}")
    return [o.result for o in outcomes]


# --------------------------------------------------------------------------- models and data


class Awkward(nn.Module):
    """Shapes that need padding at any world size: a 0-D scale, dim 0 of 1 and 2, odd
    Linear layers, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.shift = nn.Parameter(torch.randn(1))
        self.mix = nn.Parameter(torch.randn(2, 5, 3) * 0.3)
        self.proj = nn.Linear(7, 5)
        self.out = nn.Linear(6, 3)
        self.register_buffer("offset", torch.arange(3.0) / 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> MLPOutput:
        h = torch.einsum("bi,kij->bkj", self.proj(x), self.mix).flatten(1)
        out = self.out(self.scale * torch.tanh(h) + self.shift) + self.offset
        return MLPOutput(torch.nn.functional.mse_loss(out, y), out)


def build(kind: str) -> nn.Module:
    """The unsharded model ``kind`` (``awkward`` or ``llama``), same on every rank."""
    torch.manual_seed(4321)
    if kind == "awkward":
        return Awkward()
    return Llama(llama_config("tiny", tie_embeddings=True))


def batch(kind: str, step: int, rank: int) -> tuple:
    """The batch of ``rank`` at ``step``: a function of both only (so resumes are exact)."""
    gen = torch.Generator().manual_seed(7919 * step + rank)
    if kind == "awkward":
        return torch.randn(4, 7, generator=gen), torch.randn(4, 3, generator=gen)
    return (torch.randint(0, 256, (2, 16), generator=gen),)


def optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW (sharded state plus a scalar ``step``) and a warm-up LR schedule."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return opt, sched


def train(kind: str, run: nn.Module, opt, sched, steps: range) -> list[float]:
    """Train ``steps`` on this rank's batches; the local losses, exactly."""
    losses = []
    rank = dist.get_rank()
    for step in steps:
        loss = run(*batch(kind, step, rank)).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def full_optim_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """A snapshot of the optimizer state, every DTensor gathered to its full shape (cloned:
    a replicated one's full tensor is its live local tensor)."""
    osd = get_optimizer_state_dict(model, opt)
    return {
        fqn: {k: _copy(v.full_tensor() if isinstance(v, DTensor) else v) for k, v in per.items()}
        for fqn, per in osd["state"].items()
    }


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def assert_equal_state(a: dict, b: dict, what: str) -> None:
    """Same keys, and bit-identical tensors (nested dicts allowed)."""
    assert a.keys() == b.keys(), f"{what}: keys differ: {set(a) ^ set(b)}"
    for key in a:
        if isinstance(a[key], dict):
            assert_equal_state(a[key], b[key], f"{what}[{key}]")
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), f"{what}[{key}] differs"
        else:
            assert a[key] == b[key], f"{what}[{key}]: {a[key]} != {b[key]}"
