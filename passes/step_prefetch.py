"""Bind the forward's leading all-gathers to buffers the optimizer step gathers early.

A training step starts with the gathers the forward issues before it first computes with a
parameter (the first ``prefetch_depth + 1`` buckets, fewer under ``max_unsharded_bytes``):
nothing computes under them. With ``plan.step_prefetch`` each of them becomes
``graphshard::take_prefetched``: the same arguments and result as the all-gather, completed by
the same ``wait_tensor``, plus what the optimizer step needs to issue that gather itself as
soon as those shards are updated (the shards, in the order of the gathered buffer, and each
one's padded piece size). Its kernel (``graphshard.api.step_prefetch``) takes the buffer the
step gathered when every rank's input is still bit-identical to what it sent, else gathers as
before. The first of them also reads the others' inputs, so that the ranks agree on all of
them in one collective: those inputs (casts and pads of shards) move before it; nothing else
moves. A gather is bound only when its input is built from its shards by the lowering's plain
steps (cast, flatten, pad, concatenate), which the step can repeat exactly; CPU offload's
host-to-device copies are left alone.
"""

from __future__ import annotations

from torch import fx

from graphshard.passes.fx_util import ancestors_after, aten, c10d, graph_order, move_before, prims
from graphshard.passes.markers import PREFETCH_BY_BREAK, PREFETCH_BY_STEP, TAKE_PREFETCHED
from graphshard.passes.plan import Plan

__all__ = ["step_prefetch", "leading_gathers"]


# What the lowering rebuilds parameters from a gathered buffer with: not compute on them.
_REBUILD = {aten.view.default, aten.slice.Tensor, aten.clone.default, aten._unsafe_view.default,
            aten.alias.default, c10d.wait_tensor.default}


def leading_gathers(graph: fx.Graph) -> list[fx.Node]:
    """The parameter all-gathers issued before the graph first computes with a parameter
    (beyond rebuilding it from the gathered buffer)."""
    found: list[fx.Node] = []
    derived: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        tag = node.meta.get("graphshard") or {}
        if tag.get("kind") == "unshard" and node.target is c10d.all_gather_into_tensor.default:
            found.append(node)
            derived.add(node)
        elif any(a in derived for a in node.all_input_nodes):
            if node.target not in _REBUILD:
                break
            derived.add(node)
    return found


def _shard_of(piece: fx.Node) -> fx.Node | None:
    """The shard placeholder a gather piece is built from (flatten, then an optional cast
    before and an optional zero pad after), or None for anything else."""
    node = piece
    if node.target is aten.constant_pad_nd.default:
        if node.args[2:] not in ((), (0.0,), (0,)):
            return None
        node = node.args[0]
    if node.target is not aten.view.default or list(node.args[1]) != [-1]:
        return None
    node = node.args[0]
    if node.target is prims.convert_element_type.default:
        node = node.args[0]
    return node if node.op == "placeholder" else None


def _pieces(gather: fx.Node) -> list[tuple[fx.Node, int]] | None:
    """``(shard, padded piece numel)`` per slot of the gathered buffer, or None when the
    gather's input is not the plain concatenation of its shards' pieces."""
    flat = gather.args[0]
    parts = flat.args[0] if flat.target is aten.cat.default else [flat]
    if flat.target is aten.cat.default and flat.args[1:] not in ((), (0,)):
        return None
    pieces = []
    for part in parts:
        shard = _shard_of(part)
        if shard is None:
            return None
        pieces.append((shard, part.meta["val"].numel()))
    return pieces


def step_prefetch(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Turn the forward's leading all-gathers into ``take_prefetched`` (the all-gather, which
    the optimizer step, or with ``plan.break_prefetch`` the end of the forward graph before a
    graph break, may have issued already)."""
    sources = (PREFETCH_BY_STEP * plan.step_prefetch) + (PREFETCH_BY_BREAK * plan.break_prefetch)
    if not sources:
        return gm
    bound = []
    for gather in leading_gathers(gm.graph):
        pieces = _pieces(gather)
        if pieces is not None and int(gather.args[1]) > 1:
            tag = gather.meta["graphshard"]
            key = f"{gather.args[2]}/{tag['bucket']}/{len(pieces)}/{tag['params'][0]}"
            bound.append((gather, pieces, key))
    lead = "|".join(key for _, _, key in bound)  # names the graph these gathers lead
    for i, (gather, pieces, key) in enumerate(bound):
        peers = bound[1:] if i == 0 else []
        gather.target = TAKE_PREFETCHED
        gather.kwargs = {
            "shards": [shard for shard, _ in pieces],
            "piece_numels": [numel for _, numel in pieces],
            "key": key,
            "lead": lead,
            "peers": [peer.args[0] for peer, _, _ in peers],
            "peer_keys": [peer_key for _, _, peer_key in peers],
            "sources": sources,
        }
    if len(bound) > 1:  # the others' inputs (casts and pads of shards) before the first
        first = bound[0][0]
        for peer, _, _ in bound[1:]:
            position = graph_order(gm.graph)
            move_before(ancestors_after(peer.args[0], position, position[first]), first)
    return gm
