"""Views of a simulated :class:`~graphshard.passes.simulate.Timeline`: Chrome/Perfetto trace
and PNG.

Overlap is easiest to judge by eye: the trace opens in ``chrome://tracing`` or
ui.perfetto.dev, the PNG goes into reports and issues.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from graphshard.passes.simulate import Event, Timeline

__all__ = ["event_label", "render_png", "to_chrome_trace", "write_trace"]

_LANES = {"compute": 0, "comm": 1, "exposed": 2, "h2d": 3, "d2h": 4}
_SHORT = {
    "unshard": "AG",
    "all_gather": "AG",
    "reduce_grad": "RS",
    "reduce_scatter": "RS",
    "all_reduce": "AR",
}
_COLORS = {"compute": "#4c9a5f", "AG": "#3b6fb6", "RS": "#e08a2c", "comm": "#8c8c8c",
           "h2d": "#7b5ea7", "d2h": "#b5799e"}
_EXPOSED = "#d62728"


def event_label(event: Event) -> str:
    """Short label of a comm event: ``AG3``/``RS3`` for bucket 3; otherwise its name."""
    short = _SHORT.get(event.kind)
    if short is None:
        return event.name
    return short if event.bucket is None else f"{short}{event.bucket}"


def to_chrome_trace(timeline: Timeline, *, name: str = "graph") -> dict[str, Any]:
    """The timeline as Chrome trace-event JSON (``ts``/``dur`` in microseconds).

    Stalls on communication get their own ``exposed`` lane, coloured red.
    """
    trace: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": name}}
    ]
    present = {ev.lane for ev in timeline.events}
    for lane, tid in _LANES.items():
        if lane in ("h2d", "d2h") and lane not in present:
            continue  # CPU offload's copy streams, named only where the graph has them
        trace.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": lane}}
        )
        trace.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": 0,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
    for ev in timeline.events:
        exposed = ev.kind == "exposed"
        record: dict[str, Any] = {
            "name": event_label(ev) if ev.lane == "comm" else ev.name,
            "cat": ev.kind,
            "ph": "X",
            "ts": ev.start * 1e6,
            "dur": ev.duration * 1e6,
            "pid": 0,
            "tid": _LANES["exposed" if exposed else ev.lane],
            "args": {"kind": ev.kind, "bucket": ev.bucket, "node": ev.name},
        }
        if ev.lane == "compute" and not exposed:
            record["args"].update(ops=ev.ops, flops=ev.flops)
        if exposed:
            record["cname"] = "terrible"  # the trace viewer's red
        trace.append(record)
    return {
        "traceEvents": trace,
        "displayTimeUnit": "ms",
        "otherData": {
            "profile": timeline.profile,
            "total_time_s": timeline.total_time,
            "compute_time_s": timeline.compute_time,
            "comm_time_s": timeline.comm_time,
            "exposed_comm_s": timeline.exposed_comm,
            "copy_time_s": timeline.copy_time,
            "exposed_copy_s": timeline.exposed_copy,
            "peak_unsharded_bytes": timeline.peak_unsharded_bytes,
        },
    }


def write_trace(timeline: Timeline, path: str | os.PathLike, *, name: str = "graph") -> Path:
    """Write the Chrome trace JSON to ``path``; return it."""
    path = Path(path)
    path.write_text(json.dumps(to_chrome_trace(timeline, name=name)))
    return path


def render_png(timeline: Timeline, path: str | os.PathLike, *, title: str | None = None) -> Path:
    """Draw the compute and comm lanes (and CPU offload's copy streams, where the graph has
    them) as broken bars (ms), exposed waits in red."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ms = 1e3
    fig = Figure(figsize=(12, 2.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    rows = {"comm": 1, "compute": 0}
    for lane in ("h2d", "d2h"):  # CPU offload's copy streams, where the graph has them
        if any(ev.lane == lane for ev in timeline.events):
            rows[lane] = len(rows)
    comm = [ev for ev in timeline.events if ev.lane == "comm"]
    for ev in timeline.events:
        if ev.kind == "exposed":
            color, hatch = _EXPOSED, "//"
        elif ev.lane == "comm":
            color, hatch = _COLORS.get(_SHORT.get(ev.kind, ""), _COLORS["comm"]), None
        else:  # compute, or a copy (on the compute stream or its own)
            color, hatch = _COLORS.get(ev.kind, _COLORS["compute"]), None
        y = rows[ev.lane]
        ax.broken_barh(
            [(ev.start * ms, ev.duration * ms)],
            (y - 0.4, 0.8),
            facecolors=color,
            edgecolor="white",
            linewidth=0.3,
            hatch=hatch,
        )
        # Label every comm bar while there are few; only the wide ones otherwise.
        if ev.lane == "comm" and (len(comm) <= 24 or ev.duration >= 0.02 * timeline.total_time):
            ax.text(
                (ev.start + ev.duration / 2) * ms,
                y,
                event_label(ev),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
                clip_on=True,
            )
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlim(0, max(timeline.total_time, 1e-12) * ms)
    ax.set_xlabel("time (ms)")
    if title is None:
        title = (
            f"{timeline.profile or 'simulated'}: step {timeline.total_time * ms:.3f} ms, "
            f"exposed comm {timeline.exposed_comm * ms:.3f} ms"
        )
        if timeline.copy_time:
            title += f", waiting on host-device copies {timeline.exposed_copy * ms:.3f} ms"
    ax.set_title(title, fontsize=10)
    legend = [
        Patch(color=_COLORS["compute"], label="compute"),
        Patch(color=_COLORS["AG"], label="all-gather (unshard)"),
        Patch(color=_COLORS["RS"], label="reduce-scatter (grads)"),
        Patch(facecolor=_EXPOSED, hatch="//", label="exposed comm"),
    ]
    if any(_SHORT.get(ev.kind) not in ("AG", "RS") for ev in comm):
        legend.insert(3, Patch(color=_COLORS["comm"], label="other comm"))
    for kind, label in (("h2d", "copy to device"), ("d2h", "copy to host")):
        if any(ev.kind == kind for ev in timeline.events):
            legend.insert(-1, Patch(color=_COLORS[kind], label=label))
    ax.legend(
        handles=legend,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35),
        ncol=len(legend),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path
