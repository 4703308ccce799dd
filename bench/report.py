"""The report: one record per system from the ranks' measurements, and its markdown table.

Pure functions of plain data (no process group), so they can be tested without ranks.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

from bench.comm import communication
from bench.timing import step_stats

# The fields of every system object in the JSON report, in order.
FIELDS: tuple[str, ...] = (
    "system",
    "step_s_median",
    "step_s_p90",
    "compile_s",
    "peak_mem_bytes",
    "collectives_per_step",
    "bytes_per_step",
    "final_loss",
    "predicted_step_s",
    "notes",
)


def summarize(name: str, per_rank: list[dict], warmup: int) -> dict:
    """One system's record from what each rank measured (see :data:`FIELDS`).

    Statistics skip the first ``warmup`` steps. A failure on any rank leaves every number
    None and the ranks' errors in ``notes``.
    """
    record: dict[str, Any] = dict.fromkeys(FIELDS)
    record["system"] = name
    errors = [f"rank {r}: {res['error']}" for r, res in enumerate(per_rank) if "error" in res]
    if errors:
        record["notes"] = "; ".join(["failed", *errors])
        return record
    ranks = [res for res in per_rank if not res.get("idle")]
    notes = list(dict.fromkeys(n for res in ranks for n in res["notes"]))  # unique, in order
    record.update(step_stats(ranks, warmup))
    record.update(communication(ranks, notes))
    record["peak_mem_bytes"] = max(res["peak_mem_bytes"] for res in ranks)
    record["peak_mem_bytes_by_rank"] = [res["peak_mem_bytes"] for res in ranks]
    record["notes"] = "; ".join(notes) or None
    return record


def machine_info(device: str) -> dict[str, Any]:
    """Where the numbers were taken: platform, CPUs, torch version, device name."""
    if device == "cuda":
        name = torch.cuda.get_device_name(0)
    else:
        name = platform.processor() or platform.machine()
        cpuinfo = Path("/proc/cpuinfo")
        if cpuinfo.exists():
            for line in cpuinfo.read_text().splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "device": device,
        "device_name": name,
    }


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value is not None and base else "n/a"


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value * scale:,.{digits}f}"


def to_markdown(report: dict) -> str:
    """The report as a markdown table, ratios against fsdp2-eager and single-compiled."""
    systems = report["systems"]
    by_name = {s["system"]: s for s in systems}
    fsdp = by_name.get("fsdp2-eager", {})
    single = by_name.get("single-compiled", {})
    cfg = report["config"]
    lines = [
        f"{cfg['model']} ({report['reference']['params']:,} parameters), world size "
        f"{cfg['world_size']}, batch {cfg['batch_size']}x{cfg['seq_len']} per rank, "
        f"{cfg['steps']} steps ({cfg['warmup']} warm-up), {report['machine']['device_name']}, "
        f"torch {report['machine']['torch']}",
        "",
        "| system | median ms | p90 ms | compile s | vs fsdp2-eager | vs single-compiled "
        "| peak mem MiB | mem vs fsdp2-eager | collectives/step | MB sent/rank/step "
        "| final loss | predicted ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in systems:
        median, mem = s["step_s_median"], s["peak_mem_bytes"]
        loss = "n/a" if s["final_loss"] is None else f"{s['final_loss']:.4f}"
        lines.append(
            f"| {s['system']} | {_fmt(median, 1e3)} | {_fmt(s['step_s_p90'], 1e3)} "
            f"| {_fmt(s['compile_s'], 1, 2)} | {_ratio(median, fsdp.get('step_s_median'))} "
            f"| {_ratio(median, single.get('step_s_median'))} | {_fmt(mem, 2**-20, 2)} "
            f"| {_ratio(mem, fsdp.get('peak_mem_bytes'))} "
            f"| {'n/a' if s['collectives_per_step'] is None else s['collectives_per_step']} "
            f"| {_fmt(s['bytes_per_step'], 1e-6, 3)} | {loss} "
            f"| {_fmt(s['predicted_step_s'], 1e3)} |"
        )
    ref = report["reference"]
    measured = by_name.get("graphshard-compiled", {}).get("bytes_per_step")
    lines += [
        "",
        f"ZeRO-3 formula (N-1)/N * Psi * (2*4 + 4) = {ref['zero3_bytes_per_rank']:,.0f} bytes "
        f"per rank per step; graphshard-compiled measured "
        f"{'n/a' if measured is None else f'{measured:,}'} bytes "
        f"({_ratio(measured, ref['zero3_bytes_per_rank'])} of the formula).",
    ]
    noted = [s for s in systems if s["notes"]]
    if noted:
        lines += ["", "Notes:", ""]
        lines += [f"- {s['system']}: {s['notes']}" for s in noted]
    return "\n".join(lines) + "\n"
