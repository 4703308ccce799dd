"""Peak tensor memory of a step: model state alive at its start plus the profiler's peak.

The CPU has no allocator high-water mark, so memory is rebuilt from profiler events here.
"""

from __future__ import annotations

from typing import Any

import torch

from bench.systems import System


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (FSDP2 parameters and their optimizer state), else ``t``."""
    return getattr(t, "_local_tensor", t)


def state_bytes(system: System) -> int:
    """Bytes of the model state alive now: parameters, buffers, gradients, optimizer state.

    Counted once per storage (shards and views share one), so padding is included.
    """
    module = system.module
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [p.grad for p in module.parameters() if p.grad is not None]
    for state in system.optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    storages: dict[int, int] = {}
    for t in tensors:
        storage = local_tensor(t).untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def peak_allocated(events: list[Any]) -> int:
    """Peak of the running sum of the CPU memory events (allocations +, frees -) in time order."""
    from torch._C._autograd import DeviceType

    memory = [e for e in events if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    running = peak = 0
    for event in sorted(memory, key=lambda e: e.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    return peak
