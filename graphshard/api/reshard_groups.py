"""``shard(reshard_after_forward=k)``: the groups of ``k`` ranks the backward gathers over.

FSDP2 takes an integer ``reshard_after_forward`` (its ``post_forward_mesh``): after the
forward each rank keeps ``1 / k`` of every parameter, and the backward all-gathers within a
group of ``k`` ranks, a node's GPUs where ``k`` is the GPUs per node. graphshard splits each
group the parameters are sharded over into consecutive runs of ``k`` of its ranks, as
FSDP2's ``mesh.view(-1, k)`` does; the compiled graphs then keep and gather the pieces
(:mod:`graphshard.passes.group_reshard`), and eagerly the saved-tensor hooks do
(:mod:`graphshard.api.eager_reshard`).
"""

from __future__ import annotations

import torch.distributed as dist

from graphshard.errors import GraphshardValueError

__all__ = ["resolve_reshard"]

# (shard group's name, k) -> this rank's group of k: made once while it lives
_GROUPS: dict[tuple[str, int], dist.ProcessGroup] = {}


def resolve_reshard(reshard_after_forward: bool | int | str, group: dist.ProcessGroup,
                    ) -> tuple[bool | int | str, dist.ProcessGroup | None]:
    """``reshard_after_forward`` as the model keeps it, and for an integer ``k`` strictly
    between 1 and the ranks of ``group`` this rank's group of ``k`` ranks. ``1`` reads as
    ``False`` (a rank keeps the whole parameter), the group's size as ``True``, as FSDP2
    reads them. Every rank must call it (new groups are made over the default group)."""
    if isinstance(reshard_after_forward, bool) or not isinstance(reshard_after_forward, int):
        return reshard_after_forward, None
    k, world = reshard_after_forward, dist.get_world_size(group)
    if k < 1 or world % k:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise GraphshardValueError(
            f"graphshard.shard() option reshard_after_forward={k}: an integer must divide "
            f"the {world} ranks the parameters are sharded over (each group of that many "
            f"ranks gathers the parameters again in the backward, the GPUs of one node "
            f"where it is their count); pass one of {divisors}, or True or False.")
    if k == 1:
        return False, None
    if k == world:
        return True, None
    key = (group.group_name, k)
    made = _GROUPS.get(key)
    # a group destroyed since (destroy_process_group) leaves torch's registry of groups
    if made is None or made not in dist.distributed_c10d._world.pg_map:
        made = _GROUPS[key] = _make_groups(group, k)
    return k, made


def _make_groups(group: dist.ProcessGroup, k: int) -> dist.ProcessGroup:
    """This rank's run of ``k`` ranks of ``group``, after every rank made every run of every
    group like ``group`` (HSDP's shard groups, one per replica; the data-parallel groups of
    a tensor-parallel mesh)."""
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == dist.get_world_size():
        groups = [ranks]  # the whole world: every rank knows it
    else:
        everyone: list[list[int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, ranks)
        groups = sorted({tuple(r) for r in everyone if r is not None})
    runs = [list(g[i:i + k]) for g in groups for i in range(0, len(g), k)]
    mine, _ = dist.new_subgroups_by_enumeration(runs)
    return mine
