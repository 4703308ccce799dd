"""A fingerprint of the sharding plan, compared across ranks before the first collective.

Collectives only work when every rank issues the same ones in the same order, with the same
sizes. Ranks that built a different model, passed different ``buckets`` or backend options,
or run at a different world size would issue different collectives: at best a hang until
the process-group timeout, at worst a gather that silently mixes unrelated tensors. So
before the first collective graphshard compares, across the ranks of the sharding group:

- at :func:`graphshard.shard`: world size, every parameter (names, full shape, dtype,
  bucket), the bucket names and the sharding options (:func:`shard_fingerprint`);
- at :func:`graphshard.shard`, the values every rank holds (a hash of each parameter's
  and each buffer's bytes, before sharding; :func:`check_shard_values`): each rank keeps its
  rows of its own copy, so copies that differ (different seeds, a model ``to_empty``'d
  before ``shard()``) would make a model no rank built; a buffer stays whole on every rank,
  so one that differs (a random projection built without the seed) makes each rank compute
  another function, and their gradients are averaged as if they were one;
- at the first compile of a graph: the backend's plan options and every ``unshard`` marker
  of the graph (name, shape, dtype, bucket, policy) (:func:`graph_fingerprint`).

A rank compares one digest (one tiny collective); only when digests differ does it gather
the full fingerprints to name the difference in a :class:`PlanMismatchError`. Nothing is
compared on a fake process group (offline tracing) or at world size 1.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from graphshard.errors import PlanMismatchError
from graphshard.passes.markers import is_unshard, marker_args

__all__ = [
    "PlanMismatchError",
    "shard_fingerprint",
    "graph_fingerprint",
    "compare_across_ranks",
    "check_shard_plan",
    "check_shard_values",
    "check_compile_plan",
]

# (group name, digest) pairs this process already compared: a graph recompiled on one rank
# only (say, a smaller last batch) must not start a collective the others never join.
_compared: set[tuple[str, str]] = set()


def stable_repr(value: Any) -> str | None:
    """A rank-independent text for a plan value, or None to leave it out of the fingerprint
    (objects whose repr holds addresses, process groups)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.Size)):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (list, tuple)):
        parts = [stable_repr(v) for v in value]
        return None if None in parts else "[" + ", ".join(parts) + "]"  # type: ignore[arg-type]
    if isinstance(value, Mapping):
        parts = [f"{k!r}: {r}" for k, v in value.items() if (r := stable_repr(v)) is not None]
        return "{" + ", ".join(parts) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        inner = [
            f"{f.name}={r}"
            for f in dataclasses.fields(value)
            if (r := stable_repr(getattr(value, f.name))) is not None
        ]
        return f"{type(value).__name__}(" + ", ".join(inner) + ")"
    if type(value).__name__ == "DeviceMesh":
        return f"DeviceMesh(shape={tuple(value.shape)}, dims={value.mesh_dim_names})"
    return None


_STATE_SKIP = {"group", "rank", "params", "world_size", "reshard_after_forward", "bucket_names",
               # the records by bucket (compared as "params"), and what eager forwards and
               # backwards hold for a moment (graphshard.api.bucket_gathers, .eager_reshard)
               "bucket_members", "bucket_stash", "buckets_gathered", "reshard_copies",
               "resharded_live", "regathered", "regathered_clear_queued", "root_resharding",
               "reshard_kept", "bucket_prefetched", "bucket_order_now", "bucket_next",
               "bucket_relay", "regather_pending"}


def shard_fingerprint(state: Any) -> dict[str, str]:
    """What every rank's :class:`graphshard.api.sharding.ShardState` must agree on."""
    fp = {
        "world size": str(state.world_size),
        "reshard_after_forward": str(state.reshard_after_forward),
        "buckets": json.dumps(list(state.bucket_names)),
        "parameter order": json.dumps([e.names[0] for e in state.params]),
    }
    for entry in state.params:
        fp["parameter " + ", ".join(entry.names)] = (
            f"shape={tuple(entry.full_shape)} dtype={entry.param.dtype} bucket={entry.bucket} "
            f"pinned={entry.pinned} requires_grad={entry.param.requires_grad}"
        )
    if dataclasses.is_dataclass(state):
        for f in dataclasses.fields(state):
            if f.name in _STATE_SKIP or "rank" in f.name or "group" in f.name:
                continue
            text = stable_repr(getattr(state, f.name))
            if text is not None:
                fp[f"shard option {f.name}"] = text
    return fp


def graph_fingerprint(gm: fx.GraphModule, plan: Any) -> dict[str, str]:
    """The backend options and the ``unshard`` markers of a Dynamo graph, in order."""
    fp: dict[str, str] = {}
    if dataclasses.is_dataclass(plan):
        for f in dataclasses.fields(plan):
            text = stable_repr(getattr(plan, f.name))
            if text is not None:
                fp[f"backend option {f.name}"] = text
    order = []
    for node in gm.graph.nodes:
        if not is_unshard(node):
            continue
        args = marker_args(node)._asdict()
        name = args.pop("name")
        order.append(name)
        parts = []
        for key, value in args.items():
            if "group" in key or isinstance(value, fx.Node):
                continue
            text = stable_repr(value)
            if text is not None:
                parts.append(f"{key}={text}")
        shard = node.args[0]
        example = shard.meta.get("example_value", shard.meta.get("val")) \
            if isinstance(shard, fx.Node) else None
        if isinstance(example, torch.Tensor):
            parts.append(f"dtype={example.dtype}")
        fp[f"marker {name}"] = " ".join(parts)
    fp["marker order"] = json.dumps(order)
    return fp


def _skip(group: dist.ProcessGroup | None) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return True
    if dist.get_backend(group) == "fake":
        return True
    return dist.get_world_size(group) <= 1


def _digest(fp: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(fp.items())).encode()).hexdigest()


def describe_differences(fps: list[dict[str, str]], ranks: list[int], limit: int = 12) -> str:
    """Text naming what each rank's fingerprint has that the first rank's does not."""
    ref = fps[0]
    lines = []
    for rank, fp in zip(ranks[1:], fps[1:], strict=True):
        if fp == ref:
            continue
        diffs = []
        for key in ref:
            if key not in fp:
                diffs.append(f"{key}: only on rank {ranks[0]}")
            elif fp[key] != ref[key]:
                diffs.append(f"{key}: rank {ranks[0]} has {ref[key]}, rank {rank} has {fp[key]}")
        diffs += [f"{key}: only on rank {rank}" for key in fp if key not in ref]
        shown = diffs[:limit] + ([f"... and {len(diffs) - limit} more"] if len(diffs) > limit
                                 else [])
        lines.append(f"rank {rank} vs rank {ranks[0]}:\n    " + "\n    ".join(shown))
    return "\n  ".join(lines)


_DIFFERENT_COLLECTIVES = (
    "so they would issue different collectives (a hang or silently wrong results); stopped "
    "before the first one"
)


# Why ranks read different parameters, and what to change (compiled and eager messages).
READS_DIFFER = (
    "Control flow that depends on the data or on the rank changes which parameters a rank "
    "reads; the common case is a mixture of experts that skips an expert no token was "
    "routed to (`if idx.numel() == 0: continue`). Call every module on every rank at every "
    "step (an expert given an empty slice of tokens computes nothing and gets a zero "
    "gradient), or hold the experts in stacked parameters of one module (as Hugging Face's "
    "Mixtral does)."
)

_OPTIONS_DIFFER = (
    "Every rank must compile the same model with the same graphshard.backend(...) options "
    "(prefetch_depth, bucketing, bucket_bytes, profile, ...)."
)


def _compile_plan_fix(fps: list[dict[str, str]]) -> str:
    """What to change, by what differs: the options, the parameters read, or how they are
    read (gradient sync, frozen, dtype)."""
    ref = fps[0]
    differing = {key for fp in fps[1:] for key in ref.keys() | fp.keys()
                 if fp.get(key) != ref.get(key)}
    advice = []
    if any(key.startswith("backend option") for key in differing):
        advice.append(_OPTIONS_DIFFER)
    if len({fp.get("marker order") for fp in fps}) > 1:
        advice.append("The ranks traced different code: each compiled graph must read the "
                      "same parameters in the same order on every rank. " + READS_DIFFER)
    elif any(key.startswith("marker ") for key in differing):
        advice.append("The ranks read the same parameters in different ways: enter "
                      "graphshard.no_sync(model) (or set_requires_gradient_sync), freeze "
                      "parameters and cast the model on every rank alike.")
    return " ".join(advice) or _OPTIONS_DIFFER


def compare_across_ranks(
    fp: Mapping[str, str],
    group: dist.ProcessGroup | None,
    what: str,
    fix: str | Callable[[list[dict[str, str]]], str],
    consequence: str = _DIFFERENT_COLLECTIVES,
) -> None:
    """Raise :class:`PlanMismatchError` on every rank of ``group`` unless all ranks hold the
    same fingerprint. A collective over ``group`` (skipped on fake groups and world size 1).
    ``fix`` says what to change: a text, or a function of every rank's fingerprint."""
    if _skip(group):
        return
    size = dist.get_world_size(group)
    digests: list[Any] = [None] * size
    dist.all_gather_object(digests, _digest(fp), group=group)
    if len(set(digests)) == 1:
        return
    fps: list[Any] = [None] * size
    dist.all_gather_object(fps, dict(fp), group=group)
    ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(size)]
    if callable(fix):
        fix = fix(fps)
    raise PlanMismatchError(
        f"graphshard: the {what} differs between ranks, {consequence}.\n  "
        f"{describe_differences(fps, ranks)}\n{fix}"
    )


def _groups_of(state: Any) -> list[dist.ProcessGroup]:
    mesh = getattr(state, "mesh", None)
    if mesh is not None and getattr(mesh, "ndim", 1) > 1:
        return [mesh.get_group(d) for d in range(mesh.ndim)]
    return [state.group]


def check_shard_plan(state: Any) -> None:
    """Compare :func:`shard_fingerprint` over the sharding group(s); called by ``shard()``."""
    fp = shard_fingerprint(state)
    for group in _groups_of(state):
        compare_across_ranks(
            fp, group, "sharded model",
            "Every rank must build the same model (same shapes and dtypes) and call "
            "graphshard.shard() with the same buckets and options.",
        )


def value_digest(tensor: torch.Tensor) -> str:
    """A hash of a tensor's bytes (NaNs and uninitialised memory included)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):  # tensor parallel: this rank's part (dp peers share it)
        tensor = tensor.to_local()
    data = tensor.detach().reshape(-1).contiguous().view(torch.uint8).cpu()
    return hashlib.blake2b(data.numpy().tobytes(), digest_size=8).hexdigest()


def check_shard_values(state: Any, params: Sequence[tuple[torch.Tensor, str]],
                       buffers: Sequence[tuple[torch.Tensor, str]] = ()) -> None:
    """Compare the values of the full ``(parameter, name)`` pairs, before they are sharded,
    and of the ``(buffer, name)`` pairs across the sharding group(s); meta tensors have none
    and are left out."""
    groups = [g for g in _groups_of(state) if not _skip(g)]
    if not groups:
        return
    values = {f"values of {name!r}": value_digest(p) for p, name in params if not p.is_meta}
    values |= {f"values of buffer {name!r}": value_digest(b) for b, name in buffers
               if not b.is_meta}
    for group in groups:
        compare_across_ranks(
            values, group, "parameter and buffer values given to graphshard.shard()",
            "Each rank keeps its rows of its own copy, so every rank must hold the same "
            "values: seed identically (torch.manual_seed) before building the model, or "
            "build it under torch.device('meta'), call graphshard.shard(), then "
            "model.to_empty(device=...) and initialise it (reset_parameters() / "
            "init_weights()) or load it (dcp.load, set_model_state_dict). A model "
            "to_empty'd before shard() holds uninitialised memory. Buffers stay whole on "
            "every rank and are compared too; register one meant to differ per rank after "
            "graphshard.shard().",
            "so the sharded model would be a mix of copies no rank holds; stopped before "
            "sharding",
        )


def check_compile_plan(gm: fx.GraphModule, plan: Any) -> None:
    """Compare :func:`graph_fingerprint` over the group of the graph's markers, once per
    distinct graph and plan in this process; called by the graphshard backend."""
    markers = [n for n in gm.graph.nodes if is_unshard(n)]
    if not markers:
        return
    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed.distributed_c10d import _resolve_process_group

    # the shard group, and for HSDP the replica group: every group the graph talks over
    names = [
        value
        for key, value in marker_args(markers[0])._asdict().items()
        if "group" in key and isinstance(value, str) and value
    ]
    fp = graph_fingerprint(gm, plan)
    digest = _digest(fp)
    for group_name in dict.fromkeys(names):
        if (group_name, digest) in _compared:
            continue
        compare_across_ranks(fp, _resolve_process_group(group_name), "compiled plan",
                             _compile_plan_fix)
        _compared.add((group_name, digest))
