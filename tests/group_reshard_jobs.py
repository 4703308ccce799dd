"""Rank jobs of ``tests/test_group_reshard.py``: ``shard(reshard_after_forward=2)`` at world 4,
trained against one process, and the groups it makes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from dist_utils import full_state
from parity import CASES, LR, MOMENTUM, STEPS, Case, batch
from parity_features import Blocks
from torch.distributed.device_mesh import init_device_mesh

import graphshard
from graphshard.passes.markers import is_collective_start


def _regression(gen: torch.Generator) -> tuple:
    return torch.randn(4, 8, generator=gen), torch.randn(4, 3, generator=gen)


# Every block under torch.utils.checkpoint: its forward is computed again in the backward,
# reading the parameters gathered over the group of 2.
CHECKPOINTED = Case(lambda: Blocks(ckpt=True), _regression, lambda model, b: model(*b))


def _case(name: str) -> Case:
    return CHECKPOINTED if name == "blocks_checkpointed" else CASES[name]


def _build(name: str) -> torch.nn.Module:
    torch.manual_seed(1234)
    return _case(name).build()


def _batch(name: str, step: int, rank: int) -> tuple:
    if name != "blocks_checkpointed":
        return batch(name, step, rank)
    return _regression(torch.Generator().manual_seed(1000 * step + rank))


# Per module (a dict): the first block kept from forward to backward, the second gathered
# again over groups of 2, the rest (embedding, final norm, output) freed over all ranks.
PER_MODULE = {"layers.0": False, "layers.1": 2}


def _setting(reshard: bool | int | str) -> bool | int | dict:
    return dict(PER_MODULE) if reshard == "per_module" else reshard


def _gathers(backend, stage: str) -> list[int]:
    """The group size of every all-gather of ``stage`` in the graphs ``backend`` compiled."""
    return [node.args[1] for stages in backend.graphs if stage in stages
            for node in stages[stage].graph.nodes
            if is_collective_start(node) and "all_gather" in str(node.target)]


def train(rank: int, world_size: int, name: str, mode: str, reshard: bool | int | str,
          precision: str) -> dict:
    """``name`` sharded with ``reshard_after_forward=reshard`` (``"per_module"``:
    :data:`PER_MODULE`) and trained ``STEPS`` steps
    (``mode``: "compiled" with Inductor, "lowered" with graphshard's passes and no Inductor,
    "lowered_last" also freeing the bucket read last, or "eager"); losses are the ranks'
    mean."""
    torch._dynamo.reset()
    policy = graphshard.MixedPrecision(param_dtype=torch.bfloat16) if precision == "bf16" \
        else None
    model = graphshard.shard(_build(name), reshard_after_forward=_setting(reshard),
                             mixed_precision=policy)
    backend = graphshard.backend(inductor=mode == "compiled",
                                 reshard_last_bucket=mode == "lowered_last")
    run = model if mode == "eager" else torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    with _eager_gathers() as eager:
        for step in range(STEPS):
            eager["phase"] = "fw"
            loss = _case(name).loss(run, _batch(name, step, rank))
            eager["phase"] = "bw"
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world_size)
    if mode == "eager":
        fw, bw = eager["fw"], eager["bw"]
    else:
        fw, bw = _gathers(backend, "fw"), _gathers(backend, "bw")
    return {"losses": losses, "state": full_state(model), "fw_gathers": fw, "bw_gathers": bw}


@contextlib.contextmanager
def _eager_gathers() -> Iterator[dict]:
    """The group size of each eager bucket gather, by phase (``"fw"`` / ``"bw"``, which the
    caller sets): ``graphshard.api.bucket_gathers`` issues them all, a forward's buckets and
    a backward's gathers again."""
    from graphshard.api import bucket_gathers

    seen: dict = {"phase": "fw", "fw": [], "bw": []}
    issue = bucket_gathers.all_gather

    def recorded(tensor, group_size, group_name):
        seen[seen["phase"]].append(group_size)
        return issue(tensor, group_size, group_name)

    bucket_gathers.all_gather = recorded
    try:
        yield seen
    finally:
        bucket_gathers.all_gather = issue


def reference(name: str, world_size: int) -> dict:
    """One process on every rank's batch, the losses averaged."""
    model = _build(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(STEPS):
        loss = sum(_case(name).loss(model, _batch(name, step, r))
                   for r in range(world_size)) / world_size
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach() for k, v in model.state_dict().items()}}


def groups(rank: int, world_size: int) -> dict:
    """The group of 2 of this rank, sharded over the world and over HSDP's shard groups of
    a (2, 2) mesh, whose groups the ranks exchange first; and the piece a rank keeps."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    from graphshard.api.reshard_groups import resolve_reshard

    out = {}
    world = dist.group.WORLD
    out["world"] = dist.get_process_group_ranks(resolve_reshard(2, world)[1])
    out["repeated"] = resolve_reshard(2, world)[1] is resolve_reshard(2, world)[1]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shard_group = mesh.get_group("shard")
    out["hsdp_alone"] = resolve_reshard(1, shard_group)  # 1 reads as False: no group
    from graphshard.api.reshard_groups import _make_groups

    out["hsdp_runs_of_1"] = dist.get_process_group_ranks(_make_groups(shard_group, 1))
    group = resolve_reshard(2, world)[1]
    full = torch.arange(7 * 3, dtype=torch.float32).view(7, 3)
    out["piece"] = torch.ops.graphshard.take_group_piece(full, 2, group.group_name)
    out["piece_group"] = _resolve_process_group(group.group_name) is group
    out["piece_0d"] = torch.ops.graphshard.take_group_piece(torch.tensor(2.5), 2,
                                                            group.group_name)
    return out


def run_jobs(rank: int, world_size: int, jobs: list[tuple]) -> dict:
    """Entry point for each rank: the groups, then every training job in turn."""
    results: dict = {"groups": groups(rank, world_size)}
    for job in jobs:
        results[job] = train(rank, world_size, *job)
    return results
