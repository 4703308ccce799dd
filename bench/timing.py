"""Step timing: one training step, and the statistics of the timed steps across ranks.

Kept apart from the orchestration in ``bench.step`` so the numbers' definitions are in one place.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from typing import Any

import torch

from bench.systems import SETTLE_EVENT, System


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward_context(system: System, tokens: torch.Tensor) -> contextlib.AbstractContextManager:
    """``torch.autocast`` on the tokens' device type in ``system.autocast``, else nothing."""
    if system.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(tokens.device.type, dtype=system.autocast)


def train_step(system: System, tokens: torch.Tensor) -> torch.Tensor:
    """One full step inside the system's context: forward (and loss, under autocast where
    the system asks for it: ``System.autocast``), backward, the system's clip where it has
    a threshold (``System.clip_grad_norm``), optimizer step, gradients set to
    None, then whatever the system must finish before the step counts as done
    (``System.settle``).

    fp16 autocast runs without a ``GradScaler``: the bench times steps, and a gradient that
    underflows costs the same time; the fp16 losses are not a convergence result.
    """
    with system.context():
        with _forward_context(system, tokens):
            loss = system.run(tokens).loss
        loss.backward()
        if system.clip_grad_norm is not None:
            system.clip(system.module.parameters(), system.clip_grad_norm)
        system.optimizer.step()
        system.optimizer.zero_grad(set_to_none=True)
        system.settle()
    return loss.detach()


# Profiler events in which a graphshard step blocks on communication: the compiled graphs'
# waits, the forward's take of a gather the optimizer step issued (its check and wait), and
# the bench's wait for those gathers at the end of the step.
WAIT_EVENTS = ("_c10d_functional::wait_tensor", "graphshard::take_prefetched", SETTLE_EVENT)


def wait_time(events: list[Any]) -> float:
    """Seconds the profiled step spent inside :data:`WAIT_EVENTS` (their union: a take's
    own wait, nested in it, counts once)."""
    spans = sorted(
        (e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() in WAIT_EVENTS
    )
    total, end = 0, None
    for start, stop in spans:
        if end is None or start >= end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total / 1e9


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100])."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def step_stats(ranks: list[dict], warmup: int) -> dict[str, Any]:
    """Step-time statistics (a step takes as long as its slowest rank) and the losses.

    Each rank's ``times`` holds every step, the first ``warmup`` untimed, and ``rounds`` the
    round each step ran in; ``round_step_s`` is the median step time of each round's timed
    steps, the series the ratios between systems are taken from (:func:`round_ratios`).
    """
    step_times = [max(ts) for ts in zip(*(res["times"] for res in ranks), strict=True)]
    timed = step_times[warmup:]
    rounds = ranks[0].get("rounds") or list(range(len(step_times)))
    by_round: dict[int, list[float]] = {}
    for round_, step_s in zip(rounds[warmup:], timed, strict=True):
        by_round.setdefault(round_, []).append(step_s)
    median = statistics.median(timed)
    loss_per_step = [
        statistics.fmean(ls) for ls in zip(*(res["losses"] for res in ranks), strict=True)
    ]
    return {
        "step_s_median": median,
        "step_s_p10": percentile(timed, 10),
        "step_s_p90": percentile(timed, 90),
        "compile_s": step_times[0] - median,
        "first_loss": _finite(loss_per_step[0]),
        "first_loss_by_rank": [_finite(res["losses"][0]) for res in ranks],
        "final_loss": _finite(loss_per_step[-1]),
        "loss_per_step": loss_per_step,
        "round_step_s": [statistics.median(by_round[r]) for r in sorted(by_round)],
    }


def inline_collective_stats(ranks: list[dict], warmup: int) -> dict[str, Any]:
    """A fake world's step without its collectives' inline copies (empty without them).

    Each rank's ``collective_times`` holds, per step, the seconds spent in the fake groups'
    collectives (:func:`bench.fake_world.collective_seconds`). ``compute_s_median`` is the
    median of the step less them (the slowest rank's), ``round_compute_s`` its per-round
    medians (as :func:`step_stats`' ``round_step_s``).
    """
    if not all(res.get("collective_times") for res in ranks):
        return {}
    per_rank = [
        [t - c for t, c in zip(res["times"], res["collective_times"], strict=True)]
        for res in ranks
    ]
    compute = [max(ts) for ts in zip(*per_rank, strict=True)][warmup:]
    inline = [max(cs) for cs in zip(*(r["collective_times"] for r in ranks), strict=True)]
    rounds = ranks[0].get("rounds") or list(range(len(inline)))
    by_round: dict[int, list[float]] = {}
    for round_, step_s in zip(rounds[warmup:], compute, strict=True):
        by_round.setdefault(round_, []).append(step_s)
    return {
        "collective_s_median": statistics.median(inline[warmup:]),
        "compute_s_median": statistics.median(compute),
        "round_compute_s": [statistics.median(by_round[r]) for r in sorted(by_round)],
    }


def round_ratios(numerator: list[float], denominator: list[float]) -> dict[str, Any] | None:
    """Round-by-round ratio of two systems' round medians: its median, p10, p90, min, max.

    Rounds interleave the systems, so both sides of one ratio ran at nearly the same time
    and a slow spell of the machine divides out. None without a common round.
    """
    ratios = [a / b for a, b in zip(numerator, denominator, strict=False) if a and b]
    if not ratios:
        return None
    return {
        "median": statistics.median(ratios),
        "p10": percentile(ratios, 10),
        "p90": percentile(ratios, 90),
        "min": min(ratios),
        "max": max(ratios),
        "rounds": len(ratios),
    }
