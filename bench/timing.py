"""Step timing: one training step, and the statistics of the timed steps across ranks.

Kept apart from the orchestration in ``bench.step`` so the numbers' definitions are in one place.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

from bench.systems import System


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(system: System, tokens: torch.Tensor) -> torch.Tensor:
    """One full step: forward, backward, optimizer step, gradients set to None."""
    loss = system.run(tokens).loss
    loss.backward()
    system.optimizer.step()
    system.optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100])."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def step_stats(ranks: list[dict], warmup: int) -> dict[str, Any]:
    """Step-time statistics (a step takes as long as its slowest rank) and the losses."""
    step_times = [max(ts) for ts in zip(*(res["times"] for res in ranks), strict=True)]
    timed = step_times[warmup:]
    median = statistics.median(timed)
    loss_per_step = [
        statistics.fmean(ls) for ls in zip(*(res["losses"] for res in ranks), strict=True)
    ]
    return {
        "step_s_median": median,
        "step_s_p90": _percentile(timed, 90),
        "compile_s": step_times[0] - median,
        "final_loss": _finite(loss_per_step[-1]),
        "loss_per_step": loss_per_step,
    }
