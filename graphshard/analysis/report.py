"""What a scheduled graph will do: bucket table and predicted timeline (trace JSON and PNG)."""

from __future__ import annotations

from pathlib import Path

from torch import fx

from graphshard.analysis.timeline import render_png, write_trace
from graphshard.passes.cost_model import (
    HardwareProfile,
    collective_bytes_per_rank,
    collective_group,
    collective_kind,
    node_time,
    tensor_bytes,
)
from graphshard.passes.simulate import Timeline, simulate

__all__ = [
    "bucket_rows", "bucket_table", "collectives_by_group", "step_summary", "write_schedule",
]

STEP_STAGES = ("fw", "bw", "inference")


def bucket_rows(gm: fx.GraphModule, profile: HardwareProfile) -> list[dict]:
    """One row per lowered collective: kind, bucket, parameters, bytes on the wire, time."""
    rows = []
    for node in gm.graph.nodes:
        tag = node.meta.get("graphshard")
        if not tag:
            continue
        inputs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
        if any("val" not in i.meta for i in inputs):
            continue
        # a coalesced all-gather's value is its list of parameters
        full = node.meta["val"] if tag["kind"] == "unshard" else [i.meta["val"] for i in inputs]
        kind = collective_kind(node)
        world = tag.get("group_size") if kind in ("all_reduce", "all_to_all") else node.args[-2]
        rows.append(
            {
                "kind": kind,
                "bucket": tag["bucket"],
                "params": len(tag.get("params", [])),
                "names": tag.get("params", []),
                "unsharded_bytes": tensor_bytes(full),
                "world_size": int(world),
                "bytes_sent": collective_bytes_per_rank(node),
                "seconds": node_time(node, profile),
            }
        )
    return rows


def bucket_table(rows: list[dict]) -> str:
    """The rows as an aligned text table."""
    header = f"{'collective':<15}{'bucket':>7}{'params':>8}{'unsharded bytes':>17}{'time ms':>10}"
    header += "  first"
    lines = [header, "-" * len(header)]
    for r in rows:
        first = r["names"][0] if r["names"] else ""
        lines.append(
            f"{r['kind']:<15}{r['bucket']:>7}{r['params']:>8}"
            f"{r['unsharded_bytes']:>17,}{r['seconds'] * 1e3:>10.3f}  {first}"
        )
    return "\n".join(lines) + "\n"


def write_schedule(
    gm: fx.GraphModule, profile: HardwareProfile, directory: Path, stage: str, *, png: bool = True
) -> Timeline:
    """Write ``{stage}_schedule.txt``, ``{stage}_timeline.json`` (Perfetto) and the PNG."""
    directory.mkdir(parents=True, exist_ok=True)
    timeline = simulate(gm, profile)
    rows = bucket_rows(gm, profile)
    summary = (
        f"profile {profile.name}: predicted {timeline.total_time * 1e3:.3f} ms, compute "
        f"{timeline.compute_time * 1e3:.3f} ms, comm {timeline.comm_time * 1e3:.3f} ms, exposed "
        f"comm {timeline.exposed_comm * 1e3:.3f} ms, peak unsharded "
        f"{timeline.peak_unsharded_bytes / 2**20:.3f} MB\n\n"
    )
    (directory / f"{stage}_schedule.txt").write_text(summary + bucket_table(rows))
    write_trace(timeline, directory / f"{stage}_timeline.json", name=stage)
    if png:
        render_png(timeline, directory / f"{stage}_timeline.png", title=f"{stage} ({profile.name})")
    return timeline


def step_summary(graphs: list[dict[str, fx.GraphModule]], profile: HardwareProfile) -> dict:
    """Collectives, bytes and predicted time of one training step over all compiled graphs.

    ``graphs`` is ``GraphshardBackend.graphs``. Bytes are what one rank sends on a ring for
    graphshard's own collectives: ``(N-1)/N`` of each all-gather's or reduce-scatter's full
    (unsharded) buffer (also when the reduce-scatter runs as an all-to-all, on gloo),
    ``2(N-1)/N`` of an (HSDP) all-reduce's. Collectives graphshard did
    not insert (tensor parallelism's) are in :func:`collectives_by_group`; the predicted
    times include them.
    """
    counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "all_to_all": 0}
    sent = 0.0
    predicted = exposed = 0.0
    peak = 0
    for stages in graphs:
        for stage in STEP_STAGES:
            if stage not in stages:
                continue
            gm = stages[stage]
            for row in bucket_rows(gm, profile):
                counts[row["kind"]] += 1
                sent += row["bytes_sent"]
            timeline = simulate(gm, profile)
            predicted += timeline.total_time
            exposed += timeline.exposed_comm
            peak = max(peak, timeline.peak_unsharded_bytes)
    return {
        "all_gathers": counts["all_gather"],
        "reduce_scatters": counts["reduce_scatter"] + counts["all_to_all"],
        "reduce_scatters_as_all_to_all": counts["all_to_all"],
        "all_reduces": counts["all_reduce"],
        "bytes_sent_per_rank": int(round(sent)),
        "predicted_step_s": predicted,
        "predicted_exposed_comm_s": exposed,
        "peak_unsharded_bytes": peak,
    }



def collectives_by_group(
    graphs: list[dict[str, fx.GraphModule]], profile: HardwareProfile
) -> dict[str, dict]:
    """Every collective of one training step (graphshard's and any other, such as DTensor's
    tensor-parallel ones), by process group name: ``count``, ``bytes`` one rank sends (the
    ring formula of :func:`graphshard.passes.cost_model.collective_bytes_per_rank`) and ``seconds``
    (the cost model's time, overlapped or not)."""
    out: dict[str, dict] = {}
    for stages in graphs:
        for stage in STEP_STAGES:
            if stage not in stages:
                continue
            for node in stages[stage].graph.nodes:
                if collective_kind(node) is None:
                    continue
                group = out.setdefault(
                    collective_group(node)[0], {"count": 0, "bytes": 0.0, "seconds": 0.0}
                )
                group["count"] += 1
                group["bytes"] += collective_bytes_per_rank(node)
                group["seconds"] += node_time(node, profile)
    return out
