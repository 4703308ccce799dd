"""The report: one record per system from the ranks' measurements, and its markdown table.

Pure functions of plain data (no process group), so they can be tested without ranks.
"""

from __future__ import annotations

import math
import os
import platform
from pathlib import Path
from typing import Any

import torch

from bench.comm import communication
from bench.host_tax import HOST_BUCKETS
from bench.timing import inline_collective_stats, round_ratios, step_stats

# The system the others are compared with (``graphshard_ratio``).
REFERENCE = "graphshard-compiled"

# The fields of every system object in the JSON report, in order.
FIELDS: tuple[str, ...] = (
    "system",
    "step_s_median",
    "step_s_p10",
    "step_s_p90",
    "graphshard_ratio",
    "compile_s",
    "peak_mem_bytes",
    "collectives_per_step",
    "bytes_per_step",
    "wait_s",
    "copy_bytes_per_step",
    "copy_floor_bytes",
    "collective_s_median",
    "compute_s_median",
    "first_loss",
    "final_loss",
    "predicted_step_s",
    "host_tax",
    "device_time",
    "notes",
)


def _failure_note(per_rank: list[dict]) -> str | None:
    """``skipped: ...`` or ``failed ...`` from the ranks' ``skipped`` / ``error`` entries."""
    for key, word in (("skipped", "skipped"), ("error", "failed")):
        found = [(r, res[key]) for r, res in enumerate(per_rank) if key in res]
        if not found:
            continue
        messages = list(dict.fromkeys(msg for _, msg in found))
        if len(messages) == 1 and len(found) == len(per_rank):
            return f"{word} (every rank): {messages[0]}"
        return "; ".join([word, *(f"rank {r}: {msg}" for r, msg in found)])
    return None


def summarize(name: str, per_rank: list[dict], warmup: int) -> dict:
    """One system's record from what each rank measured (see :data:`FIELDS`).

    Statistics skip the first ``warmup`` steps. A system skipped (its package is missing) or
    failed on any rank has every number None and the reason in ``notes``.
    """
    record: dict[str, Any] = dict.fromkeys(FIELDS)
    record["system"] = name
    failure = _failure_note(per_rank)
    if failure:
        record["notes"] = failure
        return record
    ranks = [res for res in per_rank if not res.get("idle")]
    notes = list(dict.fromkeys(n for res in ranks for n in res["notes"]))  # unique, in order
    record.update(step_stats(ranks, warmup))
    record.update(inline_collective_stats(ranks, warmup))
    record.update(communication(ranks, notes))
    record["peak_mem_bytes"] = max(res["peak_mem_bytes"] for res in ranks)
    record["peak_mem_bytes_by_rank"] = [res["peak_mem_bytes"] for res in ranks]
    waits = [res["wait_s"] for res in ranks if res.get("wait_s") is not None]
    record["wait_s"] = max(waits) if waits else None
    record["host_tax"] = slowest_host_tax(ranks)
    record["device_time"] = slowest_device_time(ranks)
    prefetch = ranks[0].get("step_prefetch")
    if prefetch is not None:
        record["step_prefetch"] = prefetch
        if prefetch["stale"] or not prefetch["taken"]:
            notes.append(
                f"the optimizer step's gathers were taken {prefetch['taken']} times, stale "
                f"{prefetch['stale']} times (gathered again), none there {prefetch['fresh']} times"
            )
    record["notes"] = "; ".join(notes) or None
    return record


def slowest_host_tax(ranks: list[dict]) -> dict | None:
    """The host-tax split (:mod:`bench.host_tax`) of the rank whose profiled step took
    longest, with ``rank`` set; None where no rank measured one."""
    return _slowest(ranks, "host_tax")


def slowest_device_time(ranks: list[dict]) -> dict | None:
    """The device time (:mod:`bench.device_time`) of the rank whose profiled step took
    longest, with ``rank`` set; None where no rank measured one (a CPU run)."""
    return _slowest(ranks, "device_time")


def _slowest(ranks: list[dict], key: str) -> dict | None:
    measured = [(r, res[key]) for r, res in enumerate(ranks) if res.get(key)]
    if not measured:
        return None
    rank, split = max(measured, key=lambda item: item[1]["step_s"])
    return {**split, "rank": rank}


def device_time_lines(systems: list[dict], top: int = 5) -> list[str]:
    """A table of each system's device time per step (busy, idle, kernels, copies) and its
    largest kernels; no lines where no system measured one."""
    timed = [s for s in systems if s.get("device_time")]
    if not timed:
        return []
    lines = [
        "",
        f"Device time of a profiled step (the median of {timed[0]['device_time']['steps']}, "
        "slowest rank; bench/device_time.py): busy is the union of the device's kernels, "
        "copies and sets; idle is the step's time the device waited.",
        "",
        "| system | step ms | busy ms | idle ms | kernels | kernel ms | copy ms "
        f"| largest {top} kernels: ms (count) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in timed:
        d = s["device_time"]
        largest = "; ".join(f"`{name[:60]}` {sec * 1e3:.2f} ({count})"
                            for name, sec, count in d["top"][:top])
        lines.append(
            f"| {s['system']} | {d['step_s'] * 1e3:.1f} | {d['busy_s'] * 1e3:.1f} "
            f"| {d['idle_s'] * 1e3:.1f} | {d['kernels']} | {d['kernel_s'] * 1e3:.1f} "
            f"| {d['copy_s'] * 1e3:.1f} | {largest} |"
        )
    lines += ["", "Kernels by family, count (ms):", ""]
    for s in timed:
        families = s["device_time"].get("families") or {}
        ranked = sorted(families.items(), key=lambda item: -item[1][0])
        lines.append(f"- {s['system']}: " + ", ".join(
            f"{family} {count} ({sec * 1e3:.1f})" for family, (sec, count) in ranked))
    return lines


def fake_world_lines(systems: list[dict], reference: str = "single-compiled") -> list[str]:
    """A fake world's steps without their collectives: each system's time in the fake
    groups' collectives (local copies made inline, on the step's thread, where a real
    group's transfers run elsewhere), the step less that time, and that against
    ``reference``'s round by round. No lines without those measurements (a real world, CUDA).
    """
    measured = [s for s in systems if s.get("compute_s_median") is not None]
    if not measured:
        return []
    base = next((s for s in measured if s["system"] == reference), None)
    lines = [
        "",
        "The fake world's collectives are local copies made on the step's own thread. "
        f"Without them (the ratio is the step less them over {reference}'s, round by round):",
        "",
        f"| system | collectives ms | step without them ms | / {reference} (p10-p90) |",
        "|---|---:|---:|---:|",
    ]
    for s in measured:
        ratio = round_ratios(s["round_compute_s"], base["round_compute_s"]) if base else None
        lines.append(
            f"| {s['system']} | {_fmt(s['collective_s_median'], 1e3)} "
            f"| {_fmt(s['compute_s_median'], 1e3)} | {_spread(ratio)} |"
        )
    return lines


def host_tax_cell(split: dict | None) -> str:
    """``host: guards / wrappers / optimizer / rest`` in ms, per step; n/a without a split."""
    if not split:
        return "n/a"
    parts = " / ".join(f"{split[f'{b}_s'] * 1e3:.2f}" for b in HOST_BUCKETS)
    return f"{split['host_s'] * 1e3:.2f}: {parts}"


def add_ratios(records: list[dict], reference: str = REFERENCE) -> None:
    """Set every record's ``graphshard_ratio``: ``reference``'s step time over the record's,
    round by round (:func:`bench.timing.round_ratios`); None where either did not run."""
    ref = next((r for r in records if r["system"] == reference), None)
    for record in records:
        ok = ref is not None and ref.get("round_step_s") and record.get("round_step_s")
        record["graphshard_ratio"] = (
            round_ratios(ref["round_step_s"], record["round_step_s"]) if ok else None
        )


# The first steps whose losses every system of a group must share (a wrong gradient or update
# shows there within a few steps, before training's own chaos can amplify rounding), and how
# far apart, relatively, they may be: rounding moved fp32 systems by at most 1e-5 relative
# over 10 steps of llama-small; mixed precision casts at different places, so more.
LOSS_CHECK_STEPS = 10
LOSS_TOLERANCE = {"none": 1e-3, "bf16": 2e-2, "fp16": 2e-2}


def add_loss_checks(records: list[dict], alone: frozenset[str],
                    mixed_precision: str = "none") -> None:
    """Note every system whose first losses depart from its group's reference: systems that
    train the same model on the same batches must agree to rounding, so one that does not
    computes other gradients or updates (a bug, here or in a peer), and its time is not of
    the same training. The groups: the systems in ``alone``, which train the whole model on
    rank 0's batch (the one-process systems; in a fake world DDP too, whose all-reduce of
    equal copies leaves rank 0's gradients; reference the first that ran), and the others
    (the distributed systems: the global batch, or in a fake world the tiled weights;
    reference :data:`REFERENCE` where it ran, else the first that ran)."""
    tolerance = LOSS_TOLERANCE[mixed_precision]
    groups: dict[bool, list[dict]] = {}
    for record in records:
        if record.get("loss_per_step"):
            groups.setdefault(record["system"] in alone, []).append(record)
    for members in groups.values():
        ref = next((r for r in members if r["system"] == REFERENCE), members[0])
        for record in members:
            if record is ref:
                continue
            worst = _loss_departure(ref["loss_per_step"], record["loss_per_step"])
            if worst is None or worst[1] <= tolerance:
                continue
            step, rel, want, got = worst
            note = (f"losses depart from {ref['system']}'s: step {step + 1} {got:.4f} against "
                    f"{want:.4f} (relative {rel:.1e}, over {tolerance:.0e} allowed): other "
                    "gradients or updates, so not the same training")
            record["notes"] = "; ".join(filter(None, [record.get("notes"), note]))
            record["loss_departure"] = {"reference": ref["system"], "step": step + 1,
                                        "relative": rel}


def _loss_departure(want: list[float], got: list[float]) -> tuple[int, float, float, float] | None:
    """The first ``LOSS_CHECK_STEPS`` steps' largest relative difference: (step, relative,
    want, got); None where no step has a finite loss. A loss that is finite in one list alone
    counts as infinitely far."""
    worst = None
    steps = min(LOSS_CHECK_STEPS, len(want), len(got))
    for step, (a, b) in enumerate(zip(want[:steps], got[:steps], strict=True)):
        if not (math.isfinite(a) or math.isfinite(b)):
            continue
        finite = math.isfinite(a) and math.isfinite(b)
        rel = abs(a - b) / max(abs(a), 1e-12) if finite else math.inf
        if worst is None or rel > worst[1]:
            worst = (step, rel, a, b)
    return worst


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


def _spread(ratio: dict | None) -> str:
    if not ratio:
        return "n/a"
    return f"{ratio['median']:.2f} ({ratio['p10']:.2f}-{ratio['p90']:.2f})"


def _copies(record: dict) -> str:
    moved, floor = record.get("copy_bytes_per_step"), record.get("copy_floor_bytes")
    return "n/a" if moved is None else f"{moved * 1e-6:,.1f} ({_fmt(floor, 1e-6)})"


def _loss(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def precision(setting: str) -> str:
    """What ``--mixed-precision`` ``setting`` means, in a few words for the header."""
    if setting == "none":
        return "fp32 (no mixed precision)"
    return (
        f"mixed precision {setting} (params and compute {setting}, gradients reduced in "
        "fp32; autocast for ddp and single)"
    )


def header(report: dict) -> str:
    """The line that says what was run, where, and how the steps were scheduled."""
    cfg = report["config"]
    world = (
        f"fake world of {cfg['fake_world']} (rank 0 alone, collectives are local copies)"
        if cfg.get("fake_world")
        else f"world size {cfg['world_size']}"
    )
    if cfg.get("sequential"):
        schedule = "systems one after the other"
    else:
        schedule = f"interleaved, rounds of {cfg.get('round_steps', 1)} step(s) per system"
    machine = report["machine"]
    load = machine.get("load_average") or [None, None]
    busy = (
        f", load average {load[0]:.1f} at the start, {load[1]:.1f} at the end"
        if None not in load
        else ""
    )
    optimizer = cfg.get("optimizer", "default")
    adamw = "AdamW" if optimizer == "default" else f"AdamW ({optimizer})"
    if cfg.get("clip_grad_norm") is not None:
        adamw += f" after clip_grad_norm_ to {cfg['clip_grad_norm']:g}"
    compiled = ("" if cfg.get("compiler", "inductor") == "inductor" else
                "compiled without Inductor (--compiler aot_eager: step times are no system's), ")
    return (
        f"{cfg['model']} ({report['reference']['params']:,} parameters), {world}, {adamw}, "
        f"{precision(cfg.get('mixed_precision', 'none'))}, {compiled}"
        f"batch {cfg['batch_size']}x{cfg['seq_len']} per rank, {cfg['steps']} steps "
        f"({cfg['warmup']} warm-up), {schedule}, {machine['device_name']} "
        f"({machine['cpu_count']} CPUs{busy}), torch {machine['torch']}"
    )


def _compile_cell(record: dict, cold_warm: bool) -> str:
    """``compile_s``; with ``--compile-cache cold-warm``, ``cold / warm``."""
    cold = _fmt(record["compile_s"], 1, 2)
    return f"{cold} / {_fmt(record.get('compile_s_warm'), 1, 2)}" if cold_warm else cold


def to_markdown(report: dict) -> str:
    """The report as a markdown table: times with their p10-p90 spread, graphshard-compiled's
    round-by-round ratio to each system, ratios against single-compiled and fsdp2-eager."""
    systems = report["systems"]
    by_name = {s["system"]: s for s in systems}
    fsdp = by_name.get("fsdp2-eager", {})
    single = by_name.get("single-compiled", {})
    cold_warm = any("compile_s_warm" in s for s in systems)
    lines = [
        header(report),
        "",
        "| system | median ms | p10-p90 ms | graphshard-compiled / this (p10-p90) "
        f"| vs single-compiled | {'compile s cold / warm' if cold_warm else 'compile s'} "
        "| peak mem MiB | mem vs fsdp2-eager "
        "| collectives/step | MB sent/rank/step | comm wait ms | copies MB (floor) "
        "| first loss | final loss | predicted ms "
        "| host ms: guards / wrappers / optimizer / rest |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in systems:
        median, mem = s["step_s_median"], s["peak_mem_bytes"]
        spread = (
            "n/a"
            if median is None
            else f"{_fmt(s['step_s_p10'], 1e3)}-{_fmt(s['step_s_p90'], 1e3)}"
        )
        collectives = "n/a" if s["collectives_per_step"] is None else s["collectives_per_step"]
        lines.append(
            f"| {s['system']} | {_fmt(median, 1e3)} | {spread} "
            f"| {_spread(s.get('graphshard_ratio'))} "
            f"| {_ratio(median, single.get('step_s_median'))} "
            f"| {_compile_cell(s, cold_warm)} | {_fmt(mem, 2**-20, 2)} "
            f"| {_ratio(mem, fsdp.get('peak_mem_bytes'))} | {collectives} "
            f"| {_fmt(s['bytes_per_step'], 1e-6, 3)} | {_fmt(s.get('wait_s'), 1e3)} "
            f"| {_copies(s)} | {_loss(s.get('first_loss'))} "
            f"| {_loss(s['final_loss'])} | {_fmt(s['predicted_step_s'], 1e3)} "
            f"| {host_tax_cell(s.get('host_tax'))} |"
        )
    ref = report["reference"]
    b_param, b_reduce = ref.get("b_param", 4), ref.get("b_reduce", 4)
    measured = by_name.get("graphshard-compiled", {}).get("bytes_per_step")
    lines += [
        "",
        f"ZeRO-3 formula (N-1)/N * Psi * (2*{b_param} + {b_reduce}) = "
        f"{ref['zero3_bytes_per_rank']:,.0f} bytes "
        f"per rank per step; graphshard-compiled measured "
        f"{'n/a' if measured is None else f'{measured:,}'} bytes "
        f"({_ratio(measured, ref['zero3_bytes_per_rank'])} of the formula).",
    ]
    taxed = [s["host_tax"] for s in systems if s.get("host_tax")]
    if taxed:
        lines += [
            "",
            "host ms: a profiled step's time outside the compiled graphs (the median of "
            f"{taxed[0]['steps']} steps, slowest rank; the profiler adds a little per op), "
            "split into Dynamo's guards, AOTAutograd's wrappers, the optimizer and the rest "
            "(bench/host_tax.py).",
        ]
    lines += fake_world_lines(systems)
    lines += device_time_lines(systems)
    noted = [s for s in systems if s["notes"]]
    if noted:
        lines += ["", "Notes:", ""]
        lines += [f"- {s['system']}: {s['notes']}" for s in noted]
    return "\n".join(lines) + "\n"
