"""``shard(reshard_after_forward=k)``: between forward and backward each rank keeps its piece
of every freed parameter over a group of ``k`` ranks, and the backward gathers it again over
that group alone.

FSDP2's integer ``reshard_after_forward``: on ``n`` nodes of ``k`` GPUs, the forward gathers
over all ``n * k`` ranks, the backward only within a node, over the fast links, for ``k``
times the memory of a shard between the two (``1 / k`` of the parameter instead of
``1 / (n * k)``).

Two passes:

- :func:`keep_group_pieces` (joint graph, after ``reshard``): each freed ``unshard`` marker
  that carries a ``reshard_group`` gets a ``take_group_piece`` of its output (this rank's
  padded piece over the group, ``MUST_SAVE``) and a second ``unshard`` of that piece over
  the group (``MUST_RECOMPUTE``), which every reader of the parameter now reads. The
  partitioner then saves the piece, and the backward gathers the parameter from it. A kept
  marker (``reshard_after_forward`` False, the bucket read last) is left as it is. (A 0-D
  parameter's piece is its value, as a shard of it is: one element, so that every marker
  of a bucket gathers over the same group.)
- :func:`read_forward_gathers` (forward graph, first): in the forward that second gather
  would regather what was just gathered; its readers read the first one's output instead.

The piece is taken by the rank's place in the group at run time (``take_group_piece``), so
the graphs are the same on every rank.
"""

from __future__ import annotations

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from graphshard.passes.fx_util import NodeMaker
from graphshard.passes.markers import (
    RESHARD_FREE,
    TAKE_GROUP_PIECE,
    UNSHARD,
    is_unshard,
    marker_args,
)
from graphshard.passes.plan import Plan

__all__ = ["keep_group_pieces", "read_forward_gathers"]


def keep_group_pieces(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Readers of a freed marker with a ``reshard_group`` read its gather over the group
    from this rank's saved piece (module docstring)."""
    make = NodeMaker(gm.graph)
    for node in list(gm.graph.nodes):
        if not is_unshard(node):
            continue
        args = marker_args(node)
        if (args.reshard_size <= 1 or not node.users
                or node.meta.get("recompute") != CheckpointPolicy.MUST_RECOMPUTE):
            continue
        readers = list(node.users)
        with gm.graph.inserting_after(node), make.provenance(node):
            piece = make(TAKE_GROUP_PIECE, node, args.reshard_size, args.reshard_group)
        with gm.graph.inserting_after(piece), make.provenance(node):
            regather = make(
                UNSHARD, piece, list(args.full_shape), args.bucket, args.pinned,
                RESHARD_FREE, args.name, args.reshard_size, args.reshard_group,
            )
        for made, policy in ((piece, CheckpointPolicy.MUST_SAVE),
                             (regather, CheckpointPolicy.MUST_RECOMPUTE)):
            made.meta["recompute"] = policy
            if "ac_graph_id" in node.meta:
                made.meta["ac_graph_id"] = node.meta["ac_graph_id"]
            if "group_backend" in node.meta:
                made.meta["group_backend"] = node.meta["group_backend"]
        for reader in readers:
            reader.replace_input_with(node, regather)
    return gm


def read_forward_gathers(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """In a forward graph, a marker that gathers a ``take_group_piece`` of a parameter
    gathered in the same graph is that parameter: its readers read the first gather."""
    for node in list(gm.graph.nodes):
        if not is_unshard(node):
            continue
        piece = marker_args(node).shard
        if not (isinstance(piece, fx.Node) and piece.target is TAKE_GROUP_PIECE):
            continue
        node.replace_all_uses_with(piece.args[0])
        gm.graph.erase_node(node)
        if not piece.users:
            gm.graph.erase_node(piece)
    return gm
