"""Communication per step: profiled ``c10d::`` collectives, graphshard's own count, ZeRO-3 bytes.

One home for the byte rules, so profiled and compiled systems are counted the same way.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from bench.systems import System

# c10d op -> (collective kind, index of the argument that holds the full buffer).
_COLLECTIVES: dict[str, tuple[str, int]] = {
    "c10d::_allgather_base_": ("all_gather", 0),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d::allgather_": ("all_gather", 0),
    "c10d::allgather_coalesced_": ("all_gather", 0),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_": ("reduce_scatter", 1),
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::allreduce_coalesced_": ("all_reduce", 0),
    "c10d::broadcast_": ("broadcast", 0),
    "c10d::alltoall_base_": ("all_to_all", 1),
}
_NOT_COMMUNICATION = {"c10d::barrier", "c10d::monitored_barrier_"}
_DTYPE_BYTES = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
}


def _numel(shape: Any) -> int:
    """Elements of a recorded shape: a list of ints (one tensor) or nested lists (a list)."""
    if all(isinstance(d, int) for d in shape):
        return math.prod(shape)
    return sum(_numel(s) for s in shape)


# Bytes one rank sends on a ring, per byte of the full buffer, times (N-1)/N.
RING_FACTOR: dict[str, float] = {
    "all_gather": 1.0,
    "reduce_scatter": 1.0,
    "broadcast": 1.0,
    "all_reduce": 2.0,
    "all_to_all": 1.0,
}
# gloo has no reduce-scatter: it all-reduces the whole input and keeps one chunk
# (``graphshard.api.reduce_scatter``), so its reduce-scatter sends what an all-reduce sends.
GLOO_RING_FACTOR = {**RING_FACTOR, "reduce_scatter": RING_FACTOR["all_reduce"]}


def _shapes(event: Any) -> list[Any]:
    """The event's argument shapes.

    torch 2.13 records ``structured_input_shapes`` (a list of shapes for a tensor-list
    argument); older torch (2.11) has only the flat ``shapes``, where a tensor list is ``[]``.
    """
    structured = getattr(event, "structured_input_shapes", None)
    return structured() if structured is not None else event.shapes()


def count_collectives(events: list[Any], world_size: int, default_elem: int,
                      gloo: bool = False) -> dict[str, Any]:
    """Count the ``c10d::`` collectives among profiler events and the ring bytes one rank sends.

    ``default_elem`` is the element size used where the profiler records no dtype (tensor-list
    arguments). ``gloo``: the collectives ran on gloo, whose reduce-scatter sends as much as
    an all-reduce. Returns counts per kind, ``total``, ``bytes``, any unrecognised c10d ops and
    ``unsized``: collectives whose buffer the profiler did not size (a tensor-list argument
    on a torch without ``structured_input_shapes``, or a list of lists), counted as 0 bytes.
    """
    ring = (world_size - 1) / world_size
    factors = GLOO_RING_FACTOR if gloo else RING_FACTOR
    counts = dict.fromkeys(RING_FACTOR, 0)
    sent = 0.0
    unsized = 0
    unrecognised: set[str] = set()
    for event in events:
        name = event.name()
        if not name.startswith("c10d::") or name in _NOT_COMMUNICATION:
            continue
        if name not in _COLLECTIVES:
            unrecognised.add(name)
            continue
        kind, arg = _COLLECTIVES[name]
        counts[kind] += 1
        shapes, dtypes = _shapes(event), event.dtypes()
        dtype = dtypes[arg] if arg < len(dtypes) else ""
        # An empty shape without a tensor dtype is a list the profiler did not size.
        if arg >= len(shapes) or (shapes[arg] == [] and dtype in ("", "TensorList")):
            unsized += 1
            continue
        elem = _DTYPE_BYTES.get(dtype, default_elem)
        sent += factors[kind] * ring * _numel(shapes[arg]) * elem
    return {
        **counts,
        "total": sum(counts.values()),
        "bytes": int(round(sent)),
        "unrecognised": sorted(unrecognised),
        "unsized": unsized,
    }


def count_logged(entries: list[Any], world_size: int) -> dict[str, Any]:
    """:func:`count_collectives` for the collectives a fake world logged (``kind``,
    ``full_bytes``; see :func:`bench.fake_world.collective_log`), with the same ring rule."""
    ring = (world_size - 1) / world_size
    counts = dict.fromkeys(RING_FACTOR, 0)
    unrecognised: set[str] = set()
    sent = 0.0
    for entry in entries:
        if entry.kind not in RING_FACTOR:
            unrecognised.add(entry.kind)
            continue
        counts[entry.kind] += 1
        sent += RING_FACTOR[entry.kind] * ring * entry.full_bytes
    return {
        **counts,
        "total": sum(counts.values()),
        "bytes": int(round(sent)),
        "unrecognised": sorted(unrecognised),
        "unsized": 0,
    }


def graphshard_summary(system: System, device: torch.device) -> dict:
    """``step_summary`` of the graphs the graphshard backend compiled, on the matching profile,
    with the bytes graphshard's own kernels move (``copy_bytes``) and their floor
    (``copy_floor_bytes``, :mod:`graphshard.passes.traffic`), and ``checks``: the forward
    graphs that take a gather the optimizer step issued (each agrees on it in one small
    all-reduce, which the profiler sees).

    A failure is returned as ``{"error": ...}``: the profiled counts then stand in.
    """
    from graphshard.analysis.report import step_summary
    from graphshard.passes.cost_model import get_profile
    from graphshard.passes.markers import TAKE_PREFETCHED
    from graphshard.passes.traffic import step_traffic

    profile = "h100-nvlink" if device.type == "cuda" else "cpu-gloo"
    graphs = system.backend.graphs
    try:
        summary = step_summary(graphs, get_profile(profile))
        copies = step_traffic(graphs)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    checks = sum(
        any(n.target is TAKE_PREFETCHED for n in stages["fw"].graph.nodes)
        for stages in graphs if "fw" in stages
    )
    return {**summary, "profile": profile, "graphs": len(graphs), "checks": checks,
            "copy_bytes": copies.total, "copy_floor_bytes": copies.total_minimum,
            "copy_bytes_by_category": {k: v for k, v in copies.moved.items() if v}}


def communication(ranks: list[dict], notes: list[str]) -> dict[str, Any]:
    """Collectives and bytes per step: graphshard's ``step_summary`` if any, else profiled."""
    comm = [res["comm"] for res in ranks]
    out: dict[str, Any] = {
        "collectives_per_step": max(c["total"] for c in comm),
        "bytes_per_step": max(c["bytes"] for c in comm),
        "comm_profiled": comm[0],
    }
    if any((c["total"], c["bytes"]) != (comm[0]["total"], comm[0]["bytes"]) for c in comm):
        notes.append("profiled collectives differ between ranks; the largest is reported")
    unrecognised = sorted({op for c in comm for op in c["unrecognised"]})
    if unrecognised:
        notes.append(f"c10d ops without a byte rule (counted as 0 bytes): {unrecognised}")
    unsized = max(c.get("unsized", 0) for c in comm)
    if unsized:
        notes.append(f"{unsized} collectives on tensor lists counted as 0 bytes (the profiler "
                     "recorded no shapes for them)")
    summary = ranks[0].get("summary")
    if summary is None:
        return out
    if "error" in summary:
        notes.append(f"step_summary failed ({summary['error']}): collectives and bytes are the "
                     "profiled ones, predicted_step_s is missing")
        return out
    out.update(
        collectives_per_step=(
            summary["all_gathers"] + summary["reduce_scatters"] + summary.get("all_reduces", 0)
            + summary.get("checks", 0)
        ),
        copy_bytes_per_step=summary.get("copy_bytes"),
        copy_floor_bytes=summary.get("copy_floor_bytes"),
        bytes_per_step=summary["bytes_sent_per_rank"],
        predicted_step_s=summary["predicted_step_s"],
        graphshard_summary=summary,
    )
    if out["collectives_per_step"] != comm[0]["total"]:
        notes.append(f"step_summary counts {out['collectives_per_step']} collectives, the "
                     f"profiler saw {comm[0]['total']}")
    return out


def zero3_bytes(num_params: int, world_size: int, b_param: int = 4, b_reduce: int = 4) -> float:
    """Bytes one rank sends per ZeRO-3 step: ``(N-1)/N * Psi * (2*b_param + b_reduce)``."""
    return (world_size - 1) / world_size * num_params * (2 * b_param + b_reduce)
