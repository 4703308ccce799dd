"""Ranks must run the same eager forward; compared at its end, before backward.

Eagerly a module call all-gathers each parameter it reads (once: its later reads share the
copy, :mod:`graphshard.api.eager_gathers`), and collectives pair up by the order ranks issue
them: if rank 0 reads ``layers.0`` then ``layers.1`` and rank 1 the other way
round, same-shaped gathers pair across layers and the step computes garbage with no error.
The same holds when one rank alone is inside ``no_sync`` (it holds back a reduction the others
issue), freezes a layer (it skips that layer's reduce-scatter), or skipped an
``optimizer.step()`` (the ranks' shards then hold different steps of one model). Compiled
graphs are compared at their first compile (:func:`graphshard.safety.fingerprint.
check_compile_plan`).

At the end of each eager forward of a sharded model the ranks of its shard group compare a
64-bit digest of (the gradient-sync mode, the optimizer steps taken, the sequence of
parameters read and whether each is trained): one all-gather of 8 bytes per rank, about the
latency of one small collective per forward (tens of microseconds on NCCL; 0.55 ms on gloo
at world 2 on this 2-core machine under load). Only when the digests differ do the ranks
exchange the details, and every rank raises :class:`PlanMismatchError` naming the first
difference, before backward runs and before any optimizer step uses the wrong result.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from graphshard.errors import PlanMismatchError
from graphshard.passes.markers import GradSync
from graphshard.safety.fingerprint import READS_DIFFER, _skip
from graphshard.safety.gloo_gather import all_gather

__all__ = ["check_same_forward"]

_c10d = torch.ops._c10d_functional

_SYNC_NAMES = {GradSync.FULL: "synchronised", GradSync.PARTIAL: "reduce-scatter only (HSDP)",
               GradSync.NONE: "no_sync"}


def _digest(summary: Any) -> int:
    raw = hashlib.blake2b(repr(summary).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def _first_difference(summaries: list[Any]) -> str:
    """What rank r's forward did differently from rank 0's, for the first such rank."""
    sync0, steps0, reads0 = summaries[0]
    for rank, (sync, steps, reads) in enumerate(summaries[1:], start=1):
        if steps != steps0:
            return (f"rank 0 has taken {steps0} optimizer step(s) on this model, rank {rank} "
                    f"{steps}. Every rank must call optimizer.step() on every step (a step "
                    "skipped on one rank leaves the ranks' shards at different steps).")
        if sync != sync0:
            return (f"rank 0's forward ran with gradient sync '{_SYNC_NAMES.get(sync0, sync0)}'"
                    f", rank {rank}'s with '{_SYNC_NAMES.get(sync, sync)}'. Enter "
                    "graphshard.no_sync(model) (or set_requires_gradient_sync) on every rank "
                    "alike.")
        for index, (mine, theirs) in enumerate(zip(reads0, reads, strict=False)):
            if mine != theirs:
                return (f"read {index} of the forward: rank 0 read {_describe(mine)}, rank "
                        f"{rank} read {_describe(theirs)}. Every rank must read the parameters "
                        "in the same order and freeze the same ones (the reads gather). "
                        + READS_DIFFER)
        if len(reads) != len(reads0):
            return (f"rank 0's forward read {len(reads0)} parameters, rank {rank}'s "
                    f"{len(reads)}. Every rank must run the same modules. " + READS_DIFFER)
    return "the ranks' forwards differ"


def _describe(read: tuple[str, bool]) -> str:
    name, trained = read
    return f"{name!r}" + ("" if trained else " (frozen)")


def check_same_forward(state: Any, reads: list[tuple[str, bool]]) -> None:
    """Raise :class:`PlanMismatchError` on every rank of ``state``'s shard group unless all
    ran the same eager forward: ``reads`` is this rank's ``(parameter name, trained)`` in
    read order. A collective over the shard group (skipped at world 1 and on fake groups)."""
    group = state.group
    if _skip(group):
        return
    summary = (int(state.sync), state.optimizer_steps, reads)
    world = dist.get_world_size(group)
    device = state.mesh.device_type
    local = torch.tensor([_digest(summary)], dtype=torch.int64, device=device)
    gathered = _c10d.wait_tensor(all_gather(local, world, group.group_name))
    if bool((gathered == gathered[0]).all()):
        return
    summaries: list[Any] = [None] * world
    dist.all_gather_object(summaries, summary, group=group)
    raise PlanMismatchError(
        "graphshard: the ranks ran different eager forwards, so their collectives paired up "
        f"wrongly; stopped before backward. {_first_difference(summaries)}"
    )
